"""The keep policy (``statediff_hooks.recording.keep``): which tensors keep data, for real call sequences.

The sequences mimic what the vLLM adapter records for the tiny hybrid's
second request in exact mode (block 32, hit at 448, prompt 520): the
resumed GDN state and last cached K/V block at the hit, then one step per
block with its checkpoints and completed K/V blocks.
"""

from __future__ import annotations

import json

import pytest

from statediff_hooks.recording.keep import Focus, KeepPolicy, KeepSpec, parse_bytes, parse_focus_spec
from statediff_hooks.recording.refocus import focus_from_compare

BS = 32
HIT = 448
GDN_LAYERS = (0, 1, 2)
ATTN_LAYER = 3
STATE_BYTES = {"gdn.conv_state": 1536, "gdn.ssm_state": 32768}
KV_BYTES = 2048


def hit_request(policy: KeepPolicy, *, request: int = 1, hit: int = HIT, end: int = 544,
                hit_run: bool = True) -> list[tuple]:
    """Feed one request's tensors in capture order; returns the keys that kept data.

    A hit run records the resumed state at ``hit`` and then steps from there;
    a cold run steps from 0 (expected hit ``hit``) and records checkpoints and
    K/V blocks at every boundary.
    """
    kept = []

    def put(position, layer, kind, role, start=None, nbytes=0, copy=False):
        if policy.keep(request=request, position=position, layer=layer, kind=kind, role=role,
                       token_start=start, nbytes=nbytes, copy=copy):
            kept.append((position, layer, kind, role))

    policy.begin_request(request, [hit if hit_run else 0, hit])
    first = 0
    if hit_run:
        for layer in GDN_LAYERS:
            for kind in STATE_BYTES:
                put(hit, layer, kind, "resumed", nbytes=STATE_BYTES[kind])
        for kind in ("attn.k", "attn.v"):
            put(hit, ATTN_LAYER, kind, "resumed", hit - BS, KV_BYTES)
            for b in range(hit // BS - 1):  # the cached prefix below the last block: copies
                put((b + 1) * BS, ATTN_LAYER, kind, "resumed", b * BS, KV_BYTES, copy=True)
        first = hit
    for e in range(first + BS, end + 1, BS):
        for layer in GDN_LAYERS:
            for kind in STATE_BYTES:
                put(e, layer, kind, "checkpoint", nbytes=STATE_BYTES[kind])
        for kind in ("attn.k", "attn.v"):
            put(e, ATTN_LAYER, kind, "kv_block", e - BS, KV_BYTES)
    return kept


def spec(keep="hits", focus=None) -> KeepSpec:
    return KeepSpec.parse(keep, focus)


def test_hits_keeps_the_resumed_state_both_kv_sides_and_the_first_checkpoint_after():
    p = KeepPolicy(spec(), BS)
    kept = hit_request(p)
    expected = ([(448, layer, k, "resumed") for layer in GDN_LAYERS for k in STATE_BYTES]
                + [(448, 3, "attn.k", "resumed"), (448, 3, "attn.v", "resumed")]
                + [(480, layer, k, "checkpoint") for layer in GDN_LAYERS for k in STATE_BYTES]
                + [(480, 3, "attn.k", "kv_block"), (480, 3, "attn.v", "kv_block")])
    assert kept == expected
    # 448: 6 states + 2 K/V; 480: 6 states + 2 K/V; 13 + 13 prefix copies and 512, 544 digest only
    assert p.to_json() == {"policy": "hits", "budget_bytes": None, "focus": None,
                           "kept_bytes": 2 * (3 * (1536 + 32768) + 2 * 2048), "kept_tensors": 16,
                           "digest_only_tensors": 26 + 2 * 8}


def test_a_cold_run_keeps_the_same_keys_around_its_expected_hit():
    hit = {k[:3] for k in hit_request(KeepPolicy(spec(), BS))}
    cold = {k[:3] for k in hit_request(KeepPolicy(spec(), BS), hit_run=False)}
    # the hit's resumed state pairs with the cold checkpoint at 448; K/V [416, 448) and [448, 480)
    assert cold == hit


def test_a_request_without_a_hit_keeps_nothing_under_hits():
    p = KeepPolicy(spec(), BS)
    assert hit_request(p, request=0, hit=0, hit_run=False) == []
    assert p.kept_tensors == 0 and p.digest_only_tensors == 17 * 8


def test_first_checkpoint_after_the_hit_is_per_layer_and_kind_even_when_far_away():
    # default chunking: the hit run's next checkpoint can be many blocks later (the last boundary)
    p = KeepPolicy(spec(), BS)
    p.begin_request(2, [640])
    got = [p.keep(request=2, position=pos, layer=0, kind="gdn.ssm_state", role="checkpoint")
           for pos in (608, 640, 1024, 1056)]
    assert got == [False, True, True, False]
    assert p.keep(request=2, position=1056, layer=1, kind="gdn.ssm_state", role="checkpoint")
    assert p.keep(request=2, position=1056, layer=0, kind="gdn.conv_state", role="checkpoint")


def test_drafter_rows_are_kept_in_the_block_after_each_anchor():
    p = KeepPolicy(spec(), BS)
    p.begin_request(1, [96])
    got = {pos: p.keep(request=1, position=pos, layer=2, kind="drafter.input", role="drafter")
           for pos in (96, 97, 100, 128, 129, 160)}
    assert got == {96: False, 97: True, 100: True, 128: True, 129: False, 160: False}
    assert p.keep(request=1, position=96, layer=2, kind="drafter.input", role="resumed")


def test_all_keeps_everything_but_the_hit_prefix_copies_and_none_keeps_nothing():
    p_all, p_none = KeepPolicy(spec("all"), BS), KeepPolicy(spec("none"), BS)
    assert len(hit_request(p_all)) == 8 + 3 * 8
    assert p_all.digest_only_tensors == 26
    assert hit_request(p_none) == [] and p_none.digest_only_tensors == 8 + 26 + 3 * 8


def test_budget_keeps_hit_tensors_first_and_others_only_within_half():
    hits_bytes = KeepPolicy(spec(), BS)
    hit_request(hits_bytes)
    # exactly the hits selection's bytes: the other tensors would need room under budget/2
    p = KeepPolicy(spec(str(hits_bytes.kept_bytes)), BS)
    assert hit_request(p) == hit_request(KeepPolicy(spec(), BS))
    assert p.to_json()["policy"] == "budget" and p.to_json()["budget_bytes"] == 2 * (3 * 34304 + 4096)
    # a budget of 4 GB keeps everything a recording of "all" keeps
    big = KeepPolicy(spec("4GB"), BS)
    assert hit_request(big) == hit_request(KeepPolicy(spec("all"), BS))
    # 5000 bytes: the resumed conv states (1536 each) fit, no SSM state (32768) after them
    small = KeepPolicy(spec("5000"), BS)
    assert hit_request(small) == [(448, layer, "gdn.conv_state", "resumed") for layer in GDN_LAYERS]


def test_budget_does_not_spend_the_reserved_half_on_other_tensors():
    p = KeepPolicy(spec("100000"), BS)
    p.begin_request(0, [])
    kept = [p.keep(request=0, position=32 * (i + 1), layer=0, kind="gdn.ssm_state", role="checkpoint",
                   nbytes=20000) for i in range(4)]
    assert kept == [True, True, False, False]  # 40000 <= 50000 < 60000
    p.begin_request(1, [64])
    assert p.keep(request=1, position=64, layer=0, kind="gdn.ssm_state", role="resumed", nbytes=60000)
    assert p.kept_bytes == 100000


def test_focus_keeps_one_request_around_its_position_copies_included():
    f = Focus(request=1, position=416, layers=(3,))
    p = KeepPolicy(spec(focus=f), BS)
    kept = hit_request(p)
    assert kept == [(448, 3, "attn.k", "resumed"), (384, 3, "attn.k", "resumed"), (416, 3, "attn.k", "resumed"),
                    (448, 3, "attn.v", "resumed"), (384, 3, "attn.v", "resumed"), (416, 3, "attn.v", "resumed")]
    assert hit_request(KeepPolicy(spec(focus=f), BS), request=0) == []
    assert p.to_json()["focus"] == {"request": 1, "position": 416, "layers": [3]}


def test_focus_on_every_layer_adds_the_first_checkpoint_after_the_position():
    p = KeepPolicy(spec(focus=Focus(1, 448)), BS)
    kept = hit_request(p, end=640)
    assert {k[0] for k in kept if k[3] == "checkpoint"} == {480}
    p = KeepPolicy(spec(focus=Focus(1, 448)), 0)  # no window: only the checkpoints after the position
    p.begin_request(1, [])
    got = [p.keep(request=1, position=pos, layer=0, kind="gdn.ssm_state", role="checkpoint")
           for pos in (448, 512, 544)]
    assert got == [True, True, False]


@pytest.mark.parametrize("text,n", [("123456", 123456), ("500MB", 500_000_000), ("2GiB", 2 << 30),
                                    ("1.5kB", 1500), ("64 KiB", 65536), ("7b", 7)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-5", "0", "0.4", "1e9"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_keep_spec_parse_and_env_round_trip():
    s = KeepSpec.parse("2GiB", Focus(3, 1000, (1, 2)))
    assert (s.policy, s.budget_bytes) == ("budget", 2 << 30)
    assert s.to_env() == {"STATEDIFF_KEEP": str(2 << 30),
                          "STATEDIFF_FOCUS": '{"request": 3, "position": 1000, "layers": [1, 2]}'}
    assert KeepSpec.from_env(s.to_env()) == s
    assert KeepSpec.from_env({}) == KeepSpec("hits")
    with pytest.raises(ValueError, match="STATEDIFF_KEEP: 'lots'"):
        KeepSpec.from_env({"STATEDIFF_KEEP": "lots"})
    with pytest.raises(ValueError, match="not --keep all"):
        KeepSpec.parse("all", Focus(0, 32))


def test_parse_focus_spec():
    assert parse_focus_spec("request=1,position=448") == Focus(1, 448, None)
    assert parse_focus_spec("request=1, position=448, layers=3/1/3") == Focus(1, 448, (1, 3))
    assert parse_focus_spec("position=0,request=0,layers=-1") == Focus(0, 0, (-1,))
    assert Focus(1, 448, (1, 3)).spec == "request=1,position=448,layers=1/3"
    for bad in ("request=1", "request=-1,position=3", "request=1,position=x", "request=1,position=2,foo=3",
                "request=1,request=2,position=3", "request=1,position=2,layers=a/b", ""):
        with pytest.raises(ValueError):
            parse_focus_spec(bad)


def _compare_doc(**kw) -> dict:
    doc = {"statediff": "compare", "hit": {"path": "hit.h5"}, "cold": {"path": "/t/cold.h5"},
           "first": {"request": 1, "position": 416, "layer": 3, "kind": "attn.k"},
           "roots": [{"request": 1, "position": 416, "layer": 3, "kind": "attn.k"}]}
    return json.loads(json.dumps(doc | kw))


def test_focus_from_a_compare_result():
    assert focus_from_compare(_compare_doc()) == (Focus(1, 416, None), "hit.h5", "/t/cold.h5")
    doc = _compare_doc(focus={"request": 2, "position": 640, "layers": [1]})
    assert focus_from_compare(doc) == (Focus(2, 640, (1,)), "hit.h5", "/t/cold.h5")
    doc = _compare_doc(roots=[], first={"request": 0, "position": 32, "layer": 0, "kind": "gdn.ssm_state"})
    assert focus_from_compare(doc)[0] == Focus(0, 32)
    with pytest.raises(ValueError, match="no divergence"):
        focus_from_compare(_compare_doc(roots=[], first=None))
    with pytest.raises(ValueError, match="not the output"):
        focus_from_compare({"verdict": "same"})
    with pytest.raises(ValueError, match="request must be a non-negative integer"):
        focus_from_compare(_compare_doc(focus={"request": -1, "position": 3}))
