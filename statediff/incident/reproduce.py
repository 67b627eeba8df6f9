"""The commands that reproduce an incident: ``statediff record`` for each trace, then compare.

``reproduce_lines`` puts them in order; each record line comes from
``statediff.replay.command.record_line``. Also ``CompareOptions``: the
options that judged a pair, handed from the CLI to the incident functions,
to ``compare`` again (bundle check) and into the reproduce lines.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from statediff.diff.defaults import DEFAULT_FACTOR
from statediff.replay.command import focus_lines, record_line


@dataclasses.dataclass(frozen=True)
class CompareOptions:
    """The ``compare`` options that judge a pair (the seven shared by compare, extract and report).

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


def reproduce_lines(hit_run: dict, cold_run: dict, options: CompareOptions = CompareOptions(), *,
                    bundle: str | None = None, replay_file: str | None = None,
                    focus: dict | None = None, focus_why: str = "") -> list[str]:
    """Shell lines: record both runs, compare, report, extract (and compare the bundle).

    With ``focus`` (the root has no data on a side; ``focus_why`` says which), the lines that
    record both runs again keeping data around the root follow the record lines.
    """
    opts = options.argv()
    split = "hit.h5" if cold_run.get("exact_form") == "split" else None
    hit_mode, cold_mode = hit_run.get("mode") or "hit", cold_run.get("mode") or "cold"
    hit_line = record_line(hit_run, hit_mode, "hit.h5")
    cold_line = record_line(cold_run, cold_mode, "cold.h5", split_like=split)
    lines = ["# on the engine machine (same model, engine and statediff versions):"]
    if not (hit_line.exact and cold_line.exact):
        lines.append("# (rebuilt from the run metadata: the traces do not store the record command line)")
    lines += [hit_line.text, cold_line.text]
    if focus is not None:
        lines.append(f"# the root has {focus_why or 'no data on a side'}: record both runs again keeping "
                     "data around it:")
        lines += [line.text for line in focus_lines(hit_run, cold_run, focus, ("hit.h5", "cold.h5"))]
    if replay_file is not None:
        lines += [f"# or with the prompts (token ids) of every request from the bundle's {replay_file}:",
                  record_line(hit_run, hit_mode, "hit.h5", replay_file=replay_file).text,
                  record_line(cold_run, cold_mode, "cold.h5", split_like=split, replay_file=replay_file).text]
    lines += ["# anywhere (no engine needed):",
              shlex.join(["statediff", "compare", "hit.h5", "cold.h5", *opts]),
              shlex.join(["statediff", "report", "hit.h5", "cold.h5", *opts, "-o", "report.md"]),
              shlex.join(["statediff", "extract", "hit.h5", "cold.h5", *opts, "-o", "bundle.zip"])]
    if bundle is not None:
        lines += ["# the attached bundle (the same root and diagnosis):",
                  shlex.join(["statediff", "compare", bundle])]
    return lines
