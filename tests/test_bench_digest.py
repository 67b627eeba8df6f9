"""Smoke test of benchmarks/bench_digest.py at tiny sizes: shapes, the conversation's keep selection,
and a digest-only trace pair whose planted root compare names (a few seconds, no torch)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from statediff.diff.compare import compare
from statediff.trace import open_trace

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling perfdoc.py
    try:
        spec = importlib.util.spec_from_file_location("bench_digest", BENCH / "bench_digest.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_digest"] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def boundary_bytes(model) -> int:
    return sum(math.prod(shape) * (4 if dtype == "float32" else 2) for _, _, shape, dtype in model.boundary())


def test_block_and_shapes(bench):
    # 3,207,168 B of mamba state / 4,096 B of K+V per token = 782.99 -> 783 -> multiple of 16
    assert bench.hybrid_block((48, 128, 128), (3, 10240), 4, 256) == 784
    assert bench.BIG.block == 784
    assert (bench.BIG.gdn_layers, bench.BIG.attn_layers) == (48, 16)
    assert boundary_bytes(bench.BIG) == 48 * (3_145_728 + 61_440) + 32 * 1_605_632 == 205_324_288
    tiny = bench.tiny_model()
    assert (tiny.ssm, tiny.conv, tiny.kv_heads, tiny.head_dim, tiny.block) == ((2, 64, 64), (3, 256), 4, 128, 32)
    assert (tiny.gdn_layers, tiny.attn_layers) == (3, 1)
    assert boundary_bytes(tiny) == 3 * (32_768 + 1_536) + 2 * 32_768 == 168_448


def test_conversation_keep_selection(bench):
    conv = bench.Conversation(bench.BIG.block)
    assert [conv.hit(r) for r in range(5)] == [0, 30_576, 41_552, 50_176, 58_016]
    cold = bench.selection(bench.BIG, conv, "cold", "hits")
    hit = bench.selection(bench.BIG, conv, "hit", "hits")
    # cold: 315 boundaries x 128 tensors + 5 partial K/V blocks x 32
    assert (len(cold), len(hit)) == (40_480, 18_784)
    for sel in (cold, hit):
        kept = [t for t, k in sel if k]
        # per hit: 2 x 48 GDN layers x 2 states + 2 K/V blocks x 16 layers x 2 kinds; 4 hits
        assert len(kept) == 4 * (2 * 48 * 2 + 2 * 16 * 2) == 1024
        assert sum(not t["kind"].startswith("attn.") for t in kept) == 768
        assert {t["request"] for t in kept} == {1, 2, 3, 4}
    # `all` keeps everything but the hit run's cached K/V copies below each hit's last block
    copies = (30_576 + 41_552 + 50_176 + 58_016) // 784 - 4
    assert sum(k for _, k in bench.selection(bench.BIG, conv, "hit", "all")) == 18_784 - copies * 32


def test_digest_pair_names_planted_root(bench, tmp_path):
    model = bench.tiny_model()
    conv = bench.Conversation(model.block, (300, 420, 500, 580, 670), 16)
    paths = {}
    for mode in ("cold", "hit"):
        paths[mode] = tmp_path / f"{mode}.h5"
        w = bench.write_digest_trace(paths[mode], model, conv, mode, fault_layer=1)
        with open_trace(paths[mode]) as t:
            assert t.entries == [] and len(t.digests) == w["rows"]
            assert all(d.summary is not None and d.summary.sketch is not None for d in t.digests)
    res = compare(paths["hit"], paths["cold"])
    assert res.exit_code == 1
    assert res.first.key == (3, conv.hit(3), 1, "gdn.ssm_state") == (3, 512, 1, "gdn.ssm_state")
    text = res.to_json()["diagnosis"]["text"]
    assert "one block earlier" in text and "position 480" in text
