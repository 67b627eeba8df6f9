"""The commands that reproduce an incident: ``statediff record`` for each trace, then compare.

``reproduce_lines`` puts them in order; each record line comes from
``statediff.replay.command.record_line``; the options that judged the pair
(``statediff.diff.pair.CompareOptions``) are repeated in them.
"""

from __future__ import annotations

import shlex

from statediff.diff.pair import CompareOptions
from statediff.replay.command import focus_lines, record_line


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
