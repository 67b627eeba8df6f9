"""Exact replay's one block per step (``hooks/vllm/v1/sched.py``) on stand-ins for vLLM 0.32's scheduler:
the budget it sets, and the parallel-drafter rule (DFlash reserves K draft slots of every step's input)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from statediff_hooks.vllm.v1.sched import ExactReplayError, one_block_per_step


def _sched(block=32, budget=4096, inputs=4096, spec=None):
    return NS(cache_config=NS(block_size=block), max_num_scheduled_tokens=budget,
              scheduler_config=NS(enable_chunked_prefill=True, max_num_batched_tokens=inputs,
                                  max_num_scheduled_tokens=budget),
              vllm_config=NS(speculative_config=spec))


@pytest.mark.parametrize("spec", [None, NS(method="mtp", max_num_new_slots_for_drafting=0),
                                  NS(method="dflash", max_num_new_slots_for_drafting=3)])
def test_one_block_per_step_sets_the_budget_to_the_block(spec):
    s = _sched(spec=spec)
    assert one_block_per_step(s) == 32
    assert s.max_num_scheduled_tokens == s.scheduler_config.max_num_scheduled_tokens == 32
    assert s.scheduler_config.max_num_batched_tokens == 4096  # the step input (buffers) stays


def test_a_parallel_drafter_needs_a_block_plus_its_draft_slots():
    dflash = NS(method="dflash", max_num_new_slots_for_drafting=3)
    assert one_block_per_step(_sched(budget=35, inputs=35, spec=dflash)) == 32  # block + slots: runs
    with pytest.raises(ExactReplayError) as e:
        one_block_per_step(_sched(budget=32, inputs=32, spec=dflash))
    assert str(e.value) == (
        "exact replay schedules one block (32 tokens) per step, but the drafter (dflash) reserves 3 draft "
        "slots of the engine's 32-token step input (max_num_batched_tokens), leaving 29: vLLM's block-aligned "
        "prefill split would then schedule nothing, forever; pass --max-num-batched-tokens 35 or more")
    # a drafter without draft slots (MTP, EAGLE-3) runs at one block per step
    assert one_block_per_step(_sched(budget=32, inputs=32,
                                     spec=NS(method="mtp", max_num_new_slots_for_drafting=0))) == 32
