"""The planted-fault interface both engine adapters call (hooks/recording/faults.py), without an engine."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from statediff_hooks.recording.faults import FaultPlanter, Site, parse_fault
from statediff_hooks.vllm.v1.faults import BlockTableRow, GdnSlot

pytestmark = pytest.mark.engine  # imports torch when it loads


class Recorded:
    def __init__(self):
        self.notes = []

    def __call__(self, **where):
        self.notes.append(where)


def _runner(rows: dict[str, list[int]], group: int = 3):
    """A stand-in for vLLM 0.32's runner: input_batch.block_table[g].block_table.np rows, req_id_to_index."""
    table = np.zeros((4, 20), np.int32)
    index = {}
    for i, (rid, row) in enumerate(rows.items()):
        table[i, :len(row)] = row
        index[rid] = i
    groups = {group: types.SimpleNamespace(block_table=types.SimpleNamespace(np=table))}
    return types.SimpleNamespace(input_batch=types.SimpleNamespace(block_table=groups, req_id_to_index=index)), table


ROW = [4] + list(range(8, 21))  # 14 logical blocks: a hit of 448 tokens at block 32


@pytest.mark.parametrize("spec,expected", [
    ("kv-stale", ROW[:13] + [ROW[12]]),
    ("kv-swap", ROW[:12] + [ROW[13], ROW[12]]),
])
def test_kv_faults_edit_only_the_runners_row_of_the_hit_request(spec, expected):
    runner, table = _runner({"a": ROW, "b": ROW})
    note = Recorded()
    planter = FaultPlanter(parse_fault(spec), note)
    site = Site(request=1, hit=448, layer=3, module="model.layers.3.self_attn.attn", block_size=32, family="attn")
    assert planter.plant(site, BlockTableRow(runner, 3, "a"))
    assert table[0, :14].tolist() == expected and table[1, :14].tolist() == ROW  # request b untouched
    assert table[0, 14:].tolist() == [0] * 6
    assert note.notes == [planter.fired]
    assert {k: planter.fired[k] for k in ("request", "position", "layer", "kind")} == \
        {"request": 1, "position": 448, "layer": 3, "kind": "attn.k"}
    assert not planter.pending and not planter.plant(site, BlockTableRow(runner, 3, "b"))  # fires once
    assert table[1, :14].tolist() == ROW


def test_where_a_fault_may_fire():
    planter = FaultPlanter(parse_fault("kv-stale:layer=3:request=2"))
    site = dict(request=2, hit=64, layer=3, module="m", block_size=32, family="attn")
    assert planter.applies(Site(**site))
    assert not planter.applies(Site(**site | {"hit": 32}))  # one block: no block j-1 to map to
    assert not planter.applies(Site(**site | {"request": 1}))
    assert not planter.applies(Site(**site | {"layer": 7}))
    assert not planter.applies(Site(**site | {"family": "gdn"}))
    assert not FaultPlanter(None).applies(Site(**site)) and not FaultPlanter(None).pending


def test_gdn_faults_through_the_same_interface():
    conv = torch.ones(3, 3, 8, dtype=torch.bfloat16)
    ssm = torch.full((3, 2, 4, 4), 1.0 + 2 ** -20)
    site = Site(request=1, hit=64, layer=1, module="m", block_size=32, family="gdn")
    p = FaultPlanter(parse_fault("ssm-wrong-block"))
    assert not p.plant(site, GdnSlot(conv, ssm, 1, None)) and p.pending  # nothing one block earlier yet
    assert p.plant(site, GdnSlot(conv, ssm, 1, torch.zeros(2, 4, 4)))
    assert ssm[1].abs().sum().item() == 0 and ssm[0].min().item() == 1.0 + 2 ** -20
    p = FaultPlanter(parse_fault("conv-zero"))
    assert p.plant(site, GdnSlot(conv, ssm, 2, None))
    assert conv[2].abs().sum().item() == 0 and conv[1].min().item() == 1.0
    p = FaultPlanter(parse_fault("ssm-bf16"))
    assert p.plant(site, GdnSlot(conv, ssm, 0, None))
    assert ssm[0].max().item() == 1.0 and ssm[2].max().item() == 1.0 + 2 ** -20
    with pytest.raises(NotImplementedError, match="GdnSlot has no KV blocks"):
        FaultPlanter(parse_fault("kv-stale")).plant(site.__class__(**{**site.__dict__, "family": "attn"}),
                                                   GdnSlot(conv, ssm, 0, None))


def test_drafter_kv_zero_zeroes_the_drafters_cached_blocks_only():
    runner, _ = _runner({"a": ROW[:4], "b": ROW[4:8]})
    cache = torch.ones(24, 2, 32, 256)  # [num_blocks, heads, block_size, K|V]
    note = Recorded()
    planter = FaultPlanter(parse_fault("drafter-kv-zero"), note)
    target = dict(request=1, hit=96, module="model.layers.3.self_attn.attn", block_size=32, family="attn")
    assert not planter.plant(Site(layer=3, **target), BlockTableRow(runner, 3, "a", cache))  # a target layer
    assert cache.eq(1).all()
    drafter = dict(target, module="mtp.layers.0.self_attn.attn")
    assert planter.plant(Site(layer=4, drafter=True, **drafter), BlockTableRow(runner, 3, "a", cache))
    zeroed = [b for b in range(24) if cache[b].eq(0).all()]
    assert zeroed == ROW[:3]  # logical blocks 0..2 of request a: the 96 cached tokens
    assert all(cache[b].eq(1).all() for b in range(24) if b not in zeroed)
    assert {k: planter.fired[k] for k in ("request", "position", "layer", "module", "kind", "blocks")} == {
        "request": 1, "position": 32, "layer": 4, "module": "mtp.layers.0.self_attn.attn", "kind": "attn.k",
        "blocks": [0, 2]}
    assert note.notes == [planter.fired]
    # the KV remaps never act on a drafter layer
    stale = FaultPlanter(parse_fault("kv-stale"))
    assert not stale.applies(Site(layer=4, drafter=True, **dict(drafter, hit=96)))


def test_drafter_shift_moves_the_proposers_rows_one_token_and_never_fires_at_the_hand_off():
    from statediff_hooks.vllm.v1.faults import FeatureRows
    from statediff_hooks.vllm.v1.proposer import ShiftRows

    hidden = torch.arange(12, dtype=torch.float32).repeat_interleave(3).view(12, 3)  # row r holds r
    planter = FaultPlanter(parse_fault("drafter-shift"))
    where = dict(request=1, hit=64, block_size=32, family="drafter")
    # the runner's hand-off (v1/spec.py) is a target-side site: the fault waits for the proposer's
    assert not planter.plant(Site(layer=2, module="drafter.aux.2", **where), FeatureRows(hidden, 2, 4))
    assert planter.plant(Site(layer=4, module="proposer.hidden_states", drafter=True, **where),
                         ShiftRows(hidden, 2, 4))
    assert hidden[:, 0].tolist() == [0, 1, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11]  # rows 2..5 hold 3..6
    assert {k: planter.fired[k] for k in ("request", "position", "layer", "module", "kind", "rows")} == {
        "request": 1, "position": 65, "layer": 4, "module": "proposer.hidden_states",
        "kind": "drafter.model_input", "rows": [65, 68]}
