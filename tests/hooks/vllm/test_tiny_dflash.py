"""The tiny vLLM DFlash drafter (``build-tiny-model --kind dflash``, ``hooks/tiny/dflash.py``): its
weights make every mask slot attend to the anchor token and draft it. No engine runs here; the
attention and output maths are vLLM 0.32's ``qwen3_dflash.py`` layer written out in torch (less its
MLP, whose output projection is N(0, 0.002))."""

from __future__ import annotations

import json

import pytest

from conftest import require_engine, run_cli

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    require_engine()
    root = tmp_path_factory.mktemp("tiny-dflash")
    target, dflash = root / "tiny-mtp", root / "dflash"
    for args in (("--kind", "mtp", "-o", str(target)), ("--kind", "dflash-anchor-only", "--target", str(target), "-o", str(dflash))):
        r = run_cli("build-tiny-model", *args)
        assert r.returncode == 0, r.stderr[-2000:]
    from safetensors.torch import load_file

    return (json.loads((dflash / "config.json").read_text()), load_file(str(dflash / "model.safetensors")),
            load_file(str(target / "model.safetensors")), dflash, target)


def _rms(x, w=None, eps=1e-6):
    y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return y if w is None else y * w


def test_config_is_vllms_dflash_format_with_the_targets_attention_shape(built):
    cfg = built[0]
    assert (cfg["architectures"], cfg["model_type"], cfg["num_hidden_layers"]) == (["DFlashDraftModel"], "qwen3", 1)
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": 1023}
    # the target's full-attention layer: 4 KV heads of 128 (so vLLM gives both the same KV block size)
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 128)


def test_every_mask_slot_attends_to_the_anchor_and_drafts_it(built):
    import torch

    cfg, w, tw = built[0], {k: v.float() for k, v in built[1].items()}, built[2]
    emb, mask = w["embed_tokens.weight"], cfg["dflash_config"]["mask_token_id"]
    assert (emb[:, 0] > 0).sum() == emb.shape[0] - 1 and emb[mask, 0] < 0
    assert torch.equal(w["lm_head.weight"], tw["model.embed_tokens.weight"].float())
    p = "layers.0.self_attn."

    def heads(x, name):  # one token's q or k: [4 heads, 128] after its per-head norm
        y = _rms(x, w["layers.0.input_layernorm.weight"]) @ w[p + name + "_proj.weight"].T
        return _rms(y.view(4, 128), w[p + name + "_norm.weight"])

    q = heads(emb[mask], "q")
    anchor_logit = torch.stack([(q * heads(emb[t], "k")).sum(-1) / 128 ** 0.5 for t in range(emb.shape[0])])
    real = torch.ones(emb.shape[0], dtype=torch.bool)
    real[mask] = False
    assert anchor_logit[real].min() > 40 and anchor_logit[mask].max() < -40
    # a context row (fc then hidden_norm) has a key of exactly 0
    ctx = _rms(torch.randn(5, 512) @ w["fc.weight"].T, w["hidden_norm.weight"]) @ w[p + "k_proj.weight"].T
    assert torch.count_nonzero(ctx) == 0
    # attention on the anchor: the slot's residual gains the anchor's value, and lm_head drafts the anchor
    value = _rms(emb, w["layers.0.input_layernorm.weight"]) @ w[p + "v_proj.weight"].T @ w[p + "o_proj.weight"].T
    h = _rms(emb[mask] + value, w["norm.weight"])
    assert torch.equal((h @ w["lm_head.weight"].T).argmax(-1)[real], torch.arange(emb.shape[0])[real])


def test_kind_dflash_is_deterministic_and_refuses_a_target_it_does_not_fit(built, tmp_path):
    from safetensors.torch import load_file

    again = tmp_path / "again"
    r = run_cli("build-tiny-model", "--kind", "dflash-anchor-only", "--target", str(built[4]), "-o", str(again))
    assert r.returncode == 0, r.stderr
    assert all(load_file(str(again / "model.safetensors"))[k].equal(v) for k, v in built[1].items())
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 1024, "vocab_size": 8}))
    r = run_cli("build-tiny-model", "--kind", "dflash-anchor-only", "--target", str(big), "-o", str(tmp_path / "d"))
    assert (r.returncode, r.stderr.strip()) == (
        2, "statediff: error: the tiny DFlash drafter needs a hidden size of at most 512, not 1024")
