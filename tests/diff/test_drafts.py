"""Drafts as outputs of an exact replay (synthetic traces): draft ids or acceptance that differ while
the sampled tokens agree are DIVERGED ("drafts differ at request R, step S"), never SAME."""

from __future__ import annotations

import json

from click.testing import CliRunner

from statediff.cli import cli
from statediff.diff.align import Pair
from statediff.diff.compare import compare
from statediff.diff.drafts import DraftDiff, first_draft_diff
from synth import write_trace

STEPS = {2: [[40, [5, 9, 9], 2], [43, [11, 12, 13], 3]], 3: [[60, [1, 2, 3], 0]]}


def _steps(**changes):
    """STEPS with ``changes`` ({request: {step: entry}}) applied, as request-record overrides."""
    out = {r: {"spec_steps": [list(s) for s in steps]} for r, steps in STEPS.items()}
    for r, by_step in changes.items():
        for i, entry in by_step.items():
            out[int(r)]["spec_steps"][i] = entry
    return out


def test_same_drafts_are_the_same(tmp_path):
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact", requests=_steps())
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", requests=_steps())
    r = compare(hit, cold)
    assert r.exit_code == 0 and r.draft_diff is None and r.cause is None


def test_other_draft_ids_at_one_step_diverge_with_the_step_named(tmp_path):
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact", requests=_steps(**{"2": {1: [43, [11, 12, 7], 2]}}))
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", requests=_steps())
    r = compare(hit, cold)
    assert r.divergences == [] and r.output_diff is None  # no tensor, no sampled token differs
    assert r.exit_code == 1 and r.cause == "drafts"
    assert r.draft_diff == DraftDiff(2, 1, 43, ((11, 12, 7), 2), ((11, 12, 13), 3))
    assert r.headline() == ("DIVERGED: drafts differ at request 2, step 1 (position 43): hit drafted [11, 12, 7], "
                            "2 accepted; cold drafted [11, 12, 13], 3 accepted, while the sampled tokens agree "
                            "(exact replay: the drafter saw other inputs or state)")
    out = CliRunner().invoke(cli, ["compare", str(hit), str(cold), "--json"])
    assert out.exit_code == 1
    rep = json.loads(out.stdout)
    assert (rep["verdict"], rep["cause"]) == ("diverged", "drafts")
    assert rep["draft_diff"]["hit"] == {"drafts": [11, 12, 7], "accepted": 2}


def test_acceptance_alone_and_a_missing_step_are_differences_too():
    same = [[40, [5, 9, 9], 2]]
    recs = Pair({"spec_steps": same}, {"spec_steps": [[40, [5, 9, 9], 1]]})
    assert first_draft_diff(recs, 0) == DraftDiff(0, 0, 40, ((5, 9, 9), 2), ((5, 9, 9), 1))
    recs = Pair({"spec_steps": same + [[43, [1], 0]]}, {"spec_steps": same})
    assert first_draft_diff(recs, 4) == DraftDiff(4, 1, 43, ((1,), 0), None)
    assert "cold has no such step" in first_draft_diff(recs, 4).text()
    # ... unless a run stopped early (it has fewer steps for that reason)
    assert first_draft_diff(Pair({"spec_steps": same + [[43, [1], 0]]}, {"spec_steps": same, "finished": False}),
                            4) is None
    # placeholders (async scheduling) are judged by position and acceptance only
    assert first_draft_diff(Pair({"spec_steps": [[40, None, 2]]}, {"spec_steps": same}), 0) is None
    assert first_draft_diff(Pair({"spec_steps": same}, {}), 0) is None  # not recorded on one side


def test_drafts_are_not_judged_in_default_replay_or_when_outputs_differ(tmp_path):
    changed = _steps(**{"3": {0: [60, [1, 2, 4], 0]}})
    hit = write_trace(tmp_path / "hit.h5", "hit", requests=changed)
    cold = write_trace(tmp_path / "cold.h5", "cold", requests=_steps())
    assert compare(hit, cold).exit_code == 0  # default replay: rounding may change drafts
    tokens = dict(changed)
    tokens[3] = dict(changed[3], output_token_ids=[1, 2, 3])
    hit = write_trace(tmp_path / "hit2.h5", "hit", replay="exact", requests=tokens)
    cold = write_trace(tmp_path / "cold2.h5", "cold", replay="exact", requests=_steps())
    r = compare(hit, cold)
    assert r.cause == "outputs" and r.draft_diff is None


def test_drafts_of_a_discarded_drafter_call_are_judged_by_position(tmp_path):
    """``draft_calls`` (every drafter call, also on a non-final prefill chunk whose drafts the scheduler
    discards): paired by position; the cold run's calls inside the hit's cached prefix are not judged."""
    from statediff.diff.drafts import first_call_diff, first_drafts_diff

    cold_calls = [[32, [4, 4, 4], True], [64, [7, 8, 9], True], [96, [1, 2, 3], True], [110, [5, 9, 9], False]]
    hit_calls = [[96, [1, 2, 6], True], [110, [5, 9, 9], False]]  # resumed from 64 tokens: no calls before
    recs = Pair({"draft_calls": hit_calls}, {"draft_calls": cold_calls})
    want = DraftDiff(2, 0, 96, ((1, 2, 6), 0), ((1, 2, 3), 0), call="discarded")
    assert first_call_diff(recs, 2) == want
    assert want.text() == ("request 2, drafter call at position 96 (drafts discarded by the scheduler: a prefill "
                           "chunk): hit drafted [1, 2, 6]; cold drafted [1, 2, 3]")
    assert first_call_diff(Pair({"draft_calls": hit_calls[1:]}, {"draft_calls": cold_calls}), 2) is None
    assert first_call_diff(Pair({"draft_calls": hit_calls}, {}), 2) is None  # not recorded (older traces)
    # the earlier of a call and a verification step
    steps = {"spec_steps": [[111, [5, 9, 9], 2]]}
    both = Pair({**steps, "draft_calls": hit_calls}, {"spec_steps": [[111, [5, 9, 1], 2]], "draft_calls": cold_calls})
    assert first_drafts_diff(both, 2) == want
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact", requests={2: {"draft_calls": hit_calls}})
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact", requests={2: {"draft_calls": cold_calls}})
    r = compare(hit, cold)
    assert (r.exit_code, r.cause, r.draft_diff) == (1, "drafts", want)
    assert r.headline().startswith("DIVERGED: drafts differ at request 2, drafter call at position 96 (drafts "
                                   "discarded by the scheduler: a prefill chunk)")
