"""Acceptance as evidence (``statediff.trace.acceptance``): a hit request whose drafter acceptance
falls against its cold twin, or against the run's requests without a hit, is a finding in
``compare`` even when every captured tensor and output is equal (issue 34, vLLM #47930)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.trace.acceptance import RequestAcceptance, acceptance_findings, per_request, within_run_findings

from synth import write_trace


def _acc(drafts, drafted, accepted):
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def _req(hit, acc):
    return {"num_cached_tokens": hit, "acceptance": acc}


def test_per_request_reads_vllms_counters_and_skips_requests_without_them():
    got = per_request({0: _req(0, _acc(7, 21, 11)), 1: _req(96, None), 2: _req(0, {"mean_acceptance_length": 2})})
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
    assert acceptance_findings({1: _req(96, _acc(7, 21, 11))}, cold) == ()  # 72% -> 52%: under MIN_DROP
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
