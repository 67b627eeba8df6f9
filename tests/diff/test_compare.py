"""compare() on synthetic hit/cold pairs with planted faults at known keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from statediff.diff.compare import compare
from statediff.errors import MismatchError, NotComparableError, StatediffError
from statediff.diff.calibrate import calibrate
from statediff.diff.noise import load_noise
from statediff.trace.reader import open_trace
from synth import NAN_INDEX, Fault, write_trace


@pytest.fixture(scope="module")
def colds(tmp_path_factory):
    d = tmp_path_factory.mktemp("cold")
    return {"default": write_trace(d / "cold.h5", "cold"),
            "exact": write_trace(d / "cold-exact.h5", "cold", replay="exact")}


def hit_trace(tmp_path, *faults, replay="default", **kw):
    return write_trace(tmp_path / "hit.h5", "hit", faults=list(faults), replay=replay, **kw)


def test_identical_pair_is_the_same(tmp_path, colds):
    r = compare(hit_trace(tmp_path), colds["default"])
    assert r.exit_code == 0 and r.divergences == [] and r.diagnoses == []
    assert (r.pairs, r.identical) == (78, 78)
    assert r.unpaired.hit_only == 0 and r.unpaired.cold_only == r.unpaired.skipped_by_hit == 58
    assert r.to_text().splitlines()[0] == "SAME: no divergence beyond tolerance in 78 pairs"
    assert r.policy.startswith("dtype defaults")


CASES = {
    # fault -> (root key, diagnosis line, propagated: total, same request)
    "prev_block": (Fault("prev_block", 2, 1), (2, 80, 1, "gdn.ssm_state"),
                   "diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches the cold state "
                   "one block earlier (position 64, 16 tokens), bit for bit", 8, 8),
    "zero_conv": (Fault("zero_conv", 1, 0), (1, 48, 0, "gdn.conv_state"),
                  "diagnosis: request 1 layer 0 gdn.conv_state at position 48 is all zeros: "
                  "never written / zeroed", 26, 8),
    "swap_kv": (Fault("swap_kv", 2, 3), (2, 64, 3, "attn.k"),
                "diagnosis: request 2 layer 3 attn.k at position 64 matches the cold KV block "
                "one block later (position 80, 16 tokens), bit for bit: the block read as logical block 3 "
                "holds the cold run's block 4", 3, 3),
    "other_request": (Fault("other_request", 2, 1), (2, 80, 1, "gdn.ssm_state"),
                      "diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches request 3's "
                      "cold state at the same position, bit for bit", 8, 8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_planted_fault_root_diagnosis_and_propagation(tmp_path, colds, name):
    fault, key, diagnosis, propagated, same_request = CASES[name]
    r = compare(hit_trace(tmp_path, fault), colds["default"])
    assert r.exit_code == 1
    assert [d.key for d in r.roots] == [key]
    assert r.first.key == key and r.first.root
    assert r.diagnoses[0].text == diagnosis
    assert r.to_text().splitlines()[0] == diagnosis
    assert r.first.propagated == propagated == len(r.divergences) - 1
    assert r.first.propagated_same_request == same_request
    assert all(d.root_key == key for d in r.divergences[1:])


def test_report_fields_of_the_first_divergence(tmp_path, colds):
    r = compare(hit_trace(tmp_path, Fault("prev_block", 2, 1)), colds["default"])
    d = r.first
    assert (d.module, d.role_hit, d.role_cold, d.dtype, d.shape) == (
        "model.layers.1.linear_attn", "resumed", "checkpoint", "float32", (2, 64, 64))
    m = d.metrics
    assert m.n_beyond == m.numel == 8192
    assert len(m.worst_index) == 3 and m.worst_ulp > 0
    assert m.max_abs == pytest.approx(abs(m.hit_value - m.cold_value))
    assert d.tolerance.source == "dtype default float32"
    # the per-request table: request 2 collapsed after its second output token
    row = r.requests[2]
    assert (row.cached, row.outputs_equal, row.first_output_diff) == ((80, 0), False, 2)
    assert row.acceptance[0] == {"mean_acceptance_length": 1.0, "num_drafts": 4}
    text = r.to_text()
    assert "DIVERGED: first divergence at request 2, position 80, layer 1 (model.layers.1.linear_attn), " \
           "gdn.ssm_state" in text
    assert "  roles: hit resumed, cold checkpoint; float32 (2, 64, 64)" in text


def test_nan_in_one_state_is_reported_with_its_first_index(tmp_path, colds):
    r = compare(hit_trace(tmp_path, Fault("nan", 1, 2)), colds["default"])
    assert r.exit_code == 1
    d = r.first
    assert d.key == (1, 48, 2, "gdn.ssm_state") and d.reason == "NaN/Inf on one side only"
    assert (d.metrics.n_nonfinite, d.metrics.first_nonfinite) == (1, NAN_INDEX)
    assert np.isnan(d.metrics.nonfinite_hit)
    assert f"NaN/Inf on one side only: 1 element(s), first at index {NAN_INDEX}: hit nan" in r.to_text()
    # request 2 resumes from request 1's corrupted blocks: propagated, not a second root
    assert len(r.roots) == 1 and d.propagated == 26 and d.propagated_same_request == 8
    later = [x for x in r.divergences if x.request == 2]
    assert later[0].via == "prefix cache from request 1"


def test_bf16_rounded_state_in_exact_mode(tmp_path, colds):
    r = compare(hit_trace(tmp_path, Fault("bf16", 2, 1), replay="exact"), colds["exact"])
    assert r.exit_code == 1 and r.policy == "exact: bit identity (both traces replay=exact)"
    d = r.first
    assert d.key == (2, 80, 1, "gdn.ssm_state") and d.tolerance.exact
    assert d.metrics.worst_ulp > 0 and d.metrics.max_ulp <= 1 << 15  # rounding moves < half a bf16 ULP
    assert r.diagnoses[0].text == ("diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches "
                                   "the cold state rounded to bfloat16")
    assert f"{d.metrics.worst_ulp} ULP" in r.to_text()


def test_two_independent_faults_are_two_roots(tmp_path, colds):
    r = compare(hit_trace(tmp_path, Fault("prev_block", 2, 1), Fault("zero_conv", 3, 0)), colds["default"])
    assert [d.key for d in r.roots] == [(2, 80, 1, "gdn.ssm_state"), (3, 48, 0, "gdn.conv_state")]
    assert [d.propagated for d in r.roots] == [8, 16]
    assert [g.finding for g in r.diagnoses] == ["other_position", "zeros"]
    assert "root 2 of 2: request 3, position 48, layer 0" in r.to_text()


def test_json_carries_the_same_root(tmp_path, colds):
    r = compare(hit_trace(tmp_path, Fault("swap_kv", 2, 3)), colds["default"])
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))
    assert doc["exit_code"] == 1 and doc["verdict"] == "diverged"
    first = doc["first"]
    assert [first[k] for k in ("request", "position", "layer", "kind")] == [2, 64, 3, "attn.k"]
    assert doc["roots"][0]["metrics"]["worst_index"] == list(r.first.metrics.worst_index)
    assert doc["diagnosis"]["text"] == CASES["swap_kv"][2]
    assert doc["diagnosis"]["offset_tokens"] == 16
    assert doc["next"][0]["root_key"] == [2, 64, 3, "attn.k"]


# -- noise floor ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def noise_file(tmp_path_factory, colds):
    d = tmp_path_factory.mktemp("noise")
    other = write_trace(d / "cold-b.h5", "cold", noise_seed=1)
    result = calibrate(colds["default"], other, d / "noise.json")
    assert result.out == str(d / "noise.json")
    return d / "noise.json"


def test_calibrated_envelopes(noise_file):
    model = load_noise(noise_file)
    assert sorted(model.envelopes) == [(0, "gdn.conv_state"), (0, "gdn.ssm_state"), (1, "gdn.conv_state"),
                                       (1, "gdn.ssm_state"), (2, "gdn.conv_state"), (2, "gdn.ssm_state"),
                                       (3, "attn.k"), (3, "attn.v")]
    k = model.envelopes[(3, "attn.k")]
    assert 0.04 < k.max_abs < 0.06 and k.pairs == 17  # the planted +-0.05 on K, over the 17 cold K blocks
    assert model.envelopes[(1, "gdn.ssm_state")].max_ulp == 4


def test_benign_noise_passes_with_the_noise_file_and_fails_without(tmp_path, colds, noise_file):
    hit = hit_trace(tmp_path, noise_seed=2)
    r = compare(hit, colds["default"], noise=noise_file)
    assert r.exit_code == 0, r.to_text()
    assert r.policy.startswith(f"noise file {noise_file} (allowed: 4 x the calibrated max abs error")
    without = compare(hit, colds["default"])
    # the planted +-0.05 on K is 14-15u of relative L2 error: between the default-replay noise
    # model's bands (band.py), so it cannot be judged without the noise file: exit 2, no root
    assert (without.exit_code, without.verdict, without.divergences) == (2, "cannot-judge", [])
    assert {u[3] for u in without.band.unsure} == {"attn.k"}
    assert without.to_text().startswith("CANNOT JUDGE: ")
    # a rule relaxing K alone also accepts it
    assert compare(hit, colds["default"], tol=["attn.k=0.1,0"]).exit_code == 0


def test_same_noise_in_exact_mode_is_a_divergence(tmp_path, colds, noise_file):
    hit = hit_trace(tmp_path, noise_seed=2, replay="exact")  # noise from request 1, the first hit, on
    r = compare(hit, colds["exact"])
    assert r.exit_code == 1 and r.first.key == (1, 32, 3, "attn.k") and r.first.tolerance.exact
    conv = next(d for d in r.divergences if d.key == (1, 48, 0, "gdn.conv_state"))
    assert conv.tolerance.exact and conv.metrics.worst_ulp == 1


def test_difference_before_any_cache_hit_means_the_runs_are_not_comparable(tmp_path, colds):
    """Request 0 had no cache hit in either run: both computed it from scratch, so a difference
    there is a scheduling/config mismatch, not a restore bug (exit 2, one line)."""
    hit = hit_trace(tmp_path, noise_seed=2, noise_from=0, replay="exact")
    with pytest.raises(NotComparableError) as err:
        compare(hit, colds["exact"])
    msg = str(err.value)
    assert msg.startswith("runs not comparable: request 0 differs at position 16, layer 0, gdn.conv_state, "
                          "but no request up to it resumed from a prefix-cache hit (num_cached_tokens 0)")
    assert "\n" not in msg
    # another engine on purpose: the refusal is lifted, the difference is a root again
    r = compare(hit, colds["exact"], allow_engine_mismatch=True)
    assert r.exit_code == 1 and r.first.key == (0, 16, 0, "gdn.conv_state") and r.first.root


def test_noise_file_refused_in_exact_mode_unless_allowed(tmp_path, colds, noise_file):
    hit = hit_trace(tmp_path, noise_seed=2, replay="exact")
    with pytest.raises(StatediffError, match="both traces replayed exactly.*--allow-noise-in-exact"):
        compare(hit, colds["exact"], noise=noise_file)
    r = compare(hit, colds["exact"], noise=noise_file, allow_noise_in_exact=True)
    assert r.exit_code == 0 and r.policy.startswith(f"noise file {noise_file}")
    # without the override, a noise file from another replay mode is refused too
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact")
    with open_trace(cold) as t, pytest.raises(MismatchError, match="calibrated on traces with replay='default'"):
        load_noise(noise_file).check_matches(t)


def test_fault_beyond_noise_is_reported_as_a_multiple_of_the_floor(tmp_path, colds, noise_file):
    r = compare(hit_trace(tmp_path, Fault("prev_block", 2, 1), noise_seed=2), colds["default"], noise=noise_file)
    assert r.exit_code == 1 and r.first.key == (2, 80, 1, "gdn.ssm_state")
    assert r.first.noise_multiple > 1000
    assert "x the noise floor" in r.to_text()


# -- refusals ------------------------------------------------------------------------

def test_different_model_is_refused_unless_allowed(tmp_path, colds):
    hit = hit_trace(tmp_path, config_digest="deadbeef")
    with pytest.raises(MismatchError, match=r"traces differ in config_digest \(hit 'deadbeef', cold 'c0ffee'\)"):
        compare(hit, colds["default"])
    r = compare(hit, colds["default"], allow_engine_mismatch=True)
    assert r.exit_code == 0
    assert r.warnings == ["engine mismatch allowed: config_digest differs (hit 'deadbeef', cold 'c0ffee')"]


def test_replay_mode_mismatch_is_refused(tmp_path, colds):
    with pytest.raises(MismatchError, match="replayed differently"):
        compare(hit_trace(tmp_path), colds["exact"])


def test_swapped_arguments_are_refused(tmp_path, colds):
    with pytest.raises(MismatchError, match="arguments look swapped"):
        compare(colds["default"], hit_trace(tmp_path))


def test_unpaired_tensors_are_listed(tmp_path, colds):
    from statediff.trace.writer import TraceWriter
    from synth import run_meta

    w = TraceWriter(tmp_path / "h.h5", run_meta("hit"))
    w.add(np.zeros(4, np.float32), request=9, position=16, layer=0, kind="hidden", role="activation",
          module="model.norm", dtype="float32")
    w.close()
    r = compare(tmp_path / "h.h5", colds["default"])
    assert r.exit_code == 0 and r.pairs == 0
    assert r.unpaired.hit_only == 1 and r.unpaired.cold_only == 136 and r.unpaired.skipped_by_hit == 0
    assert r.unpaired.first_hit_only == ["request 9 position 16 layer 0 (model.norm) hidden [activation]"]
    assert len(r.unpaired.first_cold_only) == 5


def test_layout_mismatch_is_a_divergence_without_metrics(tmp_path):
    from statediff.trace.writer import TraceWriter
    from synth import run_meta

    for mode, shape in (("hit", (2, 3)), ("cold", (2, 4))):
        w = TraceWriter(tmp_path / f"{mode}.h5", run_meta(mode))
        w.add(np.zeros(shape, np.float32), request=0, position=16, layer=1, kind="gdn.ssm_state",
              role="checkpoint", module="m", dtype="float32")
        w.close()
    r = compare(tmp_path / "hit.h5", tmp_path / "cold.h5")
    assert r.exit_code == 1 and r.first.reason == "dtype/shape differ" and r.first.metrics is None
    assert "  dtype/shape differ: hit float32 (2, 3), cold float32 (2, 4)" in r.to_text()
    assert r.diagnoses == []


# -- --first: stop at the first divergence -------------------------------------------

def test_first_stops_at_the_root_a_full_compare_names(tmp_path, colds):
    from click.testing import CliRunner

    from statediff.cli import cli

    hit = hit_trace(tmp_path, Fault("prev_block", 2, 1), Fault("zero_conv", 3, 0))
    full = compare(hit, colds["default"])
    fast = compare(hit, colds["default"], stop_at_first=True)
    assert [d.key for d in full.roots] == [(2, 80, 1, "gdn.ssm_state"), (3, 48, 0, "gdn.conv_state")]
    assert [d.key for d in fast.divergences] == [d.key for d in fast.roots] == [(2, 80, 1, "gdn.ssm_state")]
    assert fast.exit_code == 1 and fast.first.root and fast.first.propagated == 0
    assert fast.diagnoses[0].text == full.diagnoses[0].text == CASES["prev_block"][2]
    # judged: request 0 (16 pairs), request 1 (18), request 2 up to the root (6) of 78
    assert (fast.stopped_early, fast.stopped_after, fast.pairs) == (True, 40, 78)
    assert not full.stopped_early and full.first.propagated == 8
    text = fast.to_text().splitlines()
    assert text[:2] == full.to_text().splitlines()[:2]  # diagnosis, then "DIVERGED: first divergence at ..."
    assert text[5] == ("aligned by (request, position, layer, kind): 78 pairs; stopped early at the first "
                       "divergence (--first) after judging 40 (39 bit-identical, 1 read in full): later "
                       "divergences, propagated ones included, were not counted")
    assert "  propagated from it: not counted (stopped early at the first divergence)" in text
    assert "first root (--first: later ones not searched): request 2, position 80, layer 1 " \
           "(model.layers.1.linear_attn), gdn.ssm_state" in text

    r = CliRunner().invoke(cli, ["compare", "--json", "--first", str(hit), str(colds["default"])])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert (doc["stopped_early"], doc["judged"], doc["divergent"]) == (True, 40, 1)
    assert [doc["first"][k] for k in ("request", "position", "layer", "kind")] == [2, 80, 1, "gdn.ssm_state"]
    doc_full = json.loads(CliRunner().invoke(cli, ["compare", "--json", str(hit), str(colds["default"])]).stdout)
    assert (doc_full["stopped_early"], doc_full["judged"], doc_full["divergent"]) == (False, 78, 26)
    assert doc_full["roots"][0] | {"propagated": 0, "propagated_same_request": 0} == doc["roots"][0]


def test_first_on_a_clean_pair_judges_everything(tmp_path, colds):
    r = compare(hit_trace(tmp_path), colds["default"], stop_at_first=True)
    assert (r.exit_code, r.stopped_early, r.stopped_after, r.identical) == (0, False, None, 78)
