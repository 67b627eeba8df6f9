"""Subprocess driver: statediff's torch stand-ins for vLLM's two mamba align kernels against the real
kernels run by Triton's interpreter, on the same inputs (``test_triton_interpreter.py`` runs it).

Triton's interpreter must be chosen before Triton is imported, so this runs in its own process:
``triton_interpreter.activate`` first, then vLLM. The fake GDN caches, block tables and vLLM's own
``MambaSpecDecodeGPUContext`` come from ``test_mamba_align_cpu.Caches``. Each trial draws random
inputs, runs vLLM's launcher (``run_fused_precopy`` / ``run_fused_postprocess``) with the real kernels
(interpreted), then from the same initial bytes with the stand-ins registered in their place
(``cpu/mamba_align._IMPLS`` through vLLM's override registry), and compares every byte of every
cache and the kernels' ``num_accepted_tokens_out``. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Patch:
    """The ``monkeypatch.setattr`` that ``Caches`` needs, outside pytest."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _precopy(c, rng, num_reqs):
    ctx, copies = c.ctx, 0
    for i in range(num_reqs):
        src = -1 if rng.random() < 0.2 else rng.randint(0, 5)
        dst = rng.randint(0, 5) if src < 0 else (src if rng.random() < 0.2 else src + rng.randint(1, 2))
        ctx.mamba_state_idx_buf.np[i], ctx.precopy_src_col_buf.np[i] = dst, src
        ctx.precopy_token_bias_buf.np[i] = rng.randint(0, 3)
        copies += src >= 0 and src != dst
    for b in (ctx.mamba_state_idx_buf, ctx.precopy_src_col_buf, ctx.precopy_token_bias_buf):
        b.copy_to_gpu(num_reqs)

    def run():
        ctx.run_fused_precopy(num_reqs=num_reqs, state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                              src_col_gpu=ctx.precopy_src_col_buf.gpu, token_bias_gpu=ctx.precopy_token_bias_buf.gpu,
                              idx_mapping=None)
        return []
    return run, copies


def _postprocess(c, rng, num_reqs, torch, block, spec):
    ctx, copies = c.ctx, 0
    accepted = torch.zeros(len(ctx.mamba_state_idx_buf.np), dtype=torch.int32)
    for i in range(num_reqs):
        drafts, computed = rng.randint(0, spec), rng.randint(0, 4 * block)
        if rng.random() < 0.5:  # just before a block boundary: copies with every bias
            computed = rng.randint(1, 4) * block - rng.randint(1, spec + 1)
        accepted[i] = rng.randint(1, drafts + 1)
        ctx.mamba_state_idx_buf.np[i] = (computed + drafts) // block
        ctx.num_scheduled_tokens_buf.np[i], ctx.num_computed_tokens_buf.np[i] = drafts + 1, computed
        ctx.num_draft_tokens_buf.np[i] = drafts
        copies += (computed + accepted[i].item()) // block * block >= computed + 1
    for b in (ctx.mamba_state_idx_buf, ctx.num_scheduled_tokens_buf, ctx.num_computed_tokens_buf,
              ctx.num_draft_tokens_buf):
        b.copy_to_gpu(num_reqs)

    def run():
        ctx.num_accepted_tokens_out.fill_(-7)
        ctx.run_fused_postprocess(num_reqs=num_reqs, num_accepted_tokens_gpu=accepted.clone(),
                                  mamba_state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                                  num_scheduled_tokens_gpu=ctx.num_scheduled_tokens_buf.gpu,
                                  num_computed_tokens_gpu=ctx.num_computed_tokens_buf.gpu,
                                  num_draft_tokens_gpu=ctx.num_draft_tokens_buf.gpu)
        return ctx.num_accepted_tokens_out[:num_reqs].tolist()
    return run, copies


def main(trials: int) -> dict:
    from statediff_hooks.vllm.cpu import triton_interpreter

    triton_interpreter.activate()
    import torch
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.worker import mamba_utils as mu

    import test_mamba_align_cpu as t
    from statediff_hooks.vllm.cpu import mamba_align as mamba_align_cpu

    names = [name.rsplit(".", 1)[1] for name in mamba_align_cpu.KERNELS]
    real = {n: getattr(mu, n) for n in names}
    register_kernels(mamba_align_cpu._IMPLS)  # vLLM's override registry wraps the stand-ins (KernelOverride)
    ours = {n: getattr(mu, n) for n in names}
    out = {"has_triton": HAS_TRITON, "interpreted": [type(k).__name__ for k in real.values()],
           "trials": 0, "copies": 0, "mismatches": []}
    rng = random.Random(0)
    for layout in ("SD", "DS"):
        c = t.Caches(layout == "DS", _Patch())
        for trial in range(trials):
            for kind in ("precopy", "postprocess"):
                c.randomize(rng)
                num_reqs = rng.randint(1, t.MAX_REQS)
                run, copies = (_precopy(c, rng, num_reqs) if kind == "precopy"
                               else _postprocess(c, rng, num_reqs, torch, t.B, t.NUM_SPEC))
                init = c.snapshot()
                for n in names:  # vLLM's own kernels, in Triton's interpreter (run_fused_* launch mu's globals)
                    setattr(mu, n, real[n])
                got_real = run(), c.snapshot()
                c.restore(init)
                for n in names:  # statediff's stand-ins, the same inputs
                    setattr(mu, n, ours[n])
                got_ours = run(), c.snapshot()
                c.restore(init)
                differ = [k for k in got_real[1] if not torch.equal(got_real[1][k], got_ours[1][k])]
                if differ or got_real[0] != got_ours[0]:
                    out["mismatches"].append({"layout": layout, "trial": trial, "kernel": kind, "caches": differ,
                                              "accepted_out": [got_real[0], got_ours[0]]})
                out["trials"] += 1
                out["copies"] += int(copies)
                changed = [k for k in got_real[1] if not torch.equal(got_real[1][k], init[k])]
                out.setdefault("changed_trials", 0)
                out["changed_trials"] += bool(changed)
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)), flush=True)
    os._exit(0)
