"""``compare`` of traces recorded on two engine versions (synthetic traces): "runs not comparable"
(exit 2, one line naming both versions) unless ``--allow-engine-mismatch``; with it, judged by
tolerance, both versions named in the text and JSON reports."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.errors import NotComparableError
from synth import write_trace

REFUSAL = ("runs not comparable: the hit trace was recorded on synthetic 0.29.0, the cold trace on synthetic "
           "0.30.0 (--allow-engine-mismatch compares them by tolerance)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("versions")
    return {"hit": write_trace(d / "hit.h5", "hit", replay="exact", engine_version="0.29.0"),
            "hit-noisy": write_trace(d / "hit-noisy.h5", "hit", replay="exact", noise_seed=2,
                                     engine_version="0.29.0"),
            "cold": write_trace(d / "cold.h5", "cold", replay="exact", engine_version="0.30.0"),
            "cold-same": write_trace(d / "cold-same.h5", "cold", replay="exact", engine_version="0.29.0")}


def test_two_engine_versions_are_not_comparable_without_the_flag(pair):
    with pytest.raises(NotComparableError) as e:
        compare(pair["hit"], pair["cold"])
    assert str(e.value) == REFUSAL
    r = CliRunner().invoke(cli, ["compare", str(pair["hit"]), str(pair["cold"])])
    assert r.exit_code == 2 and r.stderr.splitlines() == [f"statediff: error: {REFUSAL}"]


def test_with_the_flag_they_are_judged_by_tolerance_and_both_versions_are_named(pair):
    # benign noise from request 1 on: bit identity would not hold across versions; tolerance judges it
    r = compare(pair["hit-noisy"], pair["cold"], allow_engine_mismatch=True)
    assert r.policy.startswith("dtype defaults") and not r.bit_identity
    assert r.exit_code == 1 and r.first.key == (1, 32, 3, "attn.k")  # beyond bfloat16's atol 0.01
    assert not r.first.tolerance.exact and r.first.tolerance.atol == 0.01
    warning = ("engine versions differ: the hit trace was recorded on synthetic 0.29.0, the cold trace on "
               "synthetic 0.30.0; judged by tolerance, not bit identity")
    assert warning in r.warnings
    text = r.to_text()
    assert f"warning: {warning}" in text
    assert "engine=synthetic 0.29.0" in text and "engine=synthetic 0.30.0" in text
    loose = ["--tol", "*=0.2,0.2"]
    out = CliRunner().invoke(cli, ["compare", str(pair["hit-noisy"]), str(pair["cold"]), "--json",
                                   "--allow-engine-mismatch", *loose])
    assert out.exit_code == 0
    rep = json.loads(out.stdout)
    assert (rep["hit"]["engine_version"], rep["cold"]["engine_version"]) == ("0.29.0", "0.30.0")
    assert warning in rep["warnings"] and rep["divergent"] == 0


def test_the_same_version_stays_judged_bit_for_bit(pair):
    r = compare(pair["hit-noisy"], pair["cold-same"])
    assert r.exit_code == 1 and r.bit_identity and r.first.tolerance.exact
    assert compare(pair["hit"], pair["cold-same"]).exit_code == 0


def test_a_version_known_on_one_side_only_is_not_a_refusal(tmp_path, pair):
    unknown = write_trace(tmp_path / "cold.h5", "cold", replay="exact", engine_version=None)
    r = compare(pair["hit"], unknown)
    assert r.exit_code == 0 and r.policy.startswith("exact: bit identity")


def test_two_model_runners_are_flagged_like_two_versions(tmp_path):
    """vLLM's V1 and V2 model runners run different kernels: a pair recorded on both is not comparable
    bit for bit; with the flag it is judged by tolerance and both runners are named."""
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact", engine_version="0.32.0", model_runner="v1")
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", engine_version="0.32.0", model_runner="v2")
    with pytest.raises(NotComparableError) as e:
        compare(hit, cold)
    assert str(e.value) == (
        "runs not comparable: the hit trace was recorded on synthetic 0.32.0 (model runner v1), the cold trace "
        "on synthetic 0.32.0 (model runner v2) (--allow-engine-mismatch compares them by tolerance)")
    r = compare(hit, cold, allow_engine_mismatch=True)
    assert not r.bit_identity and r.exit_code == 0
    assert ("engine versions differ: the hit trace was recorded on synthetic 0.32.0 (model runner v1), the cold "
            "trace on synthetic 0.32.0 (model runner v2); judged by tolerance, not bit identity") in r.warnings
    same = write_trace(tmp_path / "cold2.h5", "cold", replay="exact", engine_version="0.32.0", model_runner="v1")
    assert compare(hit, same).bit_identity
