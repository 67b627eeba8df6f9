"""The default-replay noise model (statediff/diff/band.py, issue 19): a state's relative L2 error
<= 8u is rounding noise of differently chunked runs, > 16u a divergence, in between it cannot be
judged (exit 2, with the commands that make it judgeable); outputs that part at a near-tie are
reported, not a divergence. Synthetic traces (tests/synth.py) with an exactly planted error."""

from __future__ import annotations

import json

import pytest

from statediff.diff.band import NOISE_MAX, ROOT_MIN, U, band
from statediff.diff.compare import compare
from synth import write_trace

KEY = (1, 48, 1, "gdn.ssm_state")  # request 1's resumed SSM state (float32), at its cache hit


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    return write_trace(tmp_path_factory.mktemp("band") / "cold.h5", "cold")


def test_the_band_edges():
    assert (U, NOISE_MAX, ROOT_MIN) == (2 ** -8, 8 * 2 ** -8, 16 * 2 ** -8)
    assert [band(x) for x in (0.0, 4.46 * U, NOISE_MAX, NOISE_MAX * 1.0001, ROOT_MIN, ROOT_MIN * 1.0001)] == [
        "noise", "noise", "noise", "unsure", "unsure", "beyond"]
    assert band(None) == band(float("nan")) == "beyond"
    # an estimate's interval: noise only when all of it is within 8u, beyond only when all of it exceeds 16u
    assert [band(2 * U, 7 * U), band(2 * U, 9 * U), band(17 * U, 40 * U), band(15 * U, 40 * U)] == [
        "noise", "unsure", "beyond", "unsure"]


@pytest.mark.parametrize("replay", ["default", "exact"])
@pytest.mark.parametrize("units,verdict,code", [(7, "same", 0), (12, "cannot-judge", 2), (20, "diverged", 1)])
def test_a_planted_relative_error_lands_in_its_band(tmp_path, cold, replay, units, verdict, code):
    cold_path = cold if replay == "default" else write_trace(tmp_path / "cold-exact.h5", "cold", replay="exact")
    hit = write_trace(tmp_path / "hit.h5", "hit", replay=replay, scale={KEY: units * U})
    r = compare(hit, cold_path)
    if replay == "exact":  # bit identity: any differing bit is a divergence, whatever its size
        assert (r.verdict, r.exit_code, r.first.key) == ("diverged", 1, KEY)
        assert not r.band.active
        return
    assert (r.verdict, r.exit_code) == (verdict, code)
    assert r.band.active
    if verdict == "same":
        assert (r.band.noise, r.band.unsure, r.divergences) == (1, (), [])
        assert r.to_text().splitlines()[0] == "SAME: no divergence beyond tolerance in 78 pairs"
        assert ("default-replay noise model (relative L2 error <= 0.03125 = 8u is rounding noise, > 0.0625 = 16u "
                "a divergence, u = 2^-8): 1 pair within the noise") in r.to_text()
    elif verdict == "cannot-judge":
        assert r.divergences == [] and [u[:4] for u in r.band.unsure] == [KEY]
        assert r.band.unsure[0][4] == pytest.approx(12 * U, rel=1e-5)
        assert r.to_text().splitlines()[0] == (
            "CANNOT JUDGE: 1 pair differs by more than rounding noise of differently chunked runs and less than "
            "a fault stands out (default replay); make them judgeable: 'statediff check CONVERSATION --model M "
            "-o DIR' (exact, split form), or 'statediff calibrate COLD_A COLD_B -o noise.json' then "
            "'statediff compare --noise noise.json'")
        assert r.to_json()["verdict"] == "cannot-judge" and r.to_json()["exit_code"] == 2
    else:
        assert r.first.key == KEY and r.first.metrics.rel_l2 == pytest.approx(20 * U, rel=1e-5)


def test_a_tol_rule_or_noise_file_replaces_the_band(tmp_path, cold):
    hit = write_trace(tmp_path / "hit.h5", "hit", scale={KEY: 7 * U})
    r = compare(hit, cold, tol=["gdn.ssm_state=1e-5,1e-4"])  # the user's rule: judged elementwise
    assert (r.verdict, r.first.key, r.band.noise) == ("diverged", KEY, 0)


def _outputs(tokens, logprobs, topk_ids, topk_lps):
    return {"output_token_ids": tokens, "output_logprobs": logprobs, "output_topk_ids": topk_ids,
            "output_topk_logprobs": topk_lps}


@pytest.mark.parametrize("gap,verdict,code", [(8e-5, "near-tie", 0), (0.049, "near-tie", 0), (0.2, "diverged", 1)])
def test_outputs_parting_at_a_near_tie_in_default_replay(tmp_path, cold, gap, verdict, code):
    """Request 0 (no hit in either run) samples the same; request 3's first output flips between two tokens
    the cold run ranks ``gap`` nats apart."""
    n = 8
    cold_out = _outputs([5] * n, [-1.0] * n, [[5, 9]] * n, [[-1.0, -1.0 - gap]] * n)
    hit_out = _outputs([9] + [5] * (n - 1), [-1.0] * n, [[9, 5]] + [[5, 9]] * (n - 1),
                       [[-1.0, -1.0 - gap]] * n)
    c = write_trace(tmp_path / "c.h5", "cold", requests={3: cold_out})
    h = write_trace(tmp_path / "h.h5", "hit", requests={3: hit_out})
    r = compare(h, c)
    assert (r.verdict, r.exit_code) == (verdict, code)
    if verdict == "near-tie":
        assert r.output_diff is None and [d.request for d in r.near_ties] == [3]
        assert r.to_text().splitlines()[0].startswith(
            "NEAR-TIE: no divergence beyond tolerance in ")
        assert "the outputs part at a near-tie at request 3, output 0" in r.to_text().splitlines()[0]
        assert r.to_json()["near_ties"][0]["near_tie"] is True
    else:
        assert r.output_diff.request == 3 and not r.output_diff.near_tie


def test_a_near_tie_in_exact_replay_is_a_divergence(tmp_path):
    n = 8
    c = write_trace(tmp_path / "c.h5", "cold", replay="exact",
                    requests={3: _outputs([5] * n, [-1.0] * n, [[5, 9]] * n, [[-1.0, -1.0001]] * n)})
    h = write_trace(tmp_path / "h.h5", "hit", replay="exact",
                    requests={3: _outputs([9] + [5] * (n - 1), [-1.0] * n, [[9, 5]] + [[5, 9]] * (n - 1),
                                          [[-1.0, -1.0001]] * n)})
    r = compare(h, c)
    assert (r.verdict, r.exit_code, r.near_ties) == ("diverged", 1, ())


def test_pairs_no_tol_rule_matched_are_judged_by_the_named_default(tmp_path, cold):
    """A --tol rule for some tensors: the rest are judged by the policy's default (here the dtype default with
    the noise model), counted and named in the text and JSON; the band still judges them (12u: cannot judge)."""
    hit = write_trace(tmp_path / "hit.h5", "hit", scale={KEY: 12 * U})
    r = compare(hit, cold, tol=["attn.*=0,0"])
    assert (r.verdict, r.exit_code, [u[:4] for u in r.band.unsure]) == ("cannot-judge", 2, [KEY])
    assert ("tolerance default: 54 of 78 judged pairs matched no --tol rule: 54 by the dtype default, then the "
            "default-replay noise model (relative L2 error: <= 8u noise, > 16u divergence, between: cannot judge)"
            ) in r.to_text().splitlines()
    assert r.to_json()["tolerances"] | {"default_text": ""} == {
        "kinds": {"user_rule": 24, "replay_band": 54}, "default": "replay_band", "default_text": "", "by_default": 54}


def test_cannot_judge_and_an_error_are_told_apart_in_json(tmp_path, cold):
    """Both exit 2: a CANNOT JUDGE verdict prints its JSON object (verdict "cannot-judge"); an error prints no
    JSON, one line on stderr."""
    from click.testing import CliRunner

    from statediff.cli import cli

    hit = write_trace(tmp_path / "hit.h5", "hit", scale={KEY: 12 * U})
    verdict = CliRunner().invoke(cli, ["compare", "--json", str(hit), str(cold)])
    data = json.loads(verdict.stdout)
    assert (verdict.exit_code, data["exit_code"], data["verdict"]) == (2, 2, "cannot-judge")
    report = CliRunner().invoke(cli, ["report", "--json", str(hit), str(cold)])
    assert (report.exit_code, json.loads(report.stdout)["verdict"]) == (2, "cannot-judge")
    error = CliRunner().invoke(cli, ["compare", "--json", str(hit), str(tmp_path / "missing.h5")])
    assert (error.exit_code, error.stdout) == (2, "")
    assert error.stderr.startswith("statediff: error: ")
