"""`statediff record` as users run it (issue 12): the conversation and the model are
checked before any engine starts, the built-in tiny models hold 32K positions,
and the engine's own output goes to TRACE.log instead of the terminal."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from statediff.errors import StatediffError
from statediff.replay.conversation import load_conversation
from statediff.trace import open_trace
from statediff_hooks.vllm import enginelog
from statediff_hooks.vllm.enginelog import classify, engine_output
from statediff_hooks.drivers.precheck import fit_max_model_len
from statediff_hooks.tiny.model import MARKER_NAME, tiny_config, write_model_dir

from no_engine import no_engine  # noqa: F401  the fixture
from conftest import run_cli


class EngineStarted(Exception):
    pass


def record(*args: str):
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["record", *args])
    return r, time.perf_counter() - t0


def jsonl(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# --- refused before the engine starts -------------------------------------------------


def test_a_request_longer_than_max_model_len_is_refused_with_the_length_that_fits(tiny_model, tmp_path, no_engine):
    conv = jsonl(tmp_path / "c.jsonl", {"prompt_token_ids": list(range(3, 103))},
                 {"prompt_token_ids": [5] * 5000, "max_tokens": 16})
    r, _ = record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"),
                     "--max-model-len", "4096")
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        f"statediff: error: {conv}:2: request 1 needs 5016 tokens (5000 prompt + 16 max_tokens), more than "
        "--max-model-len 4096; --max-model-len 5120 fits every request"]
    assert no_engine == [] and not (tmp_path / "x.h5").exists() and not (tmp_path / "x.h5.log").exists()


def test_a_request_longer_than_the_model_is_refused_without_max_model_len(tiny_model, tmp_path, no_engine):
    conv = jsonl(tmp_path / "c.jsonl", {"prompt_token_ids": [7] * 32760})
    r, _ = record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        f"statediff: error: {conv}:1: request 0 needs 32776 tokens (32760 prompt + 16 max_tokens), more than "
        f"the model holds (max_position_embeddings 32768 in {tiny_model}/config.json)"]
    assert no_engine == []


def test_a_token_id_outside_the_vocabulary_is_named_with_its_line(tiny_model, tmp_path, no_engine):
    conv = jsonl(tmp_path / "c.jsonl", {"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 2, 3]},
                 {"prompt_token_ids": [4, 5, 1024, 6]})
    r, _ = record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        f"statediff: error: {conv}:3: token id 1024 (prompt position 2) is outside the vocabulary of "
        f"{tiny_model} (ids 0..1023)"]
    assert no_engine == []


@pytest.mark.parametrize("case,message", [
    ("missing", "--model {m}: no such directory"),
    ("empty", "--model {m}: empty directory (a model directory holds config.json, the weights and the "
              "tokenizer files)"),
    ("file", "--model {m}: a file, not a model directory (one holding config.json, the weights and the "
             "tokenizer files)"),
    ("no-config", "--model {m}: no config.json in this directory (it holds model.safetensors, tokenizer.json)"),
    ("bad-config", "--model {m}: config.json is not a JSON object"),
])
def test_a_bad_model_directory_is_one_line(tmp_path, no_engine, case, message):
    m = tmp_path / "model"
    if case == "empty":
        m.mkdir()
    elif case == "file":
        m.write_text("weights")
    elif case in ("no-config", "bad-config"):
        m.mkdir()
        (m / "model.safetensors").write_bytes(b"")
        (m / "tokenizer.json").write_text("{}")
        if case == "bad-config":
            (m / "config.json").write_text("[1, 2]")
    r, _ = record("--model", str(m), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.exit_code == 2
    assert r.stderr.splitlines() == ["statediff: error: " + message.format(m=m)]
    assert no_engine == []


@pytest.mark.parametrize("field,message", [
    ({"temperature": -0.5}, "'temperature' must be in [0, 2] (0 is greedy), not -0.5"),
    ({"temperature": 3}, "'temperature' must be in [0, 2] (0 is greedy), not 3"),
    ({"top_p": 0}, "'top_p' must be in (0, 1], not 0"),
    ({"top_k": -2}, "'top_k' must be a whole number, -1 or 0 (off) or at least 1, not -2"),
    ({"top_k": 1.5}, "'top_k' must be a whole number, -1 or 0 (off) or at least 1, not 1.5"),
    ({"max_tokens": 0}, "'max_tokens' must be a whole number of at least 1, not 0"),
    ({"max_tokens": 2.5}, "'max_tokens' must be a whole number of at least 1, not 2.5"),
    ({"seed": 1.5}, "'seed' must be a whole number, not 1.5"),
])
def test_bad_sampling_fields_are_named_with_their_line(tmp_path, no_engine, field, message):
    conv = jsonl(tmp_path / "c.jsonl", {"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 2, 3], **field})
    r, _ = record(str(conv), "--model", str(tmp_path / "unused"), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [f"statediff: error: {conv}:2: {message}"]
    assert no_engine == []


def test_default_max_model_len_is_the_longest_request_rounded_up_to_a_block(tiny_model, tmp_path, no_engine):
    conv = jsonl(tmp_path / "c.jsonl", {"prompt_token_ids": [5] * 100, "max_tokens": 16},
                 {"prompt_token_ids": [6] * 300, "max_tokens": 40}, {"prompt_token_ids": [7] * 200})
    r, _ = record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.exit_code == 2 and no_engine[0]["kw"]["max_model_len"] == 384  # 340 -> 3 blocks of 128
    r, _ = record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"),
                  "--block-size", "32")
    assert no_engine[1]["kw"]["max_model_len"] == 352  # 11 blocks of 32
    r, _ = record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"),
                  "--max-model-len", "340")
    assert no_engine[2]["kw"]["max_model_len"] == 340  # the user's setting, when everything fits


def test_chat_requests_are_tokenised_once_with_the_chat_template(tiny_model, tmp_path, no_engine):
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the cache cold?"}]
    conv = jsonl(tmp_path / "c.jsonl", {"messages": msgs, "tools": [_tool(0)], "max_tokens": 4})
    record(str(conv), "--model", str(tiny_model), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    want = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        msgs, tools=[_tool(0)], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert no_engine[0]["prompts"] == [list(want)]
    assert no_engine[0]["kw"]["max_model_len"] == 128 * -(-(len(want) + 4) // 128)


def test_the_model_limit_caps_the_default_and_a_given_max_model_len_wins(tmp_path):
    turns = load_conversation(jsonl(tmp_path / "c.jsonl", {"prompt_token_ids": [1] * 1000, "max_tokens": 20}))
    prompts = [[1] * 1000]
    limit = (1024, "max_position_embeddings 1024 in m/config.json")
    assert fit_max_model_len(turns, prompts, max_model_len=None, limit=limit, block_size=None, source="c") == 1024
    assert fit_max_model_len(turns, prompts, max_model_len=2000, limit=limit, block_size=None, source="c") == 2000
    with pytest.raises(StatediffError, match=r"^c:1: request 0 needs 1020 tokens \(1000 prompt \+ 20 max_tokens\), "
                                             r"more than --max-model-len 1000; --max-model-len 1024 fits every request$"):
        fit_max_model_len(turns, prompts, max_model_len=1000, limit=limit, block_size=None, source="c")


# --- tiny models -------------------------------------------------------------------------


def test_tiny_models_hold_32k_positions(tiny_model):
    assert tiny_config()["max_position_embeddings"] == 32768
    assert json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"] == 32768
    assert json.loads((tiny_model / "tokenizer_config.json").read_text())["model_max_length"] == 32768


@pytest.mark.engine  # write_model_dir imports torch when it runs
@pytest.mark.engine  # write_model_dir imports torch when it writes
def test_a_tiny_model_from_an_older_generator_is_rebuilt_in_place(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text('{"max_position_embeddings": 4096}')
    (out / MARKER_NAME).write_text(json.dumps({"generator_version": 1, "seed": 0, "architecture": "A"}))

    def files(d):
        (d / "config.json").write_text('{"max_position_embeddings": 32768}')
        return "digest"

    def marker(digest):
        from statediff_hooks.tiny.model import GENERATOR_VERSION

        return {"generator_version": GENERATOR_VERSION, "seed": 0, "architecture": "A"}

    write_model_dir(out, files, marker, seed=0, architecture="A", overwrite=False)
    assert json.loads((out / "config.json").read_text()) == {"max_position_embeddings": 32768}
    (out / MARKER_NAME).write_text(json.dumps({"generator_version": 1, "seed": 0, "architecture": "B"}))
    with pytest.raises(FileExistsError):  # another model: never overwritten unasked
        write_model_dir(out, files, marker, seed=0, architecture="A", overwrite=False)


# --- quiet engine output -----------------------------------------------------------------


@pytest.mark.parametrize("line,shown", [
    ("(MainProcess pid=10340) INFO 11-30 10:18:26 [model.py:733] Resolved architecture: Qwen3NextForCausalLM", None),
    ("(MainProcess pid=10340) WARNING 11-30 10:18:27 [cpu.py:224] Triton is not installed. triton-cpu is "
     "expected on x86 CPUs.", None),
    ("(MainProcess pid=10340) WARNING 11-30 10:18:28 [cpu_worker.py:114] libtcmalloc is not found in "
     "LD_PRELOAD. For best performance, ...", None),
    ("[W1130 10:18:28.207410668 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory "
     "allocation on the NUMA nodes (0).", None),
    ("/x/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated", None),
    ("(MainProcess pid=1) WARNING 11-30 10:29:00 [model.py:2498] Casting torch.bfloat16 to torch.float16.",
     ("WARNING [model.py:2498]", "engine WARNING [model.py:2498]: Casting torch.bfloat16 to torch.float16.")),
    ("(EngineCore pid=7) ERROR 11-30 10:29:00 [core.py:9] EngineCore failed to start.",
     ("ERROR [core.py:9]", "engine ERROR [core.py:9]: EngineCore failed to start.")),
    ("/x/torch/nn/modules/module.py:12: UserWarning: something new",
     ("UserWarning", "engine UserWarning: something new")),
])
def test_engine_lines_are_classified(line, shown):
    assert classify(line) == shown


def test_engine_output_goes_to_the_log_and_only_unknown_warnings_reach_the_terminal(tmp_path, capfd):
    log = tmp_path / "hit.h5.log"
    info = b"(MainProcess pid=1) INFO 11-30 10:18:26 [model.py:733] Resolved architecture: X\n"
    known = b"(MainProcess pid=1) WARNING 11-30 10:18:27 [cpu.py:224] Triton is not installed.\n"
    unknown = b"(MainProcess pid=1) WARNING 11-30 10:18:27 [utils.py:333] Attempted to load weight w%d\n"
    with engine_output(log, progress=False) as console:
        os.write(1, info)
        os.write(2, known)
        for i in range(4):
            os.write(2, unknown % i)
        os.write(2, b"[W1130 10:18:28.2 utils.cpp:68] Warning: NUMA binding: MEMBIND\n")
        assert console.log_path == log
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "engine WARNING [utils.py:333]: Attempted to load weight w0",
        "engine WARNING [utils.py:333]: Attempted to load weight w1",
        f"engine WARNING [utils.py:333]: more like these in {log}",
    ]
    text = log.read_bytes()
    assert info in text and known in text and unknown % 3 in text and b"NUMA binding" in text


def test_status_line_ends_with_done_and_survives_a_warning():
    term = io.StringIO()
    console = enginelog.Console(term)
    with console.status("starting vLLM engine (model m)") as st:
        st["note"] = "block size 32"
    with console.status("starting vLLM engine (model m)"):
        console.warn("engine WARNING [x.py:1]: odd")
    with pytest.raises(RuntimeError), console.status("starting vLLM engine (model m)"):
        raise RuntimeError
    assert term.getvalue().splitlines() == [
        "starting vLLM engine (model m)... done in 0.0 s (block size 32)",
        "starting vLLM engine (model m)... ",
        "engine WARNING [x.py:1]: odd",
        "... done in 0.0 s",
        "starting vLLM engine (model m)... failed",
    ]


def test_progress_bar_is_off_when_stderr_is_not_a_terminal(tmp_path, capfd):
    with engine_output(tmp_path / "x.log") as console:
        assert console.progress is False
        bar = console.replay_bar("record hit", 2, 100)
        bar.request_done(60)
        bar.request_done(40)
        bar.close()
    assert capfd.readouterr().err == ""
    assert enginelog.plain_console(progress=True).progress is False  # pytest's stderr is no terminal either


# --- end to end on the engine -------------------------------------------------------------


def _tool(i: int) -> dict:
    kinds = ["read_file", "run_tests", "search_code", "list_dir", "git_diff"]
    return {"type": "function", "function": {
        "name": f"tool_{i:02d}_{kinds[i % 5]}", "description": f"Tool {i}: inspect the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "pattern": {"type": "string", "description": "A regular expression to search for."},
            "limit": {"type": "integer"}}, "required": ["path"]}}}


def agent_conversation(n_tools: int = 25, n_requests: int = 5, result_lines: int = 8) -> list[dict]:
    """OpenAI chat JSONL lines of an agent loop: a system prompt and ``n_tools`` tool schemas,
    then per request one user turn; each request repeats the previous one plus its tool call
    and tool result (``result_lines`` lines of code), as an agent replays its context."""
    tools = [_tool(i) for i in range(n_tools)]
    messages = [{"role": "system", "content": "You are a careful coding agent. Use the tools before answering."}]
    lines = []
    for r in range(n_requests):
        messages.append({"role": "user", "content": f"Step {r}: find why the cache tests fail and fix it."})
        lines.append({"messages": [dict(m) for m in messages], "tools": tools, "max_tokens": 8})
        name = tools[(7 * r) % n_tools]["function"]["name"]
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": name, "arguments": {"path": f"src/module_{r}.py", "limit": 50}}}]})
        messages.append({"role": "tool", "content": "\n".join(
            f"{k:4d}    def method_{r}_{k}(self, key, value):  # keeps block {k} of request {r}"
            for k in range(result_lines))})
    return lines


@pytest.mark.vllm
@pytest.mark.slow
def test_agent_conversation_with_25_tools_past_4096_tokens_records_quietly(tiny_model, tmp_path):
    """No --max-model-len: the engine gets the longest request rounded up to a block; the
    engine's logs land in hit.h5.log, the terminal keeps statediff's lines."""
    conv = jsonl(tmp_path / "agent.jsonl", *agent_conversation())
    out = tmp_path / "hit.h5"
    r = run_cli("record", str(conv), "--model", str(tiny_model), "--mode", "hit", "--enforce-eager", "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    with open_trace(out) as t:
        reqs = [t.requests[i] for i in range(5)]
        assert [q["prompt_len"] for q in reqs] == [3515, 3862, 4210, 4558, 4906]
        assert [q["num_cached_tokens"] for q in reqs] == [0, 3456, 3840, 4096, 4480]
        assert all(1 <= len(q["output_token_ids"]) <= 8 for q in reqs)
        assert t.run["block_size"] == 128 and not t.partial
    assert r.stdout.splitlines()[0].startswith("recorded 5 requests (hit, default chunking, block size 128)")
    err = r.stderr.splitlines()
    assert err[0].startswith(f"starting vLLM engine (model {tiny_model}, default block size, max model len 4992)"
                             "... done in ") and err[0].endswith(" s (block size 128)")
    assert not [ln for ln in err if "INFO" in ln], err  # no engine logs, no progress bar (not a terminal)
    log = (tmp_path / "hit.h5.log").read_text()
    assert "INFO" in log and "Resolved architecture: Qwen3NextForCausalLM" in log
    assert "Using max model len 4992" in log


def test_the_builtin_conversation_on_a_model_without_a_chat_template_is_sent_as_token_ids(
        tiny_model, tmp_path, no_engine):
    """Issue 19: no chat template -> one note line, then the plain-text token ids (the engine gets those)."""
    import shutil

    from statediff_hooks.drivers.demo import demo_conversation, plain_text

    m = tmp_path / "notemplate"
    shutil.copytree(tiny_model, m)
    (m / "chat_template.jinja").unlink()
    r, _ = record("--model", str(m), "--mode", "hit", "-o", str(tmp_path / "x.h5"))
    assert r.exit_code == 2  # the fake engine's refusal
    assert r.stderr.splitlines() == [
        f"statediff: note: {m} has no chat template: the built-in conversation is sent as token ids of "
        "plain 'role: content' text", "statediff: error: engine would start here"]
    turns = no_engine[0]["turns"]
    assert [t.messages for t in turns] == [None] * 5
    first = plain_text(demo_conversation()[0])
    assert first.startswith("system: You are a careful coding agent.") and first.endswith("\n\nuser: The cache "
                                                                                         "tests fail after the last merge. Find out why.\n\nassistant:")
    from transformers import AutoTokenizer

    assert turns[0].prompt_token_ids == AutoTokenizer.from_pretrained(str(m)).encode(first)
    assert no_engine[0]["prompts"] == [t.prompt_token_ids for t in turns]
