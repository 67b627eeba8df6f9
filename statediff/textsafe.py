"""Text that came from a file, made safe to print.

A trace or bundle may come from a stranger. Its strings (run metadata such as
``engine_commit``, request ids, layer names, a bundle manifest's diagnosis and
sources) are printed by ``inspect``, ``verify``, ``compare``, ``audit`` and
``report``. A line break inside one could fake a line of our own output
(``SAME: ...``), a carriage return could overwrite one, and a terminal escape
sequence could recolour, retitle or clear the terminal. So:

- every string decoded from a file's JSON passes through :func:`one_line`
  (``statediff.trace.validate.parse_json_object``, the bundle manifest reader);
- everything the CLI prints passes through :func:`for_terminal`.

Both escape, never drop: ``\\n`` shows as the two characters ``\\n``, ESC as
``\\x1b``, so what the file holds stays visible.

Bytes that are not UTF-8: h5py decodes a variable-length string attribute
(the run and request records) with ``surrogateescape``, so byte 0x8a arrives
as the lone surrogate U+DC8A. Printed as it is, Python's stdout (same
handler) would write the raw byte; it is shown as ``\\x8a``, the byte the
file holds. Any other lone surrogate is shown as ``\\udxxx``. After either
function the text encodes to UTF-8 strictly and holds no control character
(newline and tab aside, for :func:`for_terminal`).
"""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the
# bidirectional overrides and isolates (text that reads differently than it is).
# Lone surrogates (U+D800-U+DFFF): bytes that were not UTF-8 (see above), never text.
_OTHER = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c\ud800-\udfff"
_ONE_LINE = re.compile(f"[\x00-\x1f{_OTHER}]")
_TERMINAL = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER}]")  # keeps \t and \n


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:  # surrogateescape: the undecodable byte c - 0xDC00, as the file holds it
        c -= 0xDC00
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def one_line(text: str) -> str:
    """``text`` with every control character, line break and bidi control escaped
    (``"a\\nb"`` -> ``"a\\\\nb"`` shown as ``a\\x0ab``): it prints as one line, as written."""
    return _ONE_LINE.sub(_escape, text)


def for_terminal(text: str) -> str:
    """``text`` with control characters escaped except newline and tab (our own line
    structure): no escape sequence, carriage return or bidi control reaches the terminal."""
    return _TERMINAL.sub(_escape, text)


def clean_strings(value: Any) -> Any:
    """A JSON value (dict/list/str/number) with :func:`one_line` applied to every string,
    keys included. Numbers, booleans and None are returned as they are."""
    if isinstance(value, str):
        return one_line(value)
    if isinstance(value, dict):
        return {clean_strings(k): clean_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_strings(v) for v in value]
    return value
