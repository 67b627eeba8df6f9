"""The incident record: a Markdown report of a hit/cold pair, ready to paste into an issue.

It answers what maintainers ask for first (engine version and commit,
target checkpoint and quantization format, drafter and method, speculative
tokens, prompt tokens and prefix-cache hit per turn, mamba cache mode,
acceptance, seed and sampling, whether reuse was forced off, replay mode,
block size), then the root divergence and its diagnosis from ``compare``,
then the commands that reproduce the traces. Every value comes from the
traces' run metadata and request records; a field the traces do not know
is written ``unknown``, never left out.

For engines whose adapter always records the speculative and quantization
configuration (``ENGINES_RECORDING_CONFIG``: vLLM), a null there means
"none" (no drafter, unquantized), not "unknown".

One record type (``IncidentReport``) serves Markdown (``to_markdown``, also
``to_text``), JSON (``to_json``) and tests (``field(label)``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Sequence
from typing import Any

from statediff.diff.result import CompareResult
from statediff.jsonutil import jsonable
from statediff.trace.reader import open_trace

UNKNOWN = "unknown"
ENGINES_RECORDING_CONFIG = ("vllm",)
FIELD_LABELS = (
    "engine", "engine version", "engine commit", "runner", "target checkpoint", "architecture",
    "model config digest", "dtype", "quantization format", "KV cache dtype", "drafter method",
    "drafter checkpoint", "speculative tokens", "drafter input", "prefix caching", "mamba cache mode",
    "mamba block size", "block size", "max num batched tokens", "replay mode", "cache reuse (hit run)",
    "cache reuse forced off (cold run)", "seed", "sampling", "enforce eager", "conversation",
    "requests", "planted fault", "prompt tokens per turn", "prefix-cache hit per turn (hit run)",
    "prefix-cache hit per turn (cold run)", "acceptance per turn (hit run)",
    "acceptance per turn (cold run)", "outputs", "root divergence", "diagnosis", "statediff version",
    "traces",
)

PathLike = str | os.PathLike


@dataclasses.dataclass
class TurnRow:
    """One request of the replay, both runs side by side (``None``: unknown)."""

    request: int
    prompt_tokens: int | None
    cached_hit: int | None
    cached_cold: int | None
    expected_hit: int | None  # boundary sweeps only
    label: str | None  # boundary sweeps only ("2B+1")
    outputs: str
    acceptance_hit: str
    acceptance_cold: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class IncidentReport:
    """The incident record.

    Attributes:
        title: one line (verdict and root).
        fields: (label, value) pairs in ``FIELD_LABELS`` order; every value a
            string, ``"unknown"`` where the traces do not say.
        turns: one row per request.
        compare_text: ``compare``'s text report (shown folded).
        reproduce: shell lines that reproduce the traces and the comparison.
        bundle: Markdown lines describing a bundle's contents (``extract``), or empty.
        exit_code: that of the comparison: 0 no divergence, 1 divergence.
    """

    title: str
    fields: list[tuple[str, str]]
    turns: list[TurnRow]
    compare_text: str
    reproduce: list[str]
    bundle: list[str] = dataclasses.field(default_factory=list)
    exit_code: int = 0

    def field(self, label: str) -> str:
        """The value of one field (KeyError for a label not in ``FIELD_LABELS``)."""
        for k, v in self.fields:
            if k == label:
                return v
        raise KeyError(label)

    def to_markdown(self) -> str:
        out = [f"# {self.title}", "", "| field | value |", "| --- | --- |"]
        out += [f"| {k} | {_cell(v)} |" for k, v in self.fields]
        sweep = any(t.label is not None for t in self.turns)
        out += ["", "## Turns", ""]
        head = ["request"] + (["sweep length"] if sweep else []) + [
            "prompt tokens", "cached (hit run)", "cached (cold run)"] + (
            ["expected hit"] if sweep else []) + ["outputs hit vs cold", "acceptance (hit run)",
                                                  "acceptance (cold run)"]
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for t in self.turns:
            row = [str(t.request)] + ([t.label or UNKNOWN] if sweep else []) + [
                _n(t.prompt_tokens), _n(t.cached_hit), _n(t.cached_cold)] + (
                [_n(t.expected_hit)] if sweep else []) + [t.outputs, t.acceptance_hit, t.acceptance_cold]
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        out += ["", "## Root divergence", "", self.field("root divergence"), "",
                f"Diagnosis: {self.field('diagnosis')}", "",
                "<details><summary>statediff compare output</summary>", "", "```text",
                self.compare_text, "```", "", "</details>", "", "## Reproduce", "", "```bash"]
        out += self.reproduce + ["```"]
        if self.bundle:
            out += ["", "## Bundle", ""] + self.bundle
        return "\n".join(out) + "\n"

    def to_text(self) -> str:
        return self.to_markdown()

    def to_json(self) -> dict:
        return jsonable({"statediff": "report", "title": self.title, "exit_code": self.exit_code,
                         "fields": dict(self.fields), "turns": [t.to_json() for t in self.turns],
                         "reproduce": self.reproduce, "bundle": self.bundle})


def _cell(v: str) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _n(v: Any) -> str:
    return UNKNOWN if v is None else str(v)


def _known(v: Any) -> str:
    if v is None:
        return UNKNOWN
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _records_config(run: dict) -> bool:
    return run.get("engine") in ENGINES_RECORDING_CONFIG


def _acceptance(acc: Any, spec: bool | None) -> str:
    """One cell: mean acceptance length and counts, or none/unknown."""
    if isinstance(acc, dict):
        mean = acc.get("mean_acceptance_length")
        parts = [f"mean acceptance length {mean:.2f}" if isinstance(mean, (int, float))
                 else "mean acceptance length unknown"]
        if acc.get("num_accepted_tokens") is not None and acc.get("num_draft_tokens") is not None:
            parts.append(f"{acc['num_accepted_tokens']}/{acc['num_draft_tokens']} drafts accepted")
        if acc.get("num_drafts") is not None:
            parts.append(f"{acc['num_drafts']} steps")
        if acc.get("accepted_per_position") is not None:
            parts.append(f"per position {acc['accepted_per_position']}")
        return ", ".join(parts)
    return "none (no drafter)" if spec is False else UNKNOWN


def _spec(run: dict) -> tuple[str | None, Any, bool | None]:
    """(method, num speculative tokens, drafter present: True/False/None unknown)."""
    drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
    method = run.get("speculative_method") or drafter.get("method")
    k = run.get("num_speculative_tokens")
    k = drafter.get("num_speculative_tokens") if k is None else k
    if method or k:
        return method, k, True
    return None, None, (False if _records_config(run) else None)


def _replay_mode(run: dict) -> str:
    replay, form = run.get("replay"), run.get("exact_form")
    if replay == "exact":
        how = {"block": "one block per step in both runs",
               "split": "split form: the cold run splits prefills where the hit run's state was computed"}
        return f"exact ({how.get(form, 'form ' + _known(form))})"
    if replay == "default":
        return "default (the engine's own chunking; hit and cold differ by floating-point noise)"
    return UNKNOWN


def _reuse_hit(run: dict) -> str:
    if run.get("cold_policy") == "cache_salt":
        return "forced off (cache_salt per request): this is not a cache-hit run"
    pc = run.get("prefix_caching")
    if pc is None:
        return UNKNOWN
    return "on (prefix caching enabled, no cache_salt)" if pc else "off (prefix caching disabled)"


def _reuse_cold(run: dict) -> str:
    if run.get("cold_policy") == "cache_salt":
        pc = run.get("prefix_caching")
        stays = " (prefix caching stays on)" if pc else ""
        return f"yes: a unique cache_salt per request{stays}"
    if run.get("prefix_caching") is False:
        return "yes: prefix caching disabled"
    if run.get("mode") == "hit":
        return "no: this is a cache-hit run"
    if run.get("cold_policy") is None and run.get("mode") is None:
        return UNKNOWN
    return f"no (cold_policy {_known(run.get('cold_policy'))})"


def _sampling(run: dict, requests: dict[int, dict]) -> str:
    s = run.get("sampling")
    if not isinstance(s, dict):
        per = [r.get("sampling") for r in requests.values() if isinstance(r.get("sampling"), dict)]
        s = per[0] if per else None
    if not isinstance(s, dict):
        return UNKNOWN
    text = json.dumps(s, sort_keys=True)
    t = s.get("temperature")
    if isinstance(t, (int, float)) and t == 0:
        text = "greedy " + text
    return text


def _fault(run: dict) -> str:
    f = run.get("fault")
    if f is None:
        return "none"
    if isinstance(f, dict):
        where = ", ".join(f"{k} {f[k]}" for k in ("request", "position", "layer", "kind") if k in f)
        return f"{f.get('spec', UNKNOWN)}" + (f" (fired at {where})" if where else "") + (
            f": {f['description']}" if f.get("description") else "")
    return _known(f)


def _per_turn(reqs: dict[int, dict], key: str) -> str:
    if not reqs:
        return UNKNOWN
    return "[" + ", ".join(_n(reqs[i].get(key)) for i in sorted(reqs)) + "]"


def _acceptance_summary(reqs: dict[int, dict], spec: bool | None) -> str:
    if not reqs:
        return UNKNOWN
    vals = []
    for i in sorted(reqs):
        acc = reqs[i].get("acceptance")
        mean = acc.get("mean_acceptance_length") if isinstance(acc, dict) else None
        vals.append(f"{mean:.2f}" if isinstance(mean, (int, float)) else UNKNOWN)
    if spec is False and all(v == UNKNOWN for v in vals):
        return "none (no speculative decoding)"
    return "mean acceptance length [" + ", ".join(vals) + "]"


def _traces(result: CompareResult, runs: tuple[dict, dict]) -> str:
    out = []
    for name, side, run in (("hit", result.hit, runs[0]), ("cold", result.cold, runs[1])):
        state = "partial" if side.partial else "complete"
        out.append(f"{name} {side.path} ({state}, mode {_known(run.get('mode'))})")
    return "; ".join(out)


def _outputs(result: CompareResult) -> str:
    differ = [r.request for r in result.requests if r.outputs_equal is False]
    unknown = [r.request for r in result.requests if r.outputs_equal is None]
    if not result.requests:
        return UNKNOWN
    if not differ and not unknown:
        return "equal in every request"
    parts = []
    if differ:
        parts.append(f"differ in requests {differ} (first: request {differ[0]})")
    if unknown:
        parts.append(f"unknown for requests {unknown} (missing on one side)")
    return "; ".join(parts)


def record_command(run: dict, mode: str, out: str, *, split_like: str | None = None,
                   replay_file: str | None = None) -> tuple[str, bool]:
    """The ``statediff record`` line that reproduces a trace of ``run`` in ``mode``.

    Uses the command line stored at recording (``record_argv``) when there
    is one; otherwise rebuilds it from the run metadata (the second value
    is then False: approximate). ``replay_file`` replaces the conversation
    (and a sweep) by a replay file holding the same prompts.
    """
    argv = run.get("record_argv")
    exact = isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    conv = run.get("conversation")
    if exact:
        words = list(argv)
    else:
        words = [] if not isinstance(conv, str) or conv.startswith("builtin:") else [conv]
        if conv is None or run.get("mode") is None:
            words = ["CONVERSATION.jsonl"]
        if conv == "builtin:sweep-boundaries":
            words.append("--sweep-boundaries")
        for key, flag in (("model", "--model"), ("dtype", "--dtype"), ("block_size", "--block-size"),
                          ("seed", "--seed")):
            if run.get(key) is not None:
                words += [flag, str(run[key])]
        if run.get("enforce_eager"):
            words.append("--enforce-eager")
        if run.get("replay") == "exact":
            words.append("--exact-split" if run.get("exact_form") == "split" else "--exact")
        elif run.get("max_num_batched_tokens") is not None:
            words += ["--max-num-batched-tokens", str(run["max_num_batched_tokens"])]
        if run.get("kv_cache_dtype") not in (None, "auto"):
            words += ["--engine-arg", f"kv_cache_dtype={run['kv_cache_dtype']}"]
        if run.get("quantization") is not None:
            words += ["--engine-arg", f"quantization={run['quantization']}"]
        drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
        method, k, spec = _spec(run)
        if spec:
            cfg = {"method": method, "model": drafter.get("model"), "num_speculative_tokens": k}
            words += ["--speculative-config", json.dumps({a: b for a, b in cfg.items() if b is not None})]
        f = run.get("fault")
        if isinstance(f, dict) and f.get("spec"):
            words += ["--fault", str(f["spec"])]
        sampling = run.get("sampling")
        if isinstance(sampling, dict) and sampling.get("max_tokens") is not None and (
                conv is not None and str(conv).startswith("builtin:")):
            words += ["--max-tokens", str(sampling["max_tokens"])]
        if isinstance(run.get("capture"), dict) and run["capture"].get("kv") == "none":
            words += ["--kv", "none"]
    if replay_file is not None:
        if words and isinstance(conv, str) and not conv.startswith("builtin:") and words[0] == conv:
            words = words[1:]
        elif words and words[0] == "CONVERSATION.jsonl":
            words = words[1:]
        kept, skip = [], 0
        for w in words:  # the replay file carries the prompts and max_tokens
            if skip:
                skip -= 1
            elif w == "--sweep-boundaries":
                pass
            elif w in ("--sweep-blocks", "--max-tokens"):
                skip = 1
            else:
                kept.append(w)
        words = [replay_file] + kept
    words += ["--mode", mode]
    if split_like is not None:
        words += ["--split-like", split_like]
    words += ["-o", out]
    return shlex.join(["statediff", "record", *words]), exact


def compare_options(tol: Sequence[str] = (), noise: str | None = None,
                    noise_factor: float | None = None) -> list[str]:
    """The ``compare`` options that judged the pair, as command-line words."""
    opts: list[str] = []
    for rule in tol:
        opts += ["--tol", str(rule)]
    if noise:
        opts += ["--noise", str(noise)]
        if noise_factor is not None:
            opts += ["--noise-factor", f"{noise_factor:g}"]
    return opts


def reproduce_lines(hit_run: dict, cold_run: dict, *, tol: Sequence[str] = (), noise: str | None = None,
                    noise_factor: float | None = None, bundle: str | None = None,
                    replay_file: str | None = None) -> list[str]:
    """Shell lines: record both runs, compare, extract (and compare the bundle)."""
    opts = compare_options(tol, noise, noise_factor)
    split = "hit.h5" if cold_run.get("exact_form") == "split" else None
    hit_cmd, exact_h = record_command(hit_run, hit_run.get("mode") or "hit", "hit.h5")
    cold_cmd, exact_c = record_command(cold_run, cold_run.get("mode") or "cold", "cold.h5", split_like=split)
    lines = ["# on the engine machine (same model, engine and statediff versions):"]
    if not (exact_h and exact_c):
        lines.append("# (rebuilt from the run metadata: the traces do not store the record command line)")
    lines += [hit_cmd, cold_cmd]
    if replay_file is not None:
        lines += [f"# or with the prompts (token ids) of every request from the bundle's {replay_file}:",
                  record_command(hit_run, hit_run.get("mode") or "hit", "hit.h5",
                                 replay_file=replay_file)[0],
                  record_command(cold_run, cold_run.get("mode") or "cold", "cold.h5", split_like=split,
                                 replay_file=replay_file)[0]]
    lines += ["# anywhere (no engine needed):",
              shlex.join(["statediff", "compare", "hit.h5", "cold.h5", *opts]),
              shlex.join(["statediff", "report", "hit.h5", "cold.h5", *opts, "-o", "report.md"]),
              shlex.join(["statediff", "extract", "hit.h5", "cold.h5", *opts, "-o", "bundle.zip"])]
    if bundle is not None:
        lines += ["# the attached bundle (the same root and diagnosis):",
                  shlex.join(["statediff", "compare", bundle])]
    return lines


def build_report(result: CompareResult, hit_run: dict, cold_run: dict, hit_requests: dict[int, dict],
                 cold_requests: dict[int, dict], *, tol: Sequence[str] = (), noise: str | None = None,
                 noise_factor: float | None = None, bundle: str | None = None,
                 bundle_lines: Sequence[str] = (), replay_file: str | None = None) -> IncidentReport:
    """Assemble the record from a comparison and both traces' metadata (no I/O)."""
    run = hit_run
    method, k, spec = _spec(run)
    drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
    none_if_known = _records_config(run)
    quant = run.get("quantization")
    fields: dict[str, str] = {
        "engine": _known(run.get("engine")),
        "engine version": _known(run.get("engine_version")),
        "engine commit": _known(run.get("engine_commit")),
        "runner": _known(run.get("runner")),
        "target checkpoint": _known(run.get("model")),
        "architecture": _known(run.get("architecture")),
        "model config digest": _known(run.get("config_digest")),
        "dtype": _known(run.get("dtype")),
        "quantization format": (str(quant) if quant is not None
                                else "none (unquantized)" if none_if_known else UNKNOWN),
        "KV cache dtype": _known(run.get("kv_cache_dtype")),
        "drafter method": (str(method) if method else "none (no speculative decoding)" if spec is False
                           else UNKNOWN),
        "drafter checkpoint": (str(drafter["model"]) if drafter.get("model")
                               else "none (no speculative decoding)" if spec is False else UNKNOWN),
        "speculative tokens": (str(k) if k is not None else "0 (no speculative decoding)"
                               if spec is False else UNKNOWN),
        "drafter input": (f"{drafter['input']}, layers {drafter.get('tapped_layers')}"
                          if drafter.get("input") else "none (no speculative decoding)"
                          if spec is False else UNKNOWN),
        "prefix caching": {True: "on", False: "off", None: UNKNOWN}.get(run.get("prefix_caching"), UNKNOWN),
        "mamba cache mode": _known(run.get("mamba_cache_mode")),
        "mamba block size": _known(run.get("mamba_block_size")),
        "block size": (f"{run['block_size']} tokens" if run.get("block_size") is not None else UNKNOWN),
        "max num batched tokens": _known(run.get("max_num_batched_tokens")),
        "replay mode": _replay_mode(run),
        "cache reuse (hit run)": _reuse_hit(run),
        "cache reuse forced off (cold run)": _reuse_cold(cold_run),
        "seed": _known(run.get("seed")),
        "sampling": _sampling(run, hit_requests),
        "enforce eager": _known(run.get("enforce_eager")),
        "conversation": _known(run.get("conversation")) + (
            f" (prompt digest {run['conversation_digest'][:16]})" if run.get("conversation_digest") else ""),
        "requests": str(len(hit_requests)) if hit_requests else _known(run.get("num_requests")),
        "planted fault": _fault(run),
        "prompt tokens per turn": _per_turn(hit_requests, "prompt_len"),
        "prefix-cache hit per turn (hit run)": _per_turn(hit_requests, "num_cached_tokens"),
        "prefix-cache hit per turn (cold run)": _per_turn(cold_requests, "num_cached_tokens"),
        "acceptance per turn (hit run)": _acceptance_summary(hit_requests, spec),
        "acceptance per turn (cold run)": _acceptance_summary(cold_requests, _spec(cold_run)[2]),
        "outputs": _outputs(result),
        "root divergence": "none" if result.first is None else result.first.where(),
        "diagnosis": "none" if not result.diagnoses else result.diagnoses[0].text.removeprefix("diagnosis: "),
        "statediff version": _known(run.get("statediff_version")),
        "traces": _traces(result, (hit_run, cold_run)),
    }
    if result.first is not None and not any(
            (g.request, g.position, g.layer, g.kind) == result.first.key for g in result.diagnoses):
        fields["diagnosis"] = "none: the wrong tensor matches nothing searched (zeros, other positions " \
                              "or requests, bf16 rounding)"
    sweep = run.get("sweep") if isinstance(run.get("sweep"), dict) else None
    turns = []
    for row in result.requests:
        i = row.request
        h, c = hit_requests.get(i) or {}, cold_requests.get(i) or {}
        label = exp = None
        if sweep is not None:
            labels, hits = sweep.get("labels") or [], sweep.get("expected_hits") or []
            label = labels[i] if i < len(labels) else None
            exp = hits[i] if i < len(hits) else None
        turns.append(TurnRow(
            request=i, prompt_tokens=h.get("prompt_len", c.get("prompt_len")),
            cached_hit=h.get("num_cached_tokens"), cached_cold=c.get("num_cached_tokens"),
            expected_hit=exp, label=label, outputs=row.outputs,
            acceptance_hit=_acceptance(h.get("acceptance"), spec),
            acceptance_cold=_acceptance(c.get("acceptance"), _spec(cold_run)[2])))
    first = result.first
    title = ("statediff: state diverges after a prefix-cache hit at " + first.where() if first
             else "statediff: no state divergence between the cache-hit and cold runs")
    return IncidentReport(
        title=title, fields=[(k, fields[k]) for k in FIELD_LABELS], turns=turns,
        compare_text=result.to_text(),
        reproduce=reproduce_lines(hit_run, cold_run, tol=tol, noise=noise, noise_factor=noise_factor,
                                  bundle=bundle, replay_file=replay_file),
        bundle=list(bundle_lines), exit_code=result.exit_code)


def incident_report(hit_path: PathLike, cold_path: PathLike, *, tol: Sequence[str] = (),
                    noise: PathLike | None = None, noise_factor: float | None = None,
                    allow_engine_mismatch: bool = False, allow_noise_in_exact: bool = False,
                    result: CompareResult | None = None) -> IncidentReport:
    """Compare ``hit_path`` against ``cold_path`` and write up the incident record.

    Args:
        hit_path, cold_path: the traces (as for ``compare``).
        tol, noise, noise_factor, allow_engine_mismatch, allow_noise_in_exact:
            passed to ``compare`` and repeated in the reproduce commands.
        result: an existing comparison of the same traces (skips comparing again).

    Returns:
        the report; ``exit_code`` is the comparison's (0 same, 1 divergence).

    Raises:
        TraceError, MismatchError, StatediffError: as ``compare``.
    """
    from statediff.diff.compare import compare
    from statediff.diff.noise import DEFAULT_FACTOR

    if result is None:
        result = compare(hit_path, cold_path, tol=tol, noise=noise,
                         noise_factor=DEFAULT_FACTOR if noise_factor is None else noise_factor,
                         allow_engine_mismatch=allow_engine_mismatch,
                         allow_noise_in_exact=allow_noise_in_exact)
    with open_trace(hit_path) as hit, open_trace(cold_path) as cold:
        return build_report(result, dict(hit.run), dict(cold.run), dict(hit.requests), dict(cold.requests),
                            tol=[str(t) for t in tol], noise=None if noise is None else str(noise),
                            noise_factor=noise_factor)
