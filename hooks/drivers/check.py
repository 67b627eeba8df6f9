"""``statediff check``: a conversation to a verdict in one call (``CheckOptions`` in, ``run_check``,
``CheckResult`` out).

The steps, in order (``STEPS``; each names what it writes in the output directory):

1. ``record-hit``: the hit run with the engine's own chunking (``record --mode hit
   --exact-split``; with ``--exact`` one block per step instead), ``hit.h5`` (engine
   log ``hit.h5.log``).
2. ``audit-hit``: the one-run audit of the hit trace (``statediff audit hit.h5``;
   ``statediff.verdict.check_pair(hit.h5)``): every restore against what the same run saved,
   ``audit.json`` (what ``audit --json`` prints). A finding is a divergence on its own
   (exit 1, named before compare's verdict, and in ``report.md``); the cold run still
   runs, since compare judges what the audit cannot see (state computed wrong before
   it was saved). A clean audit does not end the check.
3. ``record-cold``: the cold run shaped like the hit run (``--mode cold --exact-split
   --split-like hit.h5``; with ``--exact`` one block per step), ``cold.h5`` (``cold.h5.log``).
4. ``compare``: ``statediff compare hit.h5 cold.h5`` (``check_pair(hit.h5, cold.h5)``,
   the audit of step 2 reused): ``compare.json`` (what ``compare --json`` prints) and ``report.md`` (what ``statediff report`` writes, with
   the audit's section after its fields).

With ``--concurrency N`` (N > 1) the hit run replays N copies side by side with the engine's
own chunking (``record --concurrency N``) and steps 3 and 4 are skipped (``SKIP_COLD``):
``compare`` refuses two traces of different concurrency, and a cold run at the same N is
neither split like the hit run (a concurrent replay takes no ``--split-like``) nor
bit-identical to it (batched prefills), so the audit of the hit run is the check.

Each run is a ``statediff record`` subprocess (a fresh engine each, as ``ablate`` does;
its progress bar and its error line reach this process's stderr). Every check that
needs no engine (the options of both runs, the conversation against the model, the
output directory) runs first, in this process (``prepare``). The verdict is the offline
side's: ``statediff.verdict.check_pair`` audits, compares, builds the report and decides
the title and exit code; this module records the runs, calls it and writes its files.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from statediff.errors import StatediffError
from .record import RecordingOptions

#: The steps of ``run_check``, in order (see the module docstring).
STEPS = ("record-hit", "audit-hit", "record-cold", "compare")

#: What ``run_check`` writes in the output directory.
FILES = ("hit.h5", "cold.h5", "audit.json", "compare.json", "report.md", "hit.h5.log", "cold.h5.log")

#: Why a check with ``--concurrency N`` > 1 records no cold run and compares nothing (one line).
SKIP_COLD = ("cold run and compare skipped: with --concurrency {n} the copies' prefills are batched, so no cold "
             "run is bit-identical to the hit run (and compare pairs only runs of the same concurrency); "
             "the audit of the hit run is the check")

@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """What ``statediff check`` was asked.

    Attributes:
        output_dir: directory that receives ``FILES``.
        base: the recording options both runs share (``output``/``mode``/exact fields are
            set per run by ``run_options``); its ``fault`` plants in the hit run only.
        exact: one block per step in both runs instead of the split form.
        overwrite: replace what an existing ``output_dir`` holds.
        timeout: seconds one ``statediff record`` subprocess may run (None: no limit).
    """

    output_dir: str
    base: RecordingOptions
    exact: bool = False
    overwrite: bool = False
    timeout: float | None = None

    def path(self, name: str) -> str:
        """``output_dir/name``."""
        return str(Path(self.output_dir) / name)

    def run_options(self, mode: str) -> RecordingOptions:
        """The ``RecordingOptions`` of the hit or cold run (always ``overwrite``: the
        directory was checked as a whole)."""
        split = not self.exact and self.base.concurrency == 1  # a concurrent replay: the engine's chunking
        return dataclasses.replace(
            self.base, output=self.path(f"{mode}.h5"), mode=mode, exact=self.exact, exact_split=split,
            split_like=self.path("hit.h5") if split and mode == "cold" else None,
            fault=self.base.fault if mode == "hit" else "", overwrite=True, record_argv=None)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """A finished check.

    Attributes:
        options: what was asked.
        record_lines: what each ``statediff record`` printed, hit run first.
        verdict: the ``statediff.verdict.PairVerdict`` of hit.h5 (and cold.h5): the audit, the
            comparison (None under ``--concurrency N``), the report, the exit code.
    """

    options: CheckOptions
    record_lines: tuple[str, ...]
    verdict: Any

    @property
    def audit(self) -> Any:
        """The ``statediff.audit.AuditResult`` of hit.h5 alone."""
        return self.verdict.audit

    @property
    def compare(self) -> Any:
        """The ``CompareResult`` of hit.h5 against cold.h5 (None: skipped, ``--concurrency N``)."""
        return self.verdict.compare

    @property
    def exit_code(self) -> int:
        """The verdict's (``PairVerdict.exit_code``): 0 clean and no divergence, 1 either finds one."""
        return self.verdict.exit_code

    def lines(self) -> list[str]:
        """What each recording said first (``recorded 5 requests ...``), the verdict's text (the
        audit of the hit run, compare's text report, the check's answer when they disagree; under
        ``--concurrency N`` the audit and ``SKIP_COLD``), then where each file went."""
        d = self.options.output_dir
        recorded = [line for line in self.record_lines if line.startswith("recorded ")]
        if self.compare is None:
            return [*recorded, self.verdict.to_text(), "", SKIP_COLD.format(n=self.options.base.concurrency), "",
                    f"wrote {d}/: hit.h5 (engine log: hit.h5.log), audit.json"]
        return [*recorded, self.verdict.to_text(), "",
                f"wrote {d}/: hit.h5, cold.h5 (engine logs: *.h5.log), audit.json, compare.json, report.md"]


def check_output_dir(output_dir: str, overwrite: bool) -> None:
    """Refuse an output directory that is a file, holds something (without ``overwrite``) or
    cannot be created.

    Raises:
        StatediffError: one line naming the directory.
    """
    if not output_dir:  # Path("") is the working directory: never meant as the check's directory
        raise StatediffError("-o is empty: name the directory check writes into")
    p = Path(output_dir)
    if p.exists() and not p.is_dir():
        raise StatediffError(f"-o {output_dir}: exists and is not a directory")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise StatediffError(f"-o {output_dir}: the directory is not empty (give --overwrite to replace "
                             "its check files)")
    parent = p.parent if str(p.parent) else Path(".")
    if not p.exists() and not (parent.is_dir() and os.access(parent, os.W_OK)):
        raise StatediffError(f"-o {output_dir}: cannot create it (its parent {parent} is missing or not "
                             "writable)")


def prepare(options: CheckOptions) -> None:
    """Every check that needs no engine: both runs' options, the conversation against the
    model (``recording.read_inputs``), the output directory; then creates the directory and
    removes the check files an earlier check left there (``overwrite``).

    Raises:
        StatediffError: one line, before any engine starts.
    """
    from .record import check_options, engine_arguments, read_inputs

    o = options.base
    if o.engine != "vllm":
        raise StatediffError("check runs on vLLM (the split form is vLLM-only); record transformers runs "
                             "with 'statediff record --engine transformers'")
    check_output_dir(options.output_dir, options.overwrite)
    out = Path(options.output_dir)
    created = not out.exists()
    out.mkdir(exist_ok=True)
    try:
        hit = options.run_options("hit")
        inputs = read_inputs(hit, check_options(hit)[0])
        if hit.activations and not hit.enforce_eager:
            raise StatediffError("--activations needs --enforce-eager: forward hooks never run under torch.compile")
        engine_arguments(hit, inputs.model_dir, inputs.max_model_len)
    except BaseException:
        if created:  # a refusal leaves nothing behind
            out.rmdir()
        raise
    for name in FILES:
        Path(options.path(name)).unlink(missing_ok=True)


def record_in_subprocess(options: RecordingOptions, timeout: float | None) -> tuple[str, ...]:
    """``statediff record`` with ``options`` in a subprocess (a fresh engine): its stdout
    lines; its stderr (progress bar, error line) goes to this process's stderr.

    Raises:
        RecordFailed: the recording exited non-zero (it printed its own error line).
    """
    from ..cli.record import argv_from_options

    cmd = [sys.executable, "-m", "statediff", "record", *argv_from_options(options)]
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise StatediffError(f"the {options.mode} run took longer than {timeout:g} s (engine log: "
                             f"{options.output}.log)") from None
    if r.returncode != 0:
        raise RecordFailed(r.returncode)
    return tuple(r.stdout.splitlines())


class RecordFailed(Exception):
    """A ``statediff record`` subprocess failed after printing its own error line (exit code in ``code``)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"statediff record exited {code}")
        self.code = code


def run_check(options: CheckOptions, say: Callable[[str], None] = lambda s: None,
              progress: bool = False) -> CheckResult:
    """Record the hit run, audit it, record the cold run, compare them
    (``statediff.verdict.check_pair``); write ``audit.json``, ``compare.json`` and ``report.md``.

    Args:
        say: receives one progress line per step (``[1/4] hit run ...``).
        progress: a progress bar while comparing.
    Returns:
        the ``CheckResult`` (exit code 1 when the audit or compare finds a divergence).
    Raises:
        StatediffError: bad input (before any engine starts) or a comparison that cannot be made.
        RecordFailed: a recording failed (its error line is printed already).
    """
    from statediff.verdict import check_pair

    prepare(options)
    lines: list[str] = []
    form = "one block per step" if options.exact else "the engine's own chunking"
    n = options.base.concurrency
    if n > 1:
        form += f", {n} copies side by side"
    hit = options.path("hit.h5")
    verdict = None
    for step in STEPS:
        if n > 1 and step in ("record-cold", "compare"):
            if step == "record-cold":
                say(f"[3/4] {SKIP_COLD.format(n=n)}")
            continue
        if step == "record-hit":
            say(f"[1/4] hit run ({form}) -> {hit}")
            lines += record_in_subprocess(options.run_options("hit"), options.timeout)
        elif step == "audit-hit":
            say(f"[2/4] audit the hit run -> {options.path('audit.json')}")
            verdict = check_pair(hit)  # the audit alone, written before the cold run starts
            write_files(options, verdict)
        elif step == "record-cold":
            shape = "one block per step" if options.exact else "split like the hit run"
            say(f"[3/4] cold run ({shape}) -> {options.path('cold.h5')}")
            lines += record_in_subprocess(options.run_options("cold"), options.timeout)
        elif step == "compare":
            say(f"[4/4] compare -> {options.path('compare.json')}, {options.path('report.md')}")
            verdict = check_pair(hit, options.path("cold.h5"), audit=verdict.audit, progress=progress)
            write_files(options, verdict)
    return CheckResult(options, tuple(lines), verdict)


def write_files(options: CheckOptions, verdict: Any) -> None:
    """Write the verdict's files (``PairVerdict.files``) into the output directory.

    Raises:
        StatediffError: a file cannot be written (one line naming the directory).
    """
    for name, text in verdict.files().items():
        try:
            Path(options.path(name)).write_text(text, encoding="utf-8")
        except OSError as e:
            raise StatediffError(f"cannot write into {options.output_dir}: {e.strerror or e}") from None
