"""Acceptance as evidence (``statediff.trace.acceptance``): a hit request whose drafter acceptance
falls against its cold twin, or against the run's requests without a hit, is a finding in
``compare`` even when every captured tensor and output is equal (issue 34, vLLM #47930)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.compare import compare
import pytest

from statediff.trace.acceptance import (RequestAcceptance, acceptance_findings, fall_p_value, per_request,
                                      within_run_findings)

from synth import write_trace


def _acc(drafts, drafted, accepted):
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def _req(hit, acc):
    return {"num_cached_tokens": hit, "acceptance": acc}


def test_per_request_reads_vllms_counters_and_skips_requests_without_them():
    got = per_request({0: _req(0, _acc(7, 21, 11)), 1: _req(96, None), 2: _req(0, {"mean_acceptance_length": 2}),
                       3: _req(0, _acc(2, 6, 10))})  # 3: more accepted than drafted, a broken record
    assert got == {0: RequestAcceptance(7, 21, 11)}
    assert got[0].text() == "11 of 21 drafted tokens accepted (52%), mean acceptance length 2.57"


def test_a_hit_request_whose_acceptance_collapses_is_named_against_its_cold_twin():
    hit = {0: _req(0, _acc(5, 15, 12)), 1: _req(96, _acc(16, 48, 0)), 2: _req(192, _acc(6, 18, 13))}
    cold = {0: _req(0, _acc(5, 15, 12)), 1: _req(0, _acc(6, 18, 13)), 2: _req(0, _acc(6, 18, 14))}
    (f,) = acceptance_findings(hit, cold)
    assert (f.request, f.hit_tokens, f.against) == (1, 96, "its cold twin")
    assert f.text() == ("request 1 (prefix-cache hit of 96 tokens): acceptance falls to 0 of 48 drafted tokens "
                        "accepted (0%), mean acceptance length 1.00, against 13 of 18 drafted tokens accepted "
                        "(72%), mean acceptance length 3.17 in its cold twin")


def test_small_or_noisy_drops_and_too_few_drafts_are_not_findings():
    cold = {1: _req(0, _acc(6, 18, 13))}
    assert acceptance_findings({1: _req(96, _acc(7, 21, 11))}, cold) == ()  # 72% -> 52%: p 0.17, chance explains it
    assert acceptance_findings({1: _req(96, _acc(1, 3, 0))}, cold) == ()  # 3 drafted: too few to judge
    assert acceptance_findings({1: _req(0, _acc(16, 48, 0))}, cold) == ()  # no hit: not this finding


def test_within_one_run_the_baseline_is_the_requests_without_a_hit():
    reqs = {0: _req(0, _acc(5, 15, 12)), 1: _req(96, _acc(16, 48, 2)), 2: _req(0, _acc(6, 18, 13))}
    (f,) = within_run_findings(reqs)
    assert (f.request, f.baseline, f.against) == (1, RequestAcceptance(11, 33, 25), "the run's requests without a hit")
    assert within_run_findings({1: reqs[1]}) == ()  # no request without a hit: nothing to compare


def test_compare_says_diverged_on_acceptance_alone(tmp_path):
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact", requests={2: {"acceptance": _acc(16, 48, 1)}})
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", requests={2: {"acceptance": _acc(6, 18, 13)}})
    r = compare(hit, cold)
    assert (r.cause, r.exit_code, [a.request for a in r.acceptance]) == ("acceptance", 1, [2])
    assert r.headline().startswith("DIVERGED: the drafter's acceptance falls after a prefix-cache hit at request 2 (")
    res = CliRunner().invoke(cli, ["compare", str(hit), str(cold), "--json"])
    doc = json.loads(res.stdout)
    assert (res.exit_code, doc["cause"], doc["acceptance"][0]["hit"]["accepted"]) == (1, "acceptance", 1)


def test_a_collapse_to_nothing_from_a_low_rate_is_a_finding():
    """Request 1 of the DFlash pair measured in issue 34: 0 of 33 against its cold twin's 4 of 21 (19 points
    absolute, under the former 25-point threshold; p 0.019). 2 of 33 against 4 of 21 is within chance."""
    cold = {1: _req(0, _acc(7, 21, 4))}
    (f,) = acceptance_findings({1: _req(96, _acc(11, 33, 0))}, cold)
    assert f.hit.mean_length == 1.0 and f.against == "its cold twin"
    assert acceptance_findings({1: _req(96, _acc(11, 33, 2))}, cold) == ()


@pytest.mark.parametrize("hit, base, p", [
    ((11, 33, 0), (7, 21, 4), 5985 / 316251),  # C(21,4) / C(54,4): all 4 acceptances on the cold side
    ((7, 21, 11), (6, 18, 13), 0.17400),
    ((16, 48, 48), (6, 18, 0), 1.0),  # a rise: nothing fell
    ((0, 0, 0), (6, 18, 13), 1.0),  # no drafts on one side
])
def test_fall_p_value_is_fishers_exact_one_sided(hit, base, p):
    assert fall_p_value(RequestAcceptance(*hit), RequestAcceptance(*base)) == pytest.approx(p, abs=5e-6)


def test_fall_p_value_of_long_runs_stays_finite():
    # 40,000 drafted tokens a side: binomial coefficients far beyond a float's range
    got = fall_p_value(RequestAcceptance(10_000, 40_000, 19_000), RequestAcceptance(10_000, 40_000, 20_000))
    assert 0 < got < 1e-10
    assert fall_p_value(RequestAcceptance(10_000, 40_000, 20_000), RequestAcceptance(10_000, 40_000, 20_000)) > 0.5
