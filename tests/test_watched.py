"""The watched format (wire/watched.py) and the measured bound
(bounds/measured.py), one rank, no MPI.

The measured bound is only as good as the values it measures against: v,
the partial sum the watched format computes with decode_reduce(_many),
must be bit for bit what the fused hop quantized.  So for every wire and
input type the fused kernels' bytes equal encode(v)'s, and the watchers
get D(w) - v exactly, zero in flagged blocks.  The measured bound of one
quantization covers its error rotated back, and never exceeds the
format's bound.
"""
import numpy as np
import pytest
from reference import BF16
from reference_rotate import unrotate as ref_unrotate
from test_formats import as_dtype, cases, ro

from equarx_mpi import kernels as K
from equarx_mpi.bounds.measured import Measured
from equarx_mpi.collectives.rotation import Rotation
from equarx_mpi.names import acc_dtype
from equarx_mpi.wire import formats
from equarx_mpi.wire.watched import Watched

DTYPES = [np.float32, np.float64, np.float16, BF16]
NEAREST = K.ROUND_NEAREST
BLOCK = 64


def message(fmt, n):
    return fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)


def same(w1, w2):
    """The same bytes in two messages' views (an array, or a tuple of them)."""
    if isinstance(w1, np.ndarray):
        w1, w2 = (w1,), (w2,)
    return all(np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                              np.ascontiguousarray(b).view(np.uint8)) for a, b in zip(w1, w2))


def watched(fmt, n, kdtype):
    """fmt watched, and the list of what its watcher saw."""
    acc = np.float64 if kdtype == np.float64 else np.float32
    seen = []
    w = Watched(fmt, (np.empty(n, acc), np.empty(n, acc)),
                [lambda e, own, w: seen.append((e.copy(), w))])
    return w, seen


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", formats.WIRES)
def test_watched_hops_quantize_what_they_show(wire, dtype):
    rng = np.random.default_rng(5)
    for (name, a), (_, b) in zip(cases(dtype, rng), cases(dtype, rng)):
        own, other = as_dtype(a, dtype), as_dtype(b[::-1] * 0.5, dtype)
        n = own.size
        k_own, k_other = ro(own), ro(other)
        fmt = formats.make_format(wire, BLOCK, k_own.dtype)
        w_in = message(fmt, n)
        fmt.encode(k_other, w_in, NEAREST)
        plain, mine = message(fmt, n), message(fmt, n)
        fmt.decode_reduce_encode(k_own, w_in, plain, K.OP_SUM, NEAREST)
        proxy, seen = watched(formats.make_format(wire, BLOCK, k_own.dtype), n, k_own.dtype)
        proxy.decode_reduce_encode(k_own, w_in, mine, K.OP_SUM, NEAREST)
        assert same(plain, mine), f"{name}: the proxy's hop is the format's"
        v = np.empty(n, acc_dtype(dtype))
        # (a format returns a view of its own buffer of skipped blocks)
        flagged = list(fmt.decode_reduce(k_own, w_in, v, K.OP_SUM))
        d = np.empty(n, v.dtype)
        skipped = list(fmt.decode(plain, d))
        kept = np.ones(n, bool)
        for blk in skipped:
            kept[blk * BLOCK:(blk + 1) * BLOCK] = False
        (e, w), = seen
        with np.errstate(invalid="ignore", over="ignore"):     # flagged blocks' leftovers
            want = np.where(kept, d - v, 0)
        assert w is mine and np.array_equal(e, want), f"{name}: D(w) - v shown"
        # v is own + D(w_in) as the receivers add it (no fused multiply-add,
        # no other order), and every block it leaves unwritten is flagged
        d_in = np.empty(n, v.dtype)
        fmt.decode(w_in, d_in)
        with np.errstate(invalid="ignore", over="ignore"):
            sum_ = own.astype(v.dtype) + d_in
        done = np.ones(n, bool)
        for blk in flagged:
            done[blk * BLOCK:(blk + 1) * BLOCK] = False
        assert np.array_equal(v[done], sum_[done]), f"{name}: decode_reduce = own + D(w)"
        assert set(flagged) <= set(skipped), f"{name}: v's unwritten blocks are flagged"
        if wire not in formats.ROTATE_WIRES and k_own.dtype != v.dtype:
            continue        # a plain wire of 16-bit input sends that type, not v's
        # the hop quantized v, decode_reduce's sum: v's own type's format
        # (no 16-bit output limit) encodes v into the same values
        wide = formats.make_format(wire, BLOCK, v.dtype)
        for blk in flagged:                  # not written in v: the hop flags them
            v[blk * BLOCK:(blk + 1) * BLOCK] = np.nan
        again = message(wide, n)
        wide.encode(ro(v), again, NEAREST)
        d2 = np.empty(n, v.dtype)
        wide.decode(again, d2)
        keep = kept & np.isfinite(d)         # a plain wire stores an overflow as Inf
        assert np.array_equal(d[keep], d2[keep]), f"{name}: the hop quantized v"
        if wire in formats.ROTATE_WIRES:
            assert list(skipped) == list(flagged), f"{name}: the same blocks flagged"


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8", "bf16", "int4-affine"])
def test_watched_many_inputs_quantize_what_they_show(wire):
    rng = np.random.default_rng(6)
    n, count = 1000, 3
    own = rng.standard_normal(n).astype(np.float32)
    fmt = formats.make_format(wire, BLOCK, np.float32)
    size = fmt.nbytes(n)
    buf = np.zeros(count * size, np.uint8)
    for i in range(count):
        fmt.encode(ro(rng.standard_normal(n).astype(np.float32)),
                   fmt.views(buf[i * size:(i + 1) * size], n), NEAREST)
    ws = fmt.stack_views(buf, n, count)
    plain, mine = message(fmt, n), message(fmt, n)
    fmt.decode_reduce_encode_many(ro(own), 1, ws, plain, K.OP_SUM, NEAREST)
    proxy, seen = watched(formats.make_format(wire, BLOCK, np.float32), n, np.dtype(np.float32))
    proxy.decode_reduce_encode_many(ro(own), 1, ws, mine, K.OP_SUM, NEAREST)
    assert same(plain, mine)
    v = np.empty(n, np.float32)
    fmt.decode_reduce_many(ro(own), 1, ws, v, K.OP_SUM)
    again = message(fmt, n)
    fmt.encode(ro(v), again, NEAREST)
    assert same(plain, again), "the owner's reduction quantized decode_reduce_many's sum"
    d = np.empty(n, np.float32)
    fmt.decode(plain, d)
    assert np.array_equal(seen[0][0], d - v)


@pytest.mark.parametrize("size", [None, 8, 64])
@pytest.mark.parametrize("wire", ["int8", "int4", "int3"])
def test_measured_bound_covers_one_quantization(wire, size):
    """One encode of heavy-tailed values: the measured bound (times sqrt(S)
    rotated) covers |R^T (D(w) - v)| computed in float64 by the numpy
    reference, and is at most the format's bound."""
    rng = np.random.default_rng(7)
    n = 4 * BLOCK + 17
    v = rng.standard_t(3, n).astype(np.float32)
    v[::29] *= 50
    fmt = formats.make_format(wire, BLOCK, np.float32)
    rot = None if size is None else Rotation(size, 11, BLOCK)
    m = Measured(rot, np.float32, np.empty(n, np.float32))
    proxy = Watched(fmt, (np.empty(n, np.float32), np.empty(n, np.float32)), [m])
    w = message(fmt, n)
    proxy.encode(ro(v), w, NEAREST)
    q, mag = fmt.piece_error(w, NEAREST)
    t, mag2 = m.adjust(w, q, mag)
    d = np.empty(n, np.float32)
    fmt.decode(w, d)
    e = d.astype(np.float64) - v.astype(np.float64)
    if size is None:
        real, scale = np.abs(e).max(), 1.0
    else:
        real = np.abs(ref_unrotate(e, size, 11, 0, dtype=np.float64)).max()
        scale = np.sqrt(size)
    assert real <= t * scale, (real, t * scale)
    assert t <= q and mag2 == mag + (q - t)
    if size is not None and size >= 64:
        assert t < q / 2, f"measured {t:.4g} well below the format's {q:.4g}"
