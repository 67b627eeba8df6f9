"""statediff.diff.diagnose: what a wrong hit tensor matches, searched in the documented order.

Small traces written here with known contents: request 0 and request 1 hold
SSM states (layer 0) at positions 16, 32 and 48 and K blocks (layer 1) of
16 tokens; the root is request 0's tensor at position 32.
"""

from __future__ import annotations

import numpy as np
import pytest

from statediff.diff.align import Pair
from statediff.diff.diagnose import DigestCache, diagnose, logical_block, match_block, offset_words
from statediff.diff.tolerance import Policy
from statediff.trace import TraceWriter, open_trace
from statediff.trace.dtypes import round_to_bf16
from statediff.trace.summary import summarize

SSM = (2, 8, 8)
KV = (16, 2, 8)
ROOT = (0, 32, 0, "gdn.ssm_state")


def ssm(request: int, position: int) -> np.ndarray:
    return np.random.default_rng(100 * request + position).standard_normal(SSM).astype(np.float32)


def kblock(request: int, start: int) -> np.ndarray:
    x = np.random.default_rng(7 + 1000 * request + start).standard_normal(KV).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bit patterns


def write(path, mode: str, ssm_at: dict, k_at: dict, *, summaries: bool = False, digest_only: frozenset = frozenset()):
    """A trace of ``ssm_at`` ({(request, position): array}) and ``k_at`` ({(request, start): bf16 block});
    with ``summaries``, every tensor gets one; keys in ``digest_only`` keep no data."""
    w = TraceWriter(path, {"engine": "synthetic", "mode": mode, "block_size": 16}, overwrite=True)
    for r in sorted({r for r, _ in [*ssm_at, *k_at]}):
        w.begin_request(r, f"r{r}", list(range(60)))
    tensors = [((r, p, 0, "gdn.ssm_state"), a, "float32", p) for (r, p), a in ssm_at.items()]
    tensors += [((r, s + 16, 1, "attn.k"), a, "bfloat16", s) for (r, s), a in k_at.items()]
    for (r, p, layer, kind), arr, dtype, start in tensors:
        meta = dict(request=r, position=p, layer=layer, kind=kind, module=f"model.layers.{layer}", dtype=dtype,
                    role="kv_block" if kind == "attn.k" else "checkpoint", token_start=start)
        if (r, p, layer, kind) in digest_only:
            w.add_digest(summarize(arr, dtype), shape=arr.shape, **meta)
        else:
            w.add(arr, summary=summarize(arr, dtype) if summaries else None, **meta)
    w.end_step()
    w.close()
    return path


def cold_tensors():
    ssm_at = {(r, p): ssm(r, p) for r in (0, 1) for p in (16, 32, 48)}
    k_at = {(r, s): kblock(r, s) for r in (0, 1) for s in (0, 16, 32)}
    return ssm_at, k_at


@pytest.fixture(scope="module")
def colds(tmp_path_factory):
    d = tmp_path_factory.mktemp("cold")
    ssm_at, k_at = cold_tensors()
    return {"plain": write(d / "cold.h5", "cold", ssm_at, k_at),
            "summaries": write(d / "cold3.h5", "cold", ssm_at, k_at, summaries=True)}


def run(tmp_path, cold_path, root_value, key=ROOT, policy=Policy(), **kw):
    """Diagnose a hit trace whose tensor at ``key`` is ``root_value`` against ``cold_path``."""
    r, p, layer, kind = key
    if kind == "attn.k":
        hit = write(tmp_path / "hit.h5", "hit", {}, {(r, p - 16): root_value}, **kw)
    else:
        hit = write(tmp_path / "hit.h5", "hit", {(r, p): root_value}, {}, **kw)
    with open_trace(hit) as h, open_trace(cold_path) as c:
        he = next(e for e in [*h.entries, *h.digests] if e.key == key)
        ce = next(e for e in [*c.entries, *c.digests] if e.key == key)
        return diagnose(Pair(he, ce), h, c, policy)


def test_all_zeros_is_named_first(tmp_path, colds):
    g = run(tmp_path, colds["plain"], np.zeros(SSM, np.float32))
    assert (g.finding, g.exact, g.match_request) == ("zeros", True, None)
    assert g.text == "diagnosis: request 0 layer 0 gdn.ssm_state at position 32 is all zeros: never written / zeroed"
    assert g.key == ROOT


def test_the_nearest_earlier_position_of_the_same_request_first(tmp_path, colds):
    g = run(tmp_path, colds["plain"], ssm(0, 16))
    assert (g.finding, g.exact, g.match_request, g.match_position, g.offset_tokens) == (
        "other_position", True, 0, 16, -16)
    assert g.text == ("diagnosis: request 0 layer 0 gdn.ssm_state at position 32 matches the cold state one block "
                      "earlier (position 16, 16 tokens), bit for bit")
    g = run(tmp_path, colds["plain"], ssm(0, 48))
    assert g.text.endswith("matches the cold state one block later (position 48, 16 tokens), bit for bit")


def test_another_request_at_the_same_position_then_anywhere(tmp_path, colds):
    g = run(tmp_path, colds["plain"], ssm(1, 32))
    assert (g.finding, g.match_request, g.match_position) == ("other_request", 1, 32)
    assert g.text == ("diagnosis: request 0 layer 0 gdn.ssm_state at position 32 matches request 1's cold state "
                      "at the same position, bit for bit")
    g = run(tmp_path, colds["plain"], ssm(1, 48))
    assert g.text.endswith("matches request 1's cold state at position 48, bit for bit")


def test_the_cold_counterpart_rounded_to_bfloat16(tmp_path, colds):
    rounded = round_to_bf16(ssm(0, 32))
    g = run(tmp_path, colds["plain"], rounded)  # from the data of both sides (no summaries)
    assert (g.finding, g.match_request, g.match_position, g.offset_tokens) == ("bf16_rounded", 0, 32, 0)
    assert g.text == "diagnosis: request 0 layer 0 gdn.ssm_state at position 32 matches the cold state rounded to bfloat16"
    # from the summaries alone: the hit is a digest row, the cold summary's bf16 digest names it
    g = run(tmp_path, colds["summaries"], rounded, summaries=True, digest_only=frozenset({ROOT}))
    assert g.finding == "bf16_rounded"


def test_within_tolerance_of_a_neighbour(tmp_path, colds):
    near = ssm(0, 16) + np.float32(2e-6)  # float32 default: atol 1e-5, rtol 1e-4
    g = run(tmp_path, colds["plain"], near)
    assert (g.finding, g.exact, g.match_position) == ("other_position", False, 16)
    assert g.text.endswith("(position 16, 16 tokens), within tolerance")
    assert run(tmp_path, colds["plain"], near, policy=Policy(exact=True)) is None  # bit identity: no near match


def test_nothing_matches(tmp_path, colds):
    assert run(tmp_path, colds["plain"], ssm(5, 5)) is None


def test_a_digest_only_root_gets_the_same_exact_findings(tmp_path, colds):
    g = run(tmp_path, colds["summaries"], ssm(0, 16), summaries=True, digest_only=frozenset({ROOT}))
    assert (g.finding, g.exact, g.match_position) == ("other_position", True, 16)
    assert run(tmp_path, colds["summaries"], np.zeros(SSM, np.float32), summaries=True,
               digest_only=frozenset({ROOT})).finding == "zeros"
    # without data, nothing within tolerance can be searched
    assert run(tmp_path, colds["summaries"], ssm(0, 16) + np.float32(2e-6), summaries=True,
               digest_only=frozenset({ROOT})) is None


def test_a_kv_block_names_the_logical_blocks(tmp_path, colds):
    key = (0, 32, 1, "attn.k")  # tokens [16, 32): logical block 1
    g = run(tmp_path, colds["plain"], kblock(0, 0), key=key)
    assert g.text == ("diagnosis: request 0 layer 1 attn.k at position 32 matches the cold KV block one block earlier "
                      "(position 16, 16 tokens), bit for bit: the block read as logical block 1 holds the cold "
                      "run's block 0")


def test_match_block_and_the_digest_cache(tmp_path, colds):
    hit = write(tmp_path / "hit.h5", "hit", {(0, 32): ssm(0, 48)}, {})
    with open_trace(hit) as h, open_trace(colds["plain"]) as c:
        he = h.entries[0]
        ce = next(e for e in c.entries if e.key == ROOT)
        m = match_block(Pair(he, ce), h, c, DigestCache())  # data on both sides: the index hashes decide
        assert (m.request, m.position) == (0, 48)
        assert match_block(Pair(he, ce), h, c, DigestCache(), nearest=1) is None  # only position 16 looked at
        cache = DigestCache()
        assert cache.known(c, ce) is None  # version 1: no recorded digest, nothing computed yet
        from statediff.trace.digest import digest_array

        assert cache.of(c, ce) == digest_array(ssm(0, 32)) and cache.bytes_read == 2 * 8 * 8 * 4
        assert cache.known(c, ce) == digest_array(ssm(0, 32))  # computed once
        other = next(e for e in c.entries if e.key == (0, 16, 0, "gdn.ssm_state"))
        assert cache.summary(c, other) == summarize(ssm(0, 16), "float32") and cache.bytes_read == 2 * 512
    with open_trace(colds["summaries"]) as c:
        cache = DigestCache()
        e = c.entries[0]
        assert cache.known(c, e) == e.summary.digest and cache.summary(c, e) is e.summary
        assert cache.bytes_read == 0  # recorded: nothing read


def test_offset_words_and_logical_blocks():
    assert offset_words(32, 16, 16) == "one block earlier (position 16, 16 tokens)"
    assert offset_words(32, 96, 32) == "2 blocks later (position 96, 64 tokens)"
    assert offset_words(32, 37, 16) == "5 tokens later (position 37)"
    assert offset_words(32, 16, None) == "16 tokens earlier (position 16)"
    import dataclasses

    from synth import entry

    k = entry(0, 48, 1, "attn.k")
    assert logical_block(dataclasses.replace(k, token_start=32)) == 2
    assert logical_block(dataclasses.replace(k, token_start=38)) is None  # [38, 48) is not a block of its width
