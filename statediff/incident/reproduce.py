"""The commands that reproduce an incident: ``statediff record`` for each trace, then compare.

Also ``CompareOptions``: the options that judged a pair, handed from the CLI
to the incident functions, to ``compare`` again (bundle check) and into the
reproduce lines.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

from statediff.diff.focus import focus_commands, record_words
from statediff.diff.noise import DEFAULT_FACTOR


@dataclasses.dataclass(frozen=True)
class CompareOptions:
    """The ``compare`` options that judge a pair (the five shared by compare, extract and report).

    Attributes:
        tol: ``--tol`` rules as given (``PATTERN=ATOL,RTOL``), first match wins.
        noise: path of a noise file from ``calibrate``, or None.
        noise_factor: allowed multiple of the noise envelope; None: the
            default (``DEFAULT_FACTOR``, or a bundle's own factor).
        allow_engine_mismatch, allow_noise_in_exact, allow_incomplete,
        strict_hits: as for ``compare``.
    """

    tol: tuple[str, ...] = ()
    noise: str | None = None
    noise_factor: float | None = None
    allow_engine_mismatch: bool = False
    allow_noise_in_exact: bool = False
    allow_incomplete: bool = False
    strict_hits: bool = False

    FLAGS = ("allow_engine_mismatch", "allow_noise_in_exact", "allow_incomplete", "strict_hits")

    @property
    def factor(self) -> float:
        """The noise factor in effect."""
        return DEFAULT_FACTOR if self.noise_factor is None else self.noise_factor

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``statediff.diff.compare.compare``."""
        return dict(tol=list(self.tol), noise=self.noise, noise_factor=self.factor,
                    **{flag: getattr(self, flag) for flag in self.FLAGS})

    def argv(self, noise_name: str | None = None) -> list[str]:
        """The options that change the verdict, as command-line words (``noise_name`` replaces the path)."""
        words: list[str] = []
        for rule in self.tol:
            words += ["--tol", str(rule)]
        if self.noise:
            words += ["--noise", noise_name or str(self.noise), "--noise-factor", f"{self.factor:g}"]
        words += [f"--{flag.replace('_', '-')}" for flag in ("strict_hits", "allow_incomplete")
                  if getattr(self, flag)]
        return words


def speculative(run: dict) -> tuple[str | None, Any, bool]:
    """(speculative method, number of speculative tokens, whether the run metadata names a drafter).

    Reads ``speculative_method``/``num_speculative_tokens``, falling back to
    the ``drafter`` record (adapters that record only that). A
    ``speculative_method`` of ``"none"`` means the engine had no drafter.
    """
    drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
    method = run.get("speculative_method")
    method = None if method == "none" else method or drafter.get("method")
    k = run.get("num_speculative_tokens")
    k = drafter.get("num_speculative_tokens") if k is None else k
    return method, k, bool(method or k)


def _rebuilt_words(run: dict) -> list[str]:
    """``record`` arguments rebuilt from run metadata (traces without ``record_argv``)."""
    conv = run.get("conversation")
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
    if run.get("quantization") not in (None, "none"):
        words += ["--engine-arg", f"quantization={run['quantization']}"]
    drafter = run.get("drafter") if isinstance(run.get("drafter"), dict) else {}
    method, k, spec = speculative(run)
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
    return words


def _with_replay_file(words: list[str], run: dict, replay_file: str) -> list[str]:
    """Replace the conversation (and a sweep, and ``--max-tokens``) by a replay file of the same prompts."""
    conv = run.get("conversation")
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
    return [replay_file] + kept


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
    words = list(argv) if exact else _rebuilt_words(run)
    if replay_file is not None:
        words = _with_replay_file(words, run, replay_file)
    words += ["--mode", mode]
    if split_like is not None:
        words += ["--split-like", split_like]
    words += ["-o", out]
    return shlex.join(["statediff", "record", *words]), exact


def focus_lines(hit_run: dict, cold_run: dict, focus: dict, paths: tuple[str, str]) -> list[str]:
    """``diff.focus.focus_commands`` with each run's command line rebuilt from its run metadata when
    the trace does not store it (``record_command``), as the report's other record lines are."""
    def line(run: dict, mode: str, out: str, split_like: str | None) -> str:
        words = record_words(run)
        return record_command(run if words is None else dict(run, record_argv=words), mode, out,
                              split_like=split_like)[0]

    return focus_commands(hit_run, cold_run, focus, paths, record_line=line)


def reproduce_lines(hit_run: dict, cold_run: dict, options: CompareOptions = CompareOptions(), *,
                    bundle: str | None = None, replay_file: str | None = None,
                    focus: dict | None = None, focus_why: str = "") -> list[str]:
    """Shell lines: record both runs, compare, report, extract (and compare the bundle).

    With ``focus`` (the root has no data on a side; ``focus_why`` says which), the lines that
    record both runs again keeping data around the root follow the record lines.
    """
    opts = options.argv()
    split = "hit.h5" if cold_run.get("exact_form") == "split" else None
    hit_cmd, exact_h = record_command(hit_run, hit_run.get("mode") or "hit", "hit.h5")
    cold_cmd, exact_c = record_command(cold_run, cold_run.get("mode") or "cold", "cold.h5", split_like=split)
    lines = ["# on the engine machine (same model, engine and statediff versions):"]
    if not (exact_h and exact_c):
        lines.append("# (rebuilt from the run metadata: the traces do not store the record command line)")
    lines += [hit_cmd, cold_cmd]
    if focus is not None:
        lines.append(f"# the root has {focus_why or 'no data on a side'}: record both runs again keeping "
                     "data around it:")
        lines += focus_lines(hit_run, cold_run, focus, ("hit.h5", "cold.h5"))
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
