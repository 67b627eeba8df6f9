"""Build tiny, random, fully offline target models for tests.

``build_tiny_model(out_dir, seed=0)`` writes a Qwen3-Next hybrid and
``build_tiny_dense_model(out_dir, seed=0)`` a dense Qwen2 (see
``tiny_dense_config``; the EAGLE-3 drafter for it is built by
``statediff_hooks.tiny.draft``). Both share the tokenizer, chat template,
seeded weight drawing and atomic directory writer below. The hybrid is a
Hugging Face model directory that both ``transformers`` and vLLM load with
no network access:

- ``config.json``: ``Qwen3NextForCausalLM`` (``model_type`` ``qwen3_next``),
  fields as in transformers 5.19 ``Qwen3NextConfig``, read by vLLM 0.32
  ``vllm/model_executor/models/qwen3_next.py``. 4 layers: 3 Gated DeltaNet
  (linear attention) + 1 full attention (``full_attention_interval`` 4).
- ``model.safetensors``: bfloat16 random weights. Each tensor is drawn from
  its own ``torch.Generator`` seeded by ``sha256(f"{seed}:{name}")``, so the
  file is byte-identical for a given seed (and torch version) and adding a
  tensor never shifts the values of the others.
- ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``:
  a byte-level BPE trained with ``tokenizers`` on a built-in English/code
  corpus, and a ChatML chat template with ``tools`` and tool calls.
- ``generation_config.json`` and the marker ``statediff_tiny.json`` (seed,
  generator version, weights digest, library versions).

Shape choices (vLLM 0.32 CPU facts):

- GDN: 1 key head, 2 value heads, head dims 64 (the CPU GDN kernel needs
  bf16 and a head dim of 64 or 128). Per-block state: conv ``(3, 256)`` bf16
  (1536 B) + ssm ``(2, 64, 64)`` fp32 (32768 B) = 34304 B.
- Full attention: 8 query heads, 4 KV heads, head dim 128 (gated output,
  partial rotary 0.25). KV page per token = 2*4*128*2 B = 2048 B, so a
  32-token block (65536 B) already holds one mamba state page and vLLM's
  hybrid block-size alignment keeps ``block_size=32`` instead of raising it.
- ``A_log = log(U(5e-4, 5e-3))``: per-token decay ~0.994-0.999, so the
  recurrent state carries information over hundreds of tokens and a wrongly
  restored state shows up in the outputs. (transformers' default init,
  ``log(U(0.01, 16))``, forgets within a few tokens.)
- MLPs are dense (``mlp_only_layers`` = layers 0-2) except the last layer:
  vLLM 0.32's ``Qwen3NextForCausalLM.set_moe_parameters`` raises unless at
  least one layer is MoE. That layer has ``num_experts=1`` and top-1, so the
  router weight is always exactly 1 and routing can never flip; a shared
  expert with its sigmoid gate sits beside it, as in the real model.

Everything else follows transformers' ``Qwen3NextPreTrainedModel
._init_weights``: matrices N(0, 0.02), 1-centred RMSNorm weights 0, gated
GDN norm weight 1, ``dt_bias`` 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["GENERATOR_VERSION", "MARKER_NAME", "build_tiny_dense_model", "build_tiny_model",
           "build_tiny_tp_model", "tiny_config", "tiny_dense_config", "tiny_tp_config"]

#: Bump when anything that changes the written files changes (a model directory
#: written by an older version is rebuilt in place on next use).
#: 2: 32K positions (max_position_embeddings, tokenizer model_max_length), was 4096.
GENERATOR_VERSION = 2
MARKER_NAME = "statediff_tiny.json"

VOCAB_SIZE = 1024
#: Positions the tiny models accept (tokens): enough for real agent conversations
#: (25 tool schemas and a few turns run past 4K). RoPE stays "default" (no scaling),
#: whose frequencies do not depend on this number, so outputs are those of the
#: 4096-position models; only the config (and so config_digest) differs.
MAX_POSITIONS = 32768
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Plain added tokens (not special: they survive skip_special_tokens).
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_A_LOG_RANGE = (5e-4, 5e-3)
_INIT_STD = 0.02


# Keys both tiny targets (hybrid and dense) share; token ids refer to the shared tokenizer.
_COMMON_CONFIG: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": _INIT_STD,
    "max_position_embeddings": MAX_POSITIONS,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_config() -> dict[str, Any]:
    """Return the ``config.json`` contents (a plain dict, JSON-serialisable).

    Mirrors transformers 5.19 ``Qwen3NextConfig`` field names; vLLM 0.32
    reads the same names. Token ids refer to the tokenizer written alongside
    (specials first: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>``).
    """
    n_layers = 4
    layer_types = ["linear_attention"] * (n_layers - 1) + ["full_attention"]
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": n_layers,
        "layer_types": layer_types,
        "full_attention_interval": 4,
        # full attention
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        # Gated DeltaNet (linear attention)
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        # MLP / MoE: dense except the last layer (see module docstring)
        "mlp_only_layers": list(range(n_layers - 1)),
        "decoder_sparse_step": 1,
        "num_experts": 1,
        "num_experts_per_tok": 1,
        "norm_topk_prob": True,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        # misc
        **_COMMON_CONFIG,
    }


def _param_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:  # long: one checkpoint table, its shapes drawn in the docstring
    """List ``(name, shape, init)`` for every checkpoint tensor.

    Names are the Hugging Face hub checkpoint names (per-expert MoE weights,
    separate q/k/v and gate/up projections). ``init`` is one of ``normal``,
    ``zeros``, ``ones``, ``a_log``. Shapes for the default config::

        embed_tokens / lm_head              (1024, 256)
        linear_attn.in_proj_qkvz            (384, 256)   q,k (64 each), v,z (128 each)
        linear_attn.in_proj_ba              (4, 256)     b,a per value head
        linear_attn.conv1d                  (256, 1, 4)  depthwise over q,k,v
        linear_attn.A_log / dt_bias         (2,)
        linear_attn.norm                    (64,)        gated RMSNorm, 1-based
        linear_attn.out_proj                (256, 128)
        self_attn.q_proj                    (2048, 256)  query + output gate
        self_attn.k_proj / v_proj           (512, 256)
        self_attn.o_proj                    (256, 1024)
        self_attn.q_norm / k_norm           (128,)       0-centred (1 + w)
    """
    # Over 80 lines on purpose: one table, read top to bottom like the checkpoint it describes.
    h = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal"),
    ]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            specs += [
                (f"{a}.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h), "normal"),
                (f"{a}.in_proj_ba.weight", (2 * nv, h), "normal"),
                (f"{a}.conv1d.weight", (2 * key_dim + value_dim, 1, cfg["linear_conv_kernel_dim"]), "normal"),
                (f"{a}.dt_bias", (nv,), "ones"),
                (f"{a}.A_log", (nv,), "a_log"),
                (f"{a}.norm.weight", (dv,), "ones"),
                (f"{a}.out_proj.weight", (h, value_dim), "normal"),
            ]
        elif kind == "full_attention":
            a = f"{p}.self_attn"
            specs += [
                (f"{a}.q_proj.weight", (2 * nh * hd, h), "normal"),
                (f"{a}.k_proj.weight", (nkv * hd, h), "normal"),
                (f"{a}.v_proj.weight", (nkv * hd, h), "normal"),
                (f"{a}.o_proj.weight", (h, nh * hd), "normal"),
                (f"{a}.q_norm.weight", (hd,), "zeros"),
                (f"{a}.k_norm.weight", (hd,), "zeros"),
            ]
        else:
            raise ValueError(f"unknown layer type {kind!r}")
        m = f"{p}.mlp"
        if i in cfg["mlp_only_layers"] or cfg["num_experts"] == 0:
            inter = cfg["intermediate_size"]
            specs += [
                (f"{m}.gate_proj.weight", (inter, h), "normal"),
                (f"{m}.up_proj.weight", (inter, h), "normal"),
                (f"{m}.down_proj.weight", (h, inter), "normal"),
            ]
        else:
            inter, sh = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
            specs.append((f"{m}.gate.weight", (cfg["num_experts"], h), "normal"))
            for e in range(cfg["num_experts"]):
                specs += [
                    (f"{m}.experts.{e}.gate_proj.weight", (inter, h), "normal"),
                    (f"{m}.experts.{e}.up_proj.weight", (inter, h), "normal"),
                    (f"{m}.experts.{e}.down_proj.weight", (h, inter), "normal"),
                ]
            specs += [
                (f"{m}.shared_expert.gate_proj.weight", (sh, h), "normal"),
                (f"{m}.shared_expert.up_proj.weight", (sh, h), "normal"),
                (f"{m}.shared_expert.down_proj.weight", (h, sh), "normal"),
                (f"{m}.shared_expert_gate.weight", (1, h), "normal"),
            ]
        specs += [
            (f"{p}.input_layernorm.weight", (h,), "zeros"),
            (f"{p}.post_attention_layernorm.weight", (h,), "zeros"),
        ]
    specs += [
        ("model.norm.weight", (h,), "zeros"),
        ("lm_head.weight", (cfg["vocab_size"], h), "normal"),
    ]
    return specs


def tiny_dense_config() -> dict[str, Any]:
    """Return the ``config.json`` of the tiny dense target (a plain dict).

    ``Qwen2ForCausalLM`` (``model_type`` ``qwen2``; transformers 5.19
    ``Qwen2Config`` names, read by vLLM 0.32 ``models/qwen2.py``, which
    supports EAGLE-3 aux hidden-state outputs). 4 layers, hidden 256, 4 query
    heads and 2 KV heads of dim 64 (q/k/v biases, as in Qwen2), dense MLP 512,
    the tokenizer's 1024-token vocabulary. RMSNorm weights are plain
    multipliers (initialised to 1, unlike Qwen3-Next's 1-centred ones).
    With vLLM 0.32 CPU and ``block_size=32`` the block size stays 32.
    """
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["full_attention"] * 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
        "attention_dropout": 0.0,
        **_COMMON_CONFIG,
    }


def _dense_param_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, init)`` of every tensor of the dense Qwen2 checkpoint.

    Shapes for the default config: embed_tokens / lm_head (1024, 256);
    q_proj (256, 256) + bias (256,); k_proj / v_proj (128, 256) + bias (128,);
    o_proj (256, 256); gate_proj / up_proj (512, 256); down_proj (256, 512);
    norms (256,) initialised to 1; biases to 0.
    """
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal"),
    ]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.self_attn.q_proj.weight", (nh * hd, h), "normal"),
            (f"{p}.self_attn.q_proj.bias", (nh * hd,), "zeros"),
            (f"{p}.self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (f"{p}.self_attn.k_proj.bias", (nkv * hd,), "zeros"),
            (f"{p}.self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (f"{p}.self_attn.v_proj.bias", (nkv * hd,), "zeros"),
            (f"{p}.self_attn.o_proj.weight", (h, nh * hd), "normal"),
            (f"{p}.mlp.gate_proj.weight", (inter, h), "normal"),
            (f"{p}.mlp.up_proj.weight", (inter, h), "normal"),
            (f"{p}.mlp.down_proj.weight", (h, inter), "normal"),
            (f"{p}.input_layernorm.weight", (h,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
        ]
    specs += [
        ("model.norm.weight", (h,), "ones"),
        ("lm_head.weight", (cfg["vocab_size"], h), "normal"),
    ]
    return specs


def draw_tensor(name: str, shape: tuple[int, ...], init: str, seed: int, std: float = _INIT_STD) -> Any:
    """One float32 CPU tensor, drawn from a generator seeded by ``sha256(f"{seed}:{name}")``.

    ``init``: ``normal`` (N(0, std)), ``zeros``, ``ones`` or ``a_log``
    (log U(5e-4, 5e-3)). The same (seed, name) always gives the same values,
    whatever else is drawn.
    """
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    t = torch.empty(shape, dtype=torch.float32)
    if init == "normal":
        t.normal_(0.0, std, generator=gen)
    elif init == "zeros":
        t.zero_()
    elif init == "ones":
        t.fill_(1.0)
    elif init == "a_log":
        t.uniform_(*_A_LOG_RANGE, generator=gen).log_()
    else:  # pragma: no cover
        raise ValueError(init)
    return t


def _make_weights(specs: list[tuple[str, tuple[int, ...], str]], seed: int) -> dict[str, Any]:
    """Return ``{name: torch.Tensor}`` for ``specs``, all bfloat16, contiguous, on CPU."""
    import torch

    return {name: draw_tensor(name, shape, init, seed).to(torch.bfloat16).contiguous()
            for name, shape, init in specs}


# --- tokenizer -------------------------------------------------------------

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tc in message.tool_calls %}
{%- set fn = tc.function if tc.function is defined else tc %}
{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
{%- if loop.index > 1 or message.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' + args + '}</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A serving engine keeps a cache of
the keys and values it has already computed, so that a second request which
shares a long prefix with the first one does not have to compute it again.
In a hybrid model some layers are recurrent: instead of keys and values they
carry a small state that is updated at every token. When the engine reuses a
cached prefix it must also restore that state exactly at the block boundary.
If the state is wrong, nothing crashes; the model simply starts to say strange
things, and the user notices only many turns later. Good tools make such bugs
visible: they record every tensor, align two runs by position, and report the
first layer where the numbers disagree beyond the expected rounding noise.

User: Can you summarize the weather report for tomorrow in Paris and Berlin?
Assistant: Tomorrow will be cloudy in Paris with light rain in the afternoon,
and sunny but cold in Berlin. Temperatures range from three to eleven degrees.
User: Please book a table for two people at seven o'clock in the evening.
Assistant: I found a quiet restaurant near the river. Shall I confirm it?
User: Yes, thank you. Also remind me to call my sister on Friday morning.

History, science and mathematics are taught in every school. Students read
books, write essays, solve equations, and run experiments in the laboratory.
The library opens at nine and closes at six; members may borrow ten books for
three weeks. Music, painting and sport are important too, because a healthy
mind lives in a healthy body. Every year the city hosts a festival with food,
dance, theatre and fireworks over the harbour.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class Cache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self.blocks: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.blocks.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self.blocks) >= self.capacity:
            oldest = next(iter(self.blocks))
            del self.blocks[oldest]
        self.blocks[key] = value


import json
import os
import sys

def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "config.json"
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    for key, value in sorted(data.items()):
        print(f"{key}: {value}")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))

{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Name of the city"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "search_files", "description": "Search files in the repository for a pattern", "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}}, "required": ["pattern"]}}}
{"type": "function", "function": {"name": "run_command", "description": "Run a shell command and return its output", "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["command"]}}}
<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>
<tool_response>{"temperature": 11, "condition": "light rain", "humidity": 0.82}</tool_response>

$ git status
On branch main
Changes not staged for commit:
  modified:   src/server/cache.py
$ python -m pytest tests/ -q
........................................ [100%]
42 passed in 3.14s
$ grep -rn "block_size" src/ | head -n 5
SELECT name, email, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
for (let i = 0; i < items.length; i++) { console.log(items[i]); }

#include <stdio.h>
int main(void) { printf("hello, world\n"); return 0; }

fn main() { let v: Vec<u32> = (0..10).collect(); println!("{:?}", v); }

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1024 2048 4096.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March
April May June July August September October November December morning evening.
red orange yellow green blue purple black white grey brown pink gold silver.
north south east west left right up down inside outside before after between.
'''


def _train_tokenizer():
    """Train the byte-level BPE; returns a ``tokenizers.Tokenizer``.

    Ids: 0-2 special tokens, then the 256 byte symbols and merges, and the
    last ``len(ADDED_TOKENS)`` ids are the tool-call tags. Total ``VOCAB_SIZE``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating lines with small variations gives the trainer enough pairs
    # to reach the target vocabulary deterministically.
    lines = [ln for ln in _CORPUS.splitlines() if ln.strip()]
    corpus = [_CORPUS] + [f"{i}: {ln}" for i, ln in enumerate(lines)] + [CHAT_TEMPLATE]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,  # vLLM caps max_model_len by it too
        "extra_special_tokens": {},
    }


# --- writer ----------------------------------------------------------------


def _marker(seed: int, weights_sha256: str, architecture: str) -> dict[str, Any]:
    import tokenizers
    import torch

    return {
        "generator": "statediff_hooks.tinymodel",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "architecture": architecture,
        "weights_sha256": weights_sha256,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
    }


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny Qwen3-Next model directory and return its path.

    Args:
        out_dir: target directory (created, parents included).
        seed: weight seed. Same seed (and torch version) -> byte-identical
            ``model.safetensors``; the tokenizer does not depend on the seed.
        overwrite: rewrite the files even if ``out_dir`` already holds them.

    If ``out_dir`` already holds a model from this generator version with the
    same seed and architecture, it is returned untouched (cheap for test
    fixtures). A non-empty ``out_dir`` holding anything else raises
    ``FileExistsError`` unless ``overwrite``. Files are written into a
    temporary sibling directory first and then moved in, so a concurrent
    reader never sees a partial model. Only the generator's own files are
    replaced; other files are left alone.

    Side effect: calls ``torch.set_flush_denormal(True)`` in the calling
    process (random weights produce denormals at run time, which make CPU
    matmuls 50-100x slower; whoever runs the model should call it too).

    With vLLM 0.32 CPU, ``block_size=32`` and prefix caching stay at 32
    tokens (mamba page padded 34304 -> 65536 B); ``block_size=16`` is raised
    to 32; no ``block_size`` gives the CPU default 128.
    """
    cfg = tiny_config()
    return _build_target(out_dir, cfg, _param_specs(cfg), seed=seed, overwrite=overwrite)


def tiny_tp_config() -> dict[str, Any]:
    """``config.json`` of the tiny hybrid for tensor parallel size 2 (``--model tiny-tp``).

    ``tiny_config`` with 2 GDN key heads and 4 GDN value heads (head dims 64), so that
    vLLM 0.32 can shard every kind of head over 2 ranks: each rank holds 1 key head,
    2 value heads and 2 of the 4 attention KV heads (4 of the 8 query heads), and 2 MoE
    experts, both routed to every token. A hybrid with one key head fails to start under
    ``tensor_parallel_size=2``. Per-rank GDN
    state: conv ``(3, 256)`` (q 64 | k 64 | v 128 of the rank's heads), ssm ``(2, 64, 64)``.
    """
    cfg = tiny_config()
    # 2 experts, both always routed (top-2 of 2): vLLM 0.32 refuses more ranks than experts
    # (models/qwen3_next.py Qwen3NextSparseMoeBlock), and routing still cannot flip
    cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, num_experts=2, num_experts_per_tok=2)
    return cfg


def build_tiny_tp_model(out_dir: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the tiny hybrid for tensor parallel size 2 (``tiny_tp_config``) and return its path.

    Same tokenizer, seeding, caching and atomic-write rules as ``build_tiny_model``.
    """
    cfg = tiny_tp_config()
    return _build_target(out_dir, cfg, _param_specs(cfg), seed=seed, overwrite=overwrite)


def build_tiny_dense_model(out_dir: str | Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write the tiny dense Qwen2 target (``tiny_dense_config``) and return its path.

    Same tokenizer, chat template, seeding, caching and atomic-write rules
    as ``build_tiny_model``; ``FileExistsError`` likewise.
    """
    cfg = tiny_dense_config()
    return _build_target(out_dir, cfg, _dense_param_specs(cfg), seed=seed, overwrite=overwrite)


def _build_target(out_dir: str | Path, cfg: dict[str, Any], specs: list | None, *, seed: int,
                  overwrite: bool, weights: Any = None) -> Path:
    """Write a target model (config, weights, tokenizer files) via ``write_model_dir``;
    ``weights()`` (a ``{name: tensor}`` dict) replaces the weights drawn from ``specs``."""

    def files(tmp: Path) -> str:
        from safetensors.torch import save_file

        tensors = weights() if weights is not None else _make_weights(specs, seed)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _dump_json(tmp / "config.json", cfg)
        _dump_json(
            tmp / "generation_config.json",
            {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": False},
        )
        _train_tokenizer().save(str(tmp / "tokenizer.json"), pretty=True)
        _dump_json(tmp / "tokenizer_config.json", _tokenizer_config())
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
        return hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()

    arch = cfg["architectures"][0]
    return write_model_dir(out_dir, files, lambda d: _marker(seed, d, arch), seed=seed,
                           architecture=arch, overwrite=overwrite)


def write_model_dir(out_dir: str | Path, files: Any, marker: Any, *, seed: int, architecture: str,
                    overwrite: bool) -> Path:
    """Atomically write a generated model directory; shared by every tiny-model builder.

    ``files(tmp)`` writes the model files into a temporary sibling directory
    and returns the weights' sha256; ``marker(digest)`` returns the contents
    of ``MARKER_NAME`` (must hold ``generator_version``, ``seed`` and
    ``architecture``), written last as the completeness mark. An existing
    directory whose marker matches (version, seed, architecture) is returned
    untouched unless ``overwrite``; one written by an older generator version
    (same seed and architecture) is rewritten in place.

    Raises:
        FileExistsError: ``out_dir`` is non-empty and holds no matching model.
    """
    out = Path(out_dir)
    marker_path = out / MARKER_NAME
    if out.exists() and not overwrite:
        if marker_path.is_file():
            old = json.loads(marker_path.read_text(encoding="utf-8"))
            same = old.get("seed") == seed and old.get("architecture") == architecture
            if same and old.get("generator_version") == GENERATOR_VERSION:
                return out
            # an older build of this very model: rebuild rather than refuse
            overwrite = same and isinstance(old.get("generator_version"), int)
        if not overwrite and any(out.iterdir()):
            raise FileExistsError(f"{out} is not empty and holds no matching tiny model; pass overwrite=True")

    import torch

    torch.set_flush_denormal(True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        digest = files(tmp)
        _dump_json(tmp / MARKER_NAME, marker(digest))  # written last: marks completeness

        if not out.exists():
            try:
                os.replace(tmp, out)
                return out
            except OSError:  # raced with another writer; fall through
                pass
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER_NAME).unlink(missing_ok=True)
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n != MARKER_NAME] + [MARKER_NAME]:
            os.replace(tmp / name, out / name)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
