"""A verdict reached without reading the data (equal index hashes, equal recorded digests) over a
tensor whose data is damaged: never a silent SAME or CLEAN, a warning line names the tensor."""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from statediff.cli import cli
from statediff.trace import open_trace
from synth import write_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_verify import flip_byte  # noqa: E402


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def dataset_of(path: Path, key: tuple, role: str | None = None) -> tuple[str, str]:
    with open_trace(path) as t:
        e = next(e for e in t.entries if e.key == key and (role is None or e.role == role))
        return e.dataset, e.label()


def test_compare_warns_on_damaged_data_under_equal_hashes(tmp_path):
    hit = write_trace(tmp_path / "hit.h5", "hit", replay="exact")
    cold = write_trace(tmp_path / "cold.h5", "cold", replay="exact")
    assert run("compare", hit, cold).exit_code == 0
    ds, label = dataset_of(hit, (0, 16, 0, "gdn.conv_state"))
    flip_byte(hit, ds)
    r = run("compare", hit, cold)
    assert r.exit_code == 0  # the verdict, from the hashes recorded with the tensors, stands
    assert r.stdout.splitlines()[0].startswith("SAME")
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: {hit}: tensor {ds} ({label}) is damaged: its bytes do not match the hash in the index; the "
        f"verdict on it rests on the digest recorded with it, not on its data ('statediff verify {hit}' lists "
        "every damaged tensor)"]
    assert run("verify", hit).exit_code == 1


def test_audit_warns_on_damaged_data_under_equal_digests(tmp_path):
    from audit_synth import write_hit_run

    path = write_hit_run(tmp_path / "hit.h5", keep="all")
    ds, label = dataset_of(path, (3, 48, 0, "gdn.ssm_state"), role="resumed")
    flip_byte(path, ds)
    r = run("audit", path)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("CLEAN: 14 restored tensor(s) of 2 hit(s)")
    assert [line for line in lines if line.startswith("warning: ")] == [
        f"warning: {path}: tensor {ds} ({label}) is damaged: its bytes do not match the hash in the index; the "
        f"verdict on it rests on the digest recorded with it, not on its data ('statediff verify {path}' lists "
        "every damaged tensor)"]
