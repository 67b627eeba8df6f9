"""Replay a conversation on a transformers hybrid model and record a trace.

transformers has no prefix cache, so this adapter is the serving engine: a
block-aligned prefix store (``hf_cache.PrefixStore``, keyed by chained block
hashes like vLLM's) holds a frozen copy of the model's own ``DynamicCache``
(GDN conv/SSM state, attention K/V) after every chunk that ends on a block
boundary (vLLM's mamba cache mode ``align``).

- ``mode="hit"``: each request resumes from the longest stored block-aligned
  prefix of its prompt (at most ``prompt_len - 1`` tokens, as vLLM), restored
  into a fresh ``DynamicCache``; the request records
  ``num_cached_tokens`` = that length.
- ``mode="cold"``: nothing is ever reused (every request computes from token
  0, ``num_cached_tokens`` 0), but the store keeps its keys, so the prefill is
  chunked at the boundaries the hit run uses (the hit length ``h`` is a chunk
  end) and every key lines up.
- ``exact=True``: one block per chunk (vLLM ``--exact``: ``max_num_batched_tokens``
  = block size). Hit and cold runs then compute every token in identical
  chunks from identical state; measured on the tiny model (built-in
  5-request conversation, 16 tokens, with and without the DFlash drafter):
  every recorded tensor of a fault-free pair is bit-identical (683 pairs),
  and so are outputs and logprobs. ``exact=False``: vLLM's default
  align-mode split, ``[start, h)`` (cold only), ``[h, last boundary)``,
  ``[last boundary, prompt_len)``; the pair then differs by floating-point
  noise wherever a resumed state was computed on another grid of
  transformers' 64-token GDN chunks than the cold run's. Measured on the
  same conversation: requests 0-2 bit-identical, from request 3 on SSM state
  up to 1.5e-4, conv state 0.005 (1 bf16 ULP), K 0.047, V 0.012, drafter
  input rows 0.002, draft logits 0.009 (max abs), which the dtype-default
  tolerances flag in the fp32 SSM state: calibrate a noise file
  (``statediff calibrate``) or replay exactly.

What is recorded (trace keys ``(request, position, layer, kind)``, the same
as ``vllm/v1/capture.py``; states in vLLM's logical layout, see ``hf_cache``; each
tensor gets a summary, and its data when the keep policy keeps it,
``statediff_hooks.recording.keep``, through ``Recorder.tensor`` as in vLLM):

- at a hit ``h``, after the restore (and a planted fault), before the first
  forward: each GDN layer's conv and SSM state (role ``resumed``), each
  attention layer's last cached block ``[h - block, h)`` and, with a
  drafter, the drafter-input row at ``h`` (all role ``resumed``);
- after each chunk that ends at ``k * block``: each GDN layer's state (role
  ``checkpoint``) -- during decoding too, but not with a drafter (as vLLM);
- after each chunk: the K/V of every block it completed and of the prompt's
  partial tail block (role ``kv_block``; with a drafter only within the prompt);
- with a drafter: the drafter's input, as ``vllm/v1/spec.py`` records it so
  that the two engines' traces align: one ``[hidden]`` row per tapped layer
  ``L`` (``drafter.input``, role ``drafter``, module ``drafter.aux.L``; ``L``
  = the decoder layer whose *input* the feature is, which is transformers'
  ``hidden_states[L]`` and DFlash ``target_layer_ids`` entry ``L``) for
  each verified token ``p`` (prompt tokens and committed outputs) at
  ``position = p + 1`` (the row summarises tokens ``0..p``), kept when
  ``position % block`` is 0 or in ``1..WINDOW`` or ``position == prompt_len``;
  at a hit, the row at ``h`` (the last cached token's feature, read from the
  store as the drafter consumes it) with role ``resumed``; and at every draft
  call the draft logits (``drafter.logits``, ``[K, vocab]``, layer -1,
  position ``n + 1``: conditioned on ``n`` committed tokens' features and the
  anchor token; also the index of the first draft token).

Speculative decoding (``drafter``): transformers refuses assisted
generation with stateful targets, so the verify loop is here: propose K
drafts with ``dflash.DFlashProposer`` (transformers' DFlash candidate
generator), run the target on ``[anchor] + drafts`` from a snapshot of its
cache, accept the greedy-matching prefix (a), and when ``a < K`` restore the
snapshot and recompute ``[anchor] + drafts[:a]`` (a GDN state cannot be
cropped). Acceptance counters go into each request record (``acceptance``,
and ``spec_steps`` = ``[[first draft index, drafts, accepted], ...]``, as
``vllm/v1/spec.py``). The prefix store also keeps the drafter's input
features; each request gets a fresh drafter cache that encodes its whole
context on the first draft call, where vLLM reuses the drafter's cached K/V
blocks: the same values (the drafter's context K/V is a per-row function of
the features), by another mechanism. Sampling is greedy only.

Planted faults (``faults.py``) fire once, on the hit path only, right
after the restore: ``ssm-wrong-block`` (the SSM state of the entry one block
earlier), ``conv-zero``, ``ssm-bf16``, ``ssm-nan``, ``kv-stale``, ``kv-swap``
(the restored K/V rows of one logical block copied over another's); and
``drafter-perturb`` (with a drafter: one tapped layer's first rows after the
hit negated, as ``vllm/v1/spec.py``). Where they fired is in the run
metadata (``fault``); one that never fired is reported on stderr.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from statediff.replay.conversation import Turn
from statediff.errors import StatediffError

from ..recording.faults import FaultPlanter, FaultSpec, Site, parse_fault
from ..recording.keep import KeepSpec
from ..recording.recorder import Recorder
from ..recording.config import RecorderConfig
from ..recording.fields import (DRAFTER_KIND, DRAFTER_ROLE, WINDOW, Acceptance, config_digest,
                                    conversation_digest, drafter_rows, keep_row, render_prompts)
from ..tiny.catalog import tiny_dflash_for
from . import prefix_store as hf_cache
from .dflash import DFlashProposer, greedy_accepted, load_drafter

__all__ = ["TransformersResult", "plan_chunks", "record_transformers"]

ENGINE = "transformers"
RUNNER = "statediff-transformers-prefix-store"
DRAFTER_LAYER = -1  # trace layer of drafter.logits (not a target layer)
DRAFTER_MODULE = "drafter"


@dataclasses.dataclass
class TransformersResult:
    """What a replay produced.

    Attributes:
        trace: the trace path (None when not recording).
        block_size: tokens per block.
        prompt_lens, num_cached_tokens: per request (hit length; 0 in a cold run).
        output_token_ids, output_logprobs: per request (greedy; log-probability of each token,
            None where it is not finite, e.g. after a planted NaN).
        chunks: per request, the ``[start, end)`` token ranges of each committed target step.
        acceptance: per request, the ``Acceptance.to_json()`` dict, or None without a drafter.
        fault: where the planted fault fired (run metadata ``fault``), or None.
        stats: the trace writer's statistics (empty when not recording).
        seconds: wall time of the replay (model load excluded).
    """

    trace: str | None
    block_size: int
    prompt_lens: list[int]
    num_cached_tokens: list[int]
    output_token_ids: list[list[int]]
    output_logprobs: list[list[float]]
    chunks: list[list[list[int]]]
    acceptance: list[dict | None]
    fault: dict | None
    stats: dict
    seconds: float


def plan_chunks(start: int, prompt_len: int, hit: int, block_size: int, exact: bool) -> list[tuple[int, int]]:
    """Prefill chunks ``[s, e)`` from ``start`` to ``prompt_len``.

    ``exact``: one block per chunk (chunk ends at every multiple of
    ``block_size``). Otherwise vLLM's align-mode split: the chunk ends are
    ``hit`` (when past ``start``: a cold run resuming nowhere still ends a
    chunk where the hit run resumes), the last block boundary, and ``prompt_len``.
    """
    if exact:
        ends = list(range((start // block_size + 1) * block_size, prompt_len, block_size))
    else:
        ends = [e for e in (hit, prompt_len // block_size * block_size) if start < e < prompt_len]
    ends = sorted(set(ends)) + [prompt_len]
    out, s = [], start
    for e in ends:
        if e > s:
            out.append((s, e))
            s = e
    return out


@dataclasses.dataclass
class _Req:
    """One request in flight: its trace index, committed tokens, block keys, last store entry."""

    idx: int
    prompt_len: int
    tokens: list[int]  # tokens whose state the target cache holds (the prompt, then committed outputs)
    keys: list[bytes]  # chained block keys of ``tokens`` (hf_cache.extend_block_keys)
    parent: hf_cache.Snapshot | None = None  # the store entry of the longest stored prefix so far
    num_cached_tokens: int = 0
    chunks: list[list[int]] = dataclasses.field(default_factory=list)
    acceptance: dict | None = None
    spec_steps: list[list] = dataclasses.field(default_factory=list)  # [first draft index, drafts, accepted]


class _RestoredLayer:
    """``faults.RestoreTarget`` of one layer of a restored ``DynamicCache`` (or of drafter rows).

    transformers keeps K/V contiguous per layer (``keys``/``values`` ``[B,
    heads, T, head_dim]``), with no block table: remapping logical block ``a``
    to ``b`` copies ``b``'s token rows into ``a``'s (sources taken first), so
    the attention of this request reads what vLLM's kernel would read through
    an edited table. Unlike vLLM (one table per KV-cache group) it edits this
    one layer only.
    """

    def __init__(self, layer: Any, block_size: int, earlier: Any, rows: torch.Tensor | None = None) -> None:
        self.layer, self.bs, self.earlier, self.rows = layer, block_size, earlier, rows

    def conv_state(self) -> torch.Tensor:
        return self.layer.conv_states[0]

    def ssm_state(self) -> torch.Tensor:
        return self.layer.recurrent_states[0]

    def ssm_state_one_block_earlier(self) -> torch.Tensor | None:
        return self.earlier()

    def remap_kv_blocks(self, mapping: dict[int, int]) -> None:
        bs = self.bs
        for t in (self.layer.keys, self.layer.values):
            src = {b: t[:, :, b * bs:(b + 1) * bs].clone() for b in set(mapping.values())}
            for a, b in mapping.items():
                t[:, :, a * bs:(a + 1) * bs] = src[b]

    def drafter_rows(self) -> torch.Tensor:
        if self.rows is None:
            raise NotImplementedError("a cache layer has no drafter rows")
        return self.rows


class _Replay:
    """One replay: model, prefix store, recorder, planted fault; ``run_request`` per turn."""

    def __init__(self, model: Any, layers: list[hf_cache.LayerSpec], *, mode: str, exact: bool,
                 block_size: int, rec: Recorder | None, fault: FaultSpec | None, kv: str,
                 drafter: Any | None, eos: set[int]) -> None:
        self.model, self.config, self.layers = model, model.config, layers
        self.gdn = [s for s in layers if s.kind == "gdn"]
        self.attn = [s for s in layers if s.kind == "attn"] if kv == "all" else []
        self.mode, self.exact, self.bs = mode, exact, block_size
        self.rec = rec
        self.faults = FaultPlanter(fault, rec.note_fault if rec is not None else None)
        self.drafter = drafter
        self.taps = list(drafter.config.target_layer_ids) if drafter is not None else []
        self.eos = eos
        self.store = hf_cache.PrefixStore(block_size, keep_states=mode == "hit")
        self.max_length = int(getattr(self.config, "max_position_embeddings", 1 << 20))

    # -- recording helpers (no-ops without a recorder) -------------------------

    def _t(self, t: torch.Tensor, idx: int, position: int, layer: int, kind: str, role: str,
           module: str, token_start: int | None = None) -> None:
        if self.rec is not None:
            self.rec.tensor(t, request=idx, position=position, layer=layer, kind=kind, role=role,
                            module=module, token_start=token_start)

    def _gdn_states(self, idx: int, position: int, cache: Any, role: str) -> None:
        for s in self.gdn:
            self._t(hf_cache.conv_state(cache, s.layer), idx, position, s.layer, "gdn.conv_state", role, s.module)
            self._t(hf_cache.ssm_state(cache, s.layer), idx, position, s.layer, "gdn.ssm_state", role, s.module)

    def _block(self, idx: int, start: int, end: int, cache: Any, role: str) -> None:
        """K/V of tokens ``[start, end)`` of every attention layer."""
        for s in self.attn:
            k, v = hf_cache.kv_rows(cache, s.layer, start, end)
            self._t(k, idx, end, s.layer, "attn.k", role, s.module, start)
            self._t(v, idx, end, s.layer, "attn.v", role, s.module, start)

    def _drafter_rows(self, r: "_Req", start: int, end: int, feats: dict[int, torch.Tensor]) -> None:
        """Drafter-input rows of the verified tokens ``[start, end)`` that the row rule keeps."""
        for p in range(start, end):
            if keep_row(p + 1, r.prompt_len, self.bs):
                for i in self.taps:
                    self._t(feats[i][0, p], r.idx, p + 1, i, DRAFTER_KIND, DRAFTER_ROLE, f"drafter.aux.{i}")

    def _end_step(self) -> None:
        if self.rec is not None:
            self.rec.end_step()

    # -- target forward ---------------------------------------------------------

    def _forward(self, cache: Any, tokens: list[int], start: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the target on ``tokens`` at positions ``start...``; returns (logits ``[T, V]``, tapped features)."""
        ids = torch.tensor([tokens], dtype=torch.long)
        pos = torch.arange(start, start + len(tokens))[None]
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                             output_hidden_states=bool(self.taps))
        feats = {i: out.hidden_states[i] for i in self.taps}
        return out.logits[0], feats

    # -- planted fault ---------------------------------------------------------------

    @property
    def fault_done(self) -> dict | None:
        """Where the planted fault fired (``FaultPlanter.fired``), or None."""
        return self.faults.fired

    def _maybe_fault(self, r: _Req, h: int, cache: Any) -> None:
        """Plant a restore fault (faults.py) in the restored cache of a hit, before it is read."""
        fam = next((x for x in ("gdn", "attn") if self.faults.wants(x)), None)
        if fam is None:
            return
        for spec in (s for s in self.layers if s.kind == fam):
            target = _RestoredLayer(cache.layers[spec.layer], self.bs,
                                    lambda layer=spec.layer: self._ssm_one_block_earlier(r, h, layer))
            if self.faults.plant(Site(r.idx, h, spec.layer, spec.module, self.bs, fam), target):
                return

    def _ssm_one_block_earlier(self, r: _Req, h: int, layer: int) -> torch.Tensor | None:
        prev = self.store.get(r.keys, h - self.bs)
        return None if prev is None else prev.gdn[layer][1]

    def _maybe_fault_drafter(self, r: _Req, h: int, end: int, feats: dict[int, torch.Tensor]) -> None:
        """``drafter-perturb``: negate one tapped layer's first rows after the hit (as ``vllm/v1/spec.py``).

        Rows ``[h, h + n)``, ``n = min(WINDOW, block, end - h)``, in place, before
        they are recorded, stored or handed to the drafter.
        """
        if not self.faults.wants("drafter") or not self.taps:
            return
        f = self.faults.spec
        layer = self.taps[0] if f.layer is None else f.layer
        if layer not in self.taps:
            return
        n = min(WINDOW, self.bs, end - h)
        self.faults.plant(Site(r.idx, h, layer, f"drafter.aux.{layer}", self.bs, "drafter"),
                          _RestoredLayer(None, self.bs, lambda: None, rows=feats[layer][0, h:h + n]))

    # -- one request ---------------------------------------------------------------------

    def run_request(self, i: int, turn: Turn, prompt: list[int]) -> dict:
        """Prefill (resuming from the store in hit mode), then decode; returns the request's results."""
        P, bs = len(prompt), self.bs
        keys = hf_cache.extend_block_keys([], prompt, bs)
        h, snap = self.store.lookup(keys, P - 1)
        hit = h if self.mode == "hit" else 0
        idx = i
        if self.rec is not None:
            idx = self.rec.begin_request(f"transformers-{i}", prompt, num_cached_tokens=hit,
                                         sampling=dict(turn.sampling))
        r = _Req(idx, P, list(prompt[:hit]), keys, parent=snap if hit else None, num_cached_tokens=hit)

        if hit:
            cache = hf_cache.restore(snap, self.config)
            feats = snap.full_features()
            self._maybe_fault(r, h, cache)
            self._gdn_states(idx, h, cache, "resumed")
            self._block(idx, h - bs, h, cache, "resumed")
            for t in self.taps:  # the last cached token's feature, as the drafter reads it
                self._t(feats[t][0, h - 1], idx, h, t, DRAFTER_KIND, "resumed", f"drafter.aux.{t}")
        else:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
            hidden = self.config.get_text_config(decoder=True).hidden_size
            feats = {t: torch.empty(1, 0, hidden, dtype=self.model.dtype) for t in self.taps}

        logits = None
        for s, e in plan_chunks(hit, P, h, bs, self.exact):
            logits, new = self._forward(cache, prompt[s:e], s)
            feats = {t: torch.cat([feats[t], new[t]], dim=1) for t in self.taps}
            if hit and s == hit:
                self._maybe_fault_drafter(r, h, e, feats)
            r.tokens.extend(prompt[s:e])
            self._after_step(r, s, e, cache, feats, decoding=False)
        first = int(logits[-1].argmax())
        outputs, logprobs = [first], [_logprob(logits[-1], first)]
        max_tokens = int(turn.sampling.get("max_tokens", 16))
        if self.drafter is None:
            self._decode(r, cache, outputs, logprobs, max_tokens)
        else:
            r.acceptance = self._speculate(r, cache, feats, outputs, logprobs, max_tokens).to_json()
        if self.rec is not None:
            extra = {"spec_steps": r.spec_steps} if self.drafter is not None else {}
            self.rec.set_request(idx, output_token_ids=outputs, output_logprobs=logprobs,
                                           acceptance=r.acceptance, finished=True, **extra)
            self._end_step()
        return {"prompt_len": P, "num_cached_tokens": hit, "chunks": r.chunks, "acceptance": r.acceptance,
                "output_token_ids": outputs, "output_logprobs": logprobs}

    def _after_step(self, r: _Req, s: int, e: int, cache: Any, feats: dict[int, torch.Tensor],
                    decoding: bool) -> None:
        """Record what a committed step ``[s, e)`` produced; store the state at a block boundary.

        ``r.tokens`` must already hold the ``e`` committed tokens.
        """
        bs, P, spec = self.bs, r.prompt_len, bool(self.taps)
        r.chunks.append([s, e])
        if self.rec is not None:
            self.rec.add_chunk(r.idx, s, e)
        if not (spec and decoding):
            if e % bs == 0:
                self._gdn_states(r.idx, e, cache, "checkpoint")
            limit = min(e, P) if spec else e
            for k in range(s // bs, limit // bs):
                self._block(r.idx, k * bs, (k + 1) * bs, cache, "kv_block")
            if e == P and P % bs and s < P:
                self._block(r.idx, P // bs * bs, P, cache, "kv_block")
        if spec:
            self._drafter_rows(r, s, e, feats)
        if e % bs == 0:
            hf_cache.extend_block_keys(r.keys, r.tokens, bs)
            parent = r.parent
            entry = self.store.insert(r.keys, e, lambda: hf_cache.snapshot(cache, self.layers, e, feats, parent))
            if entry is not None:
                r.parent = entry
        self._end_step()

    def _decode(self, r: _Req, cache: Any, outputs: list[int], logprobs: list[float | None], max_tokens: int) -> None:
        """Plain greedy decoding, one token per step."""
        while len(outputs) < max_tokens and outputs[-1] not in self.eos:
            n = len(r.tokens)
            logits, _ = self._forward(cache, [outputs[-1]], n)
            r.tokens.append(outputs[-1])
            self._after_step(r, n, n + 1, cache, {}, decoding=True)
            tok = int(logits[-1].argmax())
            outputs.append(tok)
            logprobs.append(_logprob(logits[-1], tok))

    def _speculate(self, r: _Req, cache: Any, feats: dict[int, torch.Tensor], outputs: list[int],
                   logprobs: list[float | None], max_tokens: int) -> Acceptance:
        """DFlash drafts verified greedily by the target (see the module docstring)."""
        proposer = DFlashProposer(self.drafter, self.model, self.max_length)
        acc = Acceptance.for_drafts(proposer.num_speculative_tokens)
        new_feats, accepted = feats, 0
        while len(outputs) < max_tokens and outputs[-1] not in self.eos:
            anchor, n = outputs[-1], len(r.tokens)
            drafts, dlogits = proposer.propose(r.tokens + [anchor], new_feats, accepted)
            if dlogits is not None:
                self._t(dlogits, r.idx, n + 1, DRAFTER_LAYER, "drafter.logits", "drafter", DRAFTER_MODULE)
            saved = hf_cache.snapshot(cache, self.layers, n) if drafts else None
            logits, verify_feats = self._forward(cache, [anchor] + drafts, n)
            target = [int(t) for t in logits.argmax(-1)]
            a = greedy_accepted(drafts, target)
            if drafts:
                acc.observe(len(drafts), a)
                r.spec_steps.append([n + 1, list(drafts), a])
                if self.rec is not None:
                    self.rec.set_request(r.idx, acceptance=acc.to_json(), spec_steps=r.spec_steps)
            if a < len(drafts):  # roll back: restore, recompute the accepted prefix
                cache = hf_cache.restore(saved, self.config)
                _, verify_feats = self._forward(cache, [anchor] + drafts[:a], n)
            new_feats = {t: f[:, :a + 1] for t, f in verify_feats.items()}
            feats = {t: torch.cat([feats[t], new_feats[t]], dim=1) for t in self.taps}
            r.tokens += [anchor] + drafts[:a]
            for j, tok in enumerate(drafts[:a] + [target[a]]):
                if len(outputs) >= max_tokens or outputs[-1] in self.eos:
                    break
                outputs.append(tok)
                logprobs.append(_logprob(logits[j], tok))
            accepted = a
            self._after_step(r, n, len(r.tokens), cache, feats, decoding=True)
        return acc


def _logprob(logits: torch.Tensor, token: int) -> float | None:
    """Log-probability of ``token`` under ``logits`` (float32), None when not finite (JSON has no NaN)."""
    lp = float(torch.log_softmax(logits.float(), dim=-1)[token])
    return lp if math.isfinite(lp) else None


def _load(model_dir: str, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except Exception as e:  # transformers raises many types for unusable directories
        raise StatediffError(f"cannot load model {model_dir} with transformers: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return cfg, tok, model.eval()


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None)
        ids |= set(v) if isinstance(v, (list, tuple)) else ({v} if isinstance(v, int) else set())
    return ids


def record_transformers(turns: list[Turn], model_dir: str | os.PathLike, *, trace: str | os.PathLike | None,
                        mode: str, exact: bool = True, fault: str = "",
                        drafter: str | os.PathLike | None = None,
                        block_size: int = 32, overwrite: bool = False, kv: str = "all", seed: int = 0,
                        dtype: str = "bfloat16", threads: int | None = None,
                        run_extra: dict | None = None, progress: bool = False,
                        keep: KeepSpec | None = None) -> TransformersResult:
    """Replay ``turns`` in order on a transformers hybrid model, recording to ``trace``.

    Args:
        turns: the conversation (``statediff.replay.conversation.Turn``); chat turns
            are rendered with the tokenizer's chat template. Greedy only.
        model_dir: a Hugging Face model directory (Qwen3-Next / Qwen3.5 text
            hybrids: GDN + full-attention layers).
        trace: trace file to write, or None to replay without recording.
        mode: ``"hit"`` (resume from the prefix store) or ``"cold"`` (never reuse,
            chunk alike).
        exact: one block per chunk (a fault-free hit/cold pair is bit-identical).
        fault: planted-fault spec (``faults.parse_fault``), hit path only.
        drafter: None, ``"dflash"`` (the tiny random DFlash drafter built by
            ``tiny.draft.build_tiny_dflash`` for this target, cached under
            ``$STATEDIFF_HOME``), or a DFlash drafter directory.
        block_size: tokens per prefix-store block (positive).
        overwrite: replace an existing trace.
        kv: ``"all"`` (K/V of every completed block) or ``"none"``.
        seed: the tiny drafter's weight seed; recorded in the run metadata
            (nothing is sampled: no global torch RNG state is touched).
        dtype: model dtype (``bfloat16`` matches vLLM's CPU GDN kernel).
        threads: torch intra-op threads for this replay (restored afterwards);
            None leaves torch's setting. On a small shared CPU machine 1 thread
            is often several times faster than torch's default (measured on 2
            cores: 3 s vs 15-70 s for the same replay).
        run_extra: more run metadata.
        progress: a progress bar on stderr.
        keep: which recorded tensors keep their data (``statediff_hooks.recording.keep``; default
            ``hits``); every one is summarized (``Recorder.tensor``).

    Returns:
        the result (tokens, hit lengths, acceptance, trace stats).

    Side effect: ``torch.set_flush_denormal(True)`` (random weights produce
    denormals, which make CPU matmuls 50-100x slower; outputs unchanged).

    Raises:
        StatediffError: bad mode/block size/kv/fault/sampling, an unloadable model
            or drafter, a model this adapter does not support, an unwritable trace
            path (``TraceError``), or a write failure while recording.
    """
    fault_spec, torch_dtype = _check_arguments(turns, mode=mode, block_size=block_size, kv=kv, fault=fault,
                                               dtype=dtype, threads=threads, trace=trace, overwrite=overwrite)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _record(turns, str(model_dir), trace=trace, mode=mode, exact=exact, fault_spec=fault_spec,
                       drafter=drafter, block_size=block_size, overwrite=overwrite, kv=kv, seed=seed,
                       dtype=dtype, torch_dtype=torch_dtype, run_extra=run_extra, progress=progress,
                       keep=keep or KeepSpec())
    finally:
        torch.set_num_threads(old_threads)


def _check_arguments(turns: list[Turn], *, mode: str, block_size: Any, kv: str, fault: str, dtype: str,
                     threads: Any, trace: Any, overwrite: bool) -> tuple[FaultSpec | None, torch.dtype]:
    """``record_transformers``'s arguments checked before the model loads; returns the parsed
    fault and the torch dtype.

    Raises:
        StatediffError: the first bad argument (see ``record_transformers``).
    """
    from statediff.trace.writer import check_writable

    if mode not in ("hit", "cold"):
        raise StatediffError(f"--mode must be 'hit' or 'cold', not {mode!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise StatediffError(f"--block-size must be a positive number of tokens, not {block_size!r}")
    if kv not in ("all", "none"):
        raise StatediffError(f"--kv must be 'all' or 'none', not {kv!r}")
    try:
        fault_spec = parse_fault(fault)
    except ValueError as e:
        raise StatediffError(f"--fault: {e}") from None
    for n, t in enumerate(turns):
        if float(t.sampling.get("temperature", 0.0) or 0.0) != 0.0:
            raise StatediffError(f"request {n} ({t.id}) has temperature {t.sampling['temperature']}: the "
                                 "transformers adapter replays greedily only (temperature 0)")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise StatediffError(f"--dtype {dtype!r} is not a torch dtype")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise StatediffError(f"--threads must be a positive number, not {threads!r}")
    if trace is not None:
        check_writable(Path(trace), overwrite=overwrite)
    return fault_spec, torch_dtype


def _record(turns: list[Turn], model_dir: str, *, trace: Any, mode: str, exact: bool,
            fault_spec: FaultSpec | None, drafter: Any, block_size: int, overwrite: bool,
            kv: str, seed: int, dtype: str, torch_dtype: torch.dtype, run_extra: dict | None,
            progress: bool, keep: KeepSpec) -> TransformersResult:
    torch.set_flush_denormal(True)  # random weights: denormals make CPU matmuls 50-100x slower
    cfg, tokenizer, model = _load(model_dir, torch_dtype)
    from transformers import DynamicCache

    layers = hf_cache.discover_layers(model, DynamicCache(config=model.config))
    draft_model, path = None, None
    if drafter is not None:
        path = tiny_dflash_for(model_dir, seed) if str(drafter) == "dflash" else Path(drafter)
        draft_model = load_drafter(path, model)
    prompts = render_prompts(turns, tokenizer)
    if any(not p for p in prompts):
        raise StatediffError("a request renders to an empty prompt")

    run = _run_metadata(model_dir, cfg, model, layers, draft_model, path, prompts, turns, mode=mode,
                        exact=exact, block_size=block_size, dtype=dtype, seed=seed)
    rec = None
    if trace is not None:
        rcfg = RecorderConfig(trace=str(trace), mode=mode, replay="exact" if exact else "default", kv=kv,
                              fault=fault_spec, run_extra=dict(run_extra or {}), overwrite=overwrite, keep=keep)
        rec = Recorder(rcfg, run)
    replay = _Replay(model, layers, mode=mode, exact=exact, block_size=block_size, rec=rec,
                     fault=fault_spec, kv=kv, drafter=draft_model, eos=_eos_ids(model, tokenizer))
    from tqdm import tqdm

    t0 = time.perf_counter()
    results = []
    try:
        for i, (turn, prompt) in enumerate(tqdm(list(zip(turns, prompts)), desc=f"record {mode}",
                                                unit="req", disable=not progress, leave=False)):
            results.append(replay.run_request(i, turn, prompt))
    finally:
        stats = rec.close() if rec is not None else {}
    if fault_spec is not None and replay.fault_done is None:
        print(f"statediff: fault {fault_spec.spec} did not fire: no request resumed from a hit of at least "
              f"{fault_spec.min_blocks} block(s) with an eligible layer"
              + (" (the transformers adapter plants faults in hit mode only)" if mode != "hit" else ""),
              file=sys.stderr, flush=True)
    return TransformersResult(
        trace=None if trace is None else str(trace), block_size=block_size,
        prompt_lens=[r["prompt_len"] for r in results],
        num_cached_tokens=[r["num_cached_tokens"] for r in results],
        output_token_ids=[r["output_token_ids"] for r in results],
        output_logprobs=[r["output_logprobs"] for r in results],
        chunks=[r["chunks"] for r in results], acceptance=[r.get("acceptance") for r in results],
        fault=replay.fault_done, stats=stats, seconds=time.perf_counter() - t0)


def _run_metadata(model_dir: str, cfg: Any, model: Any, layers: list[hf_cache.LayerSpec], draft_model: Any,
                  drafter_path: Path | None, prompts: list[list[int]], turns: list[Turn], *, mode: str,
                  exact: bool, block_size: int, dtype: str, seed: int) -> dict:
    """Run metadata of a transformers replay (``docs/trace-format.md``, ``/run``): the keys the vLLM
    adapter writes, with this engine's values, and the drafter's (``vllm/v1/spec.py``'s keys first)."""
    import transformers

    return {
        "engine": ENGINE, "engine_version": transformers.__version__, "engine_commit": None,
        "runner": RUNNER, "model": model_dir,
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "config_digest": config_digest(cfg.to_dict()), "dtype": dtype, "quantization": None,
        "block_size": block_size, "mamba_block_size": block_size, "mamba_cache_mode": "align",
        "prefix_caching": mode == "hit", "cold_policy": "no-reuse" if mode == "cold" else None,
        "max_num_batched_tokens": block_size if exact else None,
        "exact_form": "block" if exact else None,
        "speculative_method": "dflash" if draft_model is not None else None,
        "num_speculative_tokens": int(draft_model.config.block_size) - 1 if draft_model is not None else None,
        "seed": seed, "sampling": turns[0].sampling if turns else None,
        "conversation_digest": conversation_digest(prompts),
        "num_requests": len(turns), "torch_version": torch.__version__,
        "layers": [{"layer": s.layer, "module": s.module, "type": s.kind, "block_size": block_size}
                   for s in layers],
        "drafter": None if draft_model is None else {
            # the keys vllm/v1/spec.py writes, then transformers-specific ones
            "method": "dflash", "model": str(drafter_path),
            "architecture": (getattr(draft_model.config, "architectures", None) or [type(draft_model).__name__])[0],
            "num_speculative_tokens": int(draft_model.config.block_size) - 1,
            "input": "hidden_states (input of decoder layer L)",
            "tapped_layers": list(draft_model.config.target_layer_ids),
            "rows": drafter_rows(block_size),
            "class": type(draft_model).__name__, "model_type": draft_model.config.model_type,
            "config_digest": config_digest(draft_model.config.to_dict()),
            "block_size": int(draft_model.config.block_size),
            "mask_token_id": int(draft_model.config.mask_token_id),
            "forward": "transformers DFlashTokenCandidateGenerator.get_candidates",
            "verify": "statediff greedy verify loop (transformers refuses assisted generation "
                      "with stateful targets)"},
    }
