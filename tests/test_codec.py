"""Our safetensors codec (handlers.wire.safetensors_io) against the reference implementation, the
`safetensors` package, in both directions: our dumps -> safetensors.torch.load, and
safetensors.torch.save -> our loads. Every dtype both support, random shapes including 0-d and
empty tensors, random bit patterns (NaN and infinities included). Tensors are compared bit for
bit, with dtype and shape.

The last tests break the codec on purpose (its dtype table, its offset computation) and check
that the same comparison reports it: a differential test that cannot fail proves nothing.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.wire import safetensors_io

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(autouse=True)
def fresh_header_caches(monkeypatch):
    """Each test starts with empty header caches: a layout cached by an earlier test (or under
    an unbroken table) would hide what this test breaks on purpose."""
    monkeypatch.setattr(safetensors_io, "_layouts", {})
    monkeypatch.setattr(safetensors_io, "_headers", {})

# Every dtype our codec names (its table is the contract); the reference handles all of them.
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    # random bytes reinterpreted: every bit pattern, NaNs and infinities of floats included
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def differences(tensors: dict) -> list:
    """What differs between our codec and the reference on `tensors`, both directions."""
    problems = []
    try:
        theirs = safetensors_torch.load(bytes(safetensors_io.dumps(tensors)))
        if set(theirs) != set(tensors):
            problems.append(f"ours->ref: names {sorted(theirs)} != {sorted(tensors)}")
        problems += [f"ours->ref: {k} {v.dtype}{list(v.shape)} differs" for k, v in tensors.items()
                     if k in theirs and not same(theirs[k], v)]
    except Exception as e:  # the reference refusing our bytes is a difference too
        problems.append(f"ours->ref: reference cannot read our bytes: {type(e).__name__}: {e}")
    try:
        # the reference writes only contiguous tensors (ours writes views in logical order)
        ours = safetensors_io.loads(safetensors_torch.save({k: v.contiguous() for k, v in tensors.items()}))
        if set(ours) != set(tensors):
            problems.append(f"ref->ours: names {sorted(ours)} != {sorted(tensors)}")
        problems += [f"ref->ours: {k} {v.dtype}{list(v.shape)} differs" for k, v in tensors.items()
                     if k in ours and not same(ours[k], v)]
    except Exception as e:
        problems.append(f"ref->ours: we cannot read the reference's bytes: {type(e).__name__}: {e}")
    return problems


shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=4)
entries = st.lists(st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31 - 1)), min_size=0,
                   max_size=6)


@settings(max_examples=150, deadline=None)
@given(entries)
def test_matches_reference_both_directions(items):
    tensors = {f"t{i}": random_tensor(dt, tuple(shape), seed) for i, (dt, shape, seed) in enumerate(items)}
    assert differences(tensors) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_0d_empty_and_strided(dtype):
    base = random_tensor(dtype, (4, 6), seed=7)
    tensors = {"scalar": random_tensor(dtype, (), seed=1), "empty": random_tensor(dtype, (0, 3), seed=2),
               "empty_last": random_tensor(dtype, (2, 0), seed=3), "full": base,
               "transposed": base.t(), "strided": base[:, ::2]}
    assert differences(tensors) == []


def test_reference_names_every_dtype_as_we_do():
    """The header names themselves, read from the reference's own bytes."""
    import json

    for dt in DTYPES:
        blob = safetensors_torch.save({"x": torch.zeros(1, dtype=dt)})
        n = int.from_bytes(blob[:8], "little")
        assert json.loads(blob[8:8 + n])["x"]["dtype"] == safetensors_io._FROM_TORCH[dt], dt


# ------------------------------------------------------------ the comparison catches a broken codec

SAMPLE = {"a": random_tensor(torch.float16, (3, 2), 1), "b": random_tensor(torch.bfloat16, (2,), 2),
          "c": random_tensor(torch.float32, (2, 2), 3), "d": random_tensor(torch.int8, (5,), 4)}


def test_detects_a_swapped_dtype_name(monkeypatch):
    table = dict(safetensors_io._FROM_TORCH)
    table[torch.float16], table[torch.bfloat16] = "BF16", "F16"
    monkeypatch.setattr(safetensors_io, "_FROM_TORCH", table)
    found = differences(SAMPLE)
    assert any(p.startswith("ours->ref: a torch.float16") for p in found), found


def test_detects_a_swapped_reader_table(monkeypatch):
    table = dict(safetensors_io._TO_TORCH, F16=torch.bfloat16, BF16=torch.float16)
    monkeypatch.setattr(safetensors_io, "_TO_TORCH", table)
    found = differences(SAMPLE)
    assert any(p.startswith("ref->ours: a torch.float16") for p in found), found


def test_detects_a_wrong_offset_computation(monkeypatch):
    sizes = dict(safetensors_io._ITEMSIZE)
    sizes[torch.float32] = 2  # offsets computed with the wrong element size
    monkeypatch.setattr(safetensors_io, "_ITEMSIZE", sizes)
    found = differences(SAMPLE)
    assert any(p.startswith("ours->ref") for p in found) and any(p.startswith("ref->ours") for p in found), found


def test_detects_dropped_header_padding(monkeypatch):
    """Unpadded header: data starts at an unaligned offset. The reference must still agree on
    content or refuse; either way the comparison must be able to see a corrupted layout."""
    real = safetensors_io.dumps

    def shifted(tensors):  # a writer off by one byte in its data offsets
        blob = real(tensors)
        n = int.from_bytes(blob[:8], "little")
        return blob[:8 + n] + b"\x00" + blob[8 + n:-1]

    monkeypatch.setattr(safetensors_io, "dumps", shifted)
    assert any(p.startswith("ours->ref") for p in differences(SAMPLE))


def test_cached_headers_give_the_reference_answers_again():
    """Second and later calls take the header caches; their bytes and tensors must still be
    exactly the reference's, with new values in the same layout (a cache that kept data would
    show), and a body too short for a cached header is still refused."""
    for seed in range(3):
        tensors = {"a": random_tensor(torch.float16, (3, 2), seed), "b": random_tensor(torch.int64, (4,), seed + 9)}
        assert differences(tensors) == []
        blob = safetensors_torch.save(tensors)
        assert bytes(safetensors_io.dumps(tensors)) == bytes(safetensors_io.dumps(dict(tensors)))
        assert all(same(safetensors_io.loads(blob)[k], v) for k, v in tensors.items())
    assert len(safetensors_io._layouts) == 1 and len(safetensors_io._headers) == 1
    with pytest.raises(safetensors_io.RequestError, match="past the"):
        safetensors_io.loads(blob[:-1])


def test_header_caches_stay_bounded():
    for rows in range(1, 3 * safetensors_io._CACHE_ENTRIES):
        t = {"x": torch.zeros(rows, 2)}
        assert same(safetensors_io.loads(safetensors_io.dumps(t))["x"], t["x"])
    assert len(safetensors_io._layouts) == len(safetensors_io._headers) == safetensors_io._CACHE_ENTRIES
    big = {f"name_{i:04d}" * 8: torch.zeros(1) for i in range(200)}  # a header over the size cap
    assert set(safetensors_io.loads(safetensors_io.dumps(big))) == set(big)
    assert not any(len(k) > safetensors_io._CACHE_HEADER_BYTES for k in safetensors_io._layouts)
