"""The incident record: a Markdown report of a compared hit/cold pair, ready to paste into an issue.

``build_report`` turns a ``CompareResult`` (which carries both traces' run
metadata and request records) into one ``IncidentReport``: the fields
maintainers ask for, one row per turn, the root divergence and its
diagnosis, and the reproduce commands. No I/O. A field the traces do not
know is ``unknown``; for engines that always record their speculative and
quantization configuration (``ENGINES_RECORDING_CONFIG``) a null means none;
a recorded ``"none"`` (``speculative_method``, ``quantization``) means none for any engine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from statediff.diff.pair import CompareOptions
from statediff.diff.result import CompareResult, no_data_text
from statediff.jsonutil import jsonable
from statediff.trace.patches import describe_patches

from statediff.replay.command import speculative

from .reproduce import reproduce_lines

UNKNOWN = "unknown"
ENGINES_RECORDING_CONFIG = ("vllm",)


@dataclasses.dataclass
class TurnRow:
    """One request of the replay, both runs side by side (``None``: unknown)."""

    request: int
    prompt_tokens: int | None
    cached_hit: int | None
    cached_cold: int | None
    expected_hit: int | None  # a sweep's own expectation, else the hit accounting's (perfect prefix cache)
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
        audit: Markdown lines of the hit run's one-run audit (``statediff check``: shown right
            after the fields, before the turns), or empty.
        exit_code: the verdict's: 0 no divergence, 1 divergence (compare's, or the audit's
            restore violation), 2 cannot judge (or, with an audit, not checked).
        verdict: the verdict in one word, as ``compare --json`` says it ("same", "near-tie",
            "diverged", "cannot-judge"; with an audit also "restore-violation", "not-checked"):
            what tells a verdict with exit code 2 from an error (which writes no record).
    """

    title: str
    fields: list[tuple[str, str]]
    turns: list[TurnRow]
    compare_text: str
    reproduce: list[str]
    bundle: list[str] = dataclasses.field(default_factory=list)
    audit: list[str] = dataclasses.field(default_factory=list)
    exit_code: int = 0
    verdict: str = "same"

    def field(self, label: str) -> str:
        """The value of one field (KeyError for a label not in ``FIELD_LABELS``)."""
        for k, v in self.fields:
            if k == label:
                return v
        raise KeyError(label)

    def to_markdown(self) -> str:
        out = [f"# {self.title}", "", "| field | value |", "| --- | --- |"]
        out += [f"| {k} | {_cell(v)} |" for k, v in self.fields]
        if self.audit:
            out += ["", "## Audit of the hit run", "", *self.audit]
        sweep = any(t.label is not None for t in self.turns)
        expected = any(t.expected_hit is not None for t in self.turns)  # sweeps, and hit accounting
        out += ["", "## Turns", ""]
        head = ["request"] + (["sweep length"] if sweep else []) + [
            "prompt tokens", "cached (hit run)", "cached (cold run)"] + (
            ["expected hit"] if expected else []) + ["outputs hit vs cold", "acceptance (hit run)",
                                                     "acceptance (cold run)"]
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for t in self.turns:
            row = [str(t.request)] + ([t.label or UNKNOWN] if sweep else []) + [
                _n(t.prompt_tokens), _n(t.cached_hit), _n(t.cached_cold)] + (
                [_n(t.expected_hit)] if expected else []) + [t.outputs, t.acceptance_hit, t.acceptance_cold]
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
                         "verdict": self.verdict,
                         "fields": dict(self.fields), "turns": [t.to_json() for t in self.turns],
                         "reproduce": self.reproduce, "bundle": self.bundle,
                         **({"audit": self.audit} if self.audit else {})})


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
    method, k, on = speculative(run)
    if on:
        return method, k, True
    return None, None, (False if _records_config(run) or run.get("speculative_method") == "none" else None)


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


def _traces(result: CompareResult) -> str:
    out = []
    for name, side in (("hit", result.hit), ("cold", result.cold)):
        state = "incomplete" if side.partial else "complete"
        out.append(f"{name} {side.path} ({state}, mode {_known(side.run.get('mode'))})")
    return "; ".join(out + list(getattr(result, "incomplete", ())))


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


@dataclasses.dataclass(frozen=True)
class _Sides:
    """What every field reads: the compared result, both runs' metadata and request records, and
    the hit run's drafter (``_spec``)."""

    result: CompareResult
    run: dict  # the hit run: the configuration fields describe it
    cold_run: dict
    hit_requests: dict[int, dict]
    cold_requests: dict[int, dict]
    method: str | None
    k: Any
    spec: bool | None
    drafter: dict

    @classmethod
    def of(cls, result: CompareResult) -> "_Sides":
        run = result.hit.run
        method, k, spec = _spec(run)
        return cls(result, run, result.cold.run, result.hit.requests, result.cold.requests, method, k, spec,
                   run.get("drafter") if isinstance(run.get("drafter"), dict) else {})


def _run_key(key: str) -> Callable[[_Sides], str]:
    return lambda c: _known(c.run.get(key))


def quantization_text(run: dict) -> str:
    """The run's quantization format as ``report`` and ``inspect`` both show it: the recorded
    format; "none (unquantized)" for a recorded ``"none"`` or a null from an engine that always
    records it (``ENGINES_RECORDING_CONFIG``); else "unknown"."""
    quant = run.get("quantization")
    if quant not in (None, "none"):
        return str(quant)
    return "none (unquantized)" if quant == "none" or _records_config(run) else UNKNOWN


def speculative_text(run: dict) -> str:
    """The run's speculative method as ``inspect`` shows it, in ``report``'s words (its "drafter
    method" row): the method; "none (no speculative decoding)" for a recorded ``"none"`` or a null
    from an engine that always records it (``ENGINES_RECORDING_CONFIG``); else "unknown"."""
    method, _, on = _spec(run)
    if method:
        return str(method)
    return "none (no speculative decoding)" if on is False else UNKNOWN


def _quantization(c: _Sides) -> str:
    return quantization_text(c.run)


def _no_drafter(c: _Sides, known: str | None, none: str = "none (no speculative decoding)") -> str:
    """``known`` when the traces say it, ``none`` when they say there is no drafter, else unknown."""
    return known if known else none if c.spec is False else UNKNOWN


def _patches(c: _Sides) -> str:
    """The hit run's engine patches; the cold run's too when they differ."""
    hit, cold = describe_patches(c.run.get("engine_patches")), describe_patches(c.cold_run.get("engine_patches"))
    return hit if hit == cold else f"hit run: {hit}; cold run: {cold}"


def _diagnosis(c: _Sides) -> str:
    r = c.result
    if r.first is not None and r.diagnosis_for(r.first.key) is None:
        return "none: the wrong tensor matches nothing searched (zeros, other positions or requests, bf16 rounding)"
    return "none" if not r.diagnoses else r.diagnoses[0].text.removeprefix("diagnosis: ")


def _root(c: _Sides) -> str:
    first = c.result.first
    return "none" if first is None else first.where() + ("" if all(first.data) else f"; {no_data_text(first.data)}")


# The record's fields, in order: (label, value from both sides); every value a string, "unknown"
# where the traces do not say.
FIELDS: tuple[tuple[str, Callable[[_Sides], str]], ...] = (
    ("engine", _run_key("engine")),
    ("engine version", _run_key("engine_version")),
    ("engine commit", _run_key("engine_commit")),
    ("runner", _run_key("runner")),
    ("engine patches", lambda c: _patches(c)),
    ("target checkpoint", _run_key("model")),
    ("architecture", _run_key("architecture")),
    ("model config digest", _run_key("config_digest")),
    ("dtype", _run_key("dtype")),
    ("quantization format", _quantization),
    ("KV cache dtype", _run_key("kv_cache_dtype")),
    ("drafter method", lambda c: _no_drafter(c, str(c.method) if c.method else None)),
    ("drafter checkpoint", lambda c: _no_drafter(c, str(c.drafter["model"]) if c.drafter.get("model") else None)),
    ("speculative tokens", lambda c: _no_drafter(c, str(c.k) if c.k is not None else None,
                                                 "0 (no speculative decoding)")),
    ("drafter input", lambda c: _no_drafter(c, f"{c.drafter['input']}, layers {c.drafter.get('tapped_layers')}"
                                            if c.drafter.get("input") else None)),
    ("prefix caching", lambda c: {True: "on", False: "off"}.get(c.run.get("prefix_caching"), UNKNOWN)),
    ("mamba cache mode", _run_key("mamba_cache_mode")),
    ("mamba block size", _run_key("mamba_block_size")),
    ("block size", lambda c: f"{c.run['block_size']} tokens" if c.run.get("block_size") is not None else UNKNOWN),
    ("max num batched tokens", _run_key("max_num_batched_tokens")),
    ("replay mode", lambda c: _replay_mode(c.run)),
    ("cache reuse (hit run)", lambda c: _reuse_hit(c.run)),
    ("cache reuse forced off (cold run)", lambda c: _reuse_cold(c.cold_run)),
    ("seed", _run_key("seed")),
    ("sampling", lambda c: _sampling(c.run, c.hit_requests)),
    ("enforce eager", _run_key("enforce_eager")),
    ("conversation", lambda c: _known(c.run.get("conversation")) + (
        f" (prompt digest {c.run['conversation_digest'][:16]})" if c.run.get("conversation_digest") else "")),
    ("requests", lambda c: str(len(c.hit_requests)) if c.hit_requests else _known(c.run.get("num_requests"))),
    ("planted fault", lambda c: _fault(c.run)),
    ("prompt tokens per turn", lambda c: _per_turn(c.hit_requests, "prompt_len")),
    ("prefix-cache hit per turn (hit run)", lambda c: _per_turn(c.hit_requests, "num_cached_tokens")),
    ("prefix-cache hit per turn (cold run)", lambda c: _per_turn(c.cold_requests, "num_cached_tokens")),
    # hit accounting of the hit run (statediff.replay.hits, via compare)
    ("expected hit per turn (perfect prefix cache)", lambda c: (
        "[" + ", ".join(_n(r.expected_hit) for r in c.result.requests) + "]" if c.result.requests else UNKNOWN)),
    ("hit findings", lambda c: "; ".join(c.result.hit_findings) or "none"),
    ("acceptance per turn (hit run)", lambda c: _acceptance_summary(c.hit_requests, c.spec)),
    ("acceptance per turn (cold run)", lambda c: _acceptance_summary(c.cold_requests, _spec(c.cold_run)[2])),
    ("outputs", lambda c: _outputs(c.result)),
    ("root divergence", _root),
    ("diagnosis", _diagnosis),
    ("statediff version", _run_key("statediff_version")),
    ("traces", lambda c: _traces(c.result)),
)
FIELD_LABELS = tuple(label for label, _ in FIELDS)


def _turns(c: _Sides) -> list[TurnRow]:
    """One row per request, both runs side by side; a boundary sweep's own expectation where it has one."""
    sweep = c.run.get("sweep") if isinstance(c.run.get("sweep"), dict) else None
    turns = []
    for row in c.result.requests:
        i = row.request
        h, cold = c.hit_requests.get(i) or {}, c.cold_requests.get(i) or {}
        label, exp = None, row.expected_hit
        if sweep is not None:  # the sweep's own expectation: align-mode retention (replay/sweep.py)
            labels, hits = sweep.get("labels") or [], sweep.get("expected_hits") or []
            label = labels[i] if i < len(labels) else None
            exp = hits[i] if i < len(hits) else None
        turns.append(TurnRow(
            request=i, prompt_tokens=h.get("prompt_len", cold.get("prompt_len")),
            cached_hit=h.get("num_cached_tokens"), cached_cold=cold.get("num_cached_tokens"),
            expected_hit=exp, label=label, outputs=row.outputs,
            acceptance_hit=_acceptance(h.get("acceptance"), c.spec),
            acceptance_cold=_acceptance(cold.get("acceptance"), _spec(c.cold_run)[2])))
    return turns


def _title(result: Any, audit: Any = None) -> str:
    """The report's one line: the verdict and its root (a tensor-parallel set: the root's rank).

    With the hit run's ``audit`` (``statediff check``): a restore violation the audit found leads
    the title when compare names no divergent state, which a clean title would hide."""
    root, where = _root_rank(result)
    first = root.first
    if first is not None:
        title = "statediff: state diverges after a prefix-cache hit at " + first.where()
    elif audit is not None and audit.exit_code == 1:
        title = (f"statediff: the one-run audit of the cache-hit run found a restore violation ({audit.headline()}); "
                 + ("compare finds no divergence from the cold run" if root.cause is None else
                    "compare finds no state divergence from the cold run"))
    elif result.verdict == "cannot-judge":
        n = sum(len(r.band.unsure) for r in getattr(result, "results", [result]))
        title = (f"statediff: cannot judge the cache-hit run against the cold run: {n} pair{'' if n == 1 else 's'} "
                 "between rounding noise and a fault (default replay)")
    else:
        title = "statediff: no state divergence between the cache-hit and cold runs"
    if audit is not None and audit.exit_code == 2:  # NOT CHECKED: the exit code is 2, the title says why
        title += "; the one-run audit of the cache-hit run could check no restore (NOT CHECKED)"
    if root.incomplete:  # compared with --allow-incomplete: say so where a reader looks first
        title += " (INCOMPLETE trace: " + "; ".join(root.incomplete) + ")"
    return title if where is None else f"{title} (tensor parallel: {where})"


def _root_rank(result: Any) -> tuple[CompareResult, str | None]:
    """The ``CompareResult`` a record describes and, for a ``statediff.diff.ranks.RankedResult`` (two
    tensor-parallel sets), which rank that is (None: one pair)."""
    from statediff.diff.ranks import RankedResult

    if not isinstance(result, RankedResult):
        return result, None
    return result.root, (f"rank {result.root_rank} of {result.world_size}" if result.root_rank is not None
                         else f"every rank of {result.world_size}")


def exit_code(result: Any, audit: Any = None) -> int:
    """The verdict's exit code: 1 when compare or the hit run's ``audit`` finds a divergence (a
    restore violation), else 2 when either cannot vouch for the pair (compare: CANNOT JUDGE; the
    audit: NOT CHECKED), else 0. ``result`` None: the audit's alone (no cold run)."""
    codes = [c.exit_code for c in (result, audit) if c is not None]
    return 1 if 1 in codes else 2 if 2 in codes else 0


def audit_section(audit: Any) -> list[str]:
    """The report's "Audit of the hit run" section (Markdown lines): the verdict, then the audit's own
    text (``AuditResult.to_text``; ``audit.json`` lists every finding)."""
    return [f"`statediff audit hit.h5`: **{audit.headline()}**", "", "```text",
            audit.to_text(more="audit.json lists them all"), "```"]


def build_report(result: Any, options: CompareOptions = CompareOptions(), *,
                 bundle: str | None = None, bundle_lines: Sequence[str] = (),
                 replay_file: str | None = None, audit: Any = None) -> IncidentReport:
    """The incident record of ``result`` (no I/O: every value comes from the result's trace sides).

    Args:
        result: ``compare`` of the pair; its ``hit``/``cold`` sides carry the
            run metadata and request records.
        options: the options that judged the pair (repeated in the reproduce commands).
        bundle: the bundle's file name, when the record goes into one (``extract``).
        bundle_lines: Markdown lines describing what the bundle keeps.
        replay_file: the bundle's replay file (adds reproduce lines that use it).
        audit: the hit run's ``statediff.audit.AuditResult`` (``statediff.verdict.check_pair``): its
            section after the fields; a violation makes the title and exit code (``exit_code``).

    A ``statediff.diff.ranks.RankedResult`` (two tensor-parallel sets) gives the record of its root
    rank's comparison, the title naming that rank and the compare section every rank's.

    Returns:
        the record; its title and ``exit_code`` are the verdict's (the comparison's, and the audit's).
    """
    root, _ = _root_rank(result)
    sides = _Sides.of(root)
    first = root.first
    no_data = first is not None and not all(first.data)
    return IncidentReport(
        title=_title(result, audit), fields=[(label, value(sides)) for label, value in FIELDS], turns=_turns(sides),
        compare_text=result.to_text(),
        reproduce=reproduce_lines(sides.run, sides.cold_run, options, bundle=bundle, replay_file=replay_file,
                                  focus=root.focus if no_data else None,
                                  focus_why=no_data_text(first.data) if no_data else ""),
        bundle=list(bundle_lines), audit=audit_section(audit) if audit is not None else [],
        exit_code=exit_code(result, audit), verdict=result.verdict if audit is None else _verdict(result, audit))


def _verdict(result: Any, audit: Any) -> str:
    """compare's verdict word, or "restore-violation" when only the audit found one."""
    if audit.exit_code == 1 and result.exit_code != 1:
        return "restore-violation"
    if audit.exit_code == 2 and result.exit_code == 0:
        return "not-checked"
    return result.verdict
