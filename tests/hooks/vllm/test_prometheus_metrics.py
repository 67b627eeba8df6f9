"""``statediff_hooks.vllm.metrics`` without an engine: the live audit's counters as vLLM's /metrics
serves them (prometheus_client's multiprocess files, read by the collector the front end registers),
from this process and from another one (a second tensor-parallel rank)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.vllm]  # prometheus_client: a dependency of vLLM

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from statediff.audit.live import LiveAuditor, LiveConfig  # noqa: E402
from statediff_hooks.vllm import metrics  # noqa: E402


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of an exposition text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def recorder(tmp_path) -> NS:
    return NS(step=0, auditor=LiveAuditor({}, LiveConfig(str(tmp_path / "inc.jsonl"))))


def _forget_served() -> None:
    for x in metrics._served:
        if isinstance(x, tuple):
            REGISTRY.unregister(x[1])
    metrics._served.clear()


@pytest.fixture
def fresh_env(monkeypatch):
    """No metrics directory and no collector of an earlier test in this process (plugin tests serve too)."""
    _forget_served()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(metrics.DIR_ENV, raising=False)
    yield
    _forget_served()


def test_counters_reach_the_front_end_registry_once_per_step(tmp_path, fresh_env):
    path = metrics.serve()
    assert os.environ[metrics.DIR_ENV] == path and os.path.isdir(path)
    assert metrics.serve() == path and len(metrics._served) == 2  # idempotent: one directory, one collector
    rec = recorder(tmp_path)
    m = metrics.AuditMetrics(rec, rank=0)
    aud = rec.auditor
    aud.checked.update({"state": 6, "kv": 6, "block_table": 4})
    aud.violations[("state", "gdn.conv_state")] += 1
    m.spent(0.003)
    before = samples(generate_latest(REGISTRY).decode())
    assert before[("statediff:restores_checked_total", (("check", "state"), ("rank", "0")))] == 0  # step not over
    assert before[("statediff:audit_seconds_count", (("rank", "0"),))] == 0
    rec.step = 1  # the step ended inside the hook that spent these 2 ms
    m.spent(0.002)
    got = samples(generate_latest(REGISTRY).decode())
    assert got[("statediff:restores_checked_total", (("check", "state"), ("rank", "0")))] == 6
    assert got[("statediff:restores_checked_total", (("check", "first_chunk"), ("rank", "0")))] == 0
    assert got[("statediff:restores_not_checkable_total", (("check", "kv"), ("rank", "0")))] == 0
    assert got[("statediff:restore_violations_total",
                (("check", "state"), ("kind", "gdn.conv_state"), ("rank", "0")))] == 1
    assert got[("statediff:audit_seconds_count", (("rank", "0"),))] == 1
    assert got[("statediff:audit_seconds_sum", (("rank", "0"),))] == pytest.approx(0.005)
    assert got[("statediff:audit_seconds_bucket", (("le", "0.0025"), ("rank", "0")))] == 0
    assert got[("statediff:audit_seconds_bucket", (("le", "0.005"), ("rank", "0")))] == 1
    assert got[("statediff:audit_seconds_bucket", (("le", "+Inf"), ("rank", "0")))] == 1
    m.close()


def test_another_process_and_vllms_own_multiprocess_directory(tmp_path, fresh_env, monkeypatch):
    shared = tmp_path / "prom"
    shared.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(shared))
    assert metrics.serve() == str(shared) and metrics._served == []  # vLLM's own registry reads it
    rec = recorder(tmp_path)
    m = metrics.AuditMetrics(rec, rank=0)
    rec.auditor.violations[("kv", "attn.k")] += 2
    rec.step = 1
    m.spent(0.0)
    child = ("import sys; from types import SimpleNamespace as NS; from collections import Counter\n"
             "from statediff_hooks.vllm.metrics import AuditMetrics\n"
             "aud = NS(checked=Counter(), not_checkable=Counter(), violations=Counter({('kv', 'attn.k'): 1}))\n"
             "rec = NS(step=0, auditor=aud); m = AuditMetrics(rec, rank=1); rec.step = 1; m.spent(0.0)\n")
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120, env=os.environ.copy())
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(shared))  # what vLLM's get_prometheus_registry() builds
    got = samples(generate_latest(reg).decode())
    assert got[("statediff:restore_violations_total", (("check", "kv"), ("kind", "attn.k"), ("rank", "0")))] == 2
    assert got[("statediff:restore_violations_total", (("check", "kv"), ("kind", "attn.k"), ("rank", "1")))] == 1
    # two files per process, named apart from prometheus_client's own (counter_<pid>.db) in a shared directory
    names = sorted(p.name for p in shared.iterdir())
    assert [n.split("statediff")[0] for n in names] == ["counter_", "counter_", "histogram_", "histogram_"]
    assert f"counter_statediff{os.getpid()}.db" in names
    m.close()


def test_no_directory_is_one_clear_error(tmp_path, fresh_env):
    with pytest.raises(ValueError, match="^no metrics directory: neither PROMETHEUS_MULTIPROC_DIR nor "
                                         "STATEDIFF_METRICS_DIR is set$"):
        metrics.AuditMetrics(recorder(tmp_path))


def test_an_inherited_directory_that_is_gone_is_created_and_served(tmp_path, fresh_env, monkeypatch):
    """A parent's temporary directory removed before this server started (seen in CI: every /metrics
    scrape without a statediff sample): created again, at the path every process of the server shares."""
    gone = tmp_path / "gone"
    monkeypatch.setenv(metrics.DIR_ENV, str(gone))
    assert metrics.serve() == str(gone) and gone.is_dir()
    rec = recorder(tmp_path)
    m = metrics.AuditMetrics(rec, rank=0)
    rec.auditor.checked["kv"] += 3
    rec.step = 1
    m.spent(0.0)
    got = samples(generate_latest(REGISTRY).decode())
    assert got[("statediff:restores_checked_total", (("check", "kv"), ("rank", "0")))] == 3
    assert sorted(p.name for p in gone.iterdir()) == [f"counter_statediff{os.getpid()}.db",
                                                      f"histogram_statediff{os.getpid()}.db"]
    m.close()
