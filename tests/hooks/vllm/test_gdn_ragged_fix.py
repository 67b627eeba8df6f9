"""``--engine-fix gdn-ragged-drafts`` (``statediff_hooks.vllm.cpu.gdn_ragged_fix``) on vLLM 0.32's own
``_spec_forward``, no engine: the conv part of the CPU GDN spec path, step by step, against a causal
conv over the accepted token stream (width 4, 3 speculative tokens: a 6-column conv buffer)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

# plain imports, no importorskip: a vLLM that moved this module fails here, in CI, instead of skipping
import torch
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn

from statediff_hooks.vllm.cpu import gdn_ragged_fix

pytestmark = pytest.mark.vllm
F = torch.nn.functional

WIDTH, K, DIM = 4, 3, 5
STATE_LEN = WIDTH - 1 + K


class ConvDone(Exception):
    """Raised where ``_spec_forward`` hands its conv output on (the SSM part is not under test)."""


@pytest.fixture(autouse=True)
def torch_conv_loop(monkeypatch):
    # the torch loop (no AMX / ARM BF16 native conv), as on the CPUs the engine tests run on
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(gdn, "is_arm_bf16", lambda: False)


def layer():
    w = torch.arange(1, DIM * WIDTH + 1, dtype=torch.float32).remainder(5).sub(2).view(DIM, 1, WIDTH)

    def rearrange(conv_out):
        raise ConvDone(conv_out.clone())
    return NS(conv1d=NS(weight=w, bias=None), activation="silu", rearrange_mixed_qkv=rearrange)


def run(spec_forward, steps):
    """Drive ``spec_forward`` through ``steps`` ``(query tokens, accepted)``; the first step follows a
    prefill (1 accepted). Returns each step's conv output and the causal conv the accepted stream says."""
    lay, buf = layer(), torch.zeros(1, DIM, STATE_LEN)
    stream, accepted, got, want = [torch.zeros(DIM, WIDTH - 1)], 1, [], []
    gen = torch.Generator().manual_seed(0)
    for q, n in steps:
        x = torch.randint(-3, 4, (q, DIM), generator=gen).float()
        meta = NS(num_spec_decodes=1, spec_state_indices_tensor=torch.tensor([[0] * (K + 1)]),
                  spec_query_start_loc=torch.tensor([0, q]), num_accepted_tokens=torch.tensor([accepted]))
        with pytest.raises(ConvDone) as done:
            spec_forward(lay, meta, x, None, None, buf, None, WIDTH, STATE_LEN)
        got.append(done.value.args[0])
        seq = torch.cat(stream + [x.T], dim=-1).unsqueeze(0)  # history, then this step's tokens
        want.append(F.silu(F.conv1d(seq, lay.conv1d.weight, None, groups=DIM)[0, :, -q:]).T)
        stream.append(x[:n].T)  # only accepted tokens stay in the stream
        accepted = n
    return got, want


UNIFORM = [(4, 2), (4, 4), (4, 1), (4, 3)]  # every step drafts K: vLLM's own code is right
RAGGED = [(4, 1), (2, 2), (4, 1), (3, 3)]  # fewer drafts, never fewer than accepted: no crash
CRASH = [(4, 3), (1, 1)]  # 3 accepted, then 1 token (no drafts): the buffer roll runs off its end


def test_vllm_own_code_matches_the_reference_when_every_step_drafts_k():
    got, want = run(gdn._spec_forward, UNIFORM)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_fix_is_byte_identical_when_every_step_drafts_k():
    theirs, _ = run(gdn._spec_forward, UNIFORM)
    ours, _ = run(gdn_ragged_fix.fixed_spec_forward(), UNIFORM)
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))


def test_vllm_crashes_when_a_request_drafts_fewer_tokens_than_it_accepted():
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(6\) must match the size of tensor b \(4\)"):
        run(gdn._spec_forward, CRASH)


def test_vllm_reads_the_wrong_conv_window_after_a_short_draft():
    got, want = run(gdn._spec_forward, RAGGED)
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True, True, False, False]


@pytest.mark.parametrize("steps", [RAGGED, CRASH, [(1, 1), (2, 1), (4, 4), (1, 1), (4, 2)]])
def test_the_fix_matches_the_reference_with_ragged_drafts(steps):
    got, want = run(gdn_ragged_fix.fixed_spec_forward(), steps)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_install_replaces_the_function_vllm_calls_and_records_it():
    orig = gdn._spec_forward
    try:
        patches = gdn_ragged_fix.install()
        assert gdn._spec_forward is not orig and gdn_ragged_fix.install() == patches
        assert [p["name"] for p in patches] == ["gdn-ragged-drafts"]
        assert patches[0]["replaces"] == ["vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._spec_forward"]
        dense = NS(speculative_config=None, model_config=NS(is_hybrid=True))
        assert gdn_ragged_fix.installed(dense) == []
        assert gdn_ragged_fix.installed(NS(speculative_config=object(), model_config=NS(is_hybrid=True))) == patches
    finally:
        gdn_ragged_fix.uninstall()
    assert gdn._spec_forward is orig and gdn_ragged_fix.installed() == []


def test_a_spec_forward_without_the_roll_is_refused(monkeypatch):
    def _spec_forward(*a):
        return None
    monkeypatch.setattr(gdn, "_spec_forward", _spec_forward)
    with pytest.raises(gdn_ragged_fix.FixRefused, match=r"^--engine-fix gdn-ragged-drafts: vLLM's _spec_forward"):
        gdn_ragged_fix.fixed_spec_forward()
