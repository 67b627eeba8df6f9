"""One synthetic hit run, laid out as vLLM 0.32 (mamba cache mode align) records it, for ``statediff audit``.

Block size 16; layer 0 a GDN layer (KV-cache group 0: conv (3, 256) bf16, SSM
(2, 64, 64) fp32), layer 1 an attention layer (group 1: K/V blocks
(16, 2, 64) bf16). Physical blocks and steps:

    request  prompt  hit  step  writes (physical block)
    0        40      -    0     state at 32 (2); K/V [0,16) (10), [16,32) (11)
                          1     K/V tail [32,40) (12)
    1        60      32   5     resumes state from 2 (running slot 4), K/V 10, 11
                                writes state at 48 (4); K/V [32,48) (13)
                          6     K/V tail [48,60) (14)
    2        40      -    7     another prefix: state at 32 (20); K/V 21, 22
    3        70      48   10    resumes state from 4 (running slot 6), K/V 10, 11, 13

Request 1's prompt is request 0's prompt and first 3 outputs, then its own
tokens; request 3's prompt starts with request 1's first 48 tokens. Every
tensor is a deterministic function of the token prefix it summarises.

Faults (``FAULTS``) corrupt what request 3 restores at step 10, as the
engine's planted faults do (``hooks/recording/faults.py``): ``ssm-wrong-block`` (the
SSM state of position 32), ``conv-zero``, ``ssm-bf16``, ``ssm-nan``,
``kv-stale`` / ``kv-swap`` (the runner's block table row of group 1 remapped),
``other-request`` (request 2's SSM state), ``reused-block`` (request 2's state
at 32 is written into block 4 before request 3 restores from it: a hit on a
block whose content was replaced), ``recycled-slot`` (request 2's first chunk,
treated as a decode, reads a slot holding request 0's state at 32),
``hit-ignores-state`` (request 3's first chunk treated as a prefill without
initial state), ``group-shortfall`` (request 3's attention group, 1, ends its
hit one block before the GDN group's: request field ``group_hit_tokens``), ``kv-unwritten``
(group 1's runner row maps logical block 2 to block 30, which nothing wrote: zeros, as a drafter's
blocks that a connector restoring only the target left empty).

First chunks (with ``keep``; request field ``first_chunk`` and role
``initial``, as ``hooks/vllm/v1/capture.py`` records them): request 0 a prefill
without prior state whose slot 1 holds leftover values (ignored by the
kernel: not a finding); request 2 treated as a decode reading slot 20, which
holds zeros; the hits (1, 3) treated as prefills with initial state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from statediff.trace.dtypes import round_to_bf16
from statediff.trace.summary import summarize
from statediff.trace.writer import TraceWriter

from synth import _tokens, clean

BS = 16
GDN, ATTN = 0, 1
_GDN_KINDS = ("gdn.conv_state", "gdn.ssm_state")
MODULES = {GDN: "model.layers.0.linear_attn", ATTN: "model.layers.1.self_attn"}
FAULTS = ("ssm-wrong-block", "conv-zero", "ssm-bf16", "ssm-nan", "kv-stale", "kv-swap", "other-request",
          "reused-block", "recycled-slot", "hit-ignores-state", "group-shortfall", "kv-unwritten")


def prompts() -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, outputs) of the four requests."""
    p0, o0 = _tokens("a0", 40), _tokens("ao0", 4)
    p1, o1 = p0 + o0[:3] + _tokens("a1", 17), _tokens("ao1", 4)
    p2, o2 = _tokens("a2", 40), _tokens("ao2", 4)
    p3, o3 = p1[:48] + _tokens("a3", 22), _tokens("ao3", 4)
    return [(p0, o0), (p1, o1), (p2, o2), (p3, o3)]


class _Run:
    def __init__(self, path: Path, keep: str | None, fault: str | None, mode: str = "hit") -> None:
        run = dict(engine="synthetic", engine_version="0", model="audit-synth", architecture="Qwen3NextForCausalLM",
                   config_digest="c0ffee", dtype="bfloat16", block_size=BS, mamba_block_size=BS,
                   mamba_cache_mode="align", prefix_caching=True, mode=mode, replay="default", seed=0,
                   cold_policy="cache_salt" if mode == "cold" else None,
                   layers=[{"layer": GDN, "module": MODULES[GDN], "type": "gdn", "group": 0, "block_size": BS},
                           {"layer": ATTN, "module": MODULES[ATTN], "type": "attn", "group": 1,
                            "block_size": BS}],
                   fault=fault)
        if keep is not None:
            run["keep"] = {"policy": keep}
        self.w, self.keep = TraceWriter(path, run), keep

    def add(self, arr: np.ndarray, **key) -> None:
        dtype = "float32" if arr.dtype == np.float32 else "bfloat16"
        key |= dict(module=MODULES[key["layer"]], dtype=dtype)
        if self.keep is None:
            self.w.add(arr, **key)
        elif self.keep == "all":
            self.w.add(arr, summary=summarize(arr, dtype), **key)
        else:
            self.w.add_digest(summarize(arr, dtype), shape=arr.shape, **key)

    def state(self, prefix, r, pos, step, block, role="checkpoint", replace=None) -> None:
        for kind in ("gdn.conv_state", "gdn.ssm_state"):
            arr = (replace or {}).get(kind)
            arr = clean(prefix[:pos], GDN, kind) if arr is None else arr
            self.add(arr, request=r, position=pos, layer=GDN, kind=kind, role=role, step=step, block=block)

    def kv(self, prefix, r, start, end, step, block, role="kv_block", source=None) -> None:
        src = source or (start, end)
        for kind in ("attn.k", "attn.v"):
            arr = clean(prefix[:src[1]] + (src[0],), ATTN, kind)[: src[1] - src[0]]
            self.add(arr, request=r, position=end, token_start=start, layer=ATTN, kind=kind, role=role,
                     step=step, block=block)


def _corrupt(fault: str | None, p3: tuple, p2: tuple) -> dict:
    good = {k: clean(p3[:48], GDN, k) for k in ("gdn.conv_state", "gdn.ssm_state")}
    if fault == "ssm-wrong-block":
        return {"gdn.ssm_state": clean(p3[:32], GDN, "gdn.ssm_state")}
    if fault == "conv-zero":
        return {"gdn.conv_state": np.zeros_like(good["gdn.conv_state"])}
    if fault == "ssm-bf16":
        return {"gdn.ssm_state": round_to_bf16(good["gdn.ssm_state"])}
    if fault == "ssm-nan":
        bad = good["gdn.ssm_state"].copy()
        bad[1, 5, 7] = np.nan
        return {"gdn.ssm_state": bad}
    if fault in ("other-request", "reused-block"):
        return {k: clean(p2[:32], GDN, k) for k in good}
    return {}


def write_hit_run(path: str | Path, fault: str | None = None, keep: str | None = "none",
                  omit_checkpoint: bool = False) -> Path:
    """The hit run of the module docstring, with ``fault`` planted at request 3's restore.

    ``keep``: "none" (summaries only, as ``record --keep none``), "all" (data and
    summaries), or None (data only: a trace before format version 3, no
    ``hit_block_table``, digests are the index's fingerprint hashes).
    ``omit_checkpoint``: request 1's state at 48 is not recorded (what request 3 restores).
    """
    reqs = prompts()
    s = [p + o for p, o in reqs]
    run = _Run(Path(path), keep, fault)
    w = run.w
    for i, (p, _) in enumerate(reqs):
        w.begin_request(i, f"req-{i}", list(p))
    if keep is not None:  # leftover values in request 0's slot: the kernel ignores them
        run.state(s[2], 0, 0, 0, 1, role="initial", replace={k: clean(s[2][:16], GDN, k) for k in _GDN_KINDS})
    run.state(s[0], 0, 32, 0, 2)
    run.kv(s[0], 0, 0, 16, 0, 10)
    run.kv(s[0], 0, 16, 32, 0, 11)
    w.end_step()
    run.kv(s[0], 0, 32, 40, 1, 12)
    w.end_step()
    run.state(s[1], 1, 32, 5, 4, role="resumed")
    run.kv(s[1], 1, 0, 16, 5, 10, role="resumed")
    run.kv(s[1], 1, 16, 32, 5, 11, role="resumed")
    if not omit_checkpoint:
        run.state(s[1], 1, 48, 5, 4)
    run.kv(s[1], 1, 32, 48, 5, 13)
    w.end_step()
    run.kv(s[1], 1, 48, 60, 6, 14)
    w.end_step()
    if keep is not None:
        slot2 = ({k: clean(s[0][:32], GDN, k) for k in _GDN_KINDS} if fault == "recycled-slot" else
                 {k: np.zeros_like(clean(s[0][:32], GDN, k)) for k in _GDN_KINDS})
        run.state(s[2], 2, 0, 7, 20, role="initial", replace=slot2)
    run.state(s[2], 2, 32, 7, 4 if fault == "reused-block" else 20)
    run.kv(s[2], 2, 0, 16, 7, 21)
    run.kv(s[2], 2, 16, 32, 7, 22)
    w.end_step()
    _request3(run, s[3], fault, s[2])
    w.end_step()
    for i, (p, o) in enumerate(reqs):
        hit = {1: 32, 3: 48}.get(i, 0)
        w.update_request(i, num_cached_tokens=hit, output_token_ids=list(o), finished=True)
    if keep is not None:
        w.update_request(1, hit_block_table={"runner": [[0, 2], [10, 11]], "scheduler": [[0, 2], [10, 11]]})
        runner = {"kv-stale": [10, 11, 11], "kv-swap": [10, 13, 11], "kv-unwritten": [10, 11, 30]}.get(fault,
                                                                                                  [10, 11, 13])
        w.update_request(3, hit_block_table={"runner": [[0, 0, 4], runner], "scheduler": [[0, 0, 4], [10, 11, 13]]})
        for i, hit in ((1, 32), (3, 48)):  # each KV-cache group's final hit, as the scheduler decided it
            w.update_request(i, group_hit_tokens=[hit, hit - BS if fault == "group-shortfall" and i == 3 else hit])
        for i, (how, prior, slot, start) in enumerate((("prefill", False, 1, 0), ("prefill", True, 4, 32),
                                                       ("decode", True, 20, 0),
                                                       ("prefill", fault != "hit-ignores-state", 6, 48))):
            w.update_request(i, first_chunk={"start": start, "layers": {
                str(GDN): {"treated_as": how, "prior_state": prior, "slot": slot}}})
    w.end_step()
    w.close()
    return Path(path)


def write_cold_run(path: str | Path, keep: str | None = "none") -> Path:
    """The cold run of the same four requests: mode cold (every request its own ``cache_salt``, so
    no hit), each state and K/V block computed from its own prefix into blocks of its own, at the
    (request, position, layer, kind) keys the hit run records (``write_hit_run``: what a cold run
    split like it holds there). ``keep`` as for ``write_hit_run``; no fault."""
    reqs = prompts()
    s = [p + o for p, o in reqs]
    run = _Run(Path(path), keep, None, mode="cold")
    w = run.w
    for i, (p, _) in enumerate(reqs):
        w.begin_request(i, f"req-{i}", list(p))
    blocks = iter(range(100, 200))
    steps = iter(range(100))
    # (request, states at, K/V blocks up to the end of each step); the hit run's restores computed here
    plan = ((0, (32,), ((0, 16), (16, 32)), ((32, 40),)), (1, (32, 48), ((0, 16), (16, 32), (32, 48)), ((48, 60),)),
            (2, (32,), ((0, 16), (16, 32)), ()), (3, (48,), ((0, 16), (16, 32), (32, 48)), ()))
    for r, states, first, tail in plan:
        step = next(steps)
        for pos in states:
            run.state(s[r], r, pos, step, next(blocks))
        for start, end in first:
            run.kv(s[r], r, start, end, step, next(blocks))
        w.end_step()
        if tail:
            step = next(steps)
            for start, end in tail:
                run.kv(s[r], r, start, end, step, next(blocks))
            w.end_step()
    for i, (_, o) in enumerate(reqs):
        w.update_request(i, num_cached_tokens=0, output_token_ids=list(o), finished=True)
    w.end_step()
    w.close()
    return Path(path)


def _request3(run: _Run, s3: tuple, fault: str | None, s2: tuple) -> None:
    """Request 3's restore at step 10: through the (possibly remapped) runner row of group 1."""
    run.state(s3, 3, 48, 10, 6, role="resumed", replace=_corrupt(fault, s3, s2))
    sources = {"kv-stale": {2: (16, 32)}, "kv-swap": {1: (32, 48), 2: (16, 32)}}.get(fault, {})
    physical = {(0, 16): 10, (16, 32): 11, (32, 48): 13}
    for j in range(3):
        if fault == "kv-unwritten" and j == 2:
            for kind in ("attn.k", "attn.v"):
                run.add(np.zeros_like(clean(s3[:48], ATTN, kind)[32:48]), request=3, position=48, token_start=32,
                        layer=ATTN, kind=kind, role="resumed", step=10, block=30)
            continue
        src = sources.get(j, (j * BS, (j + 1) * BS))
        run.kv(s3, 3, j * BS, (j + 1) * BS, 10, physical[src], role="resumed", source=src)
