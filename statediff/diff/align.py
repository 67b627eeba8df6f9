"""Pair the tensors of two traces by (request, position, layer, kind).

Alignment never uses engine steps: a hit run skips the cached steps, so step
numbers do not line up, while the absolute token position does. The plan
lists the pairs in causal order and keeps what did not pair (hit-only,
cold-only), so a report can say what had no counterpart instead of
dropping it silently. When a key occurs more than once on one side, the
occurrences pair up in step order and the surplus is listed as unpaired.
Digest-only rows (``Trace.digests``) pair like index entries.

Also here: the comparability checks that refuse a pair of traces before
anything is judged, and where the two runs' token streams part.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from statediff.errors import MismatchError, NotComparableError
from statediff.trace.reader import Trace
from statediff.trace.schema import IDENTITY_KEYS, DigestEntry, TensorEntry

T = TypeVar("T")
U = TypeVar("U")
Entry = TensorEntry | DigestEntry


@dataclasses.dataclass(frozen=True)
class Pair(Generic[T]):
    """The hit run's and the cold run's twin of anything: two traces, two records, two tensors.

    ``map`` applies one function to both sides, so code for the two sides is
    written once. For a pair of index entries (``Pair[TensorEntry]``, one
    aligned tensor pair) ``key``, ``same_shape``, ``same_dtype`` and
    ``same_layout`` describe the pair.
    """

    hit: T
    cold: T

    def map(self, fn: Callable[[T], U]) -> "Pair[U]":
        """``Pair(fn(hit), fn(cold))``."""
        return Pair(fn(self.hit), fn(self.cold))

    def __iter__(self):
        """``hit, cold = pair``."""
        return iter((self.hit, self.cold))

    @property
    def key(self) -> tuple[int, int, int, str]:
        return self.cold.key

    @property
    def same_shape(self) -> bool:
        return self.hit.shape == self.cold.shape

    @property
    def same_dtype(self) -> bool:
        return self.hit.dtype == self.cold.dtype

    @property
    def same_layout(self) -> bool:
        """Same logical dtype and shape (the fingerprint hashes can then be compared)."""
        return self.same_dtype and self.same_shape

    @property
    def digest_only(self) -> bool:
        """Either side was recorded as a digest only (a ``/digests`` row, no data)."""
        return isinstance(self.hit, DigestEntry) or isinstance(self.cold, DigestEntry)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How two traces were paired (plain data; shown in reports).

    Attributes:
        pairs: aligned pairs in causal order (request, position, layer, kind).
        hit_only, cold_only: entries without a counterpart, in causal order.
    """

    pairs: tuple[Pair[Entry], ...]
    hit_only: tuple[Entry, ...]
    cold_only: tuple[Entry, ...]


def align(hit: Sequence[Entry], cold: Sequence[Entry]) -> Plan:
    """Pair two traces' index entries (and digest rows) by key.

    Args:
        hit, cold: ``Trace.entries`` (plus ``Trace.digests``) of each side, any order.
    Returns:
        the plan, pairs sorted in causal order.
    """
    by_key: dict[tuple, list[Entry]] = defaultdict(list)
    for e in sorted(cold, key=lambda e: e.step):
        by_key[e.key].append(e)
    pairs, hit_only = [], []
    for e in sorted(hit, key=lambda e: e.step):
        bucket = by_key.get(e.key)
        if bucket:
            pairs.append(Pair(e, bucket.pop(0)))
        else:
            hit_only.append(e)
    cold_only = [e for bucket in by_key.values() for e in bucket]
    order = lambda e: e.causal_order  # noqa: E731
    return Plan(
        pairs=tuple(sorted(pairs, key=lambda p: p.cold.causal_order)),
        hit_only=tuple(sorted(hit_only, key=order)),
        cold_only=tuple(sorted(cold_only, key=order)),
    )


def check_comparable(a: Trace, b: Trace, *, allow_engine_mismatch: bool = False,
                     names: tuple[str, str] = ("hit", "cold"),
                     mismatch_hint: str = "use --allow-engine-mismatch to compare anyway") -> list[str]:
    """Refuse two traces that cannot be compared; return warnings for the report.

    Refuses when both traces know a value of ``schema.IDENTITY_KEYS`` and the
    values differ (different model or config), unless
    ``allow_engine_mismatch`` (the refusal ends with ``mismatch_hint``, what the caller
    offers instead); when both name their engine version and the versions differ,
    unless ``allow_engine_mismatch`` (then a warning naming both: they are judged by
    tolerance); and always when their ``replay`` modes or their ``concurrency`` (copies of
    the conversation side by side, 1 when absent) differ. A value known on one side only is
    a warning, not a refusal.

    Raises:
        MismatchError: one line naming the first differing key and both values (a replay mode or
            a concurrency that differs: both values).
        NotComparableError: two engine versions ("runs not comparable", both named); two block
            sizes, with or without ``allow_engine_mismatch``.
    """
    warnings = []
    for key in IDENTITY_KEYS:
        va, vb = a.run.get(key), b.run.get(key)
        if va is None or vb is None:
            if va != vb:
                side = names[0] if va is None else names[1]
                warnings.append(f"{key} is unknown in the {side} trace: cannot check it matches")
            continue
        if va != vb and key == "block_size":  # even across engines: positions would pair other tokens' blocks
            raise NotComparableError(
                f"runs not comparable: block_size differs ({names[0]} {va!r}, {names[1]} {vb!r}); their K/V "
                "blocks and state checkpoints cover different tokens, --allow-engine-mismatch or not (record "
                "both with the same --block-size)")
        if va != vb:
            if not allow_engine_mismatch:
                raise MismatchError(
                    f"traces differ in {key} ({names[0]} {va!r}, {names[1]} {vb!r}): "
                    f"different model or config ({mismatch_hint})"
                )
            warnings.append(f"engine mismatch allowed: {key} differs ({names[0]} {va!r}, {names[1]} {vb!r})")
    warnings += _engine_versions(a.run, b.run, allow_engine_mismatch, names)
    ra, rb = a.run.get("replay"), b.run.get("replay")
    if ra != rb and not split_form_pair(a.run, b.run):
        raise MismatchError(
            f"traces were replayed differently ({names[0]} replay={ra!r}, {names[1]} replay={rb!r}): "
            "record both with the same replay mode"
        )
    ca, cb = a.run.get("concurrency") or 1, b.run.get("concurrency") or 1
    if ca != cb:
        raise MismatchError(
            f"traces were replayed with different concurrency ({names[0]} {ca}, {names[1]} {cb}): their "
            "requests do not pair; record both with the same --concurrency (requests then pair copy by copy)")
    for t, name in ((a, names[0]), (b, names[1])):
        if t.partial:
            warnings.append(f"the {name} trace is partial (recording did not finish)")
    return warnings


def versions_differ(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Both runs (run metadata) name their engine version, and the versions differ; or both name the
    model runner that ran (run field ``model_runner``: vLLM's "v1" or "v2"), and the runners differ."""
    return any(a.get(k) is not None and b.get(k) is not None and a.get(k) != b.get(k)
               for k in ("engine_version", "model_runner"))


def _engine_text(run: Mapping[str, Any]) -> str:
    runner = f" (model runner {run['model_runner']})" if run.get("model_runner") else ""
    return f"{run.get('engine') or 'an engine'} {run.get('engine_version') or '(version unknown)'}{runner}"


def _engine_versions(a: Mapping[str, Any], b: Mapping[str, Any], allow: bool, names: tuple[str, str]) -> list[str]:
    """Two engine versions or model runners: "runs not comparable" (one line naming both), or with
    ``allow`` a warning that names both and says they are judged by tolerance (``both_exact`` is then
    False: two runners run different kernels)."""
    if not versions_differ(a, b):
        return []
    both = f"the {names[0]} trace was recorded on {_engine_text(a)}, the {names[1]} trace on {_engine_text(b)}"
    if not allow:
        raise NotComparableError(f"runs not comparable: {both} (--allow-engine-mismatch compares them by "
                                 "tolerance)")
    return [f"engine versions differ: {both}; judged by tolerance, not bit identity"]


def both_exact(a: Trace, b: Trace) -> bool:
    """Both traces replayed with identical chunking on the same engine version (a clean pair is
    bit-identical; two versions are judged by tolerance): both exact, or a split-form cold run
    against the hit trace it was shaped like (``split_form_pair``)."""
    same_chunks = (a.run.get("replay") == "exact" and b.run.get("replay") == "exact") or split_form_pair(a.run, b.run)
    return same_chunks and not versions_differ(a.run, b.run) and _tp_size(a.run) == _tp_size(b.run)


def _tp_size(run: Mapping[str, Any]) -> Any:
    """The tensor parallel size a trace's tensors were computed with (a set's unsharded tensors,
    run field ``tensor_parallel_merged``, keep theirs: other reduction orders than one rank's)."""
    merged = run.get("tensor_parallel_merged")
    return merged.get("world_size") if isinstance(merged, dict) else 1


def split_form_pair(hit_run: Mapping[str, Any], cold_run: Mapping[str, Any]) -> bool:
    """A cold run of the split form (``record --mode cold --exact-split --split-like HIT``) against a
    hit trace recorded with the engine's own chunking but not by ``record --exact-split``: a
    deployment's plugin trace (``STATEDIFF_TRACE``: replay not recorded) or a default-replay hit
    run. The split form's hit run is exactly such a run, so the pair is exact."""
    return (cold_run.get("replay") == "exact" and cold_run.get("exact_form") == "split"
            and bool(cold_run.get("split_plan")) and hit_run.get("replay") in (None, "default")
            and hit_run.get("mode") in ("hit", None))


# Effective engine configuration (run key ``effective``, docs/trace-format.md) that decides
# where prefills are split: two exact runs that differ here are not bit-comparable.
SCHEDULING_KEYS = ("block_size", "kv_cache_group_block_sizes", "mamba_block_size", "max_num_batched_tokens",
                   "max_num_scheduled_tokens", "chunked_prefill")
# Top-level run keys read when a trace has no ``effective`` object (traces recorded before it).
FALLBACK_KEYS = ("block_size", "mamba_block_size", "max_num_batched_tokens")


def effective_config(run: Mapping[str, Any]) -> dict[str, Any]:
    """The engine configuration a run really ran with: ``run["effective"]`` over the top-level keys.

    Older traces have no ``effective``; their top-level ``block_size``,
    ``mamba_block_size`` and ``max_num_batched_tokens`` (the engine's values
    after start) stand in. ``effective["kv_cache_groups"]`` (one object per
    KV-cache group) is reduced to ``kv_cache_group_block_sizes`` (tokens per
    block, in group order). Unknown (null) values are left out.
    """
    base = {k: run.get(k) for k in FALLBACK_KEYS if run.get(k) is not None}
    eff = run.get("effective")
    if isinstance(eff, dict):
        base |= {k: v for k, v in eff.items() if v is not None and k != "kv_cache_groups"}
        groups = eff.get("kv_cache_groups")
        if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
            base["kv_cache_group_block_sizes"] = [g.get("block_size") for g in groups]
    return base


def check_scheduling(a: Trace, b: Trace, *, exact: bool, allow_engine_mismatch: bool = False,
                     names: tuple[str, str] = ("hit", "cold")) -> list[str]:
    """Refuse an exact pair whose effective scheduling differs; warn otherwise.

    Compares ``effective_config`` of both runs key by key (keys known on both
    sides). A differing ``SCHEDULING_KEYS`` value (block sizes, mamba block
    size, max_num_batched_tokens, chunked prefill) means the two runs split
    prefills at different tokens, so an exact pair is no longer bit-comparable:
    refused unless ``allow_engine_mismatch``; in default mode it is a warning
    (a noise file absorbs it). Any other differing key (state dtypes, KV cache
    dtype, attention backend, compilation mode, GDN path) is a warning.

    Returns:
        warnings for the report, one per differing key.
    Raises:
        MismatchError: exact pair with differing scheduling; the one line names
            each differing field with both values.
    """
    ea, eb = effective_config(a.run), effective_config(b.run)
    differ = {k: (ea[k], eb[k]) for k in sorted(set(ea) & set(eb)) if ea[k] != eb[k]}
    sched = {k: v for k, v in differ.items() if k in SCHEDULING_KEYS}
    what = lambda d: "; ".join(f"{k} ({names[0]} {x!r}, {names[1]} {y!r})" for k, (x, y) in d.items())  # noqa: E731
    if sched and exact and not allow_engine_mismatch:
        raise MismatchError(
            f"both runs replayed exactly but were scheduled differently: {what(sched)}; an exact pair "
            "must run with the same effective block size and step token budget (record both with the "
            "same engine arguments)")
    warnings = []
    if sched:
        warnings.append(f"the runs were scheduled differently ({what(sched)}): they split prefills at "
                        "different tokens, so states differ by rounding; judge with a noise file")
    warnings += [f"effective {k} differs ({names[0]} {x!r}, {names[1]} {y!r})"
                 for k, (x, y) in differ.items() if k not in SCHEDULING_KEYS]
    return warnings


@dataclasses.dataclass(frozen=True)
class StreamPart:
    """Where the two runs' token streams of one request part.

    A request's token stream is its prompt followed by its sampled outputs;
    a state at position p summarises tokens [0, p), so only pairs at
    ``position`` or before saw the same tokens on both sides.

    Attributes:
        request: request index.
        position: first absolute token index whose id differs (tokens).
        hit_token, cold_token: the two token ids there.
        in_prompt: the prompts themselves differ (the runs replayed other inputs).
    """

    request: int
    position: int
    hit_token: int
    cold_token: int
    in_prompt: bool

    def text(self) -> str:
        where = "in the prompt" if self.in_prompt else "in the sampled outputs"
        return (f"token streams part at request {self.request}, position {self.position} ({where}): "
                f"hit token {self.hit_token}, cold token {self.cold_token}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def token_stream(record: Mapping[str, Any] | None) -> list[int]:
    """A request's prompt token ids followed by its output token ids ([] without a record)."""
    record = record or {}
    return [int(t) for key in ("prompt_token_ids", "output_token_ids")
            for t in (record.get(key) if record.get(key) is not None else ())]


def stream_part(ra: Mapping[int, dict], rb: Mapping[int, dict], request: int) -> StreamPart | None:
    """Where request ``request``'s token streams part between two runs, or None.

    ``ra``/``rb`` are ``Trace.requests`` of each run. Only a position where
    both streams have a token and the ids differ counts: one stream ending
    earlier (a shorter output, a missing record) is not a parting, because
    the states both runs recorded up to there still saw the same tokens.
    """
    x, y = ra.get(request), rb.get(request)
    if x is None or y is None:
        return None
    a, b = token_stream(x), token_stream(y)
    n = min(len(a), len(b))
    i = next((k for k in range(n) if a[k] != b[k]), None)
    if i is None:
        return None
    prompt = min(len(x.get("prompt_token_ids") if x.get("prompt_token_ids") is not None else ()),
                 len(y.get("prompt_token_ids") if y.get("prompt_token_ids") is not None else ()))
    return StreamPart(request, i, a[i], b[i], i < prompt)


def fed_same_tokens(ra: dict[int, dict], rb: dict[int, dict], request: int, position: int) -> bool:
    """Both runs fed request ``request`` the same first ``position`` tokens (prompt + outputs).

    A state at position p summarises tokens [0, p); once the runs' token
    streams part (``stream_part``), states past that point differ because
    their inputs do. A request missing on either side, or one stream
    ending before the other, cannot show a parting: counts as the same.
    """
    part = stream_part(ra, rb, request)
    return part is None or position <= part.position
