"""Tensor-parallel recording on vLLM 0.32: which rank a worker is and how its state is sharded.

Under ``tensor_parallel_size`` N vLLM's multi-process executor (``v1/executor/
multiproc_executor.py``) runs one worker process per rank; the plugin registers in each
(``vllm.general_plugins``), so every rank records its own shards into its own trace:
rank 0 into the trace path itself, rank r > 0 into ``rank_trace_path(path, r)``
(``TRACE.rank1.h5``, ...). Each trace is a complete trace of one rank; rank 0's run field
``tensor_parallel`` is the index of the set (``docs/trace-format.md``, "Tensor parallel").

The shard layout of each captured kind mirrors vLLM 0.32:

- ``gdn.conv_state``: ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``: ``conv1d``
  is a ``ColumnParallelLinear`` of ``conv_dim = 2 * key_dim + value_dim`` whose weight loader
  (``mamba_v2_sharded_weight_loader`` with ``(key_dim, key_dim, value_dim)``) shards q, k and v
  *each on its own*: rank r holds ``q[r*kd/N:(r+1)*kd/N] | k[...] | v[r*vd/N:(r+1)*vd/N]``,
  and ``forward`` splits its conv output at ``[kd/N, kd/N, vd/N]``. The state's dim axis
  (``mamba_utils.MambaStateShapeCalculator.gated_delta_net_state_shape``: ``conv_dim / N``)
  is laid out the same way, so concatenating two ranks' conv states is *not* the unsharded
  state (vLLM #53078); ``statediff.diff.ranks.unshard`` is the right inverse.
- ``gdn.ssm_state``: ``(num_v_heads / N, head_v_dim, head_k_dim)``, rank r holds value heads
  ``[r*nv/N, (r+1)*nv/N)`` (axis 0).
- ``attn.k`` / ``attn.v``: ``[num_kv_heads / N, block_size, head_size]``
  (``models/qwen3_next.py`` ``Qwen3NextAttention``: ``num_kv_heads = total // N`` when
  ``total >= N``), rank r holds KV heads ``[r*h/N, (r+1)*h/N)`` (axis 0).

Other vLLM versions (0.29-0.31) are not verified for tensor parallel: ``check_supported``
refuses them in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["VERIFIED_VERSIONS", "check_supported", "rank_of", "rank_trace_path", "shard_layout",
           "tensor_parallel_field"]

def _verified() -> tuple[str, ...]:
    from ..surface import VERSIONS

    return tuple(v.version.rsplit(".0", 1)[0] if v.version.endswith(".0") else v.version
                 for v in VERSIONS if v.tensor_parallel)


#: vLLM versions whose tensor-parallel layout statediff verified (``surface.VersionFacts.tensor_parallel``).
VERIFIED_VERSIONS = _verified()


def rank_trace_path(trace: str | Path, rank: int, default_suffix: str = ".h5") -> str:
    """The file rank ``rank`` writes: the path itself for rank 0, ``STEM.rankR.SUFFIX`` beside it
    otherwise (``default_suffix`` when the path has none: ``.h5`` for a trace, ``.jsonl`` for a
    live audit's incident file)."""
    p = Path(trace)
    return str(p) if rank == 0 else str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or default_suffix}"))


def check_supported(engine_version: str, tp: int, pp: int = 1) -> str | None:
    """Why ``tensor_parallel_size`` ``tp`` / ``pipeline_parallel_size`` ``pp`` cannot be recorded on
    ``engine_version`` (one line), or None when it can."""
    if pp > 1:
        return (f"pipeline parallel size {pp}: statediff records tensor-parallel engines only "
                "(pipeline-parallel stages are not captured); use --tensor-parallel-size alone")
    if tp > 1 and not any(engine_version == v or engine_version.startswith(v + ".") for v in VERIFIED_VERSIONS):
        return (f"tensor parallel size {tp} on vLLM {engine_version}: statediff verified the per-rank "
                f"shard layout on vLLM {', '.join(VERIFIED_VERSIONS)} only; record with "
                "--tensor-parallel-size 1 on this version")
    return None


def rank_of(runner: Any) -> tuple[int, int]:
    """(tensor-parallel rank, world size) of the worker ``runner`` runs in (vLLM 0.32
    ``distributed/parallel_state.py``); (0, 1) without tensor parallelism."""
    size = int(getattr(runner.parallel_config, "tensor_parallel_size", 1) or 1)
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


def shard_layout(runner: Any, rank: int, size: int) -> dict[str, Any]:
    """How this rank's tensors sit in the unsharded ones, per kind (run field
    ``tensor_parallel.shards``). Slices are ``[start, stop)`` on the unsharded axis.

    ``gdn.conv_state``: ``axis`` (the conv dim axis of the recorded tensor: 1 for the
    ``(state_len, dim)`` layout, 0 for ``(dim, state_len)``) and ``parts``: one object per
    sub-projection q, k, v with ``local`` (its slice in this rank's tensor) and ``global``
    (its slice in the unsharded conv dim). ``gdn.ssm_state``, ``attn.k``, ``attn.v``:
    ``axis`` 0 and ``slice`` (heads) of ``of`` heads. Kinds the model has not are absent.
    """
    hf = runner.model_config.hf_text_config
    out: dict[str, Any] = {}
    nk, nv = getattr(hf, "linear_num_key_heads", None), getattr(hf, "linear_num_value_heads", None)
    if nk and nv:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        kd, vd = nk * hf.linear_key_head_dim, nv * hf.linear_value_head_dim
        out["gdn.conv_state"] = {"axis": 0 if is_conv_state_dim_first() else 1,
                                 "parts": conv_parts(kd, vd, rank, size)}
        out["gdn.ssm_state"] = {"axis": 0, "of": nv, "slice": _heads(nv, rank, size)}
    nkv = getattr(hf, "num_key_value_heads", None)
    if nkv:
        for kind in ("attn.k", "attn.v"):
            out[kind] = {"axis": 0, "of": nkv, "slice": _heads(nkv, rank, size)}
    return out


def _heads(n: int, rank: int, size: int) -> list[int]:
    per = n // size
    return [rank * per, (rank + 1) * per]


def conv_parts(key_dim: int, value_dim: int, rank: int, size: int) -> list[dict[str, Any]]:
    """The q, k, v parts of rank ``rank``'s conv state dim axis (``shard_layout``)."""
    parts, local, base = [], 0, 0
    for name, dim in (("q", key_dim), ("k", key_dim), ("v", value_dim)):
        per = dim // size
        parts.append({"name": name, "local": [local, local + per],
                      "global": [base + rank * per, base + (rank + 1) * per]})
        local += per
        base += dim
    return parts


def tensor_parallel_field(runner: Any, trace: str, default_suffix: str = ".h5") -> dict[str, Any] | None:
    """Run field ``tensor_parallel`` of this rank (None without tensor parallelism): ``rank``,
    ``world_size``, ``traces`` (every rank's trace file name, rank order, beside this one) and
    ``shards`` (``shard_layout``)."""
    rank, size = rank_of(runner)
    if size == 1:
        return None
    base = Path(trace) if rank == 0 else None
    if base is None:  # rank r's own path: STEM.rankR.h5 -> STEM.h5
        p = Path(trace)
        base = p.with_name(p.name.replace(f".rank{rank}", "", 1))
    return {"rank": rank, "world_size": size,
            "traces": [Path(rank_trace_path(base, r, default_suffix)).name for r in range(size)],
            "shards": shard_layout(runner, rank, size)}


def shutdown_engine(llm: Any) -> None:
    """Stop ``llm``'s engine and its worker processes (vLLM 0.32 ``LLM.llm_engine.engine_core``
    ``.shutdown``: the multi-process executor terminates its workers, whose exit handlers close
    their traces)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def finish_rank_traces(trace: str, size: int, *, wait_s: float = 180.0) -> dict[str, Any]:
    """After the engine stopped: wait until every rank's trace is closed (its parts directory
    gone), then read what each holds.

    Returns:
        ``{"tensors": n, "bytes_file": b, "ranks": [{"rank", "trace", "tensors", "fault"}...],
        "fault": the first rank's run field ``fault`` that is set, or None}``.
    Raises:
        RuntimeError: a rank's trace is missing or still unfinished after ``wait_s`` seconds
            (one line naming it).
    """
    import os
    import time

    from statediff.trace import open_trace
    from statediff.trace.writer import parts_dir

    paths = [rank_trace_path(trace, r) for r in range(size)]
    deadline = time.monotonic() + wait_s
    while any(parts_dir(p).is_dir() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.5)
    out: dict[str, Any] = {"tensors": 0, "bytes_file": 0, "ranks": [], "fault": None}
    for r, p in enumerate(paths):
        if parts_dir(p).is_dir() or not os.path.isfile(p):
            raise RuntimeError(f"rank {r} of {size} left no finished trace at {p} "
                               f"({'still unfinished' if parts_dir(p).is_dir() else 'missing'} "
                               f"{wait_s:.0f} s after the engine stopped)")
        t = open_trace(p)
        n = len(t.entries) + len(t.digests)
        fault = t.run.get("fault")
        out["tensors"] += n
        out["bytes_file"] += os.path.getsize(p)
        out["ranks"].append({"rank": r, "trace": p, "tensors": n, "fault": fault})
        out["fault"] = out["fault"] or fault
    return out
