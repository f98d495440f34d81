"""The error-bounded mode's "mixed" format (kernels/mixed.py) against its
numpy reference (tests/reference_mixed.py), bit for bit, on adversarial
blocks (type limits, subnormals, signed zeros, offsets, constant blocks,
NaN/Inf) and budgets from nothing to everything; every decoded value
within the block's recorded bound and the budget; the two-shot owner's
many-input kernels; and the tolerance arithmetic (tolerance.py).

Serial: python -m pytest tests/test_mixed.py
"""
import itertools
import os

import numpy as np
import pytest
import reference_mixed as R
from reference import BF16, to_acc

from equarx_mpi import kernels as K
from equarx_mpi.bounds import bound, tolerance
from equarx_mpi.call import options
from equarx_mpi.names import kernel_view
from equarx_mpi.wire import formats

DTYPES = [np.float32, np.float64, np.float16, BF16]
BLOCKS = [32, 256]
SKIP = np.empty(1 << 12, np.int64)


def limits(dtype):
    if np.dtype(dtype) == BF16:
        v = np.array([0x7F7F, 0x0080, 0x0001], np.uint16).view(BF16).astype(np.float64)
        return tuple(v)
    f = np.finfo(dtype)
    return float(f.max), float(f.tiny), float(f.smallest_subnormal)


def cases(dtype, rng):
    big, tiny, sub = limits(dtype)
    n = 700
    yield "normal", rng.standard_normal(n)
    yield "zeros", np.zeros(300)
    yield "neg-zeros", -np.zeros(300)
    yield "mixed-zeros", np.where(rng.random(300) < 0.5, -0.0, 0.0)
    yield "max", np.full(300, big)
    yield "-max-and-max", np.where(np.arange(300) % 2, big, -big)
    yield "near-max", rng.uniform(-1, 1, 300) * big
    yield "constant", np.full(n, 0.1)
    yield "mask", (rng.random(n) < 0.3).astype(float)
    yield "offset", (101325.0 if np.dtype(dtype) != np.float16 else 1000.0) + rng.standard_normal(n)
    yield "smooth", np.sin(np.arange(n) / 50.0) + 3.0
    # DELTA's limits: grid indices near 2^24 (float32's), steps near the
    # smallest normal, a ramp whose differences need many bits
    yield "big-ramp", 1.6e7 + np.arange(n) * 0.37 + np.sin(np.arange(n) / 9.0)
    yield "tiny-smooth", (np.sin(np.arange(n) / 30.0) + 2.0) * tiny * 64
    yield "steep", np.cumsum(rng.standard_normal(n)) * 1e3 + np.arange(n) * 1e4
    yield "mixed-scale", rng.standard_normal(n) * np.repeat(10.0 ** rng.integers(-6, 6, 3), 256)[:n]
    yield "smallest-normal", rng.standard_normal(300) * tiny
    yield "subnormal", np.round(rng.uniform(-1, 1, 300) * 2 ** 5) * sub + 0.0
    yield "one", np.array([1.5])
    x = rng.standard_normal(n)
    x[rng.integers(0, n, 4)] = [np.nan, np.inf, -np.inf, -np.nan]
    yield "nan-inf", x


def budgets(x):
    """From nothing (all raw) to everything (all int4)."""
    with np.errstate(invalid="ignore", over="ignore"):
        a = float(np.nanmax(np.abs(np.where(np.isfinite(x), x, 0)))) if x.size else 0.0
    yield 0.0
    # 1e-12: float64's DELTA in differences wider than 32 bits
    for f in (1e-12, 1e-7, 1e-5, 1e-3, 3e-3, 1e-2, 0.05, 1.0):
        yield a * f
    yield np.inf


def as_dtype(x, dtype):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float64).astype(dtype)


def fmt_for(dtype, block):
    return formats.make_format("mixed", block, kernel_view(np.zeros(1, dtype), False).dtype)


def encode(fmt, x, room):
    buf = np.zeros(fmt.nbytes(x.size) + bound.TRAILER, np.uint8)
    w = fmt.views(buf[:buf.size - bound.TRAILER], x.size)
    fmt.budget = tolerance.Budget(1.0, 1.0, fmt.u, (0.0, 0.0), room, 0.0)
    fmt.encode(kernel_view(x, False), w, 0)
    return buf, w


def limit_of(dtype):
    return bound.out_limit(kernel_view(np.zeros(1, dtype), False).dtype)


def _sweep(*axes):
    """The cases of a slow reference sweep: every combination with
    EQUARX_MPI_FULL=1, else every value of every axis at least once (the
    longest axis in full, the others cycled along it)."""
    if os.environ.get("EQUARX_MPI_FULL") == "1":
        return list(itertools.product(*axes))
    n = max(len(a) for a in axes)
    return [tuple(a[i % len(a)] for a in axes) for i in range(n)]


def _case_id(v):
    return np.dtype(v).name if not isinstance(v, int) else str(v)


@pytest.mark.parametrize("dtype, block", _sweep(DTYPES, BLOCKS), ids=_case_id)
def test_encode_decode_against_reference(dtype, block):
    rng = np.random.default_rng(7)
    fmt = fmt_for(dtype, block)
    seen = set()
    for name, raw in cases(dtype, rng):
        x = as_dtype(raw, dtype)
        v = to_acc(x)
        for room in budgets(v):
            buf, w = encode(fmt, x, room)
            buf[-bound.TRAILER:] = np.arange(bound.TRAILER)          # a trailer travels
            msg = fmt.message(buf)
            want = R.encode(v, block, room)
            assert msg.size == want.size + bound.TRAILER <= buf.size
            assert np.array_equal(msg[:-bound.TRAILER], want), (name, room)
            assert np.array_equal(msg[-bound.TRAILER:], np.arange(bound.TRAILER))
            # the trailer at the end, which bound.Tally reads, survives
            assert np.array_equal(buf[-bound.TRAILER:], np.arange(bound.TRAILER))
            got = np.zeros_like(buf)
            got[:msg.size] = msg
            fmt.received(got)
            assert np.array_equal(got[-bound.TRAILER:], np.arange(bound.TRAILER))
            out = np.full_like(x, 7)
            skipped = set(fmt.decode(w, kernel_view(out, True)).tolist())
            q, mag = fmt.block_errors(w, 0)
            u, eta = R.consts(v.dtype)
            limit = limit_of(dtype)
            for b, (tag, h, vals) in enumerate(R.parse(msg, x.size, block, v.dtype)):
                seen.add(tag)
                sl = slice(b * block, (b + 1) * block)
                assert mag[b] == R.magnitude(tag, h, vals), (name, room, tag)
                if tag == R.FLAG:
                    assert b in skipped and (out[sl].astype(np.float64) == 7).all()
                    continue
                bnd = R.tag_bound(tag, h, u, eta)
                assert q[b] == bnd
                assert bnd * R.SAFE <= room or tag in (R.RAW, R.ZERO), (name, room, tag)
                if b in skipped or not mag[b] < limit:   # beyond a 16-bit output's range
                    assert b in skipped and not mag[b] < limit
                    continue
                assert np.array_equal(out[sl].view(np.uint8),
                                      vals.astype(dtype).view(np.uint8)), (name, room, tag)
                err = np.abs(vals.astype(np.float64) - v[sl].astype(np.float64))
                assert (err <= bnd).all(), (name, room, tag, err.max(), bnd)
                assert (np.abs(vals) <= mag[b]).all()
                if bnd == 0:
                    assert (vals == v[sl]).all()
                    assert np.array_equal(np.signbit(vals), np.signbit(v[sl])) or tag == R.ZERO
            assert float(msg[16:24].view(np.float64)[0]) == max(
                [0.0] + [q[b] for b in range(q.size) if mag[b] < np.inf])
    assert seen == set(range(9)), seen          # every tag came up


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_fewest_bits_for_the_budget(dtype):
    """Smooth data with an offset goes DELTA where the fixed tags would
    send it raw, in far fewer bytes; noise on an offset goes affine, never
    DELTA in place of an 8-bit tag (delta.SAVE); on Gaussian data DELTA
    never costs bytes over the fixed tags; a looser budget never costs
    more bytes."""
    fmt = fmt_for(dtype, 256)
    rng = np.random.default_rng(3)
    x = as_dtype(np.sin(np.arange(4096) / 300.0) * 0.5 + 2.0, dtype)
    buf, w = encode(fmt, x, 2e-6)                # finer than int16: raw, or DELTA
    tags = np.bincount(w[0][R.META:R.META + 16], minlength=9)
    assert tags[R.DELTA] == 16, tags
    raw_bytes = 16 * 256 * fmt.head.itemsize
    assert fmt.message(buf).size < 0.75 * raw_bytes
    room = 0.5 * 1.0 / 255 * 1.2                 # int8-affine fits a range of 1
    _, w = encode(fmt, x, room)
    assert not (w[0][R.META:R.META + 16] == R.DELTA).any()
    noisy = as_dtype(2.0 + 0.5 * rng.uniform(-1, 1, 4096), dtype)
    _, w = encode(fmt, noisy, room)
    assert np.bincount(w[0][R.META:R.META + 16], minlength=9)[R.INT8A] == 16
    g = as_dtype(rng.standard_normal(4096), dtype)
    sizes = []
    v = to_acc(g)
    u, eta = R.consts(v.dtype)
    asz = v.dtype.itemsize
    for room in (0.0, 1e-4, 1e-2, 1e-1, 1.0):
        buf, w = encode(fmt, g, room)
        sizes.append(fmt.message(buf).size)
        fixed = 0
        for b in range(16):
            x = v[b * 256:(b + 1) * 256].astype(np.float64)
            tag = R.choose(np.abs(x).max(), x.min(), x.max(), room, u, eta)
            fixed += R.pay_bytes(tag, 256, asz) + R.n_heads(tag) * asz
        assert sizes[-1] <= R.META + 16 + fixed + bound.TRAILER, room
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


@pytest.mark.parametrize("dtype, count", _sweep(DTYPES, [1, 2, 4]), ids=_case_id)
def test_owner_many_inputs_against_reference(dtype, count):
    """The owner's fused reduction (rank order, own raw at its place) and
    the reduce-scatter's full-precision one, on messages of every tag."""
    rng = np.random.default_rng(11 + count)
    block = 64
    fmt = fmt_for(dtype, block)
    n = 5 * block + 9
    for trial in range(6):
        xs = []
        for q in range(count + 1):
            g = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)
            g[:block] = 0.0 if trial % 2 else 100.0 + g[:block]
            if trial == 5 and q == 1:
                g[3 * block + 1] = np.inf
            xs.append(as_dtype(g, dtype))
        rooms = [0.0, 1e-4, 1e-2, 0.3][trial % 4]
        msgs = []
        stack = np.zeros(count * fmt.nbytes(n), np.uint8)
        size = fmt.nbytes(n)
        pos = trial % (count + 1)
        for i, q in enumerate([q for q in range(count + 1) if q != pos]):
            buf, _ = encode(fmt, xs[q], rooms * (1 + q))
            m = fmt.message(buf)[:-bound.TRAILER]
            stack[i * size:i * size + m.size] = m
            msgs.append(m)
        ws = fmt.stack_views(stack, n, count)
        own = kernel_view(xs[pos], False)
        room = 0.02 * (trial + 1)
        want, sums = R.owner(to_acc(xs[pos]), pos, msgs, block, room)
        obuf = np.zeros(size, np.uint8)
        wo = fmt.views(obuf, n)
        K.mx_decode_reduce_encode_many(own, pos, *ws[:5], *wo[:6], block, room, fmt.u, fmt.eta,
                                       fmt.scratch, np.empty(3 * n, fmt.head),
                                       np.empty((count, 2), np.int64), fmt.qs, fmt.predict)
        assert np.array_equal(fmt.message(obuf)[:-bound.TRAILER], want), trial
        # reduce-scatter: the sums themselves, rounded once into the type
        out = np.full(n, 7, dtype)
        skipped = fmt.decode_reduce_many(own, pos, ws, kernel_view(out, True), 0)
        flagged = np.zeros(n, bool)
        for b in skipped:
            flagged[b * block:(b + 1) * block] = True
        with np.errstate(over="ignore"):
            big = ~(np.abs(sums.astype(dtype).astype(np.float64)) < np.inf)
        assert np.array_equal(big, flagged & big)
        assert np.array_equal(out[~flagged].view(np.uint8),
                              sums[~flagged].astype(dtype).view(np.uint8))


def test_tolerance_budget_arithmetic():
    opts = options.resolve(dict(rel_tol=1e-3))
    assert opts["wire"] == "mixed" and opts["algorithm"] == "two_shot"
    b = tolerance.budget(opts, "Allreduce", np.dtype(np.float32), 4, 2.0)
    assert b.tol == 2e-3 and b.scale == 2.0 and b.cast == (0.0, 0.0)
    # the senders get about half of what the additions leave
    assert 0.4 * (b.tol - b.least) < 3 * b.send < 0.5 * (b.tol - b.least)
    rs = tolerance.budget(opts, "Reduce_scatter_block", np.dtype(np.float32), 4, 2.0)
    assert rs.send == pytest.approx(2 * b.send, rel=1e-3)
    # the owner's room from trailers where every sender used its share
    t = np.array([[0.0, b.send, 2.0]] * 3)
    room = tolerance.owner_room(b, t)
    assert 0.45 * b.tol < room < 0.55 * b.tol
    with pytest.raises(ValueError, match=r"need rel_tol >= 0\.0157"):
        tolerance.budget(opts, "Allreduce", BF16, 4, 2.0)
    with pytest.raises(ValueError, match="need abs_tol >= "):
        tolerance.budget(options.resolve(dict(abs_tol=1e-9)), "Allreduce",
                         np.dtype(np.float32), 8, 1.0)
    with pytest.raises(ValueError, match="overflow float64"):
        tolerance.budget(opts, "Allreduce", np.dtype(np.float64), 4, 1e308)
    # the suggested tolerance is enough, every dtype and size
    for dt in (np.float16, BF16, np.float32, np.float64):
        for P in (2, 3, 8):
            for what in ("Allreduce", "Reduce_scatter_block"):
                o = options.resolve(dict(abs_tol=1e-30))
                with pytest.raises(ValueError) as e:
                    tolerance.budget(o, what, np.dtype(dt), P, 3.0)
                need = float(str(e.value).rsplit(">= ", 1)[1])
                ok = tolerance.budget(options.resolve(dict(abs_tol=need)), what, np.dtype(dt),
                                      P, 3.0)
                assert ok.least <= need and ok.send >= 0


@pytest.mark.parametrize("given, match", [
    (dict(abs_tol=0.0), "finite number > 0"), (dict(rel_tol=-1e-3), "finite number > 0"),
    (dict(abs_tol=float("nan")), "finite number > 0"), (dict(rel_tol=True), "finite"),
    (dict(abs_tol="1e-3"), "finite"), (dict(abs_tol=1e-3, rel_tol=1e-3), "not both"),
    (dict(abs_tol=1e-3, wire="int8"), "leave wire unset"),
    (dict(rel_tol=1e-3, algorithm="ring"), "two_shot"),
    (dict(rel_tol=1e-3, lossy_ops=("sum", "max")), "MAX and MIN stay exact"),
    (dict(wire="mixed"), "abs_tol= or rel_tol="),
    (dict(rel_tol=1e-3, rounding="stochastic"), "leave rounding and accuracy unset"),
    (dict(abs_tol=1e-3, accuracy=0.01), "leave rounding and accuracy unset"),
])
def test_bad_tolerance_options(given, match):
    with pytest.raises(ValueError, match=match):
        options.resolve(given)


def test_tolerance_from_environment(monkeypatch):
    monkeypatch.setenv("EQUARX_MPI_REL_TOL", "0.01")
    o = options.resolve({})
    assert o["rel_tol"] == 0.01 and o["wire"] == "mixed"
    monkeypatch.setenv("EQUARX_MPI_REL_TOL", "-1")
    with pytest.warns(UserWarning, match="EQUARX_MPI_REL_TOL"):
        assert options.resolve({})["rel_tol"] is None
