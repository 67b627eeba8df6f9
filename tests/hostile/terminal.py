"""What the offline commands write to a terminal, as bytes, and whether a terminal can show it safely.

``run(args)`` runs ``statediff ARGS`` in this process with stdout and stderr
as a real process has them under a UTF-8 locale: UTF-8 text streams with the
``surrogateescape`` error handler (Python's choice for stdio), so a string
that still holds an undecodable byte of a file (h5py decodes variable-length
strings with ``surrogateescape``) comes out as that raw byte, exactly as it
would on a terminal. click's ``CliRunner`` would raise on it instead.

``unprintable(data)`` is the rule the fuzz tier asserts on every output:
UTF-8, and no control character (C0, DEL, C1), line or paragraph separator,
bidi control or other character ``statediff.textsafe`` escapes, newline and
tab aside.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Sequence

# what statediff.textsafe.for_terminal escapes, spelled out again here: the test does not trust the code
_BAD = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def unprintable(data: bytes) -> str | None:
    """Why ``data`` is not safe to show on a terminal (None: it is), with the bytes around the spot."""
    try:
        text = data.decode("utf-8")  # strict: a raw byte of a file, or a lone surrogate, fails here
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {e.start}: {data[max(0, e.start - 40):e.start + 10]!r}"
    m = _BAD.search(text)
    if m:
        return f"control character {m.group()!r} at {m.start()}: {text[max(0, m.start() - 40):m.start() + 10]!r}"
    return None


def run(args: Sequence[object]) -> tuple[int, bytes, bytes]:
    """``statediff ARGS`` in this process: (exit code, stdout bytes, stderr bytes)."""
    from statediff.cli import cli

    out, err = io.BytesIO(), io.BytesIO()
    streams = [io.TextIOWrapper(b, encoding="utf-8", errors="surrogateescape", write_through=True)
               for b in (out, err)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(streams[0]))
        stack.enter_context(contextlib.redirect_stderr(streams[1]))
        code = cli.main([str(a) for a in args], standalone_mode=False)
    for s in streams:
        s.flush()
    return code, out.getvalue(), err.getvalue()


def checked(args: Sequence[object], codes: tuple[int, ...] = (0, 1, 2)) -> tuple[int, str, str]:
    """``run(args)``, asserting an exit code in ``codes``, no traceback, and both outputs safe to show
    (``unprintable``); returns (exit code, stdout, stderr) as text."""
    code, out, err = run(args)
    shown = f"statediff {' '.join(map(str, args))}"
    assert code in codes, f"{shown}: exit {code}\n{err[-2000:]!r}"
    for name, data in (("stdout", out), ("stderr", err)):
        why = unprintable(data)
        assert why is None, f"{shown}: {name} {why}"
    assert b"Traceback" not in err, f"{shown}: {err[-2000:]!r}"
    return code, out.decode(), err.decode()


if __name__ == "__main__":  # python tests/hostile/terminal.py inspect TRACE: the verdict on one command
    code, out, err = run(sys.argv[1:])
    print(f"exit {code}; stdout: {unprintable(out) or 'safe'}; stderr: {unprintable(err) or 'safe'}")
