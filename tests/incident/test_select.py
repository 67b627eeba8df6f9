"""statediff.incident.select: which tensors a bundle keeps, and why, for a root divergence."""

from __future__ import annotations

import dataclasses
import types

import pytest

from statediff.diff.diagnose import Diagnosis
from statediff.errors import StatediffError
from statediff.incident.select import select
from statediff.trace.schema import DigestEntry

from synth import entry

ROOT = (1, 48, 2, "gdn.ssm_state")


def result(root=ROOT, match: tuple[int, int] | None = None):
    """What ``select`` reads of a compare result: the root and the diagnosis of it."""
    diag = None
    if match is not None:
        diag = Diagnosis(*root, "other_position", True, match[0], match[1], match[1] - root[1], "diagnosis: ...")
    first = None if root is None else types.SimpleNamespace(key=root)
    return types.SimpleNamespace(first=first, diagnosis_for=lambda key: diag if diag and diag.key == key else None)


def digest_row(e):
    fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(DigestEntry) if f.name not in ("digest", "summary")}
    return DigestEntry(**fields, digest="0" * 32)


def traces():
    """Request 1's layer 2 (conv and SSM state) and layer 3 (K) at every boundary of the cold run;
    the hit run resumed at 48 (nothing before it); request 0 alike; the cold run's K at 64 is a digest row."""
    cold = [entry(r, p, layer, kind) for r in (0, 1) for p in (16, 32, 48, 64, 80)
            for layer, kind in ((2, "gdn.conv_state"), (2, "gdn.ssm_state"), (3, "attn.k"))]
    cold = [digest_row(e) if e.key == (1, 64, 3, "attn.k") else e for e in cold]
    hit = [entry(r, p, layer, kind) for r in (0, 1) for p in (48, 64, 80)
           for layer, kind in ((2, "gdn.conv_state"), (2, "gdn.ssm_state"), (3, "attn.k"))]
    return hit, cold


def kept(sel) -> list[tuple]:
    return [(k.side, *k.entry.key, k.why) for k in sel.kept]


def test_the_root_its_siblings_and_one_boundary_each_side():
    hit, cold = traces()
    sel = select(result(), hit, cold)
    assert sel.root == ROOT
    assert kept(sel) == [
        ("hit", 1, 48, 2, "gdn.conv_state", "sibling kind, at the root position"),
        ("hit", 1, 48, 2, "gdn.ssm_state", "root divergence"),
        ("hit", 1, 64, 2, "gdn.conv_state", "sibling kind, 16 tokens after the root"),
        ("hit", 1, 64, 2, "gdn.ssm_state", "same kind, 16 tokens after the root"),
        ("cold", 1, 32, 2, "gdn.conv_state", "sibling kind, 16 tokens before the root"),  # positions of both traces
        ("cold", 1, 32, 2, "gdn.ssm_state", "same kind, 16 tokens before the root"),
        ("cold", 1, 48, 2, "gdn.conv_state", "sibling kind, at the root position"),
        ("cold", 1, 48, 2, "gdn.ssm_state", "root divergence"),
        ("cold", 1, 64, 2, "gdn.conv_state", "sibling kind, 16 tokens after the root"),
        ("cold", 1, 64, 2, "gdn.ssm_state", "same kind, 16 tokens after the root")]
    assert [k.entry.key for k in sel.kept if k.side == "hit"] == [e.key for e in sel.entries("hit")]


def test_the_smallest_selection_keeps_the_root_and_what_the_diagnosis_matched():
    hit, cold = traces()
    sel = select(result(match=(1, 16)), hit, cold, neighbours=0, siblings=False)
    assert kept(sel) == [
        ("hit", 1, 48, 2, "gdn.ssm_state", "root divergence"),
        ("cold", 1, 16, 2, "gdn.ssm_state", "what the diagnosis says the wrong hit tensor matches"),
        ("cold", 1, 48, 2, "gdn.ssm_state", "root divergence")]


def test_more_neighbours_and_digest_rows_travel_as_digest_rows():
    hit, cold = traces()
    sel = select(result(root=(1, 48, 3, "attn.k")), hit, cold, neighbours=2)
    cold_kept = [(k.entry.position, type(k.entry).__name__) for k in sel.kept if k.side == "cold"]
    assert cold_kept == [(16, "TensorEntry"), (32, "TensorEntry"), (48, "TensorEntry"), (64, "DigestEntry"),
                         (80, "TensorEntry")]
    assert sel.kept[0].to_json()["data"] is True
    row = next(k for k in sel.kept if isinstance(k.entry, DigestEntry))
    assert (row.to_json()["data"], row.to_json()["hash"], row.to_json()["digest"]) == (False, None, "0" * 32)


def test_a_root_position_only_one_trace_has():
    hit, cold = traces()
    hit = [e for e in hit if e.position != 48] + [entry(1, 56, 2, "gdn.ssm_state")]
    sel = select(result(root=(1, 56, 2, "gdn.ssm_state")), hit, cold, neighbours=1, siblings=False)
    assert [(k.side, k.entry.position, k.why) for k in sel.kept] == [
        ("hit", 56, "root divergence"), ("hit", 64, "same kind, 8 tokens after the root"),
        ("cold", 48, "same kind, 8 tokens before the root"), ("cold", 64, "same kind, 8 tokens after the root")]


def test_without_a_divergence_there_is_nothing_to_select():
    with pytest.raises(StatediffError, match="no divergence: nothing to extract"):
        select(result(root=None), *traces())
