"""What a recording records, as ``STATEDIFF_*`` environment variables: ``RecorderConfig``.

Environment variables reach every vLLM process unchanged (front end, engine
core, workers), so the replay (``vllm/replay.py``) and an unmodified program
(``STATEDIFF_TRACE=...``) configure the recorder the same way. Pure Python
(no torch): the replay plans its environment before any engine starts.
"""

from __future__ import annotations

import dataclasses
import json
import os

from statediff.audit.live import LiveConfig
from .faults import FaultSpec, parse_fault
from .keep import KeepSpec


@dataclasses.dataclass(frozen=True)
class RecorderConfig:
    """What to record, read from ``STATEDIFF_*`` environment variables.

    STATEDIFF_TRACE: trace path (recording is off when unset).
    STATEDIFF_MODE: "hit" or "cold" (how the run was driven; metadata).
    STATEDIFF_REPLAY: "default" or "exact" (chunking policy; metadata).
    STATEDIFF_KV: "all" (every completed K/V block, default) or "none" (no K/V captured at all).
    STATEDIFF_KEEP: which captured tensors keep their data: "hits" (default), "all",
        "none" or a byte budget in bytes (``keep.KeepSpec``); every one gets a summary.
    STATEDIFF_FOCUS: a focused re-record, JSON ``{"request": R, "position": P, "layers": [..] | null}``.
    STATEDIFF_FAULT: planted-fault spec (see ``faults.parse_fault``).
    STATEDIFF_RUN_JSON: extra run metadata (JSON object) from the front end.
    STATEDIFF_OVERWRITE: "1" to replace an existing trace.
    STATEDIFF_ACTIVATIONS: "1" for eager-mode hidden-state hooks (perturbs numerics).
    STATEDIFF_LIVE_AUDIT / STATEDIFF_LIVE_AUDIT_PROMPTS: a live audit instead of a trace
        (``statediff.audit.live.LiveConfig``; ``live`` set, ``trace`` empty, nothing kept).
    """

    trace: str
    mode: str | None = None
    replay: str | None = None
    kv: str = "all"
    fault: FaultSpec | None = None
    run_extra: dict = dataclasses.field(default_factory=dict)
    overwrite: bool = False
    activations: bool = False
    keep: KeepSpec = dataclasses.field(default_factory=KeepSpec)
    live: LiveConfig | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RecorderConfig | None":
        """The config ``env`` (default: this process's environment) asks for; None when
        neither ``STATEDIFF_TRACE`` nor ``STATEDIFF_LIVE_AUDIT`` is set (recording off).

        Raises:
            ValueError: a bad ``STATEDIFF_KV``, ``STATEDIFF_FAULT``, ``STATEDIFF_KEEP``,
                ``STATEDIFF_FOCUS`` or ``STATEDIFF_LIVE_AUDIT*`` (``LiveConfig.from_env``).
        """
        env = os.environ if env is None else env
        trace = env.get("STATEDIFF_TRACE")
        live = LiveConfig.from_env(env)
        if live is not None:  # digests only, nothing kept, no trace
            return cls(trace="", mode="live", kv="all", fault=parse_fault(env.get("STATEDIFF_FAULT") or ""),
                       keep=KeepSpec.parse("none"), live=live)
        if not trace:
            return None
        kv = env.get("STATEDIFF_KV", "all")
        if kv not in ("all", "none"):
            raise ValueError(f"STATEDIFF_KV={kv!r}: expected 'all' or 'none'")
        extra = json.loads(env.get("STATEDIFF_RUN_JSON") or "{}")
        keep = KeepSpec.from_env(env)
        return cls(
            trace=trace,
            mode=env.get("STATEDIFF_MODE") or None,
            replay=env.get("STATEDIFF_REPLAY") or None,
            kv=kv,
            fault=parse_fault(env.get("STATEDIFF_FAULT") or ""),
            run_extra=extra if isinstance(extra, dict) else {},
            overwrite=env.get("STATEDIFF_OVERWRITE") == "1",
            activations=env.get("STATEDIFF_ACTIVATIONS") == "1",
            keep=keep,
        )

    def to_env(self) -> dict[str, str]:
        """The environment that makes ``from_env`` return this config."""
        env = {"STATEDIFF_TRACE": self.trace, "STATEDIFF_KV": self.kv,
               "STATEDIFF_RUN_JSON": json.dumps(self.run_extra, default=str)}
        if self.mode:
            env["STATEDIFF_MODE"] = self.mode
        if self.replay:
            env["STATEDIFF_REPLAY"] = self.replay
        if self.fault:
            env["STATEDIFF_FAULT"] = self.fault.spec
        if self.overwrite:
            env["STATEDIFF_OVERWRITE"] = "1"
        if self.activations:
            env["STATEDIFF_ACTIVATIONS"] = "1"
        env.update(self.keep.to_env())
        return env
