"""Checks ``statediff record`` runs before any engine starts.

Everything here reads only the model directory (``config.json`` and the
tokenizer files, through ``transformers.AutoTokenizer``) and the
conversation, so a bad ``--model``, a token id outside the vocabulary or a
request longer than the engine can hold is refused in seconds with one line
naming the line of the conversation file, instead of after an engine start
(17-60 s on CPU) with the engine's own message and no line number.

The engine's limits (largest token id, longest sequence, the default block
size lengths are rounded to) are vLLM 0.32's, from
``statediff_hooks.vllm.limits``. A prompt must be shorter than
``max_model_len`` and vLLM silently cuts generation there; a replay wants
every request's ``max_tokens`` too, so a request needs prompt +
``max_tokens`` positions.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from statediff.replay.conversation import Turn
from ..recording.fields import load_tokenizer, render_prompts
from ..vllm.limits import DEFAULT_ROUND, model_length_limit, text_field, token_id_limit

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """A model's ``config.json``, read without an engine.

    ``path``: what ``--model`` resolved to (a directory, or a Hugging Face id
    found in the local cache); ``config``: the parsed ``config.json``.
    """

    path: str
    config: dict

    @property
    def vocab_size(self) -> int | None:
        """``vocab_size`` of the embedding (ids 0 .. vocab_size-1), None if unstated."""
        v = text_field(self.config, "vocab_size")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    def length_limit(self, tokenizer: Any = None) -> tuple[int, str] | None:
        """The longest sequence (tokens) the engine lets this model hold, and where it is stated
        (``vllm.limits.model_length_limit``); None when nothing states a limit."""
        return model_length_limit(self.config, self.path, tokenizer)


def check_model(model: str) -> ModelFiles:
    """Refuse a ``--model`` that is not a model directory; return its config.

    A string that is not an existing path but looks like ``org/name`` is
    looked up as a Hugging Face id (the local cache when ``HF_HUB_OFFLINE=1``,
    which ``record`` sets unless the user set it).

    Raises:
        StatediffError: one line: no such directory, a file, an empty
            directory, no ``config.json``, or a ``config.json`` that is not a JSON object.
    """
    p = Path(model).expanduser()
    if not p.exists():
        if not model.startswith((".", "/", "~")) and _REPO_ID.match(model):
            return _hub_model(model)
        raise StatediffError(f"--model {model}: no such directory")
    if not p.is_dir():
        raise StatediffError(f"--model {model}: a file, not a model directory (one holding config.json, "
                             "the weights and the tokenizer files)")
    names = sorted(x.name for x in p.iterdir())
    if not names:
        raise StatediffError(f"--model {model}: empty directory (a model directory holds config.json, "
                             "the weights and the tokenizer files)")
    cfg = p / "config.json"
    if not cfg.is_file():
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
        raise StatediffError(f"--model {model}: no config.json in this directory (it holds {shown})")
    return ModelFiles(str(p), _read_config(cfg, model))


def _hub_model(model: str) -> ModelFiles:
    from transformers.utils import cached_file  # outside the try: a missing package is not a bad --model

    try:
        path = cached_file(model, "config.json")
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; the first line says enough
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StatediffError(f"--model {model}: no such directory, and not a Hugging Face model "
                             f"this machine can read ({first})") from None
    if not path:
        raise StatediffError(f"--model {model}: no such directory, and no config.json for it on the Hugging Face hub")
    return ModelFiles(model, _read_config(Path(path), model))


def _read_config(path: Path, model: str) -> dict:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise StatediffError(f"--model {model}: cannot read config.json ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise StatediffError(f"--model {model}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise StatediffError(f"--model {model}: config.json is not a JSON object")
    return cfg


def check_token_ids(turns: list[Turn], limit: int, source: str, model: str) -> None:
    """Every ``prompt_token_ids`` id lies in 0 .. ``limit``.

    Raises:
        StatediffError: ``source:line: token id N (at prompt position P) is outside the vocabulary ...``.
    """
    for t in turns:
        if t.prompt_token_ids is None:
            continue
        for pos, tid in enumerate(t.prompt_token_ids):
            if not 0 <= tid <= limit:
                raise StatediffError(f"{source}:{t.line}: token id {tid} (prompt position {pos}) is outside the "
                                     f"vocabulary of {model} (ids 0..{limit})")


def round_up(n: int, block: int) -> int:
    """``n`` rounded up to a multiple of ``block`` (tokens)."""
    return -(-n // block) * block


def fit_max_model_len(turns: list[Turn], prompts: list[list[int]], *, max_model_len: int | None,
                      limit: tuple[int, str] | None, block_size: int | None, source: str) -> int:
    """The ``max_model_len`` to start the engine with, or a refusal.

    A request needs ``len(prompt) + max_tokens`` positions. With
    ``max_model_len`` None: the largest need, rounded up to ``block_size``
    (else ``DEFAULT_ROUND``) tokens, capped by the model's ``limit``
    (``ModelFiles.length_limit``: tokens and where it is stated). With
    ``max_model_len`` given: returned unchanged when every request fits (the
    user's setting wins over the model's limit, as in vLLM).

    Raises:
        StatediffError: one line naming the first request that does not fit
            (``source:line: request I needs N tokens (P prompt + M max_tokens) ...``),
            with the ``--max-model-len`` that fits every request, or the model's
            own limit when no setting can hold it.
    """
    needs = [len(ids) + int(t.sampling.get("max_tokens", 16)) for t, ids in zip(turns, prompts)]
    fit = round_up(max(needs), block_size or DEFAULT_ROUND)
    if max_model_len is None and limit is not None:
        for i, (t, need) in enumerate(zip(turns, needs)):
            if need > limit[0]:
                raise StatediffError(
                    f"{source}:{t.line}: request {i} needs {need} tokens ({len(prompts[i])} prompt + "
                    f"{need - len(prompts[i])} max_tokens), more than the model holds ({limit[1]})")
        fit = min(fit, limit[0])
    if max_model_len is None:
        return fit
    for i, (t, need) in enumerate(zip(turns, needs)):
        if need > max_model_len:
            raise StatediffError(
                f"{source}:{t.line}: request {i} needs {need} tokens ({len(prompts[i])} prompt + "
                f"{need - len(prompts[i])} max_tokens), more than --max-model-len {max_model_len}; "
                f"--max-model-len {fit} fits every request")
    return max_model_len


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the checks found: the prompts to replay (token ids per request) and the
    ``max_model_len`` to start the engine with (None: not an engine that takes one)."""

    model: ModelFiles
    prompts: list[list[int]]
    max_model_len: int | None


def precheck(turns: list[Turn], model: str, *, source: str, max_model_len: int | None = None,
             block_size: int | None = None, fit_length: bool = True) -> Checked:
    """All checks of a replay that need no engine, in the order a user would fix them:
    the model directory, the tokenizer, token ids, rendering, lengths.

    ``fit_length``: also settle ``max_model_len`` (``fit_max_model_len``); off for
    engines that take none (transformers).

    Raises:
        StatediffError: the first problem, as one line.
    """
    files = check_model(model)
    tok = load_tokenizer(files.path)
    check_token_ids(turns, token_id_limit(files.vocab_size, tok), source, files.path)
    prompts = render_prompts(turns, tok, source)
    mml = (fit_max_model_len(turns, prompts, max_model_len=max_model_len, limit=files.length_limit(tok),
                             block_size=block_size, source=source) if fit_length else max_model_len)
    return Checked(files, prompts, mml)


def check_focus(focus: Any, turns: list[Turn], prompts: list[list[int]], source: str,
                config: dict | None = None) -> None:
    """A ``--focus request=R,position=P[,layers=..]`` that the replay can reach (``keep.Focus``).

    Raises:
        StatediffError: request ``R`` is not in the conversation, position ``P`` is
            past the request's prompt plus its ``max_tokens``, or a listed layer is not
            one of the model's (``num_hidden_layers`` of ``config``; -1, the drafter, passes).
    """
    if focus is None:
        return
    cfg = config or {}
    n_layers = cfg.get("num_hidden_layers", (cfg.get("text_config") or {}).get("num_hidden_layers"))
    if focus.layers and isinstance(n_layers, int):
        bad = [layer for layer in focus.layers if not -1 <= layer < n_layers]
        if bad:
            raise StatediffError(f"--focus layers {bad[0]}: the model has layers 0..{n_layers - 1}")
    r, p = focus.request, focus.position
    if r >= len(turns):
        raise StatediffError(f"--focus request {r}: {source} has {len(turns)} requests (0..{len(turns) - 1})")
    end = len(prompts[r]) + int(turns[r].sampling.get("max_tokens", 16))
    if p > end:
        raise StatediffError(f"--focus position {p}: request {r} of {source} ends by token {end} "
                             f"(prompt {len(prompts[r])} + max_tokens)")
