"""``inspect`` marks the drafter's own layers (run field ``layers``, key ``drafter``)."""

from __future__ import annotations

from click.testing import CliRunner

from statediff.cli import cli
from synth import write_trace


def test_inspect_marks_drafter_layers(tmp_path):
    layers = [{"layer": 0, "module": "model.layers.0.linear_attn", "type": "gdn", "drafter": False},
              {"layer": 3, "module": "model.layers.3.self_attn.attn", "type": "attn", "drafter": False},
              {"layer": 4, "module": "model.layers.4.self_attn.attn", "type": "attn", "drafter": True}]
    r = CliRunner().invoke(cli, ["inspect", str(write_trace(tmp_path / "t.h5", "hit", layers=layers))])
    assert r.exit_code == 0, r.output
    assert "  layers                 3: 0 gdn, 3 attn, 4 attn (drafter layer 0)" in r.output.splitlines()
