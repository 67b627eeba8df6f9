"""The context-reading tiny DFlash drafters (``hooks/tiny/dflash_context.py``) without an engine:
vLLM 0.32's ``qwen3_dflash.py`` layer written out in torch (context K/V precompute, non-causal
query block, neox RoPE, GQA; less the MLP, whose output projection is N(0, 0.002)). The drafts
come from the newest context row, and context slots holding zeros turn them to one token."""

from __future__ import annotations

import json

import pytest

from conftest import require_engine, run_cli

pytestmark = pytest.mark.engine

K = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    require_engine()
    from statediff_hooks.tiny.catalog import build_tiny

    root = tmp_path_factory.mktemp("tiny-dflash-context")
    out = {"target": build_tiny("mtp", root / "tiny-mtp")}  # in this process: one torch import
    for kind in ("dflash", "dflash-own-group", "dflash2", "dspark"):
        out[kind] = build_tiny(kind, root / kind, target=str(out["target"]))
    r = run_cli("build-tiny-model", "--kind", "dflash", "--target", str(out["target"]), "-o", str(root / "cli"))
    assert r.returncode == 0 and (root / "cli" / "model.safetensors").read_bytes() == \
        (out["dflash"] / "model.safetensors").read_bytes(), r.stderr[-2000:]
    return out


def _rms(x, w=None):
    y = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    return y if w is None else y * w


def _drafts(d, rows, zeroed=0):
    """The K drafts and the recency heads' weight on the newest context row, for context ``rows``."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((d / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(d / "model.safetensors")).items()}
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    p = "layers.0.self_attn."
    inv = 10000.0 ** (-torch.arange(0, hd, 2).float() / hd)

    def rope(x, pos):
        ang = pos[:, None].float() * inv[None]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        return torch.cat([x[..., :hd // 2] * c - x[..., hd // 2:] * s, x[..., hd // 2:] * c + x[..., :hd // 2] * s], -1)

    def proj(x, names):
        return x @ torch.cat([w[p + n + "_proj.weight"] for n in names]).T + torch.cat([w[p + n + "_proj.bias"]
                                                                                         for n in names])
    n = rows.shape[0]
    kv = proj(_rms(rows @ w["fc.weight"].T, w["hidden_norm.weight"]), ("k", "v"))  # precompute_and_store_context_kv
    kc = rope(_rms(kv[:, :nkv * hd].view(n, nkv, hd), w[p + "k_norm.weight"]), torch.arange(n))
    vc = kv[:, nkv * hd:].view(n, nkv, hd)
    kc[:zeroed], vc[:zeroed] = 0, 0
    e = w["embed_tokens.weight"][[cfg["dflash_config"]["mask_token_id"]] * (K + 1)]
    qkv = proj(_rms(e, w["layers.0.input_layernorm.weight"]), ("q", "k", "v"))
    pos = torch.arange(n, n + K + 1)  # the anchor, then the K mask slots
    q = rope(_rms(qkv[:, :nh * hd].view(-1, nh, hd), w[p + "q_norm.weight"]), pos)
    kq = rope(_rms(qkv[:, nh * hd:(nh + nkv) * hd].view(-1, nkv, hd), w[p + "k_norm.weight"]), pos)
    keys = torch.cat([kc, kq]).repeat_interleave(nh // nkv, 1)
    vals = torch.cat([vc, qkv[:, (nh + nkv) * hd:].view(-1, nkv, hd)]).repeat_interleave(nh // nkv, 1)
    prob = (torch.einsum("qhd,khd->hqk", q, keys) / hd ** 0.5).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", prob, vals).reshape(-1, nh * hd) @ w[p + "o_proj.weight"].T + w[p + "o_proj.bias"]
    logits = _rms(e + o, w["norm.weight"]) @ w["lm_head.weight"].T
    return logits.argmax(-1)[1:].tolist(), prob[0, 1:, n - 1].tolist()


@pytest.mark.parametrize("kind", ["dflash", "dflash-own-group"])
def test_drafts_come_from_the_newest_context_row_and_zeroed_slots_turn_them(built, kind):
    import torch
    from safetensors.torch import load_file

    from statediff_hooks.tiny.dflash_context import COVERAGE_TOKEN

    tw = {k: v.float() for k, v in load_file(str(built["target"] / "model.safetensors")).items()}
    tokens = [3 + (37 * i + i * i) % 900 for i in range(150)]
    rows = tw["model.embed_tokens.weight"][tokens] * 3  # stand-in tapped hidden states
    norm = tw["model.norm.weight"] + 1.0  # Qwen3-Next's 0-centred final norm
    own = int((_rms(rows[-1], norm) @ tw["lm_head.weight"].T).argmax())
    drafts, weight = _drafts(built[kind], rows)
    assert drafts == [own] * K and min(weight) > 0.99
    for zeroed in (32, 64):  # the restored prefix's context slots hold zeros (never written, or zeroed)
        assert _drafts(built[kind], rows, zeroed)[0] == [COVERAGE_TOKEN] * K
    assert own != COVERAGE_TOKEN and torch.isfinite(rows).all()


def test_dflash2_and_dspark_twins_carry_their_v2_config_and_neutral_extras(built):
    from safetensors.torch import load_file

    c2 = json.loads((built["dflash2"] / "config.json").read_text())
    cs = json.loads((built["dspark"] / "config.json").read_text())
    assert c2["architectures"] == ["DFlash2DraftModel"]
    assert {k: c2["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 64,
                                                                        "selector_rank": 8, "selector_top_k": 4}
    assert (cs["architectures"], cs["markov_rank"], cs["block_size"], cs["dspark_target_layer_ids"]) == (
        ["Qwen3DSparkModel"], 8, K, [2])
    w2, ws, w1 = (load_file(str(built[k] / "model.safetensors")) for k in ("dflash2", "dspark", "dflash"))
    base = w2["layers.0.attention_conv.base_kernel"].float()
    assert base.shape == (2, 2, 256) and base[:, 0].eq(1).all() and base[:, 1].eq(0).all()
    assert not w2["candidate_selector.successor_codebook"].any() and not ws["markov_head.markov_w2.weight"].any()
    assert all(w2[k].equal(v) and ws[k].equal(v) for k, v in w1.items())  # the same attention, drafts the same
