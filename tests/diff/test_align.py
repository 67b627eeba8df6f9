"""Pairing by key, what does not pair, comparability checks, root vs propagated."""

from __future__ import annotations

import dataclasses

import pytest

from statediff.diff.align import align, check_comparable
from statediff.diff.diverge import classify, shared_prefix
from statediff.errors import MismatchError, NotComparableError

from synth import entry


def test_pairs_by_key_not_by_step_in_causal_order():
    # the hit run skipped the cached steps: its step numbers are shifted
    hit = [entry(1, 48, 3, "attn.k", step=2), entry(1, 48, 0, "gdn.ssm_state", step=2, role="resumed"),
           entry(1, 48, 0, "gdn.conv_state", step=2, role="resumed"), entry(0, 16, 0, "gdn.conv_state", step=1)]
    cold = [entry(0, 16, 0, "gdn.conv_state", step=1), entry(1, 48, 0, "gdn.conv_state", step=7),
            entry(1, 48, 0, "gdn.ssm_state", step=7), entry(1, 48, 3, "attn.k", step=7),
            entry(1, 32, 0, "gdn.conv_state", step=6)]
    plan = align(hit, cold)
    assert [p.key for p in plan.pairs] == [
        (0, 16, 0, "gdn.conv_state"), (1, 48, 0, "gdn.conv_state"),
        (1, 48, 0, "gdn.ssm_state"), (1, 48, 3, "attn.k")]
    assert plan.pairs[2].hit.role == "resumed" and plan.pairs[2].cold.role == "checkpoint"
    assert plan.hit_only == ()
    assert [e.key for e in plan.cold_only] == [(1, 32, 0, "gdn.conv_state")]


def test_surplus_duplicates_are_listed_not_dropped():
    hit = [entry(0, 16, 0, "attn.k", step=3, tag="a"), entry(0, 16, 0, "attn.k", step=1, tag="b")]
    cold = [entry(0, 16, 0, "attn.k", step=5)]
    plan = align(hit, cold)
    assert len(plan.pairs) == 1
    assert plan.pairs[0].hit.step == 1  # occurrences pair in step order
    assert [e.step for e in plan.hit_only] == [3]


def test_layout_mismatch_is_visible_on_the_pair():
    h = entry(0, 16, 0, "gdn.ssm_state")
    c = dataclasses.replace(h, shape=(3,))
    assert align([h], [c]).pairs[0].same_layout is False


class FakeTrace:
    def __init__(self, partial: bool = False, **run):
        base = dict(architecture="A", config_digest="x", dtype="bfloat16", quantization=None,
                    block_size=16, replay="default")
        self.run = base | run
        self.partial = partial
        self.path = "t.h5"


def test_identity_mismatch_refused_with_both_values():
    with pytest.raises(MismatchError, match=r"traces differ in config_digest \(hit 'x', cold 'y'\)"):
        check_comparable(FakeTrace(), FakeTrace(config_digest="y"))


def test_identity_mismatch_allowed_becomes_a_warning():
    warnings = check_comparable(FakeTrace(), FakeTrace(dtype="float16"), allow_engine_mismatch=True)
    assert warnings == ["engine mismatch allowed: dtype differs (hit 'bfloat16', cold 'float16')"]


@pytest.mark.parametrize("allow", [False, True])
def test_two_block_sizes_are_not_comparable_even_across_engines(allow):
    # issue 19: with --allow-engine-mismatch it used to name a root in request 0, which had no hit
    with pytest.raises(NotComparableError) as e:
        check_comparable(FakeTrace(), FakeTrace(block_size=32), allow_engine_mismatch=allow)
    assert str(e.value) == ("runs not comparable: block_size differs (hit 16, cold 32); their K/V blocks and "
                            "state checkpoints cover different tokens, --allow-engine-mismatch or not (record "
                            "both with the same --block-size)")


def test_unknown_identity_value_is_a_warning_and_partial_noted():
    warnings = check_comparable(FakeTrace(dtype=None), FakeTrace(partial=True))
    assert warnings == ["dtype is unknown in the hit trace: cannot check it matches",
                        "the cold trace is partial (recording did not finish)"]


def test_replay_mismatch_refused_even_when_engines_may_differ():
    with pytest.raises(MismatchError, match="replayed differently .hit replay='exact', cold replay='default'"):
        check_comparable(FakeTrace(replay="exact"), FakeTrace(), allow_engine_mismatch=True)


def test_concurrency_mismatch_refused_and_absent_means_one_copy():
    with pytest.raises(MismatchError) as e:
        check_comparable(FakeTrace(concurrency=4), FakeTrace(), allow_engine_mismatch=True)
    assert str(e.value) == ("traces were replayed with different concurrency (hit 4, cold 1): their requests do "
                            "not pair; record both with the same --concurrency (requests then pair copy by copy)")
    assert check_comparable(FakeTrace(concurrency=4), FakeTrace(concurrency=4)) == []
    assert check_comparable(FakeTrace(concurrency=1), FakeTrace()) == []


# -- root vs propagated ---------------------------------------------------------

@dataclasses.dataclass
class D:
    request: int
    position: int
    role_hit: str = "checkpoint"


def test_same_request_later_divergences_are_propagated():
    v = classify([D(1, 48, "resumed"), D(1, 48), D(1, 64)], {})
    assert [x.root for x in v] == [True, False, False]
    assert [x.root_index for x in v] == [0, 0, 0]
    assert v[1].via == "same request"


def test_prefix_cache_propagation_needs_a_shared_prefix():
    reqs = {1: {"prompt_token_ids": [1, 2, 3, 4, 5, 6], "output_token_ids": [7, 8]},
            2: {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]},   # extends request 1
            3: {"prompt_token_ids": [1, 2, 3, 9, 9, 9, 9, 9]}}      # shares 3 tokens
    v = classify([D(1, 4, "resumed"), D(2, 8), D(3, 6)], reqs)
    assert (v[1].root, v[1].root_index, v[1].via) == (False, 0, "prefix cache from request 1")
    assert v[2].root is True  # position 6 is beyond the 3 tokens request 3 shares with request 1


def test_resumed_root_does_not_explain_a_later_resume_at_the_same_position():
    # request 1 read a wrong state at 48; the cached checkpoint at 48 itself was fine
    v = classify([D(1, 48, "resumed"), D(3, 48, "resumed")], {})
    assert [x.root for x in v] == [True, True]
    # a wrong *checkpoint* at 48 is what a later request resumes from
    v = classify([D(1, 48, "checkpoint"), D(3, 48, "resumed")], {})
    assert [x.root for x in v] == [True, False]


def test_earlier_position_in_later_request_is_another_root():
    v = classify([D(2, 80, "resumed"), D(2, 96), D(3, 48, "resumed"), D(3, 64)], {})
    assert [x.root for x in v] == [True, False, True, False]
    assert [x.root_index for x in v] == [0, 0, 2, 2]


def test_without_token_ids_the_earlier_request_length_bounds_the_reach():
    reqs = {0: {"prompt_len": 40, "output_token_ids": [1] * 8}, 1: {}}
    v = classify([D(0, 16), D(1, 48), D(0, 32)][:2], reqs)
    assert v[1].root is False
    v = classify([D(0, 16), D(1, 64)], reqs)
    assert v[1].root is True  # request 0 never had 64 tokens to cache


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0


def test_pair_maps_one_function_over_both_sides():
    from statediff.diff.align import Pair

    p = Pair({"output_token_ids": [1, 2]}, {"output_token_ids": [1, 3]})
    lengths = p.map(lambda r: len(r["output_token_ids"]))
    assert lengths == Pair(2, 2)
    hit, cold = p.map(lambda r: r["output_token_ids"][-1])
    assert (hit, cold) == (2, 3)


def test_stream_part_names_the_first_differing_fed_token():
    from statediff.diff.align import StreamPart, fed_same_tokens, stream_part

    a = {2: {"prompt_token_ids": [5, 6, 7], "output_token_ids": [8, 9, 10]}}
    b = {2: {"prompt_token_ids": [5, 6, 7], "output_token_ids": [8, 4, 10, 11]}}
    assert stream_part(a, b, 2) == StreamPart(2, 4, 9, 4, False)
    assert [fed_same_tokens(a, b, 2, p) for p in (3, 4, 5)] == [True, True, False]
    # one stream ending earlier is no parting: what both recorded saw the same tokens
    assert stream_part(a, {2: {"prompt_token_ids": [5, 6, 7], "output_token_ids": [8]}}, 2) is None
    assert stream_part(a, {2: {"prompt_token_ids": [5, 1, 7]}}, 2) == StreamPart(2, 1, 6, 1, True)
