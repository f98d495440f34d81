"""Serial tests of bound.py's pieces (the MPI property test of the whole
bound is tests/test_mpi_bound.py): magnitudes at the limits of every type,
MPI's summation bound against sequential sums, and per-block bounds from
segments."""
import math

import numpy as np
import pytest
from reference import BF16

from equarx_mpi.bounds import bound
from equarx_mpi.wire import formats

DTYPES = [np.float32, np.float64, np.float16, BF16]


def kview(x):
    return x.view(bound.kernel_dtype(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_block_magnitudes_at_the_limits(dtype):
    dt = np.dtype(dtype)
    big = float(np.array(0x7F7F, np.uint16).view(BF16)) if dt == BF16 else float(np.finfo(dt).max)
    below = np.nextafter(np.float64(big), 0).astype(dt)     # the bits next to the largest
    tiny = np.array(1, f"u{dt.itemsize}").view(dt)           # smallest subnormal
    x = np.array([1, -big, below, 3, -np.inf, 2, np.nan, -0.0, tiny, -tiny, 0, 0], np.float64)
    x = x.astype(dt)
    got = bound.block_magnitudes(kview(x), 2, finite_only=True)
    # every magnitude exactly (float64 holds each type's values)
    b, t = float(below.astype(np.float64)), float(tiny.astype(np.float64))
    assert got.tolist() == [big, b, 2.0, 0.0, t, 0.0]
    assert bound.block_magnitudes(kview(x), 2).tolist() == [big, b, math.inf, math.inf, t, 0.0]
    assert bound.largest(kview(x)) == big
    assert bound.largest(kview(x[[2, 2, 2]])) == float(below.astype(np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("P", [2, 3, 8])
def test_mpi_sum_bound_covers_sequential_sums(dtype, P):
    """Sequential sums in the type (in float32 for 16-bit, rounded once, and
    for float16 fully in the 16-bit type), in random orders, against fsum."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(P)
    for _ in range(300):
        x = (rng.standard_normal(P) * 10.0 ** rng.integers(-3, 3, P)).astype(dt)
        S = float(np.abs(x.astype(np.float64)).sum())
        b = bound.mpi_sum(dt, P, S)
        exact = math.fsum(x.astype(np.float64))
        # bfloat16 is only ever added in float32 (exact.collective, shm)
        for acc in ([dt] if dt.itemsize > 2 else [np.dtype(np.float32)] if dt == BF16
                    else [dt, np.dtype(np.float32)]):
            s = x[0].astype(acc)
            for v in x[1:]:
                s = (s + v.astype(acc)).astype(acc)
            assert abs(float(np.asarray(s).astype(dt).astype(np.float64)) - exact) <= b


def test_sum_of_nonnegatives_bounds_the_exact_sum():
    rng = np.random.default_rng(3)
    for dt in (np.dtype(np.float32), np.dtype(np.float16), BF16):
        for _ in range(200):
            x = (rng.random(8) * 10.0 ** rng.integers(-4, 4)).astype(dt)
            s = np.float32(0)
            for v in x:
                s = np.float32(s + np.float32(v))
            computed = np.asarray(s).astype(dt)
            assert bound.sum_of_nonnegatives(computed, 8, dt) >= math.fsum(
                x.astype(np.float64))


def test_to_blocks_with_unaligned_segments():
    # segments of 4-value blocks starting at 2: each touches two result blocks
    seg = [(2, 12, np.array([1.0, 5.0, 2.0]))]
    assert bound.to_blocks(seg, 12, 4).tolist() == [1.0, 5.0, 5.0]
    assert bound.to_blocks([(0, 8, np.array([3.0, 4.0]))], 8, 4).tolist() == [3.0, 4.0]


def test_record_fills_out_or_refuses():
    rec = bound.Record.constant(10, 4, 0.5)
    assert rec.blocks().tolist() == [0.5, 0.5, 0.5]
    out = np.zeros(3)
    assert rec.blocks(out) is out and out.tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="float64 array of shape"):
        rec.blocks(np.zeros(3, np.float32))


def test_plain_16_bit_wire_keeps_blocks_near_the_maximum():
    """A float16 block near 65504 on the plain wire decodes exactly: its
    per-block bound must not be dropped as if the decode skipped it."""
    fmt = formats.make_format("bf16", 4, np.dtype(np.int16))
    assert not fmt.skips_overflow
    w = np.array([65504, 1, -2, 3, 1, 1, 1, 1], np.float16).view(np.int16)
    q, m = fmt.block_errors(w, 0)
    assert np.isfinite(q).all() and (m >= 65504).any()
