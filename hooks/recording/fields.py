"""What every engine adapter shares, written once: prompts, the config and conversation digests, the
drafter-row rule, acceptance counters.

The vLLM adapter (``statediff_hooks.vllm``), the transformers adapter
(``statediff_hooks.transformers``) and the checks before an engine starts
(``statediff_hooks.drivers.precheck``) all use these, so that two traces of one
model and conversation, recorded by either engine, agree on the prompts
replayed, the model's identity and which drafter rows were kept. Pure
Python (no torch): the prechecks run where no engine is installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from statediff.errors import StatediffError
from statediff.replay.conversation import Turn

# -- prompts -------------------------------------------------------------------------------------


def render_prompts(turns: list[Turn], tokenizer: Any, source: str = "the conversation") -> list[list[int]]:
    """Token ids per turn: ``prompt_token_ids`` as given, chat turns through the chat template.

    The call every engine path makes (``apply_chat_template(messages, tools=..., 
    add_generation_prompt=True, tokenize=True)``), so the prompts checked before the engine
    starts are the prompts it replays.

    Args:
        turns: the conversation (``statediff.replay.conversation.Turn``).
        tokenizer: a ``transformers`` tokenizer with a chat template (used only for chat turns).
        source: the conversation's name in an error (``source:line: ...``).

    Raises:
        StatediffError: ``source:line: the model's chat template failed on this request: ...``.
    """
    out = []
    for t in turns:
        if t.prompt_token_ids is not None:
            out.append([int(x) for x in t.prompt_token_ids])
            continue
        try:
            ids = tokenizer.apply_chat_template(t.messages, tools=t.tools, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        except Exception as e:  # noqa: BLE001 - jinja and transformers raise many types
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise StatediffError(f"{source}:{t.line}: the model's chat template failed on this request: "
                                 f"{type(e).__name__}: {first}") from None
        out.append([int(x) for x in (ids["input_ids"] if isinstance(ids, dict) else ids)])
    return out


def load_tokenizer(model: str) -> Any:
    """``transformers.AutoTokenizer`` of a model directory or hub id (the tokenizer vLLM loads too).

    Raises:
        StatediffError: one line when transformers cannot load it.
        ModuleNotFoundError: transformers is not installed (the CLI names the engine side to install).
    """
    from transformers import AutoTokenizer  # outside the try: a missing package is not a bad --model

    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - tokenizer loading raises many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StatediffError(f"--model {model}: cannot load its tokenizer: {type(e).__name__}: {first}") from None


# -- model identity --------------------------------------------------------------------------------


def config_digest(config: Mapping[str, Any]) -> str:
    """Run field ``config_digest``: sha256 (hex) of the model config as canonical JSON.

    ``json.dumps(config, sort_keys=True, default=str)`` of the config as a dict
    (``PretrainedConfig.to_dict()``: vLLM's ``model_config.hf_config``,
    transformers' ``AutoConfig``, or a ``config.json`` read as JSON), so a vLLM
    trace and a transformers trace of the same model directory carry the same digest.
    """
    return hashlib.sha256(json.dumps(dict(config), sort_keys=True, default=str).encode()).hexdigest()


def conversation_digest(prompts: list[list[int]]) -> str:
    """Run field ``conversation_digest``: sha256 (hex) of the replayed prompts' token ids as JSON."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


# -- drafter inputs --------------------------------------------------------------------------------

DRAFTER_KIND = "drafter.input"
DRAFTER_ROLE = "drafter"
#: Drafter-input rows kept after each block boundary (``keep_row``).
WINDOW = 4
#: The row rule as the run metadata ``drafter.rows.rule`` states it.
ROW_RULE = "verified rows at position % block_size in {0, 1..window} or == prompt_len"


def keep_row(position: int, prompt_len: int, block_size: int, window: int = WINDOW) -> bool:
    """Whether the drafter-input row at ``position`` (tokens it summarises) is recorded.

    Block boundaries (``position % block_size == 0``), the first ``window`` rows of
    every block (in a hit run the rows right after the hit boundary, since hits end on
    block boundaries), and the prompt's last row (``position == prompt_len``, the row
    that yields the first output token): about ``(window + 1) / block_size`` of the rows.
    """
    r = position % block_size
    return r == 0 or 1 <= r <= window or position == prompt_len


def drafter_rows(block_size: int, window: int = WINDOW) -> dict[str, Any]:
    """Run metadata ``drafter.rows``: the row rule and its numbers."""
    return {"rule": ROW_RULE, "block_size": block_size, "window": window}


@dataclasses.dataclass
class Acceptance:
    """Per-request acceptance of speculative decoding, counted as vLLM's ``SpecDecodingStats``
    (``v1/core/sched/scheduler.py`` ``update_from_output``): every draft token the target
    confirmed counts, also one cut from the output by ``max_tokens`` or an end-of-sequence token.

    A mutable accumulator (one per request, fed once per verification step);
    ``to_json`` is the request record's ``acceptance``.

    Attributes:
        num_drafts: verification steps with drafts.
        num_draft_tokens: draft tokens proposed.
        num_accepted_tokens: draft tokens accepted.
        accepted_per_position: how often draft position ``i`` was accepted; grows to the
            longest draft seen, or starts at ``K`` zeros (``for_drafts(K)``).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def for_drafts(cls, num_speculative_tokens: int) -> "Acceptance":
        """Counters whose ``accepted_per_position`` lists all ``K`` positions from the start."""
        return cls(accepted_per_position=[0] * num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification step: ``num_draft_tokens`` proposed, the first ``num_accepted`` taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (tokens per target step); None before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_json(self) -> dict:
        """Request field ``acceptance`` (``docs/trace-format.md``)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": self.mean_acceptance_length}
