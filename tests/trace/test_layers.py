"""Whose layer a recorded layer number is (statediff/trace/layers.py): the drafter's named as the drafter's."""

from __future__ import annotations

from statediff.audit.result import Finding
from statediff.trace.layers import drafter_index, drafter_layers, label

LAYERS = [{"layer": 0, "module": "model.layers.0.linear_attn", "type": "gdn", "drafter": False},
          {"layer": 3, "module": "model.layers.3.self_attn.attn", "type": "attn", "drafter": False},
          {"layer": 4, "module": "model.layers.4.self_attn.attn", "type": "attn", "drafter": True}]
RUN = {"layers": LAYERS, "drafter": {"method": "eagle3", "tapped_layers": [1, 2, 4],
                                     "model_input": {"kind": "drafter.model_input", "role": "proposer", "layer": 4,
                                                     "module": "proposer.hidden_states"}}}


def test_drafter_layers_are_numbered_from_the_drafters_first():
    assert drafter_layers(RUN) == {4: 0}
    assert drafter_layers({"layers": LAYERS + [dict(LAYERS[2], layer=5)]}) == {4: 0, 5: 1}
    # an MTP run recorded before the proposer role: the layers list alone
    assert drafter_layers({"layers": LAYERS}) == {4: 0}
    # old traces (no drafter flags) and malformed entries: every layer is the target's
    assert drafter_layers({"layers": [{"layer": 4, "type": "attn"}, "x", {"layer": "4", "drafter": True}]}) == {}
    assert drafter_layers({}) == {}


def test_labels_name_the_drafters_layers_and_never_the_hand_off_rows():
    assert label(RUN, 4, "attn.k", "model.layers.4.self_attn.attn") == \
        "drafter layer 0 (layer 4, model.layers.4.self_attn.attn)"
    assert label(RUN, 4, "drafter.model_input") == "drafter layer 0 (layer 4)"
    # the hand-off's rows are numbered by the target layer they were tapped from (4: after the last)
    assert drafter_index(RUN, 4, "drafter.input") is None
    assert label(RUN, 4, "drafter.input", "drafter.aux.4") == "layer 4 (drafter.aux.4)"
    assert label(RUN, 3, "attn.k", "model.layers.3.self_attn.attn") == "layer 3 (model.layers.3.self_attn.attn)"


def test_an_audit_finding_in_a_drafter_layer_says_so():
    f = Finding("kv", 1, 32, 4, "attn.k", "model.layers.4.self_attn.attn", 7, "differs", drafter_layer=0)
    assert f.where() == "request 1 position 32 drafter layer 0 (layer 4, model.layers.4.self_attn.attn) attn.k"
    g = Finding("kv", 1, 32, 3, "attn.k", "", 7, "differs")
    assert g.where() == "request 1 position 32 layer 3 attn.k"
