"""Trace format (version 3): names, record layout and limits. No I/O here.

The normative description is ``docs/trace-format.md``; this module is its
executable form. Everything in a trace is plain data: fixed-size numeric
and byte-string fields, UTF-8 JSON text in attributes, chunked numeric
datasets. Nothing in it is executed or unpickled on load.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from .patches import patches_problem
from .summary import SKETCH_DIM, Summary

FORMAT_NAME = "statediff.trace"
FORMAT_VERSION = 3  # the newest version read and written
# 2 added the optional /digests table (digest-only K/V blocks); 3 gave /digests a row for every
# captured tensor (a summary: digest, bf16 digest, moments, sketch; ``dataset`` links kept data)
MIN_DIGEST_VERSION = 2  # /digests is refused in files declaring an older version


def version_for(has_digests: bool) -> int:
    """The format version a writer declares (docs/trace-format.md, Versioning).

    A file without ``/digests`` is written as version 1, so readers that
    predate digests still read it; a file with ``/digests`` as version 3
    (a version-1 reader ignoring the table could call differing traces identical).
    """
    return FORMAT_VERSION if has_digests else 1

# Tensor kinds, in causal order within one (request, position, layer).
KINDS = (
    "gdn.conv_state",
    "gdn.ssm_state",
    "attn.k",
    "attn.v",
    "hidden",
    "drafter.input",
    "drafter.model_input",
    "drafter.logits",
)
KIND_RANK = {k: i for i, k in enumerate(KINDS)}

# How a tensor was obtained.
ROLES = (
    "checkpoint",  # state the engine checkpointed after computing `position` tokens
    "resumed",  # state a cache hit resumed from, read as the kernel consumes it
    "kv_block",  # the K or V rows of one KV-cache block, tokens [token_start, position)
    "activation",  # eager-mode forward-hook output (perturbs numerics; opt-in)
    "drafter",  # input handed to a speculative drafter
    "proposer",  # input the drafter model's forward receives inside the proposer (after its slicing)
    "initial",  # state a first chunk without a cache hit starts from, read from its slot as the kernel would
)

MAX_NDIM = 8
ZSTD_FILTER_ID = 32015  # registered HDF5 filter id for Zstandard (hdf5plugin)

# Reader limits (docs/trace-format.md, "Limits"): a crafted file must not make
# the reader allocate or loop without bound. Every one is checked before the
# allocation it guards.
MAX_JSON_BYTES = 16 * 1024 * 1024  # one JSON attribute
MAX_INDEX_ROWS = 1 << 22  # rows of /index (~1.5 GB at 361 bytes a row)
MAX_DIGEST_ROWS = 1 << 23  # rows of /digests (~3.8 GB at 449 bytes a row)
MAX_REQUESTS = 1_000_000
MAX_TOKENS_PER_REQUEST = 16_000_000  # elements of one per-request dataset (token ids, logprobs)
MAX_LOGPROBS_K = 64  # alternatives per output token in output_topk_* (the second axis)
MAX_CHUNK_BYTES = 64 * 1024 * 1024  # decoded size of one chunk (the writer uses ~1 MiB)
MAX_CHUNKS = 1 << 16  # chunks of one dataset
MAX_UNCHUNKED_BYTES = 256 * 1024 * 1024  # an unchunked dataset (also bounded by the file size)
MAX_DECLARED_BYTES = 1 << 40  # a tensor whose index row declares more is refused at open
MAX_SEGMENTS = 10_000_000  # segment files of a parts directory

# One row of /index per recorded tensor. Fixed-size fields only.
INDEX_DTYPE = np.dtype(
    [
        ("request", "<i4"),
        ("position", "<i8"),  # absolute tokens the tensor summarises (end of block for K/V)
        ("layer", "<i4"),
        ("kind", "S24"),
        ("role", "S16"),
        ("module", "S96"),
        ("token_start", "<i8"),  # first token covered (K/V blocks); == position for states
        ("step", "<i4"),  # engine step that produced it (informational; never aligned on)
        ("block", "<i4"),  # engine block id it was read from, -1 if none
        ("dataset", "S32"),  # name under /tensors
        ("dtype", "S16"),  # logical dtype
        ("ndim", "<i1"),
        ("shape", "<i8", (MAX_NDIM,)),
        ("hash", "S32"),  # XXH3-128 hex of the stored bytes (C order)
        ("sum", "<f8"),  # float64 moments of the decoded finite values
        ("sumsq", "<f8"),
        ("min", "<f8"),
        ("max", "<f8"),
        ("n_nan", "<i8"),
        ("n_inf", "<i8"),
    ]
)


# Version 2: one row of /digests per tensor recorded as a digest only (no dataset). Read, never written.
DIGEST_DTYPE_V2 = np.dtype(
    [
        ("request", "<i4"),
        ("position", "<i8"),  # absolute tokens covered: [token_start, position)
        ("token_start", "<i8"),
        ("layer", "<i4"),
        ("kind", "S24"),
        ("role", "S16"),
        ("module", "S96"),
        ("step", "<i4"),
        ("block", "<i4"),  # engine (physical) block id it was read from, -1 if none
        ("dtype", "S16"),  # logical dtype
        ("ndim", "<i1"),
        ("shape", "<i8", (MAX_NDIM,)),
        ("digest", "S32"),  # statediff.trace.digest of the storage bytes, 32 lowercase hex digits
    ]
)

# Version 3: one row of /digests per captured tensor, with or without data (statediff.trace.summary).
DIGEST_DTYPE = np.dtype(
    DIGEST_DTYPE_V2.descr + [
        ("dataset", "S32"),  # name under /tensors of the kept data; empty: digest only
        ("digest_bf16", "S32"),  # float32: digest of the tensor rounded to bfloat16; else empty
        ("sum", "<f8"),  # float64 moments of the finite decoded values (NaN: unknown)
        ("sumsq", "<f8"),
        ("absmax", "<f8"),
        ("n_nan", "<i8"),  # -1: unknown
        ("n_inf", "<i8"),
        ("sketch", "<f4", (SKETCH_DIM,)),  # random projection (NaN: unknown)
    ]
)


def _utf8_prefix(text: str, n: int) -> bytes:
    """At most ``n`` bytes of UTF-8, never cutting a character in half."""
    return text.encode("utf-8")[:n].decode("utf-8", "ignore").encode("utf-8")


class _Keyed:
    """Alignment key and causal order, shared by index rows and digest rows."""

    __slots__ = ()  # subclasses are slotted dataclasses: a trace may hold millions of rows

    request: int
    position: int
    layer: int
    kind: str

    @property
    def key(self) -> tuple[int, int, int, str]:
        """Alignment key: (request, absolute token position, layer, kind)."""
        return (self.request, self.position, self.layer, self.kind)

    @property
    def causal_order(self) -> tuple[int, int, int, int]:
        """Sort key: request, then position, then layer, then kind."""
        return (self.request, self.position, self.layer, KIND_RANK.get(self.kind, 99))

    @property
    def digest_value(self) -> str | None:
        """The exact digest recorded for this tensor (``/digests``), or None (none recorded)."""
        summary = getattr(self, "summary", None)
        if summary is not None:
            return summary.digest
        return getattr(self, "digest", None)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry(_Keyed):
    """One recorded tensor as listed in the trace index.

    ``position`` is the number of tokens of the request the tensor
    summarises (a GDN state after ``position`` tokens; a K/V block covering
    tokens ``[token_start, position)``). ``shape`` and ``dtype`` are logical;
    the stored array has the storage dtype of ``statediff.trace.dtypes.STORAGE``.
    ``summary`` is the tensor's ``/digests`` row (format version 3), None in
    older traces.
    """

    request: int
    position: int
    layer: int
    kind: str
    role: str
    module: str
    token_start: int
    step: int
    block: int
    dataset: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    sum: float
    sumsq: float
    min: float
    max: float
    n_nan: int
    n_inf: int
    summary: Summary | None = None  # its /digests row (version 3), if the writer recorded one

    def label(self) -> str:
        return (
            f"request {self.request} position {self.position} "
            f"layer {self.layer} ({self.module}) {self.kind}"
        )

    def to_row(self) -> tuple:
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        return (
            self.request, self.position, self.layer, self.kind.encode(), self.role.encode(),
            _utf8_prefix(self.module, 96), self.token_start, self.step, self.block,
            self.dataset.encode(), self.dtype.encode(), len(self.shape), shape,
            self.hash.encode(), self.sum, self.sumsq, self.min, self.max,
            self.n_nan, self.n_inf,
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass(frozen=True, slots=True)
class DigestEntry(_Keyed):
    """One tensor recorded as a digest only (a row of ``/digests`` without data).

    Same meaning as the ``TensorEntry`` fields of the same name; ``digest``
    is ``statediff.trace.digest.digest_array`` of the tensor's storage bytes
    (32 lowercase hex digits). Two tensors with equal dtype, shape and digest
    are treated as bit-identical. ``summary`` holds the rest of a version-3
    row (its ``digest`` equals ``digest``); None for a version-2 row.
    """

    request: int
    position: int
    token_start: int
    layer: int
    kind: str
    role: str
    module: str
    step: int
    block: int
    dtype: str
    shape: tuple[int, ...]
    digest: str
    summary: Summary | None = None

    def label(self) -> str:
        return (f"request {self.request} position {self.position} "
                f"layer {self.layer} ({self.module}) {self.kind} (digest)")

    def to_row(self) -> tuple:
        """This digest-only tensor as a version-3 ``/digests`` row."""
        return digest_row(self, "", self.summary or Summary(self.digest))


def digest_row(e: "TensorEntry | DigestEntry", dataset: str, summary: Summary) -> tuple:
    """A version-3 ``/digests`` row (``DIGEST_DTYPE``) for ``e``'s key fields and ``summary``.

    ``dataset`` names the tensor's data under ``/tensors`` ("" for a digest-only tensor).
    """
    shape = list(e.shape) + [0] * (MAX_NDIM - len(e.shape))
    sketch = summary.sketch if summary.sketch is not None else (float("nan"),) * SKETCH_DIM
    return (
        e.request, e.position, e.token_start, e.layer, e.kind.encode(),
        e.role.encode(), _utf8_prefix(e.module, 96), e.step, e.block,
        e.dtype.encode(), len(e.shape), shape, summary.digest.encode(),
        dataset.encode(), summary.digest_bf16.encode(), summary.sum, summary.sumsq, summary.absmax,
        summary.n_nan, summary.n_inf, list(sketch),
    )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


# Run metadata keys. Unknown values are stored as null, never omitted, so
# reports can say "unknown" (docs/trace-format.md lists their meaning).
RUN_KEYS = (
    "engine",  # "vllm", "transformers", "synthetic"
    "engine_version",
    "engine_commit",
    "runner",  # adapter name, e.g. "vllm-v1-gpu_model_runner"
    "model",  # path or hub id
    "architecture",
    "config_digest",  # sha256 of the model's config.json, canonical JSON
    "dtype",
    "quantization",
    "block_size",  # tokens per KV-cache block, after engine adjustment
    "mamba_block_size",
    "mamba_cache_mode",  # "align", "all", "none"
    "prefix_caching",
    "mode",  # "hit" or "cold"
    "cold_policy",  # "cache_salt" or null
    "replay",  # "default" or "exact"
    "max_num_batched_tokens",
    "speculative_method",
    "num_speculative_tokens",
    "seed",
    "sampling",
    "layers",  # list of {"layer", "module", "type"}
    "fault",  # planted fault description or null
    "capture",  # what was captured: {"kv": ..., "activations": bool}
    "statediff_version",
    "created_unix",
    "effective",  # what the started engine really ran with (object; docs/trace-format.md)
    "logprobs_k",  # top-k alternatives recorded per output token, or null (per request)
    "stopped",  # null, or {"request": int, "error": str, ...}: the replay stopped early (incomplete)
    "keep",  # null, or {"policy", "budget_bytes", "focus", "kept_bytes", "kept_tensors", "digest_only_tensors"}
    "adapter",  # "verified", or "unverified": recorded with the nearest verified version's adapter
    "adapter_version",  # the engine version whose adapter recorded it
    "version_facts",  # null, or {"one_token_first_chunk", "eagle_drop_switch", "eagle_block_drop", "hash_lookahead_tokens"}
    "engine_patches",  # null, or [{"name", "replaces", ...}]: engine code statediff stood in for (trace/patches.py)
)

# Keys that must agree for two traces to be comparable.
IDENTITY_KEYS = ("engine", "architecture", "config_digest", "dtype", "quantization", "block_size")


def canonical_json(obj: Any) -> str:
    """Deterministic JSON text (sorted keys, no NaN) used for digests and attributes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, default=str)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


RUN_INT_KEYS = ("block_size", "mamba_block_size", "max_num_batched_tokens",
                "num_speculative_tokens", "seed", "logprobs_k")
RUN_STR_KEYS = ("engine", "engine_version", "engine_commit", "runner", "model", "architecture",
                "config_digest", "dtype", "quantization", "mamba_cache_mode", "cold_policy",
                "speculative_method", "statediff_version", "adapter_version")
RUN_ENUMS = {"mode": ("hit", "cold"), "replay": ("default", "exact"), "adapter": ("verified", "reviewed", "unverified")}


def run_problem(run: dict) -> str | None:
    """Why ``run`` breaks the documented run-metadata types, or None.

    Every documented key may be null (unknown); other keys are free-form JSON.
    """
    for key in RUN_INT_KEYS:
        v = run.get(key)
        if v is not None and not _is_int(v):
            return f"run field '{key}' is {v!r}, not an integer or null"
    for key in RUN_STR_KEYS:
        v = run.get(key)
        if v is not None and not isinstance(v, str):
            return f"run field '{key}' is {v!r}, not a string or null"
    for key, allowed in RUN_ENUMS.items():
        v = run.get(key)
        if v is not None and v not in allowed:
            return f"run field '{key}' is {v!r}, not one of {allowed} or null"
    v = run.get("prefix_caching")
    if v is not None and not isinstance(v, bool):
        return f"run field 'prefix_caching' is {v!r}, not a boolean or null"
    v = run.get("layers")
    if v is not None and not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
        return "run field 'layers' is not a list of objects or null"
    v = run.get("created_unix")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        return f"run field 'created_unix' is {v!r}, not a number or null"
    v = run.get("effective")
    if v is not None and not isinstance(v, dict):
        return "run field 'effective' is not an object or null"
    v = run.get("logprobs_k")
    if v is not None and not 0 <= v <= MAX_LOGPROBS_K:
        return f"run field 'logprobs_k' is {v!r}, not in 0..{MAX_LOGPROBS_K} or null"
    v = run.get("keep")
    if v is not None and not (isinstance(v, dict) and isinstance(v.get("policy"), (str, type(None)))):
        return "run field 'keep' is not an object {policy: string, ...} or null"
    if patches_problem(run.get("engine_patches")):
        return patches_problem(run.get("engine_patches"))
    v = run.get("stopped")
    if v is not None and not (isinstance(v, dict) and (v.get("request") is None or (
            _is_int(v["request"]) and v["request"] >= 0)) and isinstance(v.get("error"), (str, type(None)))):
        return "run field 'stopped' is not an object {request: int >= 0 or null, error: str or null} or null"
    return None


def stop_reason(run: dict) -> str | None:
    """One line saying where and why a replay stopped early (run field ``stopped``), or None."""
    v = run.get("stopped")
    if not isinstance(v, dict):
        return None
    total = run.get("num_requests")
    at = "" if v.get("request") is None else f" at request {v['request']}" + (
        f" of {total}" if _is_int(total) else "")
    return f"the replay stopped early{at}: {v.get('error') or 'unknown error'}"


# Datasets of a request group: name -> (storage dtype, number of dimensions).
# A missing token dataset reads as empty; missing logprob datasets as null
# (not recorded). The writer routes these keys of a request record to
# datasets, never to its JSON attribute.
REQUEST_DATASETS: dict[str, tuple[str, int]] = {
    "prompt_token_ids": ("<i8", 1),
    "output_token_ids": ("<i8", 1),
    "output_logprobs": ("<f4", 1),  # logprob of each sampled token [n_out]
    "output_topk_ids": ("<i8", 2),  # top-k alternatives per output token [n_out, k], best first
    "output_topk_logprobs": ("<f4", 2),  # their logprobs [n_out, k]
}
TOKEN_DATASETS = ("prompt_token_ids", "output_token_ids")
LOGPROB_DATASETS = ("output_logprobs", "output_topk_ids", "output_topk_logprobs")


def request_arrays_problem(shapes: dict[str, tuple[int, ...] | None]) -> str | None:
    """Why the shapes of a request's datasets disagree with each other, or None.

    ``shapes`` maps a name of ``REQUEST_DATASETS`` to its shape, or to None
    (absent); a name missing from ``shapes`` is absent. Rules: each has its
    documented number of dimensions and at most ``MAX_TOKENS_PER_REQUEST``
    elements; ``output_logprobs`` has one value per output token;
    ``output_topk_ids`` and ``output_topk_logprobs`` come together, with
    ``output_logprobs``, and have the same shape ``[n_out, k]`` with
    ``0 <= k <= MAX_LOGPROBS_K``.
    """
    for name, shape in shapes.items():
        if shape is None:
            continue
        ndim = REQUEST_DATASETS[name][1]
        size = 1
        for d in shape:
            size *= d
        if len(shape) != ndim or size > MAX_TOKENS_PER_REQUEST:
            return f"{name} is not a {ndim}-D dataset of at most {MAX_TOKENS_PER_REQUEST} elements"
    n_out = (shapes.get("output_token_ids") or (0,))[0]
    lp, ids, lps = (shapes.get(k) for k in LOGPROB_DATASETS)
    if lp is not None and lp != (n_out,):
        return f"output_logprobs has {lp[0]} values for {n_out} output tokens"
    if (ids is None) != (lps is None) or (ids is not None and lp is None):
        return "output_topk_ids and output_topk_logprobs must come together, with output_logprobs"
    if ids is not None:
        if ids != lps:
            return f"output_topk_ids has shape {ids} but output_topk_logprobs {lps}"
        if ids[0] != n_out or ids[1] > MAX_LOGPROBS_K:
            return (f"output_topk_ids has shape {ids}, not [{n_out} output tokens, k <= "
                    f"{MAX_LOGPROBS_K}]")
    return None


def request_problem(rec: dict) -> str | None:
    """Why a request record breaks the documented field types, or None.

    Checks ``index`` (int >= 0), ``prompt_len``/``num_cached_tokens``
    (int >= 0 or null), ``request_id``/``cache_salt`` (str or null),
    ``finished`` (bool), ``acceptance`` (object or null) and ``chunks``
    (list of [start, end] int pairs with 0 <= start <= end). Token id lists
    are checked by whoever stores them.
    """
    idx = rec.get("index")
    if not _is_int(idx) or idx < 0:
        return f"request index {idx!r} is not a non-negative integer"
    for key in ("prompt_len", "num_cached_tokens"):
        v = rec.get(key)
        if v is not None and (not _is_int(v) or v < 0):
            return f"'{key}' is {v!r}, not a non-negative integer or null"
    for key in ("request_id", "cache_salt"):
        v = rec.get(key)
        if v is not None and not isinstance(v, str):
            return f"'{key}' is {v!r}, not a string or null"
    if not isinstance(rec.get("finished", False), bool):
        return "'finished' is not a boolean"
    acc = rec.get("acceptance")
    if acc is not None and not isinstance(acc, dict):
        return "'acceptance' is not an object or null"
    chunks = rec.get("chunks", [])
    if not isinstance(chunks, (list, tuple)) or not all(
            isinstance(c, (list, tuple)) and len(c) == 2 and _is_int(c[0]) and _is_int(c[1])
            and 0 <= c[0] <= c[1] for c in chunks):
        return "'chunks' is not a list of [start, end) token ranges"
    return None
