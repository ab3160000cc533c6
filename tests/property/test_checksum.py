"""The end-to-end checksums (executors.checksum) against references written here, independently: hashlib's
SHA-256 of the concatenated bytes, and the "sum64" sums computed with Python integers."""
from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from hypothesis import given, strategies as st

from reshard.errors import ArgumentError
from reshard.executors.checksum import ALGORITHMS, Streams, algorithm
from reshard.executors.reference import block

M64 = (1 << 64) - 1


def reference_sum64(data: bytes) -> bytes:
    """count, sum x, sum x (i + 1), sum x T(i mod 2^23) with T(j) = ((j 1103515245 + 12345) mod 2^31) >> 8,
    all mod 2^64."""
    s1 = s2 = s3 = 0
    for i, x in enumerate(data):
        s1 += x
        s2 += x * (i + 1)
        s3 += x * ((((i % (1 << 23)) * 1103515245 + 12345) % (1 << 31)) >> 8)
    return struct.pack("<4Q", len(data) & M64, s1 & M64, s2 & M64, s3 & M64)


def reference(name: str, data: bytes) -> bytes:
    return hashlib.sha256(data).digest() if name == "sha256" else reference_sum64(data)


def streamed(name: str, data: bytes, cuts: list[int]) -> bytes:
    """`data` fed to one stream in pieces cut at `cuts`."""
    sums = Streams(name)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    edges = [0] + sorted(c % (len(data) + 1) for c in cuts) + [len(data)]
    for a, b in zip(edges, edges[1:]):
        sums.update("s", t[a:b])
    return sums.digest("s")


@pytest.mark.parametrize("name", ALGORITHMS)
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_a_stream_digest_is_the_reference_of_its_bytes_however_cut(name, data, cuts):
    assert streamed(name, data, cuts) == reference(name, data)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(data=st.binary(min_size=1, max_size=600), where=st.integers(0, 10_000), delta=st.integers(1, 255))
def test_one_corrupted_byte_changes_the_digest(name, data, where, delta):
    i = where % len(data)
    bad = bytearray(data)
    bad[i] = (bad[i] + delta) % 256
    assert streamed(name, bytes(bad), [i]) != streamed(name, data, [])


@given(data=st.binary(min_size=2, max_size=300), a=st.integers(0, 10_000), b=st.integers(0, 10_000))
def test_swapped_bytes_change_the_sum64_digest(data, a, b):
    i, j = a % len(data), b % len(data)
    if data[i] == data[j]:
        return
    swapped = bytearray(data)
    swapped[i], swapped[j] = data[j], data[i]
    assert streamed("sum64", bytes(swapped), []) != streamed("sum64", data, [])


@pytest.mark.parametrize("name", ALGORITHMS)
@given(rows=st.integers(1, 5), cols=st.integers(1, 7), pad=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_strided_blocks_hash_their_own_elements_in_row_order(name, rows, cols, pad, seed):
    stride = cols + pad
    flat = torch.randint(-2**15, 2**15, (rows * stride + 3,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int16).to(torch.bfloat16)
    view = block(flat, 3, rows, cols, stride)
    rows_bytes = b"".join(flat[3 + r * stride: 3 + r * stride + cols].view(torch.uint8).numpy().tobytes()
                          for r in range(rows))
    sums = Streams(name)
    sums.update(0, view)
    assert sums.digest(0) == reference(name, rows_bytes)


def test_streams_longer_than_a_period_of_the_weights_match_the_reference():
    data = bytes([255]) * ((1 << 23) + 5) + bytes(range(256)) * 5  # across a period of the weights
    assert streamed("sum64", data, [1 << 20, (1 << 23) - 3]) == reference_sum64(data)


def test_the_option_names_an_algorithm_or_is_refused():
    assert algorithm(False) is None and algorithm(None) is None
    assert algorithm(True) == "sha256" and algorithm("sum64") == "sum64"
    for bad in ("md5", 1, "SHA256", 0.5):
        with pytest.raises(ArgumentError, match="checksum"):
            algorithm(bad)


@pytest.mark.gpu
def test_sum64_on_the_gpu_equals_the_cpu_and_the_reference():
    """A GPU stream's digest equals the same bytes' on the CPU (a sender and a receiver may differ in device)
    and the reference, across periods of the weights and cut anywhere."""
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, ((1 << 24) + 12_345,), dtype=torch.uint8, generator=g)
    cuts = [0, 17, 1 << 22, (1 << 23) + 1, data.numel()]
    on = {}
    for device in ("cpu", "cuda"):
        sums, t = Streams("sum64"), data.to(device)
        for a, b in zip(cuts, cuts[1:]):
            sums.update(0, t[a:b])
        on[device] = sums.digest(0)
    assert on["cuda"] == on["cpu"] == reference_sum64(bytes(data.numpy()))
