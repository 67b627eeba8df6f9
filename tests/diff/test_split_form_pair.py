"""A split-form cold run against a hit trace that `record --exact-split` did not write (a
deployment's plugin trace: replay and mode not recorded; or a default-replay hit run): the pair
is exact (issue 19). And the conversation a trace replayed, for a cold run without a conversation file."""

from __future__ import annotations

import pytest

from statediff.diff.compare import compare
from statediff.errors import MismatchError, StatediffError
from statediff.replay.conversation import turns_of_trace
from synth import write_trace

SPLIT = {"exact_form": "split", "split_plan": {"1": [48], "2": [48, 80]}}


@pytest.mark.parametrize("hit_meta", [{"run_mode": None, "replay": None}, {"replay": "default"}])
def test_a_split_cold_run_of_a_plugin_trace_is_judged_bit_for_bit(tmp_path, hit_meta):
    replay = hit_meta.pop("replay")
    hit = write_trace(tmp_path / "hit.h5", "hit", replay=replay, **hit_meta)
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", **SPLIT)
    r = compare(hit, cold)
    assert (r.verdict, r.exit_code, r.policy) == ("same", 0, "exact: bit identity (both traces replay=exact)")
    noisy = write_trace(tmp_path / "noisy.h5", "hit", replay=replay, noise_seed=3, **hit_meta)
    r = compare(noisy, cold)  # any differing bit is a finding, as in exact replay
    assert r.verdict == "diverged" and r.first.tolerance.exact and r.first.request == 1


def test_a_default_cold_run_still_refuses_an_exact_hit_run(tmp_path):
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact", exact_form="split")
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="default")
    with pytest.raises(MismatchError, match="replayed differently"):
        compare(hit, cold)


def test_the_conversation_of_a_trace():
    requests = {0: {"prompt_token_ids": [5, 6, 7], "output_token_ids": [1, 2, 3, 4],
                    "sampling": {"temperature": 0.0, "top_k": -1, "max_tokens": None, "seed": None}},
                1: {"prompt_token_ids": [5, 6, 7, 8], "output_token_ids": [9], "sampling": None}}
    turns = turns_of_trace(requests, "served.h5")
    assert [(t.id, t.prompt_token_ids, t.sampling) for t in turns] == [
        ("request-0", [5, 6, 7], {"max_tokens": 4, "temperature": 0.0}),
        ("request-1", [5, 6, 7, 8], {"max_tokens": 1, "temperature": 0.0})]
    with pytest.raises(StatediffError, match="^served.h5: request 0 has no prompt token ids to replay$"):
        turns_of_trace({0: {"prompt_token_ids": None}}, "served.h5")
