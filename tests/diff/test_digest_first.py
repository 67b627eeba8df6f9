"""compare on per-tensor summaries: traces that keep data for some tensors, or none (digest-first recording).

Every synthetic fault must get the same root, propagation and diagnosis
from summaries alone (``keep="none"``) as from full data (``keep="all"``)
in exact mode; in default mode the sketch's L2 estimate judges the pairs
without data. Mixed pairs (data on one side only), the report's line for
a root without data and the command that records it are checked here too.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from statediff.diff.calibrate import calibrate
from statediff.diff.compare import compare
from statediff.trace.reader import Trace, open_trace
from statediff.trace.summary import Q_HI, Q_LO
from synth import Fault, write_trace

# fault -> (root key, reason with data, reason from summaries, diagnosis finding, divergences (root + propagated))
FAULTS = {
    "prev_block": (Fault("prev_block", 2, 1), (2, 80, 1, "gdn.ssm_state"), "other_position", 9),
    "zero_conv": (Fault("zero_conv", 1, 0), (1, 48, 0, "gdn.conv_state"), "zeros", 27),
    "swap_kv": (Fault("swap_kv", 2, 3), (2, 64, 3, "attn.k"), "other_position", 4),
    "nan": (Fault("nan", 1, 2), (1, 48, 2, "gdn.ssm_state"), None, 27),
    "bf16": (Fault("bf16", 2, 1), (2, 80, 1, "gdn.ssm_state"), "bf16_rounded", 9),
    "other_request": (Fault("other_request", 2, 1), (2, 80, 1, "gdn.ssm_state"), "other_request", 9),
}
ARGV = ["agent.jsonl", "--model", "/models/target", "--exact", "--keep", "none"]


@pytest.fixture(scope="module")
def colds(tmp_path_factory):
    d = tmp_path_factory.mktemp("colds")
    return {(replay, keep): write_trace(d / f"cold-{replay}-{keep}.h5", "cold", replay=replay, keep=keep)
            for replay in ("exact", "default") for keep in ("all", "none", None)}


def hit(tmp_path, *faults, replay="exact", keep="none", name="hit", **kw):
    return write_trace(tmp_path / f"{name}-{keep}.h5", "hit", faults=list(faults), replay=replay, keep=keep, **kw)


def no_reads(monkeypatch, allowed=()):
    """Fail the test if any tensor data is read (the judging and diagnoses must use summaries),
    except tensors whose key is in ``allowed``."""
    real = Trace.read, Trace.iter_blocks

    def guard(fn):
        def read(self, e, *args, **kw):
            assert e.key in allowed, f"data read: {e.label()}"
            return fn(self, e, *args, **kw)
        return read
    monkeypatch.setattr(Trace, "read", guard(real[0]))
    monkeypatch.setattr(Trace, "iter_blocks", guard(real[1]))


def outline(r):
    """What must not depend on the keep policy: roots, propagation, diagnoses."""
    return ([d.key for d in r.divergences], [d.key for d in r.roots], [d.root_key for d in r.divergences],
            [d.via for d in r.divergences], [(g.finding, g.text, g.match_request, g.match_position)
                                             for g in r.diagnoses])


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_every_fault_gets_the_same_root_and_diagnosis_from_summaries_in_exact_mode(tmp_path, colds, name,
                                                                                  monkeypatch):
    fault, key, finding, n = FAULTS[name]
    full = compare(hit(tmp_path, fault, keep="all"), colds["exact", "all"])
    path = hit(tmp_path, fault)
    no_reads(monkeypatch)
    r = compare(path, colds["exact", "none"])
    assert r.exit_code == full.exit_code == 1
    assert r.first.key == full.first.key == key and len(r.divergences) == len(full.divergences) == n
    assert outline(r) == outline(full)
    assert [g.finding for g in r.diagnoses] == ([finding] if finding else [])
    d = r.first
    assert (d.data, d.metrics, d.root, d.propagated) == ((False, False), None, True, n - 1)
    assert d.reason == ("NaN/Inf on one side only" if name == "nan" else "digest differs")
    # judged from summaries only: no pair read, every one decided by its digest
    assert (r.digests.pairs, r.digests.by_digest, r.digests.by_estimate, r.digests.unjudged) == (78, 78, 0, 0)
    assert r.digests.identical == r.identical == 78 - n
    assert "0 read in full, " + f"{n} judged from summaries (no data on a side)" in r.to_text()


def test_bf16_rounding_is_found_from_the_cold_bf16_digest(tmp_path, colds, monkeypatch):
    path = hit(tmp_path, Fault("bf16", 2, 1))
    no_reads(monkeypatch)
    r = compare(path, colds["exact", "none"])
    assert r.diagnoses[0].text == ("diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches "
                                   "the cold state rounded to bfloat16")
    with open_trace(colds["exact", "none"]) as t:
        cold = next(e for e in t.digests if e.key == (2, 80, 1, "gdn.ssm_state"))
    assert r.first.digests[0] == cold.summary.digest_bf16 != cold.summary.digest


def test_the_nan_counts_are_named_from_the_summaries(tmp_path, colds):
    r = compare(hit(tmp_path, Fault("nan", 1, 2)), colds["exact", "none"])
    d = r.first
    assert (d.sketch.nonfinite_hit, d.sketch.nonfinite_cold) == ((1, 0), (0, 0))
    assert ("  NaN/Inf on one side only: hit 1 NaN, 0 Inf; cold 0 NaN, 0 Inf (from the summaries: no values "
            "to locate them)") in r.to_text()


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_default_mode_flags_every_fault_by_the_sketch_estimate(tmp_path, colds, name):
    fault, key, finding, n = FAULTS[name]
    full = compare(hit(tmp_path, fault, replay="default", keep="all"), colds["default", "all"])
    r = compare(hit(tmp_path, fault, replay="default"), colds["default", "none"])
    if name == "bf16":  # a bfloat16 rounding (~0.5u relative L2) is within the default-replay noise model
        assert key not in {d.key for d in r.divergences} | {d.key for d in full.divergences}
        assert r.band.noise >= 1 and full.band.noise >= 1
        return
    assert r.exit_code == 1 and r.first.key == full.first.key == key
    # roots and diagnoses as with data; of the propagated pairs, those whose estimated error interval
    # straddles the noise model's 16u are "cannot judge" from summaries (band.py), not divergent
    assert (outline(r)[1], outline(r)[4]) == (outline(full)[1], outline(full)[4])
    assert {d.key for d in r.divergences} <= {d.key for d in full.divergences}
    d = r.first
    if name == "nan":
        assert d.reason == "NaN/Inf on one side only"
        return
    assert d.reason == "beyond tolerance (sketch estimate)"
    assert d.sketch.estimate.low > d.sketch.budget
    assert r.digests.by_estimate == n and r.digests.beyond_estimate + r.band.noise + len(r.band.unsure) == n
    assert r.digests.beyond_estimate == len(r.divergences)


def test_the_estimate_brackets_the_true_l2_error_of_the_root(tmp_path, colds):
    """prev_block: the hit state is the cold state of position 64; the true error is measured from the data."""
    r = compare(hit(tmp_path, Fault("prev_block", 2, 1), replay="default"), colds["default", "none"])
    with open_trace(colds["default", "all"]) as t:
        at = {e.key: t.read(e) for e in t.entries if e.layer == 1 and e.kind == "gdn.ssm_state" and e.request == 2}
    c = at[(2, 80, 1, "gdn.ssm_state")].astype(np.float64)
    true = float(np.linalg.norm(at[(2, 64, 1, "gdn.ssm_state")] - c))
    sk = r.first.sketch
    e = sk.estimate
    assert e.low <= true <= e.high and true == pytest.approx(12.8, rel=0.05)
    assert (e.low, e.high) == pytest.approx((e.l2 / math.sqrt(Q_HI), e.l2 / math.sqrt(Q_LO)))
    assert e.norm_cold == pytest.approx(float(np.linalg.norm(c)), rel=1e-6)
    assert sk.budget == pytest.approx(1e-5 * math.sqrt(8192) + 1e-4 * e.norm_cold)
    lo, hi = sk.rel_interval
    text = r.to_text()
    assert (f"  beyond tolerance (sketch estimate): L2 error ~ {e.l2:.2g} (sketch estimate, 99%: {e.low:.2g}-"
            f"{e.high:.2g}), above {sk.budget:.4g}, the largest L2 error the tolerance allows over 8192 "
            "elements") in text
    assert f"  rel L2 ~ {e.rel_l2:.2g} (sketch estimate, 99%: {lo:.2g}-{hi:.2g})" in text
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))["first"]
    assert doc["sketch"]["budget"] == pytest.approx(sk.budget) and doc["sketch"]["confidence"] == 0.99
    assert doc["sketch"]["rel_low"] == pytest.approx(lo) and doc["data"] == {"hit": False, "cold": False}
    # the next divergences carry their estimate on one line
    assert "request 2 position 96 layer 0 gdn.conv_state [propagated, same request] beyond tolerance (sketch " \
           "estimate): rel L2 ~ " in text


@pytest.fixture(scope="module")
def noise_file(tmp_path_factory, colds):
    d = tmp_path_factory.mktemp("noise")
    other = write_trace(d / "cold-b.h5", "cold", noise_seed=1)
    calibrate(colds["default", None], other, d / "noise.json")
    return d / "noise.json"


def test_benign_noise_is_same_by_estimate_with_the_noise_file(tmp_path, colds, noise_file):
    path = hit(tmp_path, replay="default", noise_seed=2)
    r = compare(path, colds["default", "none"], noise=noise_file)
    assert (r.exit_code, r.divergences, r.warnings) == (0, [], [])
    # request 0 ran from scratch in both runs (16 bit-identical pairs); the 62 noisy ones are within
    assert (r.digests.by_digest, r.digests.identical, r.digests.by_estimate, r.digests.beyond_estimate) == (
        16, 16, 62, 0)
    # without it, the +-0.05 on attention K is beyond the bfloat16 default, as with data
    full = compare(hit(tmp_path, replay="default", noise_seed=2, keep="all"), colds["default", "all"])
    r = compare(path, colds["default", "none"])
    # ... and between the noise model's bands (band.py): cannot be judged without the noise file
    assert (r.verdict, full.verdict, r.divergences, full.divergences) == ("cannot-judge", "cannot-judge", [], [])
    assert r.band.unsure[0][:4] == full.band.unsure[0][:4] == (1, 32, 3, "attn.k")
    # a fault on top of the noise is still beyond the noise file's allowance
    r = compare(hit(tmp_path, Fault("prev_block", 2, 1), replay="default", noise_seed=2, name="faulty"),
                colds["default", "none"], noise=noise_file)
    assert r.first.key == (2, 80, 1, "gdn.ssm_state") and r.first.reason == "beyond tolerance (sketch estimate)"


def test_a_pair_with_data_on_one_side_is_judged_by_summaries(tmp_path, colds, monkeypatch):
    """Hit keeps data for its resumed states only (as --keep hits does), cold keeps all."""
    path = hit(tmp_path, Fault("prev_block", 2, 1),
               keep=lambda request, position, layer, kind, role: role == "resumed")
    full = compare(hit(tmp_path, Fault("prev_block", 2, 1), name="full", keep="all"), colds["exact", "all"])
    # only the root pair (data on both sides) is read: recorded summaries stand in for everything else
    no_reads(monkeypatch, allowed={(2, 80, 1, "gdn.ssm_state")})
    r = compare(path, colds["exact", "all"])
    assert outline(r) == outline(full)
    # the root pair has data on both sides (a resumed state), its later divergences on the cold side only
    assert r.first.data == (True, True) and r.first.metrics is not None
    assert {d.data for d in r.divergences[1:]} == {(False, True)}
    assert r.digests.pairs == 78 - 18 and r.identical == 78 - 9


def test_a_data_side_without_summaries_is_summarised_from_its_data(tmp_path, colds):
    """A digest-only hit trace against a cold trace recorded before summaries (format version 1)."""
    r = compare(hit(tmp_path, Fault("swap_kv", 2, 3)), colds["exact", None])
    full = compare(hit(tmp_path, Fault("swap_kv", 2, 3), keep="all"), colds["exact", "all"])
    assert outline(r) == outline(full) and r.first.data == (False, True)
    r = compare(hit(tmp_path, Fault("zero_conv", 1, 0), replay="default", name="z"), colds["default", None])
    assert r.first.key == (1, 48, 0, "gdn.conv_state") and r.first.reason == "beyond tolerance (sketch estimate)"
    assert r.diagnoses[0].finding == "zeros"


def test_a_root_without_data_says_so_and_prints_the_commands_that_record_it(tmp_path, colds):
    path = hit(tmp_path, Fault("prev_block", 2, 1), record_argv=ARGV + ["--fault", "ssm-prev-block"])
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", keep="none", record_argv=ARGV)
    r = compare(path, cold)
    lines = r.to_text().splitlines()
    i = lines.index("  the root has no data in either trace (recorded digest only); record it again keeping data "
                    "around it (--focus request=2,position=80), both runs:")
    assert lines[i + 1:i + 3] == [
        "    statediff record agent.jsonl --model /models/target --exact --fault ssm-prev-block --mode hit "
        f"-o hit-focus.h5 --focus request=2,position=80 --focus-check {path}",
        "    statediff record agent.jsonl --model /models/target --exact --mode cold -o cold-focus.h5 "
        f"--focus request=2,position=80 --focus-check {cold}"]
    doc = r.to_json()
    assert doc["focus"] == {"request": 2, "position": 80, "layers": []}  # every layer around the root
    assert doc["focus_commands"] == [line.strip() for line in lines[i + 1:i + 3]]
    assert (doc["hit"]["path"], doc["cold"]["path"]) == (str(path), str(cold))
    # data on the cold side only: named as such
    r = compare(path, colds["exact", "all"])
    assert "  the root has no data in the hit trace (recorded digest only); record it again" in r.to_text()
    # without a stored command line: the arguments rebuilt from the run metadata, and said so
    bare = hit(tmp_path, Fault("prev_block", 2, 1), name="bare")
    r = compare(bare, colds["exact", "all"])
    rebuilt = "statediff record CONVERSATION.jsonl --model synthetic-tiny --dtype bfloat16 --block-size 16 --seed 0 --exact"
    assert r.focus_commands() == [
        f"{rebuilt} --mode hit -o hit-focus.h5 --focus request=2,position=80 --focus-check {bare}",
        f"{rebuilt} --mode cold -o cold-focus.h5 --focus request=2,position=80 --focus-check {colds['exact', 'all']}"]
    assert r.to_text().splitlines()[i + 3] == (
        "    (arguments rebuilt from the run metadata: the traces do not store the record command line)")


def test_a_root_with_data_prints_no_command_but_json_names_the_focus(tmp_path, colds):
    r = compare(hit(tmp_path, Fault("swap_kv", 2, 3), keep="all"), colds["exact", "all"])
    assert "record it again" not in r.to_text()
    doc = r.to_json()
    assert (doc["focus"], doc["focus_commands"]) == ({"request": 2, "position": 64, "layers": []}, [])
    assert doc["first"]["data"] == {"hit": True, "cold": True} and doc["first"]["sketch"] is None
    assert compare(hit(tmp_path, keep="all", name="clean"), colds["exact", "all"]).to_json()["focus"] is None
