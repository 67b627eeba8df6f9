"""Run several ``statediff`` commands in one process (one vLLM import), for the smoke set.

``python tests/smoke_driver.py JOBS.json OUT.json``: JOBS is ``[[name, argv, version, env], ...]``;
each job runs ``statediff`` with ``argv``, with ``env`` (a dict) added to the environment.
``version`` (or null) stands in for the installed vLLM's version while that job runs
(``vllm.__version__``, what ``statediff_hooks.vllm.surface`` reads): how a test simulates a
vLLM version statediff has not verified. OUT gets
``{name: {"code": exit code, "stderr": what the job printed on stderr, "seconds": wall time}}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time


def main() -> None:
    import vllm

    from statediff.cli import cli

    jobs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    real, out = vllm.__version__, {}
    for name, argv, version, env in jobs:
        vllm.__version__ = version or real
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        err, t0 = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv, standalone_mode=False)
            except Exception as e:  # noqa: BLE001 - a crash is this job's result, not the driver's
                code, err = -1, io.StringIO(f"{type(e).__name__}: {e}")
        out[name] = {"code": code, "stderr": err.getvalue()[-3000:], "seconds": round(time.perf_counter() - t0, 1)}
        vllm.__version__ = real
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
