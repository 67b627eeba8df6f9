"""report and extract on traces that keep data for some tensors or none (digest-first recording)."""

from __future__ import annotations

import pytest

from statediff.diff.compare import compare
from statediff.incident.bundle import compare_bundle, open_bundle, write_bundle
from statediff.incident.record import build_report
from statediff.diff.pair import CompareOptions
from statediff.trace import open_trace
from synth import Fault, write_trace

ARGV = ["agent.jsonl", "--exact", "--model", "/models/target", "--keep", "none"]
ROOT = (2, 80, 1, "gdn.ssm_state")
PREV_BLOCK = ("diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches the cold state "
              "one block earlier (position 64, 16 tokens), bit for bit")


def resumed(request, position, layer, kind, role):
    return role == "resumed"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("keep-incident")
    fault = [Fault("prev_block", 2, 1)]
    return {"none": write_trace(d / "hit-none.h5", "hit", faults=fault, replay="exact", keep="none",
                                record_argv=ARGV + ["--fault", "ssm-prev-block"]),
            "hits": write_trace(d / "hit-hits.h5", "hit", faults=fault, replay="exact", keep=resumed),
            "cold_none": write_trace(d / "cold-none.h5", "cold", replay="exact", keep="none", record_argv=ARGV),
            "cold_all": write_trace(d / "cold-all.h5", "cold", replay="exact", keep="all")}


def test_report_names_the_missing_data_and_the_focus_commands(traces):
    r = build_report(compare(traces["none"], traces["cold_none"]))
    assert r.field("root divergence") == ("request 2, position 80, layer 1 (model.layers.1.linear_attn), "
                                          "gdn.ssm_state; no data in either trace (recorded digest only)")
    assert r.field("diagnosis") == PREV_BLOCK.removeprefix("diagnosis: ")
    i = r.reproduce.index("# the root has no data in either trace (recorded digest only): record both runs "
                          "again keeping data around it:")
    assert r.reproduce[i + 1:i + 3] == [
        "statediff record agent.jsonl --exact --model /models/target --fault ssm-prev-block --mode hit "
        "-o hit-focus.h5 --focus request=2,position=80 --focus-check hit.h5",
        "statediff record agent.jsonl --exact --model /models/target --mode cold -o cold-focus.h5 "
        "--focus request=2,position=80 --focus-check cold.h5"]
    # the first record lines still reproduce the traces as they were recorded (--keep none included)
    assert r.reproduce[1] == ("statediff record agent.jsonl --exact --model /models/target --keep none --fault "
                              "ssm-prev-block --mode hit -o hit.h5")
    assert "record both runs again" in r.to_markdown()


def test_report_of_a_root_with_data_has_no_focus_lines(traces):
    r = build_report(compare(traces["hits"], traces["cold_all"]))
    assert r.field("root divergence") == "request 2, position 80, layer 1 (model.layers.1.linear_attn), gdn.ssm_state"
    assert not any("focus" in line for line in r.reproduce)


def test_bundle_of_a_digest_first_pair_keeps_digest_rows_and_reproduces_the_diagnosis(traces, tmp_path):
    result = compare(traces["hits"], traces["cold_none"])
    assert result.first.key == ROOT and result.first.data == (True, False)
    res = write_bundle(result, tmp_path / "b.zip", CompareOptions(), plot=False)
    assert res.root.key == ROOT and res.diagnosis == PREV_BLOCK
    assert res.verified[1] == "statediff compare on the extracted pair finds the same root and diagnosis"
    with open_bundle(res.path) as b:
        with open_trace(b.hit) as h, open_trace(b.cold) as c:
            # hit: the resumed states at 80 with data; at 96 (computed after the hit) digest rows
            assert [(e.key, e.summary is not None) for e in h.entries] == [
                ((2, 80, 1, "gdn.conv_state"), True), ((2, 80, 1, "gdn.ssm_state"), True)]
            assert [e.key for e in h.digests] == [(2, 96, 1, "gdn.conv_state"), (2, 96, 1, "gdn.ssm_state")]
            # cold: digest rows only, the diagnosis match (position 64) among them
            assert c.entries == [] and (2, 64, 1, "gdn.ssm_state") in [e.key for e in c.digests]
        again = compare_bundle(res.path)
        assert again.first.key == ROOT and again.diagnoses[0].text == PREV_BLOCK
    note = next(n for n in res.notes if n.startswith("the root has no data in the cold trace"))
    assert note.endswith(f"--mode cold -o cold-focus.h5 --focus request=2,position=80 "
                         f"--focus-check {traces['cold_none']}")
    assert "statediff record agent.jsonl --exact --model /models/target --mode cold" in note
