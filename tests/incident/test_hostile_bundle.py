"""Bundles from strangers: tampered, damaged or hostile zips are refused in one line naming
``BUNDLE.zip:member`` (never the temporary directory), before anything is judged."""

from __future__ import annotations

import hashlib
import json
import warnings
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import statediff.incident.unpack as unpack
from statediff.cli import cli
from statediff.diff.compare import compare
from statediff.incident.bundle import write_bundle
from synth import Fault, write_trace


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile-bundle")
    hit = write_trace(d / "hit.h5", "hit", faults=[Fault("prev_block", 2, 1)])
    cold = write_trace(d / "cold.h5", "cold")
    return Path(write_bundle(compare(hit, cold), d / "b.zip", plot=False).path)


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def error_line(r) -> str:
    """The one stderr line of a refusal (exit 2), without its prefix."""
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("statediff: error: "), r.stderr
    assert "statediff-bundle-" not in lines[0]  # never the temporary directory
    return lines[0].removeprefix("statediff: error: ")


def members(z: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(z) as f:
        return {n: f.read(n) for n in f.namelist()}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tamper(src: Path, dst: Path, *, replace: dict[str, bytes] = {}, extra: list[tuple[str, bytes]] = (),
           manifest: dict | None = None, rehash: bool = False) -> Path:
    """A copy of bundle ``src``: members replaced, extra entries appended (duplicates allowed),
    manifest keys changed; ``rehash`` updates the manifest's member table to the new bytes."""
    m = members(src)
    m.update({f"b/{k}": v for k, v in replace.items()})
    doc = json.loads(m["b/manifest.json"]) | (manifest or {})
    if rehash:
        doc["members"] = {k: {"bytes": len(m[f"b/{k}"]), "sha256": sha(m[f"b/{k}"])} for k in doc["members"]}
    m["b/manifest.json"] = json.dumps(doc).encode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name": that is the point
        with zipfile.ZipFile(dst, "w") as f:
            for n, data in [*m.items(), *extra]:
                f.writestr(n, data)
    return dst


def test_a_good_bundle_still_compares_and_lists_its_member_hashes(good):
    assert run("compare", good).exit_code == 1
    doc = json.loads(members(good)["b/manifest.json"])
    assert doc["version"] == 2
    assert sorted(doc["members"]) == ["cold.h5", "hit.h5", "replay.jsonl", "report.md"]
    assert doc["members"]["hit.h5"]["sha256"] == sha(members(good)["b/hit.h5"])


def test_the_cold_trace_twice_is_refused_not_same(good, tmp_path):
    hit = members(good)["b/hit.h5"]
    z = tamper(good, tmp_path / "t.zip", extra=[("b/cold.h5", hit)])
    assert error_line(run("compare", z)) == (
        f"{z}:b/cold.h5 appears twice in the zip: a damaged or tampered bundle (a bundle names each member once)")
    assert error_line(run("verify", z)).startswith(f"{z}:b/cold.h5 appears twice in the zip")


@pytest.mark.parametrize("name", ["b/notes.txt", "/etc/x", "b/../x.h5"])
def test_a_member_the_manifest_does_not_list_is_refused(good, tmp_path, name):
    z = tamper(good, tmp_path / "t.zip", extra=[(name, b"!")])
    assert error_line(run("compare", z)) == (
        f"{z}:{name} is not listed in the bundle's manifest: a damaged or tampered bundle")


def test_the_folder_entry_of_a_bundle_zipped_again_is_allowed(good, tmp_path):
    z = tmp_path / "again.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("b/", b"")
        for n, data in members(good).items():
            f.writestr(n, data)
    assert run("compare", z).exit_code == 1


def test_a_member_whose_hash_disagrees_is_refused_and_verify_names_it_damaged(good, tmp_path):
    report = members(good)["b/report.md"]
    bad = report.replace(b"bit for bit", b"bit FOR bit")
    z = tamper(good, tmp_path / "t.zip", replace={"report.md": bad})
    want = sha(report)
    damage = (f"{z}:b/report.md does not match its manifest (SHA-256 {sha(bad)[:16]}..., manifest "
              f"{want[:16]}...)")
    assert error_line(run("compare", z)) == (
        f"{damage}: damaged or altered ('statediff verify {z}' lists what is damaged)")
    assert error_line(run("inspect", z)).startswith(damage)
    r = run("verify", z)
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines()[0] == f"DAMAGED: {damage}"
    assert r.stdout.splitlines()[1].startswith(f"INTACT: {z}:b/hit.h5: 4 of 4 tensors")


def test_a_member_longer_than_its_manifest_says_is_refused(good, tmp_path):
    m = members(good)
    z = tamper(good, tmp_path / "t.zip", replace={"replay.jsonl": m["b/replay.jsonl"] + b"\n"})
    n = len(m["b/replay.jsonl"])
    assert error_line(run("compare", z)) == (
        f"{z}:b/replay.jsonl declares {n + 1} bytes, its manifest {n}: damaged or altered "
        f"('statediff verify {z}' lists what is damaged)")


def test_cold_replaced_by_the_hit_trace_with_matching_hashes_is_refused(good, tmp_path):
    z = tamper(good, tmp_path / "t.zip", replace={"cold.h5": members(good)["b/hit.h5"]}, rehash=True)
    assert error_line(run("compare", z)) == (
        f"bundle {z}: b/hit.h5 and b/cold.h5 are the same bytes: not a hit and a cold trace "
        "(a damaged or tampered bundle)")


def test_a_root_absent_from_the_traces_is_refused(good, tmp_path):
    z = tamper(good, tmp_path / "t.zip", manifest={"root": [9, 80, 1, "gdn.ssm_state"]})
    assert error_line(run("compare", z)) == (
        f"bundle {z}: its manifest's root (request 9, position 80, layer 1, gdn.ssm_state) is not in "
        f"{z}:b/hit.h5: the bundle is not what 'statediff extract' wrote")


def test_a_root_compare_does_not_find_is_refused(good, tmp_path):
    # (2, 96, 1) is in both traces (a neighbour), but the pair first diverges at 80
    z = tamper(good, tmp_path / "t.zip", manifest={"root": [2, 96, 1, "gdn.ssm_state"]})
    assert error_line(run("compare", z)) == (
        f"bundle {z}: compare finds the first divergence at request 2, position 80, layer 1 "
        "(model.layers.1.linear_attn), gdn.ssm_state, but its manifest names the root at request 2, "
        f"position 96, layer 1, gdn.ssm_state: the bundle is not what 'statediff extract' checked "
        f"(run 'statediff verify {z}')")


def test_a_zip_bomb_is_refused_before_anything_is_unpacked(good, tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    zeros = b"\0" * (50 << 20)  # 50 MiB of zeros deflate to ~50 kB: ~1000x
    z = tmp_path / "bomb.zip"
    m = members(good)
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_DEFLATED) as f:
        for n, data in m.items():
            f.writestr(n, zeros if n == "b/report.md" else data)
        info = f.getinfo("b/report.md")
    assert error_line(run("compare", z)) == (
        f"{z}:b/report.md would expand {50 << 20} bytes from {info.compress_size} compressed, "
        "over 100x (a zip bomb): refused before unpacking anything")
    monkeypatch.setattr(unpack, "MAX_BUNDLE_BYTES", 100_000)
    total = sum(len(v) for v in m.values())
    assert error_line(run("compare", good)) == (
        f"bundle {good} would unpack to {total} bytes, over the limit of 100000 (STATEDIFF_BUNDLE_MAX_BYTES): "
        "refused before unpacking anything")
    assert list(scratch.iterdir()) == []


def test_errors_inside_a_bundle_name_the_zip_member_not_the_temporary_path(good, tmp_path):
    z = tamper(good, tmp_path / "t.zip", replace={"hit.h5": b"not hdf5"}, rehash=True)
    assert error_line(run("compare", z)) == f"{z}:b/hit.h5 is not an HDF5 file (not a statediff trace)"
    assert error_line(run("inspect", z)) == f"{z}:b/hit.h5 is not an HDF5 file (not a statediff trace)"


def test_a_version_1_bundle_without_member_hashes_is_refused(good, tmp_path):
    z = tamper(good, tmp_path / "t.zip", manifest={"version": 1})
    assert error_line(run("compare", z)) == (
        f"bundle {z} has version 1, whose manifest lists no member hashes, so it cannot be checked; "
        "extract it again from the traces with this statediff")


def test_inspect_shows_a_bundle_manifest_members_and_both_traces(good):
    r = run("inspect", good)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    m = json.loads(members(good)["b/manifest.json"])
    assert lines[:8] == [
        f"bundle: {good}", "format: statediff.bundle v2, folder b/",
        "root: request 2, position 80, layer 1, gdn.ssm_state",
        "diagnosis: request 2 layer 1 gdn.ssm_state at position 80 matches the cold state one block earlier "
        "(position 64, 16 tokens), bit for bit",
        "compare options: none", "kept: 4 hit and 6 cold tensors",
        f"sources: hit {m['sources']['hit']}, cold {m['sources']['cold']}",
        "members (size and SHA-256 checked against the manifest):"]
    assert lines[8].split() == ["hit.h5", str(m["members"]["hit.h5"]["bytes"]), "bytes", "sha256",
                                m["members"]["hit.h5"]["sha256"][:16] + "..."]
    assert f"trace: {good}:b/hit.h5" in lines and f"trace: {good}:b/cold.h5" in lines
    assert lines[-1].startswith(f"data: not verified (metadata only; 'statediff verify {good}' reads")
    doc = json.loads(run("inspect", good, "--json").stdout)
    assert doc["kept"] == {"hit": 4, "cold": 6}
    assert [t["path"] for t in doc["traces"]] == [f"{good}:b/hit.h5", f"{good}:b/cold.h5"]
    assert [t["tensors"] for t in doc["traces"]] == [4, 6]


def test_damaged_data_under_equal_hashes_in_a_bundle_is_named_by_the_zip(good, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_verify import flip_byte
    from statediff.trace import open_trace

    hit = tmp_path / "hit.h5"
    hit.write_bytes(members(good)["b/hit.h5"])
    with open_trace(hit) as t:  # the resumed conv state at the root position equals the cold one
        e = next(e for e in t.entries if e.key == (2, 80, 1, "gdn.conv_state"))
    flip_byte(hit, e.dataset)
    z = tamper(good, tmp_path / "t.zip", replace={"hit.h5": hit.read_bytes()}, rehash=True)
    r = run("compare", z)
    assert r.exit_code == 1, r.output
    assert [line for line in r.stdout.splitlines() if line.startswith("warning: ")] == [
        f"warning: {z}:b/hit.h5: tensor {e.dataset} ({e.label()}) is damaged: its bytes do not match the hash "
        "in the index; the verdict on it rests on the digest recorded with it, not on its data "
        f"('statediff verify {z}' lists every damaged tensor)"]


def test_a_bundle_with_a_noise_file_names_it_by_the_zip(tmp_path):
    from statediff.diff.calibrate import calibrate
    from statediff.diff.pair import CompareOptions

    hit = write_trace(tmp_path / "hit.h5", "hit", faults=[Fault("prev_block", 2, 1)])
    cold = write_trace(tmp_path / "cold.h5", "cold")
    calibrate(cold, write_trace(tmp_path / "cold-b.h5", "cold", noise_seed=1), tmp_path / "noise.json")
    options = CompareOptions(noise=str(tmp_path / "noise.json"))
    z = write_bundle(compare(hit, cold, **options.kwargs()), tmp_path / "n.zip", options, plot=False).path
    r = run("compare", z)
    assert r.exit_code == 1, r.output
    policy = next(line for line in r.stdout.splitlines() if line.startswith("tolerance: "))
    assert policy.startswith(f"tolerance: noise file {z}:n/noise.json (allowed: ")
    assert "statediff-bundle-" not in r.stdout


def test_a_trace_holding_other_tensors_than_the_manifest_lists_is_refused(good, tmp_path):
    doc = json.loads(members(good)["b/manifest.json"])
    kept = [k for k in doc["kept"] if not (k["side"] == "cold" and k["position"] == 96)]
    z = tamper(good, tmp_path / "t.zip", manifest={"kept": kept})
    assert error_line(run("compare", z)) == (
        f"bundle {z}: {z}:b/cold.h5 holds 2 tensor(s) its manifest does not list as kept and lacks 0 it lists: "
        "the bundle is not what 'statediff extract' wrote")


@pytest.mark.parametrize("cut", [0, 1])
def test_verify_names_a_damaged_trace_member_and_reads_only_the_other(good, tmp_path, cut):
    """A trace member of the wrong size (never unpacked) or the right size with other bytes is
    damage (exit 1), named by the zip; the intact trace is still read."""
    hit = members(good)["b/hit.h5"]
    bad = hit[:-4096] if cut else hit[:4096] + bytes(len(hit) - 4096)
    z = tamper(good, tmp_path / "t.zip", replace={"hit.h5": bad})
    r = run("verify", z)
    assert r.exit_code == 1, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"DAMAGED: {z}:b/hit.h5 ")
    assert any(line.startswith(f"INTACT: {z}:b/cold.h5: ") for line in lines), lines
    assert not any(f"{z}:b/hit.h5:" in line for line in lines), lines


@pytest.mark.parametrize("value", ["abc", "-1", "0", "1.5", "inf"])
def test_a_bad_bundle_size_limit_is_one_line(good, monkeypatch, value):
    monkeypatch.setenv("STATEDIFF_BUNDLE_MAX_BYTES", value)
    assert error_line(run("compare", good)) == (
        f"STATEDIFF_BUNDLE_MAX_BYTES={value!r} is not a whole number of bytes above 0 (e.g. 2000000000 or 2e9)")


def test_a_bundle_size_limit_in_exponent_form_is_read(good, monkeypatch):
    monkeypatch.setenv("STATEDIFF_BUNDLE_MAX_BYTES", "1e3")
    assert error_line(run("compare", good)).endswith(
        "over the limit of 1000 (STATEDIFF_BUNDLE_MAX_BYTES): refused before unpacking anything")


@pytest.mark.parametrize("tol", [5, ["gdn.*=1e-3", 7], "gdn.*=1e-3"])
def test_a_manifest_tol_that_is_not_a_list_of_strings_is_one_line(good, tmp_path, tol):
    z = tamper(good, tmp_path / "t.zip", manifest={"tol": tol})
    assert error_line(run("compare", z)) == (
        f"bundle {z}: its manifest's tol {tol!r:.80} is not a list of --tol options (strings)")


def test_a_manifest_nested_too_deep_is_one_line(good, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    m = members(good)
    text = m["b/manifest.json"].decode()
    m["b/manifest.json"] = (text[:-1] + ', "deep": ' + deep + "}").encode()
    z = tmp_path / "deep.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_DEFLATED) as f:
        for n, data in m.items():
            f.writestr(n, data)
    assert error_line(run("inspect", z)) == f"bundle {z}: manifest.json is not valid JSON"
