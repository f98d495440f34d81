"""Numba kernels against the numpy reference of the format (bit for bit),
and the format's promises: exact block extremes, signs, the error bound,
directed rounding, flagged blocks.

Serial: python -m pytest tests/test_kernels.py
"""
import numpy as np
import pytest
from reference import BF16, _over_limit, dequantize, quantize, reduce, step_bound, to_acc

from equarx_mpi import kernels as K
from equarx_mpi.names import kernel_view as _kernel_view

DTYPES = [np.float32, np.float64, np.float16, BF16]
OPS = {"sum": K.OP_SUM, "max": K.OP_MAX, "min": K.OP_MIN}
ROUND = {"nearest": K.ROUND_NEAREST, "up": K.ROUND_UP, "down": K.ROUND_DOWN}
SKIP = np.empty(1 << 14, np.int64)       # indices of skipped blocks


def ro(a):
    return _kernel_view(np.ascontiguousarray(a), writable=False)


def finfo(dtype):
    return np.finfo(np.float32 if np.dtype(dtype) == BF16 else dtype) if np.dtype(
        dtype) != BF16 else _BF16_INFO


class _BF16_INFO:
    max = float(np.array(0x7F7F, np.uint16).view(BF16))
    tiny = float(np.array(0x0080, np.uint16).view(BF16))
    smallest_subnormal = float(np.array(0x0001, np.uint16).view(BF16))


def cases(dtype, rng):
    """Inputs at the limits of the type, not only Gaussian data."""
    info = finfo(dtype)
    big, tiny, sub = float(info.max), float(info.tiny), float(info.smallest_subnormal)
    yield "normal", rng.standard_normal(1000)
    yield "one", np.array([1.5])
    yield "zeros", np.zeros(300)
    yield "neg-zeros", -np.zeros(300)
    yield "mixed-zeros", np.where(rng.random(300) < 0.5, -0.0, 0.0)
    yield "max", np.full(300, big)
    yield "-max", np.full(300, -big)
    yield "max-and-zero", np.where(np.arange(300) % 3 == 0, big, 0.0)
    yield "constant", np.full(700, 0.1)
    yield "mask", (rng.random(600) < 0.3).astype(float)
    yield "mixed-scale", rng.standard_normal(700) * np.repeat(10.0 ** rng.integers(-6, 6, 3), 256)[:700]
    outlier = rng.standard_normal(512)
    outlier[7] = 1e4
    yield "outlier", outlier
    yield "smallest-normal", rng.standard_normal(300) * tiny
    yield "subnormal", np.full(40, sub * 3)
    # the block maximum swept across the subnormal range, values on its grid
    for e in range(0, 24, 3):
        yield f"subnormal-max-{e}", np.round(rng.uniform(-1, 1, 256) * 2 ** e) * sub + 0.0
    yield "near-max", rng.uniform(-1, 1, 300) * big
    yield "halves", np.concatenate([np.arange(-127, 127) + 0.5, [127, -127]])
    yield "many-scales", rng.uniform(-1, 1, 64 * 37) * np.repeat(10.0 ** rng.uniform(-3, 3, 64), 37)
    x = rng.standard_normal(600)
    x[[3, 300, 301]] = [np.inf, np.inf, -np.inf]
    x[520] = np.nan
    yield "nonfinite", x
    x = np.full(300, big * 0.9)
    x[::7] *= -1
    yield "overflowing-sum", x
    if np.dtype(dtype) == np.float64:
        yield "f64-tiny-block", rng.standard_normal(512) * np.repeat([1.0, 1e-42], 256)
        yield "f64-beyond-f32", rng.standard_normal(512) * np.repeat([1e300, 1e-300], 256)
        yield "f64-subnormal", np.round(rng.uniform(-1, 1, 256) * 1000) * 5e-324


def heads_bits(h):
    return h.view(np.uint32 if h.dtype == np.float32 else np.uint64)


def encode(x, block, rounding="nearest"):
    v = to_acc(x)
    nb = -(-x.size // block)
    h, c = np.full(nb, 7, v.dtype), np.full(x.size, 7, np.int8)
    K.i8_encode(ro(x), h, c, block, np.empty(block, v.dtype), ROUND[rounding])
    return h, c


@pytest.mark.parametrize("block", [32, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_encode_decode_match_reference(dtype, block):
    rng = np.random.default_rng(1)
    for name, raw in cases(dtype, rng):
        with np.errstate(over="ignore"):
            x = raw.astype(dtype)
        for rounding in ROUND:
            h, c = encode(x, block, rounding)
            ref_h, ref_c = quantize(to_acc(x), block, rounding)
            np.testing.assert_array_equal(heads_bits(h), heads_bits(ref_h), err_msg=name)
            np.testing.assert_array_equal(c, ref_c, err_msg=f"{name} {rounding}")
        out = np.full_like(x, 7)
        flagged = K.i8_decode(h, c, _kernel_view(out, True), block, SKIP)
        ref = dequantize(ref_h, ref_c, block)
        ok = np.isfinite(ref)
        assert flagged == (~np.isfinite(ref_h)).sum(), name
        np.testing.assert_array_equal(out[ok].view(np.uint8), ref[ok].astype(dtype).view(np.uint8),
                                      err_msg=name)
        assert (out[~ok].view(np.uint8) == np.full_like(x, 7)[~ok].view(np.uint8)).all(), \
            f"{name}: flagged blocks must be left untouched"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_format_promises(dtype):
    """Block extremes come back exactly, nothing finite becomes Inf, every
    value is within its step bound, directed rounding never crosses, zeros
    keep their sign."""
    rng = np.random.default_rng(2)
    for name, raw in cases(dtype, rng):
        with np.errstate(over="ignore"):
            x = raw.astype(dtype)
        v = to_acc(x).astype(np.float64)
        finite_blocks = np.repeat([np.isfinite(v[i:i + 64]).all() for i in range(0, v.size, 64)],
                                  64)[:v.size]
        for rounding in ROUND:
            h, c = encode(x, 64, rounding)
            out = np.empty(x.size, to_acc(x).dtype)
            K.i8_decode(h, c, out, 64, SKIP)
            d = out.astype(np.float64)[finite_blocks]
            w = v[finite_blocks]
            if not w.size:
                continue
            assert np.isfinite(d).all(), name
            err = np.abs(d - w)
            assert (err <= step_bound(h, 64, x.size, rounding)[finite_blocks]).all(), (name, rounding)
            if rounding == "up":
                assert (d >= w).all(), name
            elif rounding == "down":
                assert (d <= w).all(), name
            else:
                amax = np.repeat(np.abs(h.astype(np.float64)), 64)[:x.size][finite_blocks]
                extreme = np.abs(w) == amax
                assert (d[extreme] == w[extreme]).all(), f"{name}: block extremes exact"
                zero = w == 0
                if (amax[zero] == 0).any():
                    z = zero & (amax == 0)
                    assert (np.signbit(d[z]) == np.signbit(w[z])).all(), f"{name}: signed zeros"


def test_constant_blocks_masks_and_float_max_exact():
    for dt in (np.float32, np.float64):
        m = np.finfo(dt).max
        for x in (np.full(512, 0.1, dt), (np.arange(512) % 3 == 0).astype(dt),
                  np.full(512, m, dt), np.full(512, -m, dt), np.r_[np.full(256, m), np.zeros(256)].astype(dt)):
            h, c = encode(x, 256)
            out = np.empty_like(x)
            K.i8_decode(h, c, out, 256, SKIP)
            assert out.tobytes() == x.tobytes()


def test_subnormal_block_maximum_keeps_half_step():
    # the reviewer's case: 189 x 2^-149 used to come back as 127 x 2^-149
    sub = float(np.finfo(np.float32).smallest_subnormal)
    x = np.array([189 * sub, 3 * sub, 0.0, -100 * sub], np.float32)
    h, c = encode(x, 256)
    out = np.empty_like(x)
    K.i8_decode(h, c, out, 256, SKIP)
    assert out[0] == x[0] and np.abs(out - x).max() <= sub


@pytest.mark.parametrize("rounding", sorted(ROUND))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_fused_hop_and_decode_reduce_match_reference(dtype, op, rounding):
    block = 128
    rng = np.random.default_rng(3)
    for (name, a), (_, b) in zip(cases(dtype, rng), cases(dtype, rng)):
        with np.errstate(over="ignore"):
            own = a.astype(dtype)
            other = (b[::-1] * 0.5).astype(dtype)
        h_in, c_in = quantize(to_acc(other), block)
        with np.errstate(invalid="ignore", over="ignore"):
            acc = reduce(op, to_acc(own), dequantize(h_in, c_in, block))
        ref_h, ref_c = quantize(acc, block, rounding)
        scratch = np.empty(block, to_acc(own).dtype)
        h, c = h_in.copy(), c_in.copy()      # in place: the ring's use
        K.i8_decode_reduce_encode(ro(own), h, c, h, c, block, OPS[op], scratch, ROUND[rounding])
        np.testing.assert_array_equal(heads_bits(h), heads_bits(ref_h), err_msg=name)
        np.testing.assert_array_equal(c, ref_c, err_msg=name)
        out = np.full_like(own, 9)
        flagged = K.i8_decode_reduce(ro(own), h_in, c_in, _kernel_view(out, True), block,
                                     OPS[op], scratch, SKIP)
        with np.errstate(over="ignore"):
            want = acc.astype(dtype)
        good = ~_over_limit(acc, block, dtype)          # Inf/NaN, or too big for dtype
        assert flagged == (~good[::block]).sum(), name
        np.testing.assert_array_equal(out[good].view(np.uint8), want[good].view(np.uint8),
                                      err_msg=name)
        assert (out[~good].view(np.uint8) == np.full_like(own, 9)[~good].view(np.uint8)).all()


def test_flagged_blocks_are_skipped_and_counted():
    x = np.ones(1024, np.float32)
    x[300], x[900] = np.nan, -np.inf
    h, c = encode(x, 256)
    assert np.isinf(h[1]) and np.isinf(h[3]) and np.isfinite(h[[0, 2]]).all()
    assert not c[256:512].any()
    out = np.full_like(x, 5.0)
    assert K.i8_decode(h, c, out, 256, SKIP) == 2
    assert (out[256:512] == 5).all() and (out[768:] == 5).all() and (out[:256] == 1).all()


def test_bf16_and_f16_conversions_exhaustive():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for dt, kview in ((BF16, np.uint16), (np.float16, np.int16)):
        out = np.empty(bits.size, np.float32)
        K.plain_encode(bits.view(kview), out)          # a float32 "wire": the conversion
        ref = bits.view(dt).astype(np.float32)
        same = (out.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(out) & np.isnan(ref))
        assert same.all(), dt
    rng = np.random.default_rng(4)
    f = np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * 1e3,
                        rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
                        .view(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.99,
                                  6e-8, 3e-8, 2.9e-8, 1e-40], np.float32)])
    for dt, kview in ((BF16, np.uint16), (np.float16, np.int16)):
        got = np.empty(f.size, kview)
        with np.errstate(over="ignore"):
            K.plain_encode(f, got)
            ref = f.astype(dt)
        g = got.view(dt).astype(np.float32)
        r = ref.astype(np.float32)
        same = (g.view(np.uint32) == r.view(np.uint32)) | (np.isnan(g) & np.isnan(r))
        assert same.all(), (dt, f[~same][:5], g[~same][:5], r[~same][:5])


@pytest.mark.parametrize("wire", [np.float32, BF16, np.float16])
def test_plain_wire_formats(wire):
    rng = np.random.default_rng(5)
    own = rng.standard_normal(1001).astype(np.float32)
    other = rng.standard_normal(1001).astype(np.float32)
    kw = {np.dtype(np.float32): np.float32, BF16: np.uint16,
          np.dtype(np.float16): np.int16}[np.dtype(wire)]
    w = np.empty(own.size, kw)
    K.plain_encode(ro(other), w)
    np.testing.assert_array_equal(w.view(wire), other.astype(wire))
    K.plain_decode_reduce_encode(ro(own), w, w, K.OP_SUM)
    ref = (own + other.astype(wire).astype(np.float32)).astype(wire)
    np.testing.assert_array_equal(w.view(wire).astype(np.float64), ref.astype(np.float64))
    # a value that overflowed the wire type is flagged, never decoded as Inf
    w[5] = np.array(np.inf, wire).view(kw)
    out = np.zeros(own.size, np.float32)
    assert K.plain_decode(w, out, 256, SKIP) == 1 and SKIP[0] == 0 and (out[:256] == 0).all() and out[300] != 0


def test_a_fresh_checkout_keeps_what_the_first_process_compiles(tmp_path):
    """The first import on a fresh tree (no __pycache__ yet) leaves the
    stamp of the kernels' sources, so the next process keeps numba's cache
    instead of dropping it (the warmup's work was lost on every fresh clone)."""
    import pathlib
    import shutil
    import subprocess
    import sys
    src = pathlib.Path(K.__file__).resolve().parent.parent
    shutil.copytree(src, tmp_path / "equarx_mpi",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    subprocess.run([sys.executable, "-c", "import equarx_mpi.kernels"], env=env, check=True,
                   cwd=tmp_path)
    stamp = tmp_path / "equarx_mpi" / "kernels" / "__pycache__" / "kernels.stamp"
    assert stamp.exists()
    cache = stamp.parent
    (cache / "marker.nbi").write_bytes(b"")        # stands for a compiled kernel
    subprocess.run([sys.executable, "-c", "import equarx_mpi.kernels"], env=env, check=True,
                   cwd=tmp_path)
    assert (cache / "marker.nbi").exists(), "the second process dropped the cache"


def _signatures():
    from equarx_mpi.warmup import _dispatchers
    return {id(d): (d, len(d.signatures)) for d in _dispatchers()}


@pytest.mark.parametrize("algorithm, kind, P, name", [
    ("ring", "allreduce", 2, "sum"), ("ring", "allreduce", 3, "max"),
    ("ring", "reduce_scatter", 3, "sum"), ("ring", "allgather", 2, "sum"),
    ("two_shot", "allreduce", 2, "sum"), ("two_shot", "allreduce", 4, "min"),
    ("two_shot", "reduce_scatter", 3, "sum")])
def test_warm_compiles_every_kernel_a_schedule_runs(algorithm, kind, P, name):
    """What engine.warm compiles for a call (one rank first, the others
    load it: collectives/nodes.in_turn) is all the call compiles: running
    the schedule's kernels afterwards, with its array layouts and rounding,
    adds no signature.  The cold start compiles only that (docs/PERFORMANCE.md)."""
    from equarx_mpi.collectives.engine import NEEDS, warm
    from equarx_mpi.names import KERNEL_OP, ROUNDING
    from equarx_mpi.wire import formats
    kd = np.dtype(np.float32)
    fmt = formats.make_format("int8", 256, kd)
    warm(fmt, kd, algorithm, kind, P, (ROUNDING[name],))
    before = _signatures()
    n = 1000
    own = ro(np.random.default_rng(0).standard_normal(n).astype(kd))
    out = np.zeros(n, kd)
    w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    op, rmode = KERNEL_OP[name], ROUNDING[name]
    stack = fmt.stack_views(np.zeros((P - 1) * fmt.nbytes(n), np.uint8), n, P - 1)
    run = {"encode": lambda: fmt.encode(own, w, rmode),
           "decode": lambda: fmt.decode(w, out),
           "decode_reduce": lambda: fmt.decode_reduce(own, w, out, op),
           "decode_reduce_encode": lambda: fmt.decode_reduce_encode(own, w, w, op, rmode),
           "decode_reduce_many": lambda: fmt.decode_reduce_many(own, 1, stack, out, op),
           "decode_reduce_encode_many":
               lambda: fmt.decode_reduce_encode_many(own, 1, stack, w, op, rmode)}
    for need in NEEDS[algorithm, kind]:
        run[need]()
    after = _signatures()
    grew = [d.py_func.__name__ for key, (d, count) in after.items()
            if count > before.get(key, (d, 0))[1]]
    assert not grew, f"compiled after warm: {grew}"


def test_rounding_to_nearest_has_its_own_int8_kernels():
    """int8's fused hop compiles rounding to nearest without the other
    roundings' code (half the compile time): rmode None; the kernel for
    every rounding gives the same bits."""
    from equarx_mpi.kernels import int8
    rng = np.random.default_rng(3)
    n, block = 700, 256
    own = ro(rng.standard_normal(n).astype(np.float32))
    h = np.empty(3, np.float32)
    c = np.empty(n, np.int8)
    K.i8_encode(ro(rng.standard_normal(n).astype(np.float32)), h, c, block,
                np.empty(block, np.float32), K.ROUND_NEAREST)
    outs = []
    for run in (lambda ho, co: K.i8_decode_reduce_encode(ro(own), ro(h), ro(c), ho, co, block,
                                                         K.OP_SUM, np.empty(block, np.float32),
                                                         K.ROUND_NEAREST),
                lambda ho, co: int8._decode_reduce_encode(ro(own), ro(h), ro(c), ho, co, block,
                                                          K.OP_SUM, np.empty(block, np.float32),
                                                          K.ROUND_NEAREST, np.uint64(0))):
        ho, co = np.empty_like(h), np.empty_like(c)
        run(ho, co)
        outs.append((ho, co))
    assert any(str(s[8]) == "none" for s in int8._decode_reduce_encode.signatures)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


# --- error feedback's bound on how far its input moved ------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_max_finite_gap_is_numpys_float64_one(dtype):
    """kernels.gap against the float64 numpy it replaced, on the type's
    limits: Inf - Inf, NaN and overflowing differences left out."""
    from equarx_mpi.kernels.gap import max_finite_gap
    rng = np.random.default_rng(7)
    for name, x in cases(dtype, rng):
        a = np.asarray(x).astype(dtype)
        for b in (a[::-1].copy(), np.zeros_like(a), -a, np.full_like(a, np.inf)):
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
            d = d[np.isfinite(d)]
            want = float(d.max()) if d.size else 0.0
            assert max_finite_gap(ro(a), ro(b)) == want, name
