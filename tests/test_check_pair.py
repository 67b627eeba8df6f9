"""``statediff.check_pair``: one way from two traces to a verdict (the hit trace's audit, the comparison,
the record), its title and exit code decided once; what ``statediff check`` calls after recording."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import statediff
from audit_synth import write_cold_run, write_hit_run
from statediff.diff.pair import CompareOptions
from statediff.incident.record import exit_code
from statediff.verdict import PairVerdict, check_pair

TRACES = Path(__file__).resolve().parents[1] / "traces"
ROOT = "request 1, position 448, layer 2 (model.layers.2.linear_attn), gdn.ssm_state"


def test_the_package_exports_it():
    assert (statediff.check_pair, statediff.PairVerdict) == (check_pair, PairVerdict)
    with pytest.raises(AttributeError):
        statediff.no_such_name  # noqa: B018


def test_a_fault_both_find_is_one_verdict_with_the_roots_title():
    v = check_pair(TRACES / "hit-ssm-bf16.h5", TRACES / "cold.h5")
    assert (v.exit_code, v.audit.exit_code, v.compare.exit_code, v.report.exit_code) == (1, 1, 1, 1)
    assert v.title == v.report.title == f"statediff: state diverges after a prefix-cache hit at {ROOT}"
    assert v.report.verdict == "diverged" and v.verdict_line() == ""
    files = v.files()
    assert sorted(files) == ["audit.json", "compare.json", "report.md"]
    assert json.loads(files["audit.json"])["first"]["layer"] == 2
    assert json.loads(files["compare.json"])["verdict"] == "diverged"
    assert files["report.md"].splitlines()[0] == f"# {v.title}"
    assert "## Audit of the hit run" in files["report.md"]
    text = v.to_text().splitlines()
    assert text[0] == ("audit of the hit run: RESTORE VIOLATION: first at request 1 position 448 layer 2 "
                       "(model.layers.2.linear_attn) gdn.ssm_state (1 finding(s))")
    assert text[1].startswith("  finding 1 (state): request 1 position 448 layer 2 ")
    assert f"DIVERGED: first divergence at {ROOT}" in text


def test_a_restore_violation_compare_cannot_see_makes_the_title_and_the_exit_code(tmp_path):
    hit, cold = write_hit_run(tmp_path / "hit.h5", "ssm-bf16"), write_cold_run(tmp_path / "cold.h5")
    v = check_pair(hit, cold)
    assert (v.exit_code, v.audit.exit_code, v.compare.exit_code) == (1, 1, 0)
    assert (v.report.exit_code, v.report.verdict) == (1, "restore-violation")
    assert v.title == (
        "statediff: the one-run audit of the cache-hit run found a restore violation (RESTORE VIOLATION: first at "
        "request 3 position 48 layer 0 (model.layers.0.linear_attn) gdn.ssm_state (1 finding(s))); compare finds "
        "no divergence from the cold run")
    assert v.to_text().splitlines()[-1] == (
        "check: RESTORE VIOLATION (exit 1): the audit above names it; compare's SAME says only that the hit and "
        "cold runs agree within tolerance")
    data = v.report.to_json()
    assert (data["verdict"], data["exit_code"], data["title"]) == ("restore-violation", 1, v.title)


def test_without_a_cold_trace_the_audit_decides_and_a_given_audit_is_not_redone(monkeypatch):
    alone = check_pair(TRACES / "hit-ssm-bf16.h5")
    assert (alone.compare, alone.report, alone.exit_code) == (None, None, 1)
    assert alone.title.startswith("statediff: the one-run audit of the cache-hit run: RESTORE VIOLATION: first at ")
    assert sorted(alone.files()) == ["audit.json"]

    def no_second_audit(path):
        raise AssertionError("audited twice")

    monkeypatch.setattr("statediff.audit.audit_trace", no_second_audit)
    v = check_pair(TRACES / "hit-ssm-bf16.h5", TRACES / "cold.h5", CompareOptions(), audit=alone.audit)
    assert v.audit is alone.audit and v.exit_code == 1


@pytest.mark.parametrize("compare_code,audit_code,code", [
    (0, 0, 0), (1, 0, 1), (0, 1, 1), (2, 0, 2), (0, 2, 2), (2, 1, 1), (1, 2, 1), (None, 2, 2), (None, 0, 0)])
def test_a_divergence_outranks_a_verdict_that_vouches_for_nothing(compare_code, audit_code, code):
    """1 when either finds a divergence; else 2 when either cannot vouch (CANNOT JUDGE, NOT CHECKED); else 0."""
    compare = None if compare_code is None else types.SimpleNamespace(exit_code=compare_code)
    assert exit_code(compare, types.SimpleNamespace(exit_code=audit_code)) == code


def test_an_audit_that_checked_nothing_is_named_in_the_title_and_exits_2():
    """A clean comparison with a NOT CHECKED audit: exit 2 (nothing vouched for the restores), said in the title."""
    from statediff.diff.pair import compare_pair
    from statediff.incident.record import build_report

    head = "NOT CHECKED: 2 hit(s) restored 16 tensor(s), none of them checkable"
    audit = types.SimpleNamespace(exit_code=2, headline=lambda: head, to_text=lambda **kw: head)
    report = build_report(compare_pair(TRACES / "hit.h5", TRACES / "cold.h5"), audit=audit)
    assert (report.exit_code, report.verdict) == (2, "not-checked")
    assert report.title == ("statediff: no state divergence between the cache-hit and cold runs; the one-run audit "
                            "of the cache-hit run could check no restore (NOT CHECKED)")
    assert report.audit == [f"`statediff audit hit.h5`: **{head}**", "", "```text", head, "```"]
