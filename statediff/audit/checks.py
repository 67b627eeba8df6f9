"""The restore checks: each restored tensor against what the same run wrote into the block it restores.

A prefix-cache hit copies; copies are exact. So, bit for bit:

- a resumed GDN conv/SSM state (role ``resumed``, read after the engine's
  restore copy into the running slot) equals the checkpoint the run saved at
  that boundary (``checkpoint``, read right after the step that wrote it);
- a K/V block read through the runner's block table at a hit equals what
  was written into the block the scheduler allocated for those tokens
  (``kv_block``, read right after the step that completed it);
- the runner's block table row equals the scheduler's allocation
  (request field ``hit_block_table``).

Where the restore came from: with ``hit_block_table`` (vLLM traces of format
3) the scheduler's row names the physical block (vLLM 0.32 mamba cache mode
``align``: a hit of ``h`` tokens restores the state from the group's logical
block ``h // block_size - 1``; K/V of logical block ``j`` cover tokens
``[j * bs, (j + 1) * bs)``), and the expected value is the last write into
that block before the restore's step, which must hold the same token prefix.
Without it (older traces) the expected value is the last write of the same
layer, kind and token range by a request with the same token prefix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .ledger import Ledger, Rec, Streams
from .result import Finding


class Context:
    """What the checks read from one trace: layers, token streams, writes, hit block tables."""

    def __init__(self, run: dict[str, Any], requests: dict[int, dict[str, Any]], recs: list[Rec]) -> None:
        self.requests = requests
        self.streams = Streams(requests)
        self.ledger = Ledger(recs)
        self.read_layers(run)

    def read_layers(self, run: dict[str, Any]) -> None:
        """Each layer's KV-cache group and block size, from the run's ``layers`` (and block sizes)."""
        self.group: dict[int, int] = {}
        self.bs: dict[int, int] = {}
        default = {"gdn": run.get("mamba_block_size") or run.get("block_size"), "attn": run.get("block_size")}
        for li in run.get("layers") or ():
            if not isinstance(li, dict) or not isinstance(li.get("layer"), int):
                continue
            fam = "gdn" if li.get("type") == "gdn" else "attn"
            if isinstance(li.get("group"), int):
                self.group[li["layer"]] = li["group"]
            bs = li.get("block_size") if isinstance(li.get("block_size"), int) else default[fam]
            if isinstance(bs, int) and bs > 0:
                self.bs[li["layer"]] = bs

    def same_prefix(self, r: Rec, w: Rec, n: int) -> bool:
        """``r``'s request and ``w``'s (a write) hold the same first ``n`` tokens and cache_salt."""
        return self.streams.same_prefix(r.request, w.request, n)

    def block_size(self, r: Rec) -> int | None:
        """Tokens per block of ``r``'s layer: the run's per-layer value, else the run's
        (``mamba_block_size`` for states, ``block_size`` for K/V), else the K/V block's own span."""
        bs = self.bs.get(r.layer)
        if bs is None and not r.is_state and r.position > r.token_start:
            bs = r.position - r.token_start
        return bs

    def scheduler_block(self, r: Rec) -> int | None:
        """The physical block the scheduler allocated for what ``r`` restores, or None (unknown)."""
        table = self.requests.get(r.request, {}).get("hit_block_table")
        g, bs = self.group.get(r.layer), self.block_size(r)
        if not isinstance(table, dict) or g is None or not bs:
            return None
        rows = table.get("scheduler")
        lb = r.position // bs - 1 if r.is_state else r.token_start // bs
        if not isinstance(rows, list) or g >= len(rows) or not 0 <= lb < len(rows[g]):
            return None
        return int(rows[g][lb])


def _expected_ref(w: Rec) -> dict[str, int]:
    return {"request": w.request, "position": w.position, "token_start": w.token_start, "step": w.step,
            "block": w.block}


def _what(r: Rec) -> str:
    return "state" if r.is_state else "K/V"


def expected_write(ctx: Context, r: Rec) -> tuple[Rec | None, Finding | None, str | None]:
    """What ``r`` should equal: ``(write, None, None)``; ``(write, block_owner finding, None)`` when the
    block restored from last held another prefix; ``(None, None, why)`` when the trace holds no write
    of it (not checkable)."""
    src = ctx.scheduler_block(r)
    if src is None:
        same = [w for w in ctx.ledger.at(r.layer, r.kind, r.position, r.token_start, r.step)
                if (r.step >= 0 or w.request < r.request) and ctx.same_prefix(r, w, r.position)]
        if not same:
            return None, None, f"{_label(r)}: no {_what(r)} of this prefix was recorded as saved"
        return same[-1], None, None
    w = ctx.ledger.last_into(r.layer, r.kind, src, r.step)
    if w is None:
        return None, None, f"{_label(r)}: nothing recorded was written into block {src} before step {r.step}"
    if w.position == r.position and w.token_start == r.token_start and \
            ctx.same_prefix(r, w, r.position):
        return w, None, None
    if not r.is_state and w.token_start == r.token_start and w.position < r.position and \
            ctx.same_prefix(r, w, w.position):
        # a partial block (a prompt's tail) completed later by steps the capture does not read
        return None, None, f"{_label(r)}: block {src} was completed after its last recorded write"
    what = (f"the scheduler restored it from block {src}, whose last write (request {w.request}, "
            f"{w.span()}, step {w.step}) holds another token prefix")
    return w, Finding("block_owner", r.request, r.position, r.layer, r.kind, r.module, r.step, what,
                      _expected_ref(w)), None


def _label(r: Rec) -> str:
    return f"request {r.request} position {r.position} layer {r.layer} {r.kind}"


def check_restore(ctx: Context, r: Rec) -> tuple[Finding | None, str | None]:
    """One restored tensor: ``(finding or None, why it is not checkable or None)``; a K/V block read
    from a block nothing in the run wrote is a ``read_before_write`` finding (``read_before_write``)."""
    if not r.is_state:
        unwritten = read_before_write(ctx, r)
        if unwritten is not None:
            return unwritten, None
    w, owner, why = expected_write(ctx, r)
    if why is not None:
        return None, why
    if owner is not None:
        return dataclasses.replace(owner, diagnosis=diagnose(ctx, r, w)), None
    if w.scheme != r.scheme:
        return None, f"{_label(r)}: its digest and the saved one are of different kinds"
    if w.digest == r.digest:
        return None, None
    what = (f"resumed {_what(r)} differs from the checkpoint saved at this boundary" if r.is_state else
            f"K/V read through the runner's block table (block {r.block}) differ from what was written "
            f"into block {w.block} for {r.span()}")
    return Finding("state" if r.is_state else "kv", r.request, r.position, r.layer, r.kind, r.module, r.step,
                   what, _expected_ref(w), diagnose(ctx, r, w)), None


def read_before_write(ctx: Context, r: Rec) -> Finding | None:
    """A K/V block read at a hit (role ``resumed``, through the runner's block table) from a physical
    block that nothing in this run wrote before the read, while the run did write these tokens'
    K/V (same layer, kind, token range and prefix) elsewhere: "read, never written".

    Any layer and KV-cache group, a drafter's included (a DFlash/DSpark drafter's context K/V are
    written by its precompute). Returns the finding (which group, which block, which positions,
    where the tokens' K/V were written, who else holds the block) or None: the block was written
    (what it holds is the other checks' business), or the run recorded no write of these tokens
    at all (nothing to tell "never written" from "not captured": the restore stays unchecked).
    """
    if r.block < 0 or ctx.ledger.last_into(r.layer, r.kind, r.block, r.step) is not None:
        return None
    written = [w for w in ctx.ledger.at(r.layer, r.kind, r.position, r.token_start, r.step)
               if (r.step >= 0 or w.request < r.request) and ctx.same_prefix(r, w, r.position)]
    g = ctx.group.get(r.layer)
    group = f"KV-cache group {g}" if g is not None else "its KV-cache group"
    head = (f"read, never written: {group} reads {r.span()} from block {r.block}, which nothing in this run "
            f"wrote before step {r.step}; ")
    if written:
        w = written[-1]
        what = head + f"these tokens' K/V were written by request {w.request} at step {w.step} into block {w.block}"
    else:
        # no layer-r write of these tokens at all, while this layer's writes are captured and another
        # attention layer's K/V of the same tokens were written: this layer's were never computed (a
        # restore that filled the target's blocks only, vLLM #47930)
        w = _other_layer_write(ctx, r)
        if w is None:
            return None
        what = head + (f"this layer never wrote these tokens' K/V in this run, while layer {w.layer}'s were "
                       f"written by request {w.request} at step {w.step} into block {w.block}")
    return Finding("read_before_write", r.request, r.position, r.layer, r.kind, r.module, r.step, what,
                   _expected_ref(w), _holders(ctx, r, g))


def _other_layer_write(ctx: Context, r: Rec) -> Rec | None:
    """The last write of ``r``'s tokens (same token range, kind and prefix, before ``r.step``) by
    another attention layer, when ``r``'s layer has writes of its own in the ledger (its writes are
    captured); else None."""
    # only on the rare path (a block nothing wrote); a trace's ledger is fixed, so its index is kept
    cached = getattr(ctx, "_by_tokens", None) if type(ctx.ledger) is Ledger else None
    if cached is None:
        index: dict[tuple, list[Rec]] = {}
        layers = set()
        for (layer, kind, pos, start), ws in ctx.ledger.by_key.items():
            if ws:
                index.setdefault((kind, pos, start), []).extend(ws)
                layers.add((layer, kind))
        cached = (index, layers)
        if type(ctx.ledger) is Ledger:
            ctx._by_tokens = cached
    index, layers = cached
    if (r.layer, r.kind) not in layers:
        return None
    others = [w for w in index.get((r.kind, r.position, r.token_start), ()) if w.layer != r.layer
              and (w.step < r.step if r.step >= 0 else w.request < r.request) and ctx.same_prefix(r, w, r.position)]
    return max(others, key=lambda w: (w.step, w.layer)) if others else None


def _holders(ctx: Context, r: Rec, g: int | None) -> str:
    """Who holds ``r.block`` in the recorded allocations (``hit_block_table``), and why the group's
    hit may fall short (``group_hit_tokens``), as one line."""
    held = []
    for req, rec in sorted(ctx.requests.items()):
        table = rec.get("hit_block_table")
        rows = table.get("scheduler") if isinstance(table, dict) else None
        if g is None or not isinstance(rows, list) or g >= len(rows):
            continue
        held += [f"request {req} logical block {j}" for j, b in enumerate(rows[g]) if b == r.block]
    out = ("block held by " + ", ".join(held[:3]) if held else
           f"block {r.block} is in no recorded allocation of this run (no hit_block_table row holds it)")
    hits = ctx.requests.get(r.request, {}).get("group_hit_tokens")
    if g is not None and isinstance(hits, list) and g < len(hits) and isinstance(hits[g], int) and \
            hits[g] < max(h for h in hits if isinstance(h, int)) and hits[g] <= r.token_start:
        out += (f"; group {g}'s prefix-cache hit covers {hits[g]} tokens, the longest group's "
                f"{max(hits)}: these tokens were neither restored nor recomputed in group {g}")
    return out


def diagnose(ctx: Context, r: Rec, expected: Rec) -> str | None:
    """What the restored value is instead, from digests alone (cheapest first), or None."""
    if r.zero:
        return "all zeros: the restored value was never written, or was zeroed"
    if r.nonfinite > 0 and expected.nonfinite == 0:
        return f"{r.nonfinite} NaN/Inf element(s), where the saved value has none"
    if expected.digest_bf16 and r.digest == expected.digest_bf16 and r.digest != expected.digest:
        return "equals the saved value rounded to bfloat16"
    bs = ctx.block_size(r) or 1
    matches = [w for w in ctx.ledger.matching(r, r.step) if r.step >= 0 or w.request < r.request]
    same = [w for w in matches if ctx.same_prefix(r, w, w.position)]
    for w in same[::-1]:
        k = (r.position - w.position) // bs
        rel = f"{k} block(s) earlier" if k > 0 else f"{-k} block(s) later"
        what = "the checkpoint saved at" if r.is_state else "the K/V written for"
        return (f"equals {what} {w.span()} of the same prefix ({rel}), written by request {w.request} "
                f"at step {w.step} into block {w.block}")
    for w in matches[::-1]:
        return (f"equals request {w.request}'s {_what(r)} at {w.span()} (another prefix), written at "
                f"step {w.step} into block {w.block}")
    return None


def block_table_findings(ctx: Context, hit_steps: dict[int, int]) -> tuple[list[Finding], int]:
    """Runner vs scheduler block table rows of every hit request (``hit_block_table``):
    one finding per KV-cache group at its first differing logical block; and how many rows were checked."""
    out, checked = [], 0
    layers_of: dict[int, list[int]] = {}
    for layer, g in sorted(ctx.group.items()):
        layers_of.setdefault(g, []).append(layer)
    for req, rec in sorted(ctx.requests.items()):
        table = rec.get("hit_block_table")
        if not isinstance(table, dict):
            continue
        runner, sched = table.get("runner") or [], table.get("scheduler") or []
        for g, (a, b) in enumerate(zip(runner, sched)):
            checked += 1
            diff = [j for j, (x, y) in enumerate(zip(a, b)) if x != y]
            if not diff and len(a) == len(b):
                continue
            j = diff[0] if diff else min(len(a), len(b))
            layer = (layers_of.get(g) or [-1])[0]
            bs = ctx.bs.get(layer, 0)
            what = (f"KV-cache group {g}, logical block {j}: the runner's block table maps physical block "
                    f"{a[j] if j < len(a) else None}, the scheduler allocated {b[j] if j < len(b) else None}"
                    + ("" if len(diff) <= 1 else f" ({len(diff)} logical blocks of this row differ)"))
            out.append(Finding("block_table", req, (j + 1) * bs, layer, "block_table", "",
                               hit_steps.get(req, -1), what))
    return out, checked


def first_chunk_findings(ctx: Context, initial: list[Rec], hits: set[int]) -> tuple[list[Finding], int]:
    """The state each first chunk starts from, as the GDN metadata makes the kernel consume it.

    From the request field ``first_chunk`` (``{"start", "layers": {layer: {"treated_as",
    "prior_state", "slot"}}}``, vLLM: read inside the forward) and the ``initial`` states:
    a request without a hit whose chunk is treated as having prior state (a decode, or
    ``has_initial_state`` set) reads its slot, which must then hold zeros; a slot the
    kernel ignores is not a finding. A hit whose chunk is treated as having no prior state
    ignores the restored state. Returns the findings and how many (request, layer) were checked.
    """
    out, checked = [], 0
    states = {(r.request, r.layer): [] for r in initial}
    for r in initial:
        states[(r.request, r.layer)].append(r)
    for req, rec in sorted(ctx.requests.items()):
        fc = rec.get("first_chunk")
        if not isinstance(fc, dict) or not isinstance(fc.get("layers"), dict):
            continue
        for key, v in sorted(fc["layers"].items(), key=lambda kv: int(kv[0])):
            layer, prior, slot = int(key), bool(v.get("prior_state")), v.get("slot")
            checked += 1
            if req in hits and not prior:
                out.append(Finding("first_chunk", req, int(fc.get("start") or 0), layer, "gdn.conv_state", "", -1,
                                   f"the hit's first chunk is treated as a prefill without initial state: the "
                                   f"kernel ignores the state restored into slot {slot}"))
            elif req not in hits and prior:
                out += [_recycled(ctx, r, v) for r in sorted(states.get((req, layer), []), key=lambda r: r.kind)
                        if r.zero is False]
    return out, checked


def _recycled(ctx: Context, r: Rec, how: dict) -> Finding:
    treated = "a decode" if how.get("treated_as") == "decode" else "having prior state (has_initial_state set)"
    what = (f"a request without a prefix-cache hit has its first chunk treated as {treated}, so the kernel "
            f"reads state slot {r.block}, which is not zeros")
    matches = [w for w in ctx.ledger.matching(r, r.step) if r.step < 0 or w.step < r.step]
    diag = ("recycled slot: holds a state no recorded write matches" if not matches else
            f"recycled slot: holds request {matches[-1].request}'s state at position {matches[-1].position} "
            f"(written at step {matches[-1].step} into block {matches[-1].block})")
    return Finding("initial", r.request, r.position, r.layer, r.kind, r.module, r.step, what, None, diag)


def group_hit_findings(ctx: Context, run: dict[str, Any]) -> tuple[list[Finding], int]:
    """Each KV-cache group's final hit (request field ``group_hit_tokens``, one length in tokens per
    group, read where the scheduler decided it): in a correct engine they agree; a group whose hit
    is shorter never holds the blocks between, which the others' hit skips computing.
    Returns one finding per disagreeing request (naming the shortest and longest groups) and how
    many requests were checked."""
    eff = run.get("effective") if isinstance(run.get("effective"), dict) else {}
    specs = {g.get("group"): g for g in eff.get("kv_cache_groups") or () if isinstance(g, dict)}
    first_layer: dict[int, int] = {}
    for layer, g in sorted(ctx.group.items(), reverse=True):
        first_layer[g] = layer
    out, checked = [], 0
    for req, rec in sorted(ctx.requests.items()):
        hits = rec.get("group_hit_tokens")
        if not isinstance(hits, list) or not hits or not all(isinstance(h, int) for h in hits):
            continue
        checked += 1
        if len(set(hits)) == 1:
            continue
        lo, hi = hits.index(min(hits)), hits.index(max(hits))

        def name(g: int) -> str:
            spec = (specs.get(g) or {}).get("spec")
            return f"group {g}" + (f" ({spec})" if spec else "")
        what = (f"KV-cache groups disagree on the final prefix-cache hit: {name(lo)} covers {hits[lo]} tokens, "
                f"{name(hi)} covers {hits[hi]} (the engine reported {rec.get('num_cached_tokens')}); tokens "
                f"[{hits[lo]}, {hits[hi]}) are neither cached in the shorter group nor recomputed")
        bs = (specs.get(lo) or {}).get("block_size") or ctx.bs.get(first_layer.get(lo, -1), 0)
        out.append(Finding("group_hit", req, hits[lo] + (bs or 0), first_layer.get(lo, -1), "group_hit", "", -1,
                           what))
    return out, checked
