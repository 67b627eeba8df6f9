"""statediff.diff.tolerance: which threshold judges a pair, in the documented order."""

from __future__ import annotations

import dataclasses

import pytest

from statediff.diff.tolerance import (DEFAULTS, Policy, Rule, Tolerance, ToleranceKind, ToleranceUse, dtype_default,
                                      parse_rule)
from statediff.errors import StatediffError

from synth import entry


def _e(kind: str = "gdn.ssm_state", dtype: str = "float32", layer: int = 0):
    return dataclasses.replace(entry(0, 16, layer, kind), dtype=dtype)


USER = ToleranceKind.USER_RULE


class _Noise:
    """A stand-in for calibrated envelopes (the ``Envelopes`` protocol): layer 0 only."""

    def tolerance_for(self, e):
        return Tolerance(0.5, 0.0, ToleranceKind.NOISE_ENVELOPE, "noise envelope x4", noise_max_abs=0.125) if e.layer == 0 else None

    def describe(self) -> str:
        return "noise file n.json x4"


@pytest.mark.parametrize("text,rule", [
    ("gdn.ssm_state=1e-6,1e-5", Rule("gdn.ssm_state", 1e-6, 1e-5)),
    (" attn.* = 0,0", Rule("attn.*", 0.0, 0.0)),
    ("model.layers.0.*:gdn.conv_state=2,0.5", Rule("model.layers.0.*:gdn.conv_state", 2.0, 0.5)),
])
def test_parse_rule(text, rule):
    assert parse_rule(text) == rule
    assert str(parse_rule(str(rule))) == str(rule)


@pytest.mark.parametrize("text,message", [
    ("attn.k", "--tol 'attn.k': expected PATTERN=ATOL,RTOL (e.g. 'gdn.ssm_state=1e-6,1e-5')"),
    ("=1,2", "--tol '=1,2': expected PATTERN=ATOL,RTOL (e.g. 'gdn.ssm_state=1e-6,1e-5')"),
    ("attn.k=1", "--tol 'attn.k=1': expected PATTERN=ATOL,RTOL (e.g. 'gdn.ssm_state=1e-6,1e-5')"),
    ("attn.k=a,1", "--tol 'attn.k=a,1': ATOL and RTOL must be numbers"),
    ("attn.k=-1,0", "--tol 'attn.k=-1,0': ATOL and RTOL must be finite and >= 0"),
    ("attn.k=inf,0", "--tol 'attn.k=inf,0': ATOL and RTOL must be finite and >= 0"),
    ("attn.k=0,nan", "--tol 'attn.k=0,nan': ATOL and RTOL must be finite and >= 0"),
])
def test_bad_rules_are_one_line(text, message):
    with pytest.raises(StatediffError) as info:
        parse_rule(text)
    assert str(info.value) == message


def test_a_rule_matches_kind_module_or_both():
    e = _e("gdn.conv_state")  # module model.layers.0
    assert Rule("gdn.*", 0, 0).matches(e)
    assert Rule("model.layers.0", 0, 0).matches(e)
    assert Rule("model.layers.0:gdn.conv_state", 0, 0).matches(e)
    assert not Rule("model.layers.1:*", 0, 0).matches(e)
    assert not Rule("GDN.*", 0, 0).matches(e)  # case-sensitive


def test_the_first_rule_wins_then_noise_then_exact_then_the_dtype_default():
    rules = (parse_rule("gdn.ssm_state=1,2"), parse_rule("gdn.*=3,4"))
    assert Policy(rules, True, _Noise()).for_entry(_e()) == Tolerance(1.0, 2.0, USER, "--tol gdn.ssm_state")
    assert Policy(rules, True, _Noise()).for_entry(_e("gdn.conv_state")) == Tolerance(3.0, 4.0, USER, "--tol gdn.*")
    assert Policy((), True, _Noise()).for_entry(_e()) == Tolerance(0.5, 0.0, ToleranceKind.NOISE_ENVELOPE, "noise envelope x4", 0.125)
    assert Policy((), True, _Noise()).for_entry(_e(layer=1)) == Tolerance(0.0, 0.0, ToleranceKind.EXACT, "exact replay")
    assert Policy((), False, _Noise()).for_entry(_e(layer=1)) == Tolerance(1e-5, 1e-4, ToleranceKind.DTYPE_DEFAULT, "dtype default float32")
    assert Policy().for_entry(_e(dtype="bfloat16")) == Tolerance(1e-2, 2e-2, ToleranceKind.DTYPE_DEFAULT, "dtype default bfloat16")
    assert Policy().for_entry(_e(dtype="int32")).exact  # integers: exact by default
    assert dtype_default("bool") == (0.0, 0.0) and dtype_default("float16") == DEFAULTS["float16"]


def test_different_dtypes_are_judged_by_the_less_precise_one():
    hit, cold = _e(dtype="float32"), _e(dtype="bfloat16")
    tol = Policy((), True, _Noise()).for_pair(hit, cold)  # neither bit identity nor a noise envelope
    assert (tol.atol, tol.rtol) == DEFAULTS["bfloat16"]
    assert tol.source == "dtype default bfloat16: hit float32 vs cold bfloat16, each decoded with its own dtype"
    ruled = Policy((parse_rule("gdn.*=7,0"),), True).for_pair(hit, cold)
    assert ruled == Tolerance(7.0, 0.0, USER, "--tol gdn.*")
    assert Policy((), True).for_pair(hit, _e()) == Tolerance(0.0, 0.0, ToleranceKind.EXACT, "exact replay")  # same dtype


def test_exact_and_describe():
    assert Tolerance(0, 0, ToleranceKind.EXACT, "exact replay").exact and not Tolerance(0, 1e-9, USER, "x").exact
    assert Tolerance(0, 0, ToleranceKind.EXACT, "exact replay").describe() == "bit identity (exact replay)"
    assert Tolerance(1e-5, 1e-4, ToleranceKind.DTYPE_DEFAULT, "dtype default float32").describe() == "atol 1e-05 rtol 0.0001 (dtype default float32)"
    assert Tolerance(1, 2, USER, "s").to_json() == {"atol": 1, "rtol": 2, "kind": "user_rule", "source": "s",
                                                      "noise_max_abs": None, "exact": False}
    assert Policy((), True).describe() == "exact: bit identity (both traces replay=exact)"
    assert Policy((parse_rule("attn.*=0,0"),)).describe() == (
        "dtype defaults (float32 atol 1e-05 rtol 0.0001; float16 atol 0.001 rtol 0.005; bfloat16 atol 0.01 "
        "rtol 0.02; integers exact); --tol rules first: attn.*=0,0")
    assert Policy((), True, _Noise()).describe() == (
        "noise file n.json x4 (exact replay: bit identity where the file has no envelope)")


def test_each_tolerance_names_the_rule_that_chose_it():
    """The kind decides (the default-replay noise model judges only REPLAY_BAND pairs); the source is text."""
    rules = (parse_rule("gdn.ssm_state=1e-5,1e-4"),)
    band = Policy(rules, band=True)
    assert band.for_entry(_e()).kind is USER  # a rule with the dtype default's numbers is still the user's
    assert band.for_entry(_e()).source == "--tol gdn.ssm_state"
    assert band.for_entry(_e("gdn.conv_state")) == Tolerance(1e-5, 1e-4, ToleranceKind.REPLAY_BAND,
                                                             "dtype default float32")
    assert band.for_pair(_e(dtype="float32"), _e(dtype="bfloat16", kind="gdn.conv_state")).kind is \
        ToleranceKind.REPLAY_BAND
    assert Policy(band=False).for_entry(_e()).kind is ToleranceKind.DTYPE_DEFAULT  # two engine versions
    # exact replay and a noise file replace the band, also where they fall back to a dtype default
    assert Policy((), True, band=True).for_entry(_e()).kind is ToleranceKind.EXACT
    assert Policy((), True, band=True).for_pair(_e(dtype="float32"), _e(dtype="bfloat16")).kind is \
        ToleranceKind.DTYPE_DEFAULT
    assert Policy((), False, _Noise(), band=True).for_entry(_e(layer=1)).kind is ToleranceKind.DTYPE_DEFAULT
    assert Policy((), False, _Noise(), band=True).for_entry(_e()).kind is ToleranceKind.NOISE_ENVELOPE
    assert [Policy(exact=True, band=True).default_kind, Policy(band=True).default_kind, Policy().default_kind,
            Policy(noise=_Noise(), band=True).default_kind] == [
        ToleranceKind.EXACT, ToleranceKind.REPLAY_BAND, ToleranceKind.DTYPE_DEFAULT, ToleranceKind.DTYPE_DEFAULT]


def test_pairs_no_rule_matched_are_named_with_the_default_that_judged_them():
    use = ToleranceUse({"user_rule": 10, "replay_band": 28}, ToleranceKind.REPLAY_BAND, rules=1)
    assert use.by_default == 28
    assert use.to_text() == (
        "tolerance default: 28 of 38 judged pairs matched no --tol rule: 28 by the dtype default, then the "
        "default-replay noise model (relative L2 error: <= 8u noise, > 16u divergence, between: cannot judge)")
    assert use.to_json() == {"kinds": {"user_rule": 10, "replay_band": 28}, "default": "replay_band",
                             "default_text": ToleranceKind.REPLAY_BAND.text(), "by_default": 28}
    mixed = ToleranceUse({"user_rule": 1, "exact": 5, "dtype_default": 2}, ToleranceKind.EXACT, rules=2, noise=True)
    assert mixed.to_text() == ("tolerance default: 7 of 8 judged pairs matched no --tol rule and no noise envelope: "
                               "5 by bit identity (exact replay), 2 by the dtype default")
    # without rules the policy line names the default already; every pair matched a rule: nothing to name
    assert ToleranceUse({"replay_band": 38}, ToleranceKind.REPLAY_BAND).to_text() == ""
    assert ToleranceUse({"user_rule": 38}, ToleranceKind.REPLAY_BAND, rules=1).to_text() == ""
