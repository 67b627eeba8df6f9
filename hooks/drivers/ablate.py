"""Ablation tables: one hit/cold comparison per variant of an engine setup, as PASS/FAIL rows.

People debug restore bugs by changing one setting at a time (drafter on or
off, another checkpoint format, block size, a forced cache miss) and
watching the output. ``statediff ablate MATRIX.toml`` does the same with
the state compared: each variant is recorded twice (``statediff record
--mode hit`` and ``--mode cold``, each in its own subprocess, so each gets
a fresh engine: the same ``recording.make_recording`` as ``record``, its
options parsed from the words ``variant_argv`` builds), compared with
``statediff.diff.compare.compare``, and becomes
one row: PASS (no divergence), FAIL (with the root divergence) or ERROR
(a recording or the comparison failed; the row carries its one-line
error and the matrix goes on). A run whose ``statediff record`` arguments
equal an earlier variant's reuses that trace (typically one cold baseline
for several hit-side variants); ``--no-reuse`` records every run afresh.

Matrix file (TOML)::

    title = "tiny hybrid, exact replay"     # optional

    [base]                                  # every key optional
    model = "tiny"                          # directory, hub id or tiny / tiny-dense
    conversation = "builtin"                # builtin | sweep | path to a JSONL replay file
    replay = "exact"                        # exact | exact-split | default
    block_size = 32
    max_tokens = 4
    enforce_eager = true
    engine_args = { gpu_memory_utilization = 0.5 }   # --engine-arg KEY=VALUE each

    [[variant]]
    name = "no fault"                       # required, unique
    expect = "pass"                         # pass (default) | fail | error

    [[variant]]
    name = "planted fault"
    fault = "ssm-wrong-block:layer=1"       # planted in the hit run only (a forced miss has no hit run)
    expect = "fail"
    expect_root = { layer = 1, kind = "gdn.ssm_state" }   # optional: request, position, layer, kind

    [[variant]]
    name = "forced miss"
    forced_miss = true                      # both runs cold (a unique cache_salt per request)

Setting keys (in ``[base]`` and in each variant, a variant's value wins;
``engine_args`` tables are merged key by key; ``speculative_config = false``
removes the base's): ``model``, ``conversation``, ``replay``,
``block_size``, ``max_tokens``, ``enforce_eager``, ``seed``, ``dtype``,
``max_model_len``, ``max_num_batched_tokens``, ``kv``, ``engine_args``,
``speculative_config`` (a table, passed as ``--speculative-config``),
``fault``, ``forced_miss``, ``sweep_blocks`` (with ``conversation =
"sweep"``), ``record_args`` (extra ``statediff record`` words), ``tol``
(list of ``compare --tol`` rules), ``noise`` (a noise file) and ``python``
(the interpreter, or a venv directory, that records the variant: another
installed engine version, e.g. ``python = "/work/venvs/vllm-0.29"``; default
the one running ``ablate``), ``env`` (environment variables the variant's
recordings run with, string values; merged key by key like ``engine_args``:
``env = { VLLM_USE_V2_MODEL_RUNNER = "1" }`` records on Model Runner V2). Relative paths (the conversation, the model, a
``speculative_config`` drafter ``model``) are relative to the matrix file.

Engine version as an axis: variants that differ only in ``python`` give one
row per engine version (the table's ``engine`` column names each, read from
the hit trace); each interpreter records its own cold baseline (a trace is
reused only by a run with the same interpreter and arguments)::

    [[variant]]
    name = "vLLM 0.29"
    python = "/work/venvs/vllm-0.29"

    [[variant]]
    name = "vLLM 0.30"
    python = "/work/venvs/vllm-0.30"

Target format as an axis: ``format = "bf16" | "fp8" | "nvfp4"`` picks the
built-in tiny hybrid's checkpoint in that format (``model = "tiny"``, the
default: ``tiny``, ``tiny-fp8``, ``tiny-nvfp4``; ``tiny-mtp``: ``tiny-mtp-fp8``,
``tiny-mtp-nvfp4``; compressed-tensors, built on first use by
``tiny/formats.py``). A model with no build in that format (any other
model) makes that row an ERROR naming it. The
table gains a ``format`` column (the hit trace's ``target_format``) when a
variant or an axis sets ``format``.

Axes: ``[[axis]]`` tables multiply the rows. Each axis has a ``name`` and
``values``, a list of tables of settings, each with a ``label``; every
variant runs once per combination of one value from each axis (the axes in
file order, the first varying slowest). A row is named ``variant / label /
label``; its settings are the variant's, then each value's in order
(``expect`` and ``expect_root`` stay the variant's). Without ``[[variant]]``
tables the base is the one variant (named ``base``). The report's matrix::

    [[axis]]
    name = "drafter"
    values = [{ label = "none" },
              { label = "MTP", model = "tiny-mtp", speculative_config = { method = "mtp", num_speculative_tokens = 3 } }]

    [[axis]]
    name = "prefix hit"
    values = [{ label = "hit" }, { label = "forced miss", forced_miss = true }]

    [[axis]]
    name = "format"
    values = [{ label = "bf16", format = "bf16" }, { label = "FP8", format = "fp8" },
              { label = "NVFP4", format = "nvfp4" }]

Exit code: 0 when every row matched its expectation, 1 otherwise, 2 for a
bad matrix file (nothing is run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from statediff.errors import StatediffError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# key -> accepted Python types (after TOML parsing)
SETTINGS: dict[str, tuple[type, ...]] = {
    "model": (str,), "conversation": (str,), "replay": (str,), "block_size": (int,),
    "max_tokens": (int,), "enforce_eager": (bool,), "seed": (int,), "dtype": (str,),
    "max_model_len": (int,), "max_num_batched_tokens": (int,), "kv": (str,), "engine_args": (dict,),
    "speculative_config": (dict, bool), "fault": (str,), "forced_miss": (bool,), "sweep_blocks": (int,),
    "record_args": (list,), "tol": (list,), "noise": (str,), "python": (str,), "format": (str,),
    "env": (dict,),
}
#: ``format`` values and, per built-in tiny model that has them, the model of each format.
FORMATS = ("bf16", "fp8", "nvfp4")
FORMAT_MODELS = {"tiny": {"bf16": "tiny", "fp8": "tiny-fp8", "nvfp4": "tiny-nvfp4"},
                 "tiny-mtp": {"bf16": "tiny-mtp", "fp8": "tiny-mtp-fp8", "nvfp4": "tiny-mtp-nvfp4"}}
VARIANT_KEYS = ("name", "expect", "expect_root", "description")
REPLAYS = ("exact", "exact-split", "default")
EXPECTS = ("pass", "fail", "error")
ROOT_FIELDS = {"request": int, "position": int, "layer": int, "kind": str}
DEFAULT_TIMEOUT = 1800


class MatrixError(StatediffError):
    """The matrix file is unreadable or invalid (exit 2, nothing run)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row to run: its merged settings and what it is expected to give."""

    name: str
    settings: dict
    expect: str
    expect_root: dict | None
    changes: str  # the variant's own overrides, as text ("base" when none)


@dataclasses.dataclass
class Matrix:
    """A parsed matrix file."""

    path: Path
    title: str
    base: dict
    variants: list[Variant]


def _bad(path: Path, msg: str) -> MatrixError:
    return MatrixError(f"{path}: {msg}")


def _check_settings(path: Path, where: str, d: dict, *, variant: bool) -> None:
    allowed = set(SETTINGS) | (set(VARIANT_KEYS) if variant else set())
    for key, val in d.items():
        if key not in allowed:
            raise _bad(path, f"{where}: unknown key {key!r} (known: {', '.join(sorted(allowed))})")
        if key in SETTINGS:
            types = SETTINGS[key]
            if not isinstance(val, types) or (bool not in types and isinstance(val, bool)):
                names = " or ".join("table" if t is dict else "array" if t is list else t.__name__
                                    for t in types)
                raise _bad(path, f"{where}: {key} = {val!r} is not a {names}")
    if d.get("replay") is not None and d["replay"] not in REPLAYS:
        raise _bad(path, f"{where}: replay = {d['replay']!r}, expected one of {', '.join(REPLAYS)}")
    if d.get("speculative_config") is True:
        raise _bad(path, f"{where}: speculative_config = true: give a table, or false to remove it")
    if "env" in d and not all(isinstance(x, str) for x in d["env"].values()):
        raise _bad(path, f"{where}: env values must be strings")
    for key in ("record_args", "tol"):
        if key in d and not all(isinstance(x, str) for x in d[key]):
            raise _bad(path, f"{where}: {key} must be an array of strings")
    if d.get("kv") is not None and d["kv"] not in ("all", "none"):
        raise _bad(path, f"{where}: kv = {d['kv']!r}, expected 'all' or 'none'")
    if d.get("format") is not None and d["format"] not in FORMATS:
        raise _bad(path, f"{where}: format = {d['format']!r}, expected one of {', '.join(FORMATS)}")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k in VARIANT_KEYS:
            continue
        if k in ("engine_args", "env"):
            out[k] = dict(base.get(k) or {}) | v
        elif k == "speculative_config" and v is False:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _changes(over: dict) -> str:
    parts = []
    for k, v in over.items():
        if k in VARIANT_KEYS:
            continue
        text = json.dumps(v, sort_keys=True, separators=(",", ":")) if isinstance(v, (dict, list)) else (
            str(v).lower() if isinstance(v, bool) else str(v))
        parts.append(f"{k}={text}")
    return ", ".join(parts) or "base"


def load_matrix(path: str | os.PathLike) -> Matrix:
    """Read and validate a matrix file (module docstring).

    Raises:
        MatrixError: unreadable file, invalid TOML, unknown or mistyped keys,
            no variants, a variant without a unique name, a bad expectation.
    """
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise MatrixError(f"cannot read matrix file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise _bad(p, "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise _bad(p, f"invalid TOML ({e})") from None
    unknown = set(doc) - {"title", "base", "variant", "axis"}
    if unknown:
        raise _bad(p, f"unknown top-level key {sorted(unknown)[0]!r} (known: axis, base, title, variant)")
    title = doc.get("title", p.stem)
    base = doc.get("base", {})
    if not isinstance(title, str):
        raise _bad(p, "title must be a string")
    if not isinstance(base, dict):
        raise _bad(p, "[base] must be a table")
    _check_settings(p, "[base]", base, variant=False)
    axes = _axes(p, doc.get("axis"))
    raw = doc.get("variant", [{"name": "base"}] if axes else None)
    if not isinstance(raw, list) or not raw or not all(isinstance(v, dict) for v in raw):
        raise _bad(p, "no [[variant]] tables (each variant is a [[variant]] table with a name)")
    variants, names = [], set()
    for n, v in enumerate(raw, 1):
        where = f"variant {n}" + (f" ({v['name']!r})" if isinstance(v.get("name"), str) else "")
        _check_settings(p, where, v, variant=True)
        name = v.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _bad(p, f"{where}: needs a name")
        if name in names:
            raise _bad(p, f"{where}: the name {name!r} is used twice")
        names.add(name)
        expect = v.get("expect", "pass")
        if expect not in EXPECTS:
            raise _bad(p, f"{where}: expect = {expect!r}, expected one of {', '.join(EXPECTS)}")
        root = v.get("expect_root")
        if root is not None:
            if not isinstance(root, dict) or not root or any(
                    k not in ROOT_FIELDS or not isinstance(x, ROOT_FIELDS[k]) or isinstance(x, bool)
                    for k, x in root.items()):
                raise _bad(p, f"{where}: expect_root must be a table of request, position, layer (integers) "
                              "and kind (a string)")
            if expect != "fail":
                raise _bad(p, f"{where}: expect_root needs expect = \"fail\"")
        for labels, overs in _combinations(axes):
            settings = _merge(base, v)
            for over in overs:
                settings = _merge(settings, over)
            if settings.get("python") is not None:
                settings["python"] = _interpreter(p, where, settings["python"])
            changes = ", ".join(c for c in [_changes(v)] + [_changes(o) for o in overs] if c != "base") or "base"
            variants.append(Variant(" / ".join([name, *labels]), settings, expect, root, changes))
    return Matrix(p, title, base, variants)


def _axes(path: Path, raw: object) -> list[tuple[str, list[dict]]]:
    """The ``[[axis]]`` tables as (name, values); each value a settings table with a ``label``.

    Raises:
        MatrixError: not a list of tables, an axis without a name or values, a value without a
            unique label, a value setting an unknown or mistyped key.
    """
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(a, dict) for a in raw):
        raise _bad(path, "axis must be [[axis]] tables")
    out = []
    for n, a in enumerate(raw, 1):
        where = f"axis {n}" + (f" ({a['name']!r})" if isinstance(a.get("name"), str) else "")
        if set(a) - {"name", "values"}:
            raise _bad(path, f"{where}: unknown key {sorted(set(a) - {'name', 'values'})[0]!r} (known: name, values)")
        if not isinstance(a.get("name"), str) or not a["name"].strip():
            raise _bad(path, f"{where}: needs a name")
        values = a.get("values")
        if not isinstance(values, list) or not values or not all(isinstance(x, dict) for x in values):
            raise _bad(path, f"{where}: values must be a non-empty array of tables, each with a label")
        labels = [x.get("label") for x in values]
        if not all(isinstance(lb, str) and lb.strip() for lb in labels) or len(set(labels)) != len(labels):
            raise _bad(path, f"{where}: every value needs a label, each used once")
        for x in values:
            _check_settings(path, f"{where}, value {x['label']!r}", {k: y for k, y in x.items() if k != "label"},
                            variant=False)
        out.append((a["name"], [{k: y for k, y in x.items() if k != "label"} | {"_label": x["label"]}
                                for x in values]))
    return out


def _combinations(axes: list[tuple[str, list[dict]]]) -> list[tuple[list[str], list[dict]]]:
    """Every combination of one value per axis, the first axis varying slowest: (labels, settings)."""
    import itertools

    combos = itertools.product(*[values for _, values in axes])
    return [([x["_label"] for x in c], [{k: y for k, y in x.items() if k != "_label"} for x in c]) for c in combos]


def _interpreter(path: Path, where: str, value: str) -> str:
    """The Python executable a ``python`` setting names (a venv directory: its ``bin/python``).

    Raises:
        MatrixError: no executable file there.
    """
    exe = Path(_local(value, path.parent))
    if exe.is_dir():
        exe = exe / "bin" / "python"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise _bad(path, f"{where}: python = {value!r}: no Python executable there (give an interpreter "
                         "or a venv directory)")
    return str(exe)


def _local(path: str, root: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else root / p)


class NoSuchFormat(StatediffError):
    """A ``format`` the variant's model has no build of (the row is an ERROR)."""


def format_model(settings: dict) -> str:
    """The model a variant records: ``model`` (default ``tiny``), or with ``format`` the built-in
    tiny model's checkpoint in that format (``FORMAT_MODELS``).

    Raises:
        NoSuchFormat: ``format`` names a format the model has no build of.
    """
    model, fmt = settings.get("model", "tiny"), settings.get("format")
    if fmt is None:
        return model
    built = FORMAT_MODELS.get(model, {})
    if fmt not in built:
        have = ", ".join(f"{m} ({', '.join(f)})" for m, f in FORMAT_MODELS.items())
        raise NoSuchFormat(f"format = {fmt!r}: no {fmt} build of model {model!r} (built-in formats: {have})")
    return built[fmt]


def variant_argv(settings: dict, mode: str, out: Path, root: Path, *, hit_trace: Path | None = None) -> list[str]:
    """``statediff record`` words for one run of a variant.

    Args:
        settings: the variant's merged settings.
        mode: "hit" or "cold" (the run's role; a forced miss records its hit run cold too).
        out: the trace to write.
        root: directory relative paths are resolved against (the matrix file's).
        hit_trace: the hit run's trace (``--split-like`` of an exact-split cold run).
    """
    s = settings
    words = ["record"]
    conv = s.get("conversation", "builtin")
    if conv == "sweep":
        words.append("--sweep-boundaries")
        if s.get("sweep_blocks") is not None:
            words += ["--sweep-blocks", str(s["sweep_blocks"])]
    elif conv not in ("builtin", "builtin:demo"):
        words.append(_local(conv, root))
    model = format_model(s)
    if (root / model).exists() and not Path(model).is_absolute():
        model = str(root / model)
    words += ["--model", model]
    replay = s.get("replay", "exact")
    if replay == "exact":
        words.append("--exact")
    elif replay == "exact-split":
        words.append("--exact-split")
        if mode == "cold" and hit_trace is not None:
            words += ["--split-like", str(hit_trace)]
    for key in ("block_size", "max_tokens", "seed", "dtype", "max_model_len", "max_num_batched_tokens", "kv"):
        if s.get(key) is not None:
            words += ["--" + key.replace("_", "-"), str(s[key])]
    if s.get("enforce_eager"):
        words.append("--enforce-eager")
    for k, v in (s.get("engine_args") or {}).items():
        words += ["--engine-arg", f"{k}={json.dumps(v)}"]
    if s.get("speculative_config"):
        spec = dict(s["speculative_config"])
        drafter = spec.get("model")
        if isinstance(drafter, str) and not Path(drafter).is_absolute() and (root / drafter).exists():
            spec["model"] = str(root / drafter)  # a drafter directory beside the matrix file
        words += ["--speculative-config", json.dumps(spec)]
    run_mode = "cold" if s.get("forced_miss") else mode
    if s.get("fault") and run_mode == "hit":  # a planted fault fires on cache hits only
        words += ["--fault", s["fault"]]
    words += list(s.get("record_args") or [])
    return words + ["--mode", run_mode, "-o", str(out), "--overwrite", "--no-progress"]


@dataclasses.dataclass
class Row:
    """One variant's outcome.

    Attributes:
        status: "PASS", "FAIL" or "ERROR".
        matched: the status (and root, with ``expect_root``) is what the variant expected.
        root: the root divergence (text) of a FAIL, else None.
        root_key: (request, position, layer, kind) of a FAIL's root.
        diagnosis: the root's diagnosis line, if any.
        error: one line, for an ERROR (or why a FAIL's root was not the expected one).
        hits: prefix-cache hit tokens per request in the hit run, if it was recorded.
        traces: (hit, cold) trace paths.
        engine: the hit run's engine and version ("vllm 0.29.0"), if it was recorded.
        acceptance: (accepted, drafted) speculative tokens over the hit run's requests (their
            ``acceptance`` fields), None without a drafter.
    """

    index: int
    variant: Variant
    status: str
    matched: bool
    root: str | None = None
    root_key: tuple | None = None
    diagnosis: str | None = None
    error: str | None = None
    hits: list | None = None
    traces: tuple[str, str] | None = None
    seconds: float = 0.0
    engine: str | None = None
    format: str | None = None  # the hit trace's target_format
    acceptance: tuple[int, int] | None = None

    @property
    def detail(self) -> str:
        if self.status == "ERROR":
            return f"error: {self.error}"
        if self.status == "FAIL":
            text = f"root: {self.root}"
            if self.diagnosis:
                text += f"; {self.diagnosis}"
            if self.error:
                text += f" ({self.error})"
            return text
        return "no divergence"

    def to_json(self) -> dict:
        return {"index": self.index, "name": self.variant.name, "changes": self.variant.changes,
                "expect": self.variant.expect, "expect_root": self.variant.expect_root,
                "status": self.status, "matched": self.matched, "root": self.root,
                "root_key": list(self.root_key) if self.root_key else None, "diagnosis": self.diagnosis,
                "error": self.error, "hits": self.hits, "traces": list(self.traces) if self.traces else None,
                "seconds": round(self.seconds, 1), "engine": self.engine,
                "format": self.format, "acceptance": list(self.acceptance) if self.acceptance else None}


@dataclasses.dataclass
class AblationResult:
    """The table; ``exit_code`` 0 when every row matched its expectation, else 1."""

    title: str
    matrix: str
    rows: list[Row]
    work_dir: str | None = None  # where the traces were kept, if they were

    @property
    def exit_code(self) -> int:
        return 0 if all(r.matched for r in self.rows) else 1

    def _formats(self) -> bool:
        """The table has a format column: some row's variant sets ``format``."""
        return any(r.variant.settings.get("format") is not None for r in self.rows)

    def _drafters(self) -> bool:
        """The table has an acceptance column: some row's variant runs a drafter."""
        return any(r.variant.settings.get("speculative_config") for r in self.rows)

    def _cells(self) -> list[list[str]]:
        fmt, spec = self._formats(), self._drafters()
        return [[str(r.index), r.variant.name, r.variant.changes, r.engine or "-"]
                + ([r.format or r.variant.settings.get("format") or "-"] if fmt else [])
                + ["-" if r.hits is None else json.dumps(r.hits)]
                + ([acceptance_text(r.acceptance)] if spec else [])
                + [r.status, r.variant.expect.upper(), "ok" if r.matched else "UNEXPECTED", r.detail]
                for r in self.rows]

    HEAD = ["#", "variant", "changes", "engine", "hit tokens per request", "result", "expected", "",
            "root divergence"]

    def _head(self) -> list[str]:
        return (self.HEAD[:4] + (["format"] if self._formats() else []) + self.HEAD[4:5]
                + (["accepted / drafted (hit run)"] if self._drafters() else []) + self.HEAD[5:])

    def summary(self) -> str:
        bad = [r for r in self.rows if not r.matched]
        counts = {s: sum(r.status == s for r in self.rows) for s in ("PASS", "FAIL", "ERROR")}
        head = ", ".join(f"{n} {s}" for s, n in counts.items())
        return (f"{len(self.rows)} variants: {head}; "
                + ("every row as expected" if not bad else
                   f"{len(bad)} not as expected: {', '.join(r.variant.name for r in bad)}"))

    def to_text(self) -> str:
        head = self._head()
        rows = [head] + self._cells()
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = [f"ablation: {self.title} ({self.matrix})"]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        lines.append(self.summary())
        if self.work_dir:
            lines.append(f"traces kept in {self.work_dir}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        def cell(c: str) -> str:
            return c.replace("|", "\\|")

        head = [h or "as expected" for h in self._head()]
        out = [f"## Ablation: {self.title}", "", "| " + " | ".join(head) + " |",
               "|" + " --- |" * len(head)]
        out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in self._cells()]
        out += ["", self.summary()]
        return "\n".join(out) + "\n"

    def to_json(self) -> dict:
        return {"statediff": "ablate", "title": self.title, "matrix": self.matrix,
                "exit_code": self.exit_code, "rows": [r.to_json() for r in self.rows],
                "work_dir": self.work_dir}


def hit_acceptance(fields: list) -> tuple[int, int] | None:
    """(accepted, drafted) speculative tokens summed over requests' ``acceptance`` fields
    (``num_accepted_tokens``, ``num_draft_tokens``); None when no request has one."""
    got = [a for a in fields if isinstance(a, dict) and isinstance(a.get("num_draft_tokens"), int)]
    if not got:
        return None
    return (sum(int(a.get("num_accepted_tokens") or 0) for a in got), sum(int(a["num_draft_tokens"]) for a in got))


def acceptance_text(acc: tuple[int, int] | None) -> str:
    """``50/93 (54%)``, or ``-`` without a drafter."""
    if acc is None:
        return "-"
    return f"{acc[0]}/{acc[1]} ({100 * acc[0] / acc[1]:.0f}%)" if acc[1] else f"{acc[0]}/0"


def _error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("statediff: error: "):
            return ln.removeprefix("statediff: error: ")
    return lines[-1][:300] if lines else "no error message"


def _record(argv: list[str], timeout: float, python: str | None = None, env: dict | None = None) -> str | None:
    """Run ``statediff`` with ``argv`` under ``python`` (default: this interpreter), with ``env`` added
    to the environment; None on success, else its one-line error."""
    cmd = [python or sys.executable, "-m", "statediff", *argv]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=os.environ | env if env else None)
    except subprocess.TimeoutExpired:
        return f"statediff record timed out after {timeout:g} s"
    return None if r.returncode == 0 else _error_line(r.stderr)


def _slug(name: str, i: int) -> str:
    keep = "".join(c if c.isalnum() or c in "-_" else "-" for c in name.lower()).strip("-")
    return f"{i:02d}-{keep[:40] or 'variant'}"


def run_variant(v: Variant, index: int, work: Path, root: Path, *, timeout: float = DEFAULT_TIMEOUT,
                say: Callable[[str], None] = lambda s: None, reuse: dict | None = None) -> Row:
    """Record, compare and judge one variant (never raises for the variant's own failures).

    ``reuse``: record-arguments -> trace of earlier variants; a run whose
    ``statediff record`` arguments and interpreter (``python``) equal an earlier
    one's reuses its trace (e.g. one cold baseline for every fault variant, one
    per engine version), except that the two sides of one variant are never the
    same recording. Updated in place.
    """
    from statediff.diff.compare import compare
    from statediff.trace import open_trace

    t0 = time.perf_counter()
    slug = _slug(v.name, index)
    paths = {"hit": work / f"{slug}-hit.h5", "cold": work / f"{slug}-cold.h5"}
    row = Row(index, v, "ERROR", v.expect == "error")
    try:
        format_model(v.settings)
    except NoSuchFormat as e:
        row.error = str(e)
        return row
    for mode in ("hit", "cold"):
        out = paths[mode]
        python = v.settings.get("python")
        env = v.settings.get("env") or {}
        key = (python or sys.executable, *sorted(env.items()),
               *variant_argv(v.settings, mode, Path("OUT"), root, hit_trace=paths["hit"]))
        earlier = None if reuse is None else reuse.get(key)
        if earlier is not None and earlier != paths["hit"]:  # never both sides from one recording
            say(f"[{index}] {v.name}: the {mode} run reuses {earlier.name} (same record arguments)")
            paths[mode] = earlier
            continue
        forced = " (forced miss: recorded cold)" if v.settings.get("forced_miss") and mode == "hit" else ""
        say(f"[{index}] {v.name}: recording the {mode} run{forced}")
        err = _record(variant_argv(v.settings, mode, out, root, hit_trace=paths["hit"]), timeout, python, env)
        if err is not None:
            row.error = f"{mode} run: {err}"
            row.seconds = time.perf_counter() - t0
            return row
        if reuse is not None:
            reuse[key] = out
    hit, cold = paths["hit"], paths["cold"]
    row.traces = (str(hit), str(cold))
    try:
        with open_trace(hit) as t:
            row.hits = [t.requests[i].get("num_cached_tokens") for i in sorted(t.requests)]
            row.engine = " ".join(str(t.run[k]) for k in ("engine", "engine_version") if t.run.get(k)) or None
            row.format = t.run.get("target_format") if isinstance(t.run.get("target_format"), str) else None
            row.acceptance = hit_acceptance([t.requests[i].get("acceptance") for i in sorted(t.requests)])
        noise = v.settings.get("noise")
        result = compare(hit, cold, tol=v.settings.get("tol") or (),
                         noise=_local(noise, root) if noise else None)
    except StatediffError as e:
        row.error = f"compare: {e}"
        row.seconds = time.perf_counter() - t0
        return row
    row.seconds = time.perf_counter() - t0
    first = result.first
    if result.exit_code == 0:
        row.status, row.matched = "PASS", v.expect == "pass"
        return row
    if first is None:  # outputs or the block table differ while no captured tensor does
        row.status, row.root = "FAIL", result.headline().removeprefix("DIVERGED: ")
        row.matched = v.expect == "fail" and not v.expect_root  # no tensor root to match an expected one
        return row
    row.status, row.root, row.root_key = "FAIL", first.where(), first.key
    row.diagnosis = next((g.text for g in result.diagnoses
                          if (g.request, g.position, g.layer, g.kind) == first.key), None)
    row.matched = v.expect == "fail"
    if row.matched and v.expect_root:
        got = dict(zip(("request", "position", "layer", "kind"), first.key))
        wrong = {k: x for k, x in v.expect_root.items() if got[k] != x}
        if wrong:
            row.matched = False
            row.error = "expected root " + ", ".join(f"{k} {x}" for k, x in v.expect_root.items())
    return row


def run_matrix(matrix: Matrix, *, work_dir: str | os.PathLike | None = None,
               timeout: float = DEFAULT_TIMEOUT, say: Callable[[str], None] = lambda s: None,
               reuse: bool = True) -> AblationResult:
    """Run every variant in order, each on fresh engines; traces go to ``work_dir`` (kept) or a temp dir.

    ``reuse``: a run whose record arguments equal an earlier variant's reuses
    that trace instead of recording again (``run_variant``).

    Raises:
        StatediffError: ``work_dir`` cannot be created.
    """
    root = matrix.path.parent
    keep = work_dir is not None
    if keep:
        work = Path(work_dir)
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StatediffError(f"cannot create work directory {work}: {e.strerror or e}") from None
    else:
        work = Path(tempfile.mkdtemp(prefix="statediff-ablate-"))
    try:
        done: dict | None = {} if reuse else None
        rows = [run_variant(v, i, work, root, timeout=timeout, say=say, reuse=done)
                for i, v in enumerate(matrix.variants, 1)]
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    if not keep:
        for r in rows:
            r.traces = None
    return AblationResult(matrix.title, str(matrix.path), rows, str(work) if keep else None)
