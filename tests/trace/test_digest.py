"""Block digests: the numpy reference (statediff.trace.digest) and the torch twin
(statediff_hooks.recording.digest) give the same 32 hex digits on the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from statediff.trace.digest import MASK64, PIECE_WORDS, digest_array, weights
from statediff_hooks.recording import digest as tdigest
from statediff_hooks.recording.recorder import to_host

pytestmark = pytest.mark.engine  # imports torch when it loads


def _naive(data: bytes) -> str:
    """The definition, word by word in Python integers (the slowest, plainest form)."""
    if len(data) % 2:
        data += b"\0"
    words = np.frombuffer(data, "<u2")
    out = []
    for seed in (0x243F6A8885A308D3, 0x13198A2E03707344):
        acc = 0
        for i, w in enumerate(words):
            z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK64
            z ^= z >> 30
            z = (z * 0xBF58476D1CE4E5B9) & MASK64
            z ^= z >> 27
            z = (z * 0x94D049BB133111EB) & MASK64
            z ^= z >> 31
            acc = (acc + (2 * int(w) + 1) * z) & MASK64
        out.append(acc)
    return f"{out[0]:016x}{out[1]:016x}"


def test_weights_are_splitmix64_outputs(monkeypatch):
    import statediff.trace.digest as d

    assert d.SEEDS == (0x243F6A8885A308D3, 0x13198A2E03707344)
    # weight i = output i of splitmix64; seeded with 0 its first outputs are published values
    monkeypatch.setattr(d, "SEEDS", (0, 0))
    assert [int(x) for x in d.weights(0, 0, 2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    monkeypatch.undo()
    assert int(weights(0, 5, 3)[1]) == int(weights(0, 6, 1)[0])  # depends on the index only
    assert [int(x) for x in tdigest.weights(7, 3, "cpu")[1]] == \
        [int(x) - (1 << 64) if x >= 1 << 63 else int(x) for x in weights(1, 7, 3)]


@pytest.mark.parametrize("data", [b"", b"\x01", b"\x00\x00", b"abc", bytes(range(255))])
def test_reference_matches_the_definition(data):
    assert digest_array(np.frombuffer(data, np.uint8)) == _naive(data)


def test_known_values():
    # Pinned so a change of the definition cannot go unnoticed (traces store these).
    assert digest_array(np.zeros(0, np.uint8)) == "0" * 32
    assert digest_array(np.zeros(1, np.uint8)) == _naive(b"\0")
    assert digest_array(np.arange(4, dtype="<f4")) == "384777a7b3a132f5" "fecad0b54c16fad7"


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool,
          torch.int32, torch.int64, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (7, 5), (2, 3, 33), (4, 32, 16), (1, 1, 1, 3)])
def test_torch_equals_numpy(dtype, shape):
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) & 0xFFFF)
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 3).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -1 << 40), min(info.max, 1 << 40), shape, generator=g, dtype=dtype)
    host, _ = to_host(t)  # the trace storage form: bf16 as uint16 bit patterns
    assert tdigest.digest_tensor(t) == digest_array(host)
    if t.numel():
        assert digest_array(host) == _naive(host.tobytes())


def test_rows_of_a_batch_are_digested_separately():
    t = torch.randn(6, 4, 32, 16).to(torch.bfloat16)
    rows = tdigest.digest_rows(t)
    assert rows == [digest_array(to_host(t[i])[0]) for i in range(6)]
    assert len(set(rows)) == 6
    # non-contiguous input (a transposed view, as the CPU K layout is read) digests its logical order
    v = t.transpose(2, 3)
    assert tdigest.digest_rows(v) == [digest_array(to_host(v[i])[0]) for i in range(6)]


def test_one_flipped_bit_or_a_moved_zero_changes_the_digest():
    a = np.zeros(1000, np.uint16)
    base = digest_array(a)
    for i in (0, 1, 999):
        for bit in (0, 7, 15):
            b = a.copy()
            b[i] ^= 1 << bit
            assert digest_array(b) != base
    assert digest_array(np.zeros(1001, np.uint16)) != base  # zeros count (2w + 1)


def test_large_arrays_are_processed_in_pieces(monkeypatch):
    # 2.5 pieces of words with odd byte count, checked against one-shot digests of a smaller piece size
    import statediff.trace.digest as d

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 2 * PIECE_WORDS * 2 + 2 * (PIECE_WORDS // 2) + 1, dtype=np.uint8)
    full = digest_array(data)
    monkeypatch.setattr(d, "PIECE_WORDS", 1000)
    assert digest_array(data) == full
    monkeypatch.setattr(tdigest, "PIECE_WORDS", 100_000)
    monkeypatch.setattr(tdigest, "BATCH_WORDS", 50_000)
    assert tdigest.digest_tensor(torch.from_numpy(data)) == full


def test_big_endian_arrays_digest_their_values():
    a = np.arange(10, dtype="<f4")
    assert digest_array(a.astype(">f4")) == digest_array(a)
    with pytest.raises(TypeError):
        digest_array(np.array([object()]))
