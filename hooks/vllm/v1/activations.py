"""Opt-in eager-mode activation capture (``--activations``) for the V1 runner.

Forward hooks on the decoder layers (``model.model.layers``, vLLM 0.32.0
``model_executor/models/qwen3_next.py`` and friends: each layer returns
``(hidden_states, residual)``; the residual stream after the layer is their
sum) record, at block-boundary rows and at the prompt's last row, the
residual stream after every layer: kind ``hidden``, role ``activation``,
``position = p + 1`` for the token at absolute index ``p``.

This is NOT the default capture and it perturbs what it observes: hooks
fire only in eager mode (under torch.compile and CUDA graphs they never
run), and eager and compiled runs produce different numerics (on the tiny
model, different greedy tokens). Use it to localise a divergence inside a
step, never to decide whether a compiled deployment diverges.

Rows are laid out in ``runner.input_batch.req_ids`` order,
``num_scheduled_tokens[req]`` rows each (``v1/worker/gpu_model_runner.py``
``_prepare_inputs``), read at the first hook call of each step.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import surface


class ActivationHooks:
    """Registers forward hooks; ``step_started`` resets the row plan each step."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        model = cap.runner.get_model()
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise RuntimeError("statediff --activations: the model has no model.layers to hook")
        self.block = cap.layers[0].block_size if cap.layers else 16
        self.rows: list[tuple[int, int, int]] | None = None
        self.scheduled: dict[str, int] = {}
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)
                        if isinstance(layer, torch.nn.Module)]

    def step_started(self, scheduler_output: Any) -> None:
        self.rows = None
        self.scheduled = surface.scheduled_tokens(scheduler_output)

    def _plan(self) -> list[tuple[int, int, int]]:
        """(row in the batch, request index, position) of the rows to record this step."""
        starts = {sr.req_id: sr for sr in self.cap.step}
        rows, offset = [], 0
        for rid in surface.batch_request_ids(self.cap.runner):
            n = self.scheduled.get(rid, 0)
            sr = starts.get(rid)
            if sr is not None:
                for j in range(n):
                    pos = sr.start + j + 1
                    if pos % self.block == 0 or pos == sr.prompt_len:
                        rows.append((offset + j, sr.index, pos))
            offset += n
        return rows

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            if self.rows is None:
                self.rows = self._plan()
            if not self.rows:
                return
            if isinstance(out, tuple):
                h = out[0] if len(out) < 2 or out[1] is None else out[0].float() + out[1].float()
            else:
                h = out
            idx = torch.tensor([row for row, _, _ in self.rows], dtype=torch.long, device=h.device)
            self.cap.rec.tensors(h.index_select(0, idx), [
                dict(request=req, position=pos, layer=layer, kind="hidden", role="activation",
                     module=f"model.layers.{layer}") for _, req, pos in self.rows])
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
