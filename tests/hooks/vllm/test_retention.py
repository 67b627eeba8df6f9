"""Prefix-cache retention in the run's effective config (``effective.retention_facts``, read through
``surface.retention_interval``) and in ``inspect``: vLLM 0.32's own config objects, no engine."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from click.testing import CliRunner

from statediff.cli import cli
from synth import write_trace

# plain imports, no importorskip: a vLLM that moved these fails here, in CI, instead of skipping
from vllm.config.cache import CacheConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from statediff_hooks.vllm import effective, surface

pytestmark = pytest.mark.vllm


def runner(interval):
    """A runner holding the engine's own ``KVCacheConfig`` resolved with ``interval``."""
    return NS(kv_cache_config=KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[],
                                            prefix_cache_retention_interval=interval))


def test_vllm_default_is_boundaries_only():
    # vLLM 0.32's default: 0 (only replay-boundary checkpoints); the engine's KVCacheConfig copies it
    assert CacheConfig().prefix_cache_retention_interval == 0
    assert effective.retention_facts(runner(CacheConfig().prefix_cache_retention_interval)) == {
        "prefix_cache_retention_interval": 0, "prefix_cache_retention": "boundaries"}


@pytest.mark.parametrize("interval, text", [(None, "dense"), (64, "every 64 tokens")])
def test_dense_and_periodic_retention(interval, text):
    assert surface.retention_interval(runner(interval)) == (True, interval)
    assert effective.retention_facts(runner(interval)) == {
        "prefix_cache_retention_interval": interval, "prefix_cache_retention": text}


def test_an_engine_without_the_setting_records_nothing():
    assert surface.retention_interval(NS(kv_cache_config=NS())) == (False, None)
    assert effective.retention_facts(NS(kv_cache_config=NS())) == {}


@pytest.mark.parametrize("interval, line", [
    (0, "0 (only prompt-boundary states are kept: a hit ends at a prompt's last full block; "
        "states saved while decoding are not reused)"),
    (None, "None (dense: a state at every block boundary, decode included, can be reused)"),
    (64, "64 (every 64 tokens, plus prompt boundaries)")])
def test_inspect_shows_the_retention(tmp_path, interval, line):
    eff = effective.retention_facts(runner(interval))
    path = write_trace(tmp_path / "t.h5", "hit", effective=eff)
    r = CliRunner().invoke(cli, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert f"  prefix retention       {line}" in r.output.splitlines()


def test_inspect_of_a_trace_without_it_has_no_line(tmp_path):
    r = CliRunner().invoke(cli, ["inspect", str(write_trace(tmp_path / "t.h5", "hit"))])
    assert r.exit_code == 0 and "prefix retention" not in r.output


def test_a_pair_whose_retention_differs_is_compared_with_a_warning(tmp_path):
    from statediff.diff.compare import compare

    hit = write_trace(tmp_path / "hit.h5", "hit", effective=effective.retention_facts(runner(None)))
    cold = write_trace(tmp_path / "cold.h5", "cold", effective=effective.retention_facts(runner(0)))
    result = compare(hit, cold)
    assert result.exit_code == 0
    assert "effective prefix_cache_retention differs (hit 'dense', cold 'boundaries')" in result.warnings
