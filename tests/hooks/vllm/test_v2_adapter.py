"""The Model Runner V2 adapter's reads and fault targets on stand-in runner objects (no engine): the
device block-table row by request slot (``v2/surface.py``, ``v2/faults.py``), an ``AsyncOutput`` read
as the V1 capture reads a ``ModelRunnerOutput``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.engine
torch = pytest.importorskip("torch")


def _runner():
    tables = [torch.tensor([[0, 0, 0, 0], [7, 8, 9, 3], [0, 0, 0, 0]], dtype=torch.int32),
              torch.tensor([[0, 0, 0, 0], [11, 12, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)]
    bt = SimpleNamespace(block_tables=[SimpleNamespace(gpu=t) for t in tables], num_kv_cache_groups=2,
                         num_blocks=SimpleNamespace(np=np.array([[0, 3, 0], [0, 2, 0]], dtype=np.int32)))
    ms = SimpleNamespace(_mamba_state_idx_gpu=torch.tensor([0, 2, 0], dtype=torch.int32))
    return SimpleNamespace(req_states=SimpleNamespace(req_id_to_index={"r": 1}), block_tables=bt, model_state=ms)


def test_a_requests_blocks_are_its_slot_row_up_to_its_length():
    from statediff_hooks.vllm.v2 import surface as v2

    r = _runner()
    assert v2.slot_block_ids(r, "r") == ([7, 8, 9], [11, 12])
    assert v2.slot_block_ids(r, "gone") is None
    assert v2.mamba_state_column(r, "r") == 2 and int(v2.block_table(r, 0)[1, 2]) == 9
    with pytest.raises(KeyError):
        v2.mamba_state_column(r, "gone")


@pytest.mark.parametrize("fault,row", [("kv-swap", [7, 9, 8, 3]), ("kv-stale", [7, 8, 8, 3])])
def test_kv_faults_edit_the_device_row_by_slot_and_nothing_else(fault, row):
    """j = hit // block - 1 = 2 for a hit of 3 blocks: kv-swap exchanges logical blocks 1 and 2, kv-stale
    reads block 2 where block 1 is; the other slots' rows and the other group stay as they were."""
    from statediff_hooks.recording.faults import KV_REMAPS
    from statediff_hooks.vllm.v2.faults import DeviceBlockTableRow

    r = _runner()
    before = [t.gpu.clone() for t in r.block_tables.block_tables]
    DeviceBlockTableRow(r, 0, "r").remap_kv_blocks(KV_REMAPS[fault](2))
    assert r.block_tables.block_tables[0].gpu[1].tolist() == row
    assert torch.equal(r.block_tables.block_tables[0].gpu[[0, 2]], before[0][[0, 2]])
    assert torch.equal(r.block_tables.block_tables[1].gpu, before[1])
    with pytest.raises(KeyError):
        DeviceBlockTableRow(r, 0, "gone")


def test_an_async_output_is_read_through_get_output_and_a_plain_output_as_is():
    from statediff_hooks.vllm.v2 import surface as v2

    plain = SimpleNamespace(req_ids=["a"], sampled_token_ids=[[5]])
    assert v2.runner_output(plain) is plain
    calls = []
    async_out = SimpleNamespace(sampler_output=object(), get_output=lambda: calls.append(1) or plain)
    assert v2.runner_output(async_out) is plain and calls == [1]
