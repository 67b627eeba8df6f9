"""Cold-run split points for the split form of exact replay."""

import pytest

from statediff.errors import StatediffError
from statediff.replay.splitplan import cold_splits, decode_filled


def req(prompt, chunks, hit=0, out=()):
    return {"prompt_token_ids": list(prompt), "output_token_ids": list(out),
            "num_cached_tokens": hit, "chunks": [list(c) for c in chunks]}


def test_chain_of_hits_collects_every_ancestor_split():
    base = list(range(100))
    reqs = {
        0: req(base[:70], [(0, 64), (64, 70), (70, 71)]),
        1: req(base[:90], [(64, 80), (80, 90), (90, 91)], hit=64),
        2: req(base[:100], [(80, 96), (96, 100)], hit=80),
    }
    assert cold_splits(reqs) == {0: [64], 1: [64, 80], 2: [64, 80, 96]}


def test_hit_resumes_from_the_first_request_that_computed_the_boundary():
    base = list(range(100))
    reqs = {
        0: req(base[:50], [(0, 16), (16, 48), (48, 50)]),
        1: req(base[:60], [(0, 48), (48, 60)]),  # computed 48 again, in one chunk
        2: req(base[:70], [(48, 64), (64, 70)], hit=48),
    }
    assert cold_splits(reqs)[2] == [16, 48, 64]


def test_other_tokens_are_not_an_ancestor():
    reqs = {0: req(range(50), [(0, 48), (48, 50)]),
            1: req([7] * 60, [(48, 60)], hit=48)}
    with pytest.raises(StatediffError, match="request 1 resumed at token 48, but no earlier request"):
        cold_splits(reqs)


def test_decode_filled_boundaries_are_reported():
    reqs = {0: req(range(40), [(0, 32), (32, 40), (40, 41), (41, 48)], out=range(40, 48)),
            1: req(list(range(48)) + [1, 2], [(48, 50)], hit=48)}
    assert decode_filled(reqs) == {1: [48]}
    assert cold_splits(reqs) == {0: [32], 1: [32, 40, 41, 48]}


def test_an_attention_hit_inside_an_earlier_chunk_resumes_from_that_chunk():
    """Issue 34: dense target + DFlash, default check: request 0's prompt ran in one chunk (0, 150];
    request 1's hit at 96 (the last full block dropped) lies inside it: split at 96, not exit 2."""
    base = list(range(200))
    reqs = {0: req(base[:150], [(0, 150), (150, 151)]),
            1: req(base[:180], [(96, 180)], hit=96)}
    assert cold_splits(reqs) == {0: [], 1: [96]}
    assert decode_filled(reqs) == {}
