"""Known engine bugs: which upstream bugs an engine configuration is exposed to.

The data is ``known_bugs.toml`` beside this module (shipped in the wheel): one ``[[bug]]`` per
upstream bug, with the vLLM version range and the configuration that triggers it. Read by
``statediff doctor`` (from a model directory's config.json and engine options, no engine) and
by the vLLM plugin when the engine starts (``statediff_hooks.vllm.startup``, from the engine's
own config): both print ``Bug.line()``, one line per match, so the two say the same.

A ``[[bug]]`` table's keys:

- ``id`` (str), ``summary`` (one line), ``evidence`` (``"measured"`` or ``"read"``),
  ``measured`` (what this project saw or read, one line), ``links`` (upstream URLs),
  optional ``doc`` (a file of this repository) and ``workaround``.
- Conditions, each optional (left out: any): ``vllm`` (version range, comma-separated
  comparisons such as ``">=0.29,<0.33"``), ``platform`` (``cpu``, ``cuda``, ``rocm``, ...),
  ``drafter`` (speculative methods, ``"none"`` for no drafter), ``hybrid`` (the target has
  recurrent layers: GDN, Mamba), ``prefix_caching``, ``target_format`` (``bf16``, ``fp8``,
  ``nvfp4``, ...), ``runner`` (``v1`` or ``v2``).

A fact the caller does not know (None) never matches a condition on it: no warning on a guess.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Bug", "EngineFacts", "KNOWN_BUGS_ENV", "load", "matches", "version_in"]

#: ``warn`` (default): one WARNING line per match at engine start; ``refuse``: the engine does not
#: start when one matches (one line, the bug's id); ``off``: no check.
KNOWN_BUGS_ENV = "STATEDIFF_KNOWN_BUGS"
_CONDITIONS = ("vllm", "platform", "drafter", "hybrid", "prefix_caching", "target_format", "runner")
_CMP = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What is known of an engine configuration (None: not known).

    Attributes:
        vllm: vLLM version string (``"0.32.0"``; local or pre-release suffixes are ignored).
        platform: ``cpu``, ``cuda``, ``rocm``, ... (vLLM's ``current_platform.device_type``).
        drafter: the speculative method (``ngram``, ``mtp``, ``dflash``, ...), ``"none"`` without one.
        hybrid: the target model has recurrent (GDN / Mamba) layers.
        prefix_caching: prefix caching is on.
        target_format: the target checkpoint's format (``bf16``, ``fp16``, ``fp8``, ``nvfp4``, ...).
        runner: ``v1`` or ``v2`` (vLLM's model runner).
    """

    vllm: str | None = None
    platform: str | None = None
    drafter: str | None = None
    hybrid: bool | None = None
    prefix_caching: bool | None = None
    target_format: str | None = None
    runner: str | None = None


@dataclasses.dataclass(frozen=True)
class Bug:
    """One known upstream bug (a ``[[bug]]`` of ``known_bugs.toml``; keys in the module docstring)."""

    id: str
    summary: str
    evidence: str
    measured: str
    links: tuple[str, ...] = ()
    doc: str | None = None
    workaround: str | None = None
    conditions: tuple[tuple[str, Any], ...] = ()

    def applies(self, facts: EngineFacts) -> bool:
        """Every condition holds for ``facts`` (an unknown fact never holds)."""
        for key, want in self.conditions:
            got = getattr(facts, key)
            if got is None:
                return False
            if key == "vllm":
                if not version_in(got, want):
                    return False
            elif isinstance(want, list):
                if str(got).lower() not in [str(w).lower() for w in want]:
                    return False
            elif isinstance(want, bool):
                if bool(got) is not want:
                    return False
            elif str(got).lower() != str(want).lower():
                return False
        return True

    def where(self) -> str:
        """The triggering configuration in words, from the entry alone (the same in every process)."""
        c = dict(self.conditions)
        parts = [f"vLLM {c['vllm']}" if "vllm" in c else "any vLLM"]
        if "platform" in c:
            parts[0] += f" on {c['platform']}"
        if "drafter" in c:
            parts.append("drafter " + "/".join(c["drafter"]))
        if "hybrid" in c:
            parts.append("hybrid target" if c["hybrid"] else "non-hybrid target")
        if "prefix_caching" in c:
            parts.append("prefix caching " + ("on" if c["prefix_caching"] else "off"))
        if "target_format" in c:
            parts.append("target " + "/".join(c["target_format"]))
        if "runner" in c:
            parts.append(f"model runner {c['runner']}")
        return ", ".join(parts)

    def line(self) -> str:
        """The one line a match prints (``statediff doctor`` and the engine log alike)."""
        evidence = "measured here" if self.evidence == "measured" else "read, not measured here"
        refs = " ".join(self.links + ((self.doc,) if self.doc else ()))
        return (f"statediff: known engine bug {self.id} ({self.where()}; {evidence}): {self.summary}"
                + (f"; see {refs}" if refs else ""))


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(x) for x in m.group(1).split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def version_in(version: str, spec: str) -> bool:
    """Whether ``version`` (``"0.32.0"``, ``"0.32.0+cpu"``, ``"0.28.1rc1.dev43"``: its release
    numbers) satisfies ``spec`` (comma-separated comparisons, e.g. ``">=0.29,<0.33"``).

    Raises:
        ValueError: ``version`` has no release numbers, or ``spec`` holds something else.
    """
    got = _release(version)
    for part in spec.split(","):
        m = _CMP.match(part)
        if not m:
            raise ValueError(f"version range {spec!r}: {part.strip()!r} is not a comparison like >=0.29")
        op, want = m.group(1), _release(m.group(2))
        ok = {">=": got >= want, "<=": got <= want, ">": got > want, "<": got < want, "==": got == want,
              "!=": got != want}[op]
        if not ok:
            return False
    return True


def _bug(entry: dict[str, Any], where: str) -> Bug:
    for key in ("id", "summary", "evidence", "measured"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{where}: key {key!r} missing or not a string")
    if entry["evidence"] not in ("measured", "read"):
        raise ValueError(f"{where}: evidence {entry['evidence']!r}: expected 'measured' or 'read'")
    unknown = set(entry) - {"id", "summary", "evidence", "measured", "links", "doc", "workaround", *_CONDITIONS}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    if "vllm" in entry:
        try:  # a malformed range fails here, not at an engine's start
            version_in("0.0.0", entry["vllm"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return Bug(id=entry["id"], summary=entry["summary"], evidence=entry["evidence"], measured=entry["measured"],
               links=tuple(entry.get("links") or ()), doc=entry.get("doc"), workaround=entry.get("workaround"),
               conditions=tuple((k, entry[k]) for k in _CONDITIONS if k in entry))


def load(text: str | None = None) -> list[Bug]:
    """The known bugs: ``text`` (TOML) or the shipped ``known_bugs.toml``.

    Raises:
        ValueError: malformed TOML or entry (one line, naming the entry).
    """
    if text is None:
        text = resources.files(__package__).joinpath("known_bugs.toml").read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"known_bugs.toml: {e}") from None
    return [_bug(e, f"known_bugs.toml [[bug]] {i + 1} ({e.get('id', '?')})") for i, e in enumerate(data.get("bug", []))]


def matches(facts: EngineFacts, bugs: list[Bug] | None = None) -> list[Bug]:
    """The known bugs whose every condition holds for ``facts``, in file order."""
    return [b for b in (load() if bugs is None else bugs) if b.applies(facts)]
