"""What a trace holds besides tensor data, as the writer stores it: JSON text (run metadata, request
fields), request records and their datasets, the ``/digests`` table.

The writer (``writer.TraceWriter``) and recovery (``recovery.merge_parts``)
write these; every record is checked against ``schema`` before anything is
stored (nothing invalid is ever written). Layouts: docs/trace-format.md.
"""

from __future__ import annotations

import json
from typing import Any

import h5py
import numpy as np

from .schema import (
    DIGEST_DTYPE,
    REQUEST_DATASETS,
    DigestEntry,
    TensorEntry,
    digest_row,
    request_arrays_problem,
    request_problem,
)
from .storage import write_array

DIGESTS_PLAIN_BYTES = 64 * 1024  # a /digests table up to this size is stored uncompressed


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if np.isfinite(obj) else None
    if isinstance(obj, np.ndarray):
        return _finite(obj.tolist())
    return obj


def to_json(value: Any) -> str:
    """JSON text as stored in a trace: sorted keys, numpy scalars as numbers.

    NaN and infinities (e.g. an acceptance rate of 0/0) are stored as null:
    the format allows no non-finite numbers in metadata.
    """
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False, default=_json_default)
    except ValueError:
        return json.dumps(_finite(value), sort_keys=True, allow_nan=False, default=_json_default)


def _plain(value: dict) -> dict:
    """``value`` as it will read back (numpy scalars and tuples become JSON types)."""
    return json.loads(to_json(value))


def write_json_attr(obj: h5py.HLObject, name: str, value: Any) -> None:
    """Store ``value`` as a UTF-8 JSON text attribute (sorted keys, no NaN)."""
    obj.attrs[name] = to_json(value)


def _request_arrays(fields: dict) -> dict[str, Any]:
    """Pop the dataset keys (``schema.REQUEST_DATASETS``) out of ``fields``, converted.

    Token ids become lists of int; logprob datasets numpy arrays of their
    storage dtype (``<f4`` / ``<i8``), or None (absent). An empty sequence
    given for a 2-D dataset becomes shape ``(0, 0)``.

    Raises:
        TypeError: token or top-k ids that are not integers.
        ValueError: a logprob array with the wrong number of dimensions.
    """
    out: dict[str, Any] = {}
    for name in [k for k in fields if k in REQUEST_DATASETS]:
        value = fields.pop(name)
        dtype, ndim = REQUEST_DATASETS[name]
        if name in ("prompt_token_ids", "output_token_ids"):
            arr = np.asarray(value if value is not None else [])
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"{name}: token ids of type {arr.dtype}, not integers")
            out[name] = [int(t) for t in arr.reshape(-1)]
            continue
        if value is None:
            out[name] = None
            continue
        if dtype == "<f4" and not isinstance(value, np.ndarray):
            value = [np.nan if x is None else x for x in value] if ndim == 1 else [
                [np.nan if x is None else x for x in row] for row in value]
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.reshape((0,) * ndim)
        if dtype == "<i8" and arr.dtype.kind not in "iu":
            raise TypeError(f"{name}: ids of type {arr.dtype}, not integers")
        if arr.ndim != ndim:
            raise ValueError(f"{name}: {arr.ndim}-D, expected {ndim}-D")
        out[name] = np.ascontiguousarray(arr, dtype=np.dtype(dtype))
    return out


def _array_shapes(rec: dict) -> dict[str, tuple[int, ...] | None]:
    """Shapes of a record's datasets (None: absent), for ``schema.request_arrays_problem``."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    for name in REQUEST_DATASETS:
        v = rec.get(name)
        if v is None:
            shapes[name] = (0,) if name in ("prompt_token_ids", "output_token_ids") else None
        else:
            shapes[name] = tuple(v.shape) if isinstance(v, np.ndarray) else (len(v),)
    return shapes


def _check_arrays(index: Any, rec: dict) -> None:
    problem = request_arrays_problem(_array_shapes(rec))
    if problem:
        raise ValueError(f"request {index!r}: {problem}")


def snapshot_request(rec: dict) -> tuple[str, dict[str, np.ndarray]]:
    """A request record frozen now: (JSON text of its fields, its datasets).

    The datasets are ``{name: array}`` for the names of
    ``schema.REQUEST_DATASETS`` the record has (token ids always, possibly
    empty), in their storage dtypes. Taken on the caller's thread at
    ``end_step()``: callers may keep mutating the live record (e.g.
    appending to ``chunks``) afterwards.
    """
    text = to_json({k: v for k, v in rec.items() if k not in REQUEST_DATASETS})
    arrays = {}
    for name, (dtype, _) in REQUEST_DATASETS.items():
        v = rec.get(name)
        if v is None and name not in ("prompt_token_ids", "output_token_ids"):
            continue
        arrays[name] = np.array(v if v is not None else [], dtype=np.dtype(dtype))  # a copy
    return text, arrays


def digest_rows(digests: list[DigestEntry], entries: list[TensorEntry] = ()) -> np.ndarray | None:
    """The ``/digests`` table (version 3): a row per digest-only tensor, then a row per tensor
    with data and a summary (linked by ``dataset``); None when there are none."""
    rows = [d.to_row() for d in digests]
    rows += [digest_row(e, e.dataset, e.summary) for e in entries if e.summary is not None]
    return np.array(rows, dtype=DIGEST_DTYPE) if rows else None


def write_digest_table(f: h5py.File, rows: np.ndarray | None, clevel: int = 3) -> None:
    """Write a ``digest_rows`` table as ``/digests``; nothing for None. Compressed from
    ``DIGESTS_PLAIN_BYTES``: in a digest-first trace this table is most of the file."""
    if rows is not None:
        write_array(f, "digests", rows, clevel, plain_up_to=DIGESTS_PLAIN_BYTES)


def write_requests(f: h5py.File, reqs: dict[int, tuple[str, dict[str, np.ndarray]]],
                   clevel: int = 3) -> None:
    """Write request snapshots (``snapshot_request``) under /requests/rNNNNNNNN.

    Each dataset of ``schema.REQUEST_DATASETS`` the snapshot has is written
    in its storage dtype (token ids ``<i8``, logprobs ``<f4``, top-k ids ``<i8``).

    Raises:
        ValueError: a record breaks the documented field types or its
            datasets disagree in shape (a caller may have edited
            ``TraceWriter.requests`` directly); nothing invalid is ever stored.
    """
    g = f.require_group("requests")
    for i, (text, arrays) in reqs.items():
        problem = request_problem(json.loads(text)) or request_arrays_problem(
            {k: tuple(a.shape) for k, a in arrays.items()})
        if problem:
            raise ValueError(f"request {i}: {problem}")
        name = f"r{int(i):08d}"
        if name in g:
            del g[name]
        rg = g.create_group(name)
        rg.attrs["json"] = text
        for key, arr in arrays.items():
            write_array(rg, key, np.asarray(arr, dtype=np.dtype(REQUEST_DATASETS[key][0])), clevel)
