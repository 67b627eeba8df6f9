"""What `statediff audit` costs: the capture it adds per request, the trace bytes, and the audit itself.

1. Capture the audit adds to a recording (engine side, this CPU, torch): per
   request, the first chunk's state read from its slot and summarised
   (``statediff_hooks.recording.digest.summarize_rows`` of the conv and SSM states of
   every GDN layer, stacked per kind as ``hooks/vllm/v1/capture.py`` ``Batch`` does),
   for the tiny hybrid and a 27B-class hybrid (48 GDN layers: SSM (48, 128,
   128) fp32, conv (3, 10240) bf16). The other inputs of the audit (checkpoints,
   the K/V of each completed block, the hit's reads, block tables) were
   already recorded; their cost is in "Hit reads through the block table" and
   "Digest-first recording". The group hit lengths are a list of ints per request.
2. Trace bytes the additions take: ``/digests`` rows (449 B each) and the
   ``first_chunk`` / ``group_hit_tokens`` JSON.
3. ``audit_trace`` wall time on a digest-only trace of a 27B-class
   conversation (5 requests of 31K-67K tokens, block 784, each resuming from
   the previous one's prompt: every checkpoint, completed K/V block and hit read
   as ``record --keep none`` writes them), written here with ``TraceWriter.add_digest``.

Prints Markdown and writes it to docs/performance.md under the heading below.

    .venv/bin/python benchmarks/bench_audit.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_audit.py --no-doc
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perfdoc import replace_section  # noqa: E402

HEADING = "## Audit: capture cost and audit time"
LAYERS_27B = dict(gdn=48, attn=16, block=784, ssm=(48, 128, 128), conv=(3, 10240), kv=(4, 784, 256))
LAYERS_TINY = dict(gdn=3, attn=1, block=128, ssm=(2, 64, 64), conv=(3, 256), kv=(4, 128, 128))
ROW_BYTES = 449


def first_chunk_read_ms(shapes: dict, reps: int) -> float:
    """Median ms per request: stack every GDN layer's slot state per kind and summarise it (v1.Batch)."""
    import torch

    from statediff_hooks.recording.digest import summarize_rows

    n = shapes["gdn"]
    conv = torch.randn(n + 2, *shapes["conv"]).to(torch.bfloat16)
    ssm = torch.randn(n + 2, *shapes["ssm"], dtype=torch.float32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        summarize_rows(torch.stack([conv[i + 1] for i in range(n)]))
        summarize_rows(torch.stack([ssm[i + 1] for i in range(n)]))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def added_bytes(shapes: dict) -> tuple[int, int]:
    """(digest-row bytes, JSON bytes) the audit's additions take per request."""
    rows = 2 * shapes["gdn"] * ROW_BYTES
    first = {"start": 0, "layers": {str(i): {"treated_as": "prefill", "prior_state": False, "slot": 100000 + i}
                                    for i in range(shapes["gdn"])}}
    groups = [60000] * (shapes["gdn"] + shapes["attn"])
    return rows, len(json.dumps(first)) + len(json.dumps(groups))


def _digest(*key: object) -> str:
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


def write_conversation(path: Path, shapes: dict) -> int:
    """A digest-only hit trace of the 27B-class conversation (module docstring); returns its row count."""
    from statediff.trace.writer import TraceWriter

    b, rows = shapes["block"], 0
    lengths = [31000, 40000, 49000, 58000, 67000]
    layers = ([{"layer": i, "module": f"l{i}", "type": "gdn", "group": i, "block_size": b} for i in range(shapes["gdn"])]
              + [{"layer": 100 + i, "module": f"a{i}", "type": "attn", "group": shapes["gdn"], "block_size": b}
                 for i in range(shapes["attn"])])
    w = TraceWriter(path, dict(engine="synthetic", mode="hit", block_size=b, mamba_block_size=b, layers=layers))
    tokens = list(range(max(lengths)))
    step, done = 0, 0
    for r, n in enumerate(lengths):
        w.begin_request(r, f"r{r}", tokens[:n])
        hit = (done - 1) // b * b if done else 0
        key = dict(request=r, step=step)
        for li in layers:
            gdn = li["type"] == "gdn"
            if hit:
                for kind in (("gdn.conv_state", "gdn.ssm_state") if gdn else ("attn.k", "attn.v")):
                    for j in ((hit // b - 1,) if gdn else range(hit // b)):
                        shape = shapes["conv" if kind == "gdn.conv_state" else "ssm" if gdn else "kv"]
                        w.add_digest(_digest(li["layer"], kind, j), position=(j + 1) * b,
                                     token_start=(j + 1) * b if gdn else j * b, layer=li["layer"], kind=kind,
                                     role="resumed", module=li["module"], dtype="float32", shape=shape,
                                     block=7 if gdn else 1000 + j, **key)
                        rows += 1
            for kind in (("gdn.conv_state", "gdn.ssm_state") if gdn else ("attn.k", "attn.v")):
                for j in ((n - 1) // b - 1,) if gdn else range(hit // b, n // b):
                    shape = shapes["conv" if kind == "gdn.conv_state" else "ssm" if gdn else "kv"]
                    w.add_digest(_digest(li["layer"], kind, j), position=(j + 1) * b,
                                 token_start=(j + 1) * b if gdn else j * b, layer=li["layer"], kind=kind,
                                 role="checkpoint" if gdn else "kv_block", module=li["module"], dtype="float32",
                                 shape=shape, block=7 if gdn else 1000 + j, **key)
                    rows += 1
        w.update_request(r, num_cached_tokens=hit, output_token_ids=[1], finished=True)
        w.end_step()
        step, done = step + 1, n
    w.close()
    return rows


def audit_time(shapes: dict) -> tuple[float, int, int, dict]:
    """(seconds, rows, file bytes, checked) of ``audit_trace`` on the conversation trace."""
    from statediff.audit import audit_trace

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "hit.h5"
        rows = write_conversation(p, shapes)
        t0 = time.perf_counter()
        r = audit_trace(p)
        secs = time.perf_counter() - t0
        assert r.exit_code == 0, r.to_text()
        return secs, rows, p.stat().st_size, r.checked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    load0 = os.getloadavg()[0]
    lines = [HEADING, "",
             f"Measured by `.venv/bin/python benchmarks/bench_audit.py` on {os.cpu_count()} CPUs "
             f"({platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}); "
             f"1-minute load average {load0:.1f} before"]
    rows = ["| model | GDN layers | first-chunk read + summary per request (ms) | digest rows per request | "
            "JSON per request |", "| --- | --- | --- | --- | --- |"]
    for name, shapes in (("tiny hybrid", LAYERS_TINY), ("27B-class hybrid", LAYERS_27B)):
        ms = first_chunk_read_ms(shapes, args.reps)
        rb, jb = added_bytes(shapes)
        rows.append(f"| {name} | {shapes['gdn']} | {ms:.2f} | {2 * shapes['gdn']} ({rb / 1024:.1f} KiB) | {jb} B |")
    secs, n, size, checked = audit_time(LAYERS_27B)
    lines[-1] += f", {os.getloadavg()[0]:.1f} after (the machine was shared with other work)."
    lines += ["", *rows, "",
              f"`audit_trace` on the digest-only hit trace of the 27B-class conversation (5 requests, 31K-67K "
              f"tokens, block 784; {n} digest rows, {size / 1e6:.1f} MB file): {secs:.2f} s, checking "
              f"{checked['state']} resumed states and {checked['kv']} K/V blocks.", "",
              "Reading it: the audit adds one read of each GDN layer's state slot per request (the first "
              "chunk, before the kernels run) and its summary: the same bytes as one checkpoint of every "
              "layer, once per request, not per step. On this shared CPU the 27B-class summary (144 MiB of "
              "fp32 SSM state) takes seconds, as a checkpoint read does; on a GPU the digest pass is a memory-"
              "bound pass of tens of milliseconds (see \"Hit reads through the block table\"). Everything "
              "else the audit compares was already recorded. The audit itself reads only the digest table, "
              "no tensor data."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_doc:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
