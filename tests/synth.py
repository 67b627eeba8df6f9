"""Synthetic hit/cold trace pairs with planted faults at known keys.

Model: 3 Gated DeltaNet layers (0-2: conv state (3, 256) bf16, SSM state
(2, 64, 64) fp32) and one attention layer (3: K and V blocks (16, 2, 64)
bf16), block size 16. Four requests replayed as a multi-turn conversation:

    request  prompt  hit run resumes at  shares its prefix with
    0        40      -                   -
    1        78      48                  request 0 (prompt + output, 48 tokens)
    2        106     80                  request 1 (prompt + output, 86 tokens)
    3        90      48                  request 1 (first 50 prompt tokens)

Every tensor is a deterministic function of the tokens it summarises, so
requests sharing a prefix have bit-identical states there, as in a real
engine. The cold run records every block boundary up to each prompt's
length; the hit run records the resumed states at the hit boundary, the
two cached KV blocks before it, and everything computed after it.

Keep policies (``write_trace(..., keep=...)``, digest-first recording): by
default a trace holds data only, as traces before format version 3; with
``keep`` every tensor also gets its summary (``statediff.trace.summary``)
and only the tensors ``keep`` selects keep their data ("all", "none", or a
callable of ``(request, position, layer, kind, role)``).

Faults (``Fault(name, request, layer)``) change the hit run's resumed state
of ``request`` at its hit boundary (or its KV blocks for "swap_kv"); the
corruption then *propagates*: states the request computes afterwards are
perturbed, and so are cached states a later request resumes from when it
reuses the corrupted request's blocks (see ``_poison``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from statediff.diff.diverge import shared_prefix
from statediff.trace.dtypes import round_to_bf16
from statediff.trace.reader import open_trace
from statediff.trace.schema import TensorEntry
from statediff.trace.summary import summarize
from statediff.trace.writer import TraceWriter

BLOCK = 16
GDN_LAYERS = (0, 1, 2)
ATTN_LAYER = 3
CONV_SHAPE, SSM_SHAPE, KV_SHAPE = (3, 256), (2, 64, 64), (BLOCK, 2, 64)
NAN_INDEX = (1, 5, 7)
FAULTS = ("prev_block", "zero_conv", "swap_kv", "nan", "bf16", "other_request")


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    hit: int  # tokens the hit run resumes from (num_cached_tokens)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A planted fault in the hit run: ``name`` in FAULTS, at ``request``'s hit boundary."""

    name: str
    request: int
    layer: int
    other: int = 3  # for "other_request": whose cold state is resumed instead


def _tokens(seed: str, n: int) -> tuple[int, ...]:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    return tuple(int(t) for t in rng.integers(3, 1000, n))


def scenario() -> list[Request]:
    """The four requests of the module docstring."""
    r0 = Request(_tokens("p0", 40), _tokens("o0", 8), 0)
    p1 = r0.prompt + r0.output + _tokens("p1", 30)
    r1 = Request(p1, _tokens("o1", 8), 48)
    r2 = Request(p1 + r1.output + _tokens("p2", 20), _tokens("o2", 8), 80)
    r3 = Request(p1[:50] + _tokens("p3", 40), _tokens("o3", 8), 48)
    return [r0, r1, r2, r3]


def _rng(*parts: object) -> np.random.Generator:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(h, "little"))


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    return (round_to_bf16(x.astype(np.float32)).view(np.uint32) >> 16).astype(np.uint16)


def clean(prefix: tuple[int, ...], layer: int, kind: str) -> np.ndarray:
    """The fault-free stored tensor summarising ``prefix`` (storage dtype)."""
    rng = _rng(prefix, layer, kind)
    if kind == "gdn.ssm_state":
        return (rng.standard_normal(SSM_SHAPE) * 0.1).astype(np.float32)
    shape = CONV_SHAPE if kind == "gdn.conv_state" else KV_SHAPE
    return to_bf16_bits(rng.standard_normal(shape) * 0.5)


def _perturb(arr: np.ndarray, kind: str, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Add ``scale`` x N(0,1) in value space; returns the storage dtype."""
    if arr.dtype == np.float32:
        return (arr + rng.standard_normal(arr.shape).astype(np.float32) * scale).astype(np.float32)
    vals = (arr.astype(np.uint32) << 16).view(np.float32)
    return to_bf16_bits(vals + rng.standard_normal(arr.shape) * scale)


def _benign(arr: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Benign run-to-run noise: a few ULP everywhere, up to 0.05 absolute on attention K."""
    if kind == "attn.k":
        vals = (arr.astype(np.uint32) << 16).view(np.float32)
        return to_bf16_bits(vals + rng.uniform(-0.05, 0.05, arr.shape))
    step = rng.integers(-1, 2, arr.shape)
    if arr.dtype == np.float32:
        return (arr.view(np.uint32).astype(np.int64) + 4 * step).astype(np.uint32).view(np.float32)
    return (arr.astype(np.int64) + step).astype(np.uint16)


def _kinds(layer: int) -> tuple[str, ...]:
    return ("attn.k", "attn.v") if layer == ATTN_LAYER else ("gdn.conv_state", "gdn.ssm_state")


def _module(layer: int) -> str:
    return f"model.layers.{layer}." + ("self_attn" if layer == ATTN_LAYER else "linear_attn")


def _poison(reqs: list[Request], faults: list[Fault]) -> tuple[dict[int, int], dict[int, int]]:
    """bad_after[r]: positions > this of r computed in the hit run are corrupted;
    producer[r]: the earlier request whose cached blocks r resumes from."""
    bad_after: dict[int, int] = {}
    producer: dict[int, int] = {}
    state_faults = {f.request for f in faults if f.name != "swap_kv"}
    for r, req in enumerate(reqs):
        if req.hit:
            for q in range(r):
                if shared_prefix(req.prompt, reqs[q].prompt + reqs[q].output) >= req.hit and reqs[q].hit < req.hit:
                    producer[r] = q
                    break
        inherited = r in producer and req.hit > bad_after.get(producer[r], 1 << 30)
        if r in state_faults or inherited:
            bad_after[r] = req.hit
    return bad_after, producer


def _hit_tensor(reqs, r, p, layer, kind, faults, bad_after, producer) -> np.ndarray:
    req = reqs[r]
    arr = clean(req.prompt[:p], layer, kind)
    owner = r if p > req.hit else producer.get(r, r)  # who computed this position
    if p > bad_after.get(owner, 1 << 30):
        arr = _perturb(arr, kind, _rng("poison", req.prompt[:p], layer, kind), 0.05)
    for f in faults:
        if f.request != r or f.layer != layer:
            continue
        if f.name == "swap_kv" and p in (req.hit - BLOCK, req.hit):
            other = req.hit if p == req.hit - BLOCK else req.hit - BLOCK
            arr = clean(req.prompt[:other], layer, kind)
        elif p != req.hit:
            continue
        elif f.name == "prev_block" and kind == "gdn.ssm_state":
            arr = clean(req.prompt[:p - BLOCK], layer, kind)
        elif f.name == "zero_conv" and kind == "gdn.conv_state":
            arr = np.zeros_like(arr)
        elif f.name == "nan" and kind == "gdn.ssm_state":
            arr = arr.copy()
            arr[NAN_INDEX] = np.nan
        elif f.name == "bf16" and kind == "gdn.ssm_state":
            arr = round_to_bf16(arr)
        elif f.name == "other_request" and kind == "gdn.ssm_state":
            arr = clean(reqs[f.other].prompt[:p], layer, kind)
    return arr


def run_meta(mode: str, replay: str = "default", **overrides) -> dict:
    meta = dict(
        engine="synthetic", engine_version="0", model="synthetic-tiny",
        architecture="Qwen3NextForCausalLM", config_digest="c0ffee", dtype="bfloat16",
        quantization=None, block_size=BLOCK, mamba_block_size=BLOCK, mamba_cache_mode="align",
        prefix_caching=True, mode=mode, cold_policy="cache_salt" if mode == "cold" else None,
        replay=replay, seed=0,
        layers=[{"layer": i, "module": _module(i), "type": "attention" if i == ATTN_LAYER else "gdn"}
                for i in (*GDN_LAYERS, ATTN_LAYER)],
    )
    return meta | overrides


def _keeps(keep, request: int, position: int, layer: int, kind: str, role: str) -> bool:
    if keep in ("all", None):
        return True
    if keep == "none":
        return False
    return bool(keep(request, position, layer, kind, role))


def write_trace(path: str | Path, mode: str, *, faults: list[Fault] = (), noise_seed: int | None = None,
                replay: str = "default", noise_from: int | None = None,
                requests: dict[int, dict] | None = None, keep=None, keep_run: dict | None = None,
                scale: dict[tuple[int, int, int, str], float] | None = None, **run_overrides) -> Path:
    """Write one synthetic trace ("hit" or "cold") and return its path.

    ``keep`` None writes data only, no summaries (a trace as before format
    version 3); "all", "none" or a callable ``(request, position, layer,
    kind, role) -> bool`` writes every tensor's summary and the data of the
    tensors it keeps (run key ``keep`` says which policy: "all", "none", or
    "custom" for a callable; ``keep_run`` replaces that run record).

    ``noise_seed`` adds benign noise to every tensor of the requests from
    ``noise_from`` on (default: 1 in a hit run, where the first cache hit is:
    request 0 ran from scratch in both runs and is bit-identical there, as in
    a real engine; 0 in a cold run, a differently chunked cold run).
    ``requests`` overrides fields of request records at the end (e.g.
    ``{3: {"output_token_ids": [...], "output_logprobs": [...]}}``).
    ``scale`` multiplies float32 tensors by ``1 + s`` at (request, position, layer, kind): a
    relative L2 error of exactly ``s`` (within float32 rounding) against the clean tensor.
    """
    if noise_from is None:
        noise_from = 1 if mode == "hit" else 0
    reqs, faults = scenario(), list(faults)
    bad_after, producer = _poison(reqs, faults) if mode == "hit" else ({}, {})
    if keep_run is not None or keep is not None:
        run_overrides["keep"] = keep_run or {"policy": keep if isinstance(keep, str) else "custom"}
    meta = run_meta(mode, replay, fault=[dataclasses.asdict(f) for f in faults] or None, **run_overrides)
    if "run_mode" in meta:  # the run field `mode` as recorded (None: a plugin trace), apart from the data's mode
        meta["mode"] = meta.pop("run_mode")
    w = TraceWriter(path, meta)
    for r, req in enumerate(reqs):
        hit = req.hit if mode == "hit" else 0
        w.begin_request(r, f"req-{r}", list(req.prompt))
        for p in range(BLOCK, len(req.prompt) + 1, BLOCK):
            for layer in (*GDN_LAYERS, ATTN_LAYER):
                attn = layer == ATTN_LAYER
                if p < (hit - BLOCK if attn else hit):  # skipped by the hit (attention: last 2 cached blocks kept)
                    continue
                role = "kv_block" if attn else ("resumed" if p == hit else "checkpoint")
                for kind in _kinds(layer):
                    if mode == "hit":
                        arr = _hit_tensor(reqs, r, p, layer, kind, faults, bad_after, producer)
                    else:
                        arr = clean(req.prompt[:p], layer, kind)
                    if noise_seed is not None and r >= noise_from:
                        arr = _benign(arr, kind, _rng("noise", noise_seed, r, p, layer, kind))
                    if scale and (r, p, layer, kind) in scale and arr.dtype == np.float32:
                        arr = (arr.astype(np.float64) * (1 + scale[r, p, layer, kind])).astype(np.float32)
                    dtype = "float32" if arr.dtype == np.float32 else "bfloat16"
                    meta = dict(request=r, position=p, layer=layer, kind=kind, role=role, module=_module(layer),
                                dtype=dtype, token_start=p - BLOCK if attn else p, step=r * 100 + p // BLOCK)
                    if keep is None:
                        w.add(arr, **meta)
                    elif _keeps(keep, r, p, layer, kind, role):
                        w.add(arr, summary=summarize(arr, dtype), **meta)
                    else:
                        w.add_digest(summarize(arr, dtype), shape=arr.shape, **meta)
            w.end_step()
        bad = mode == "hit" and r in bad_after
        out = list(req.output[:2]) + [7] * (len(req.output) - 2) if bad else list(req.output)
        w.update_request(r, num_cached_tokens=hit, output_token_ids=out, finished=True,
                         acceptance={"mean_acceptance_length": 1.0 if bad else 2.5, "num_drafts": 4})
        if requests and r in requests:
            w.update_request(r, **requests[r])
        w.end_step()
    w.close()
    return Path(path)


def write_pair(directory: str | Path, *, faults: list[Fault] = (), replay: str = "default",
               noise_seed: int | None = None, hit_run: dict | None = None, keep=None) -> tuple[Path, Path]:
    """A hit trace and its cold trace under ``directory``, both with ``keep``; returns (hit, cold)."""
    d = Path(directory)
    hit = write_trace(d / "hit.h5", "hit", faults=faults, noise_seed=noise_seed, replay=replay, keep=keep,
                      **(hit_run or {}))
    cold = write_trace(d / "cold.h5", "cold", replay=replay, keep=keep)
    return hit, cold


def entry(request: int, position: int, layer: int, kind: str, *, step: int = 0, role: str = "checkpoint",
          tag: str = "") -> TensorEntry:
    """A bare index entry (float32, shape (2,)) for tests that need no data."""
    return TensorEntry(request=request, position=position, layer=layer, kind=kind, role=role,
                       module=f"model.layers.{layer}", token_start=position, step=step, block=-1,
                       dataset=f"d{request}-{position}-{layer}-{kind}-{step}{tag}", dtype="float32",
                       shape=(2,), hash="h", sum=0.0, sumsq=0.0, min=0.0, max=0.0, n_nan=0, n_inf=0)


# tensor parallel size 2 (issue 20): conv (3, 256) = q 64 | k 64 | v 128; ssm (2, 64, 64): 2 value heads; K/V (16, 2, 64): 2 heads on axis 1
TP_KD, TP_VD = 64, 128


def tp_layout(rank: int) -> dict:
    """Rank ``rank``'s run field ``tensor_parallel.shards`` of a 2-rank split of these traces."""
    parts, local, base = [], 0, 0
    for name, dim in (("q", TP_KD), ("k", TP_KD), ("v", TP_VD)):
        per = dim // 2
        parts.append({"name": name, "local": [local, local + per], "global": [base + rank * per, base + (rank + 1) * per]})
        local, base = local + per, base + dim
    heads = {"slice": [rank, rank + 1], "of": 2}
    return {"gdn.conv_state": {"axis": 1, "parts": parts}, "gdn.ssm_state": {"axis": 0, **heads},
            "attn.k": {"axis": 1, **heads}, "attn.v": {"axis": 1, **heads}}


def tp_shard(kind: str, arr: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of the unsharded tensor ``arr`` of ``kind``."""
    lay = tp_layout(rank)[kind]
    if kind == "gdn.conv_state":
        return np.concatenate([arr[:, slice(*p["global"])] for p in lay["parts"]], axis=1)
    idx = [slice(None)] * arr.ndim
    idx[lay["axis"]] = slice(*lay["slice"])
    return arr[tuple(idx)].copy()


def split_ranks(full: Path | list[Path], out: Path) -> list[Path]:
    """``full`` as a 2-rank set, split the way vLLM 0.32 shards (``tp_layout``): rank 0 at ``out``,
    rank 1 beside it. A list: rank r's shards come from ``full[r]`` (a fault on one rank only)."""
    paths = [out, out.with_name(f"{out.stem}.rank1.h5")]
    fulls = full if isinstance(full, list) else [full, full]
    for rank, (p, src) in enumerate(zip(paths, fulls)):
        with open_trace(src) as t:
            run = dict(t.run) | {"tensor_parallel": {"rank": rank, "world_size": 2, "traces": [q.name for q in paths],
                                                     "shards": tp_layout(rank)}}
            w = TraceWriter(p, run, threads=0)
            for i in sorted(t.requests):
                rec = dict(t.requests[i])
                prompt, outs = rec.pop("prompt_token_ids", None) or [], rec.pop("output_token_ids", None) or []
                rid = rec.pop("request_id", None)
                rec.pop("index", None)
                w.begin_request(i, rid, prompt, output_token_ids=outs, **rec)
            for e in t.entries:
                w.add(tp_shard(e.kind, t.read(e), rank), request=e.request, position=e.position, layer=e.layer,
                      kind=e.kind, role=e.role, module=e.module, dtype=e.dtype, token_start=e.token_start,
                      step=e.step, block=e.block)
            w.end_step()
            w.close()
    return paths
