"""The int4, int3, int2, int5, int6, fp8 and affine wire formats: numba kernels (through the format
classes) against the numpy reference bit for bit, the formats' promises,
and the C reference (native/equarx_formats.c) against numba bit for bit.

Serial: python -m pytest tests/test_formats.py   (builds native/ with make)
"""
import ctypes

import numpy as np
import pytest
from reference import BF16, _nonfinite_blocks, _over_limit, reduce, to_acc
from reference_formats import CODECS, E4M3, e4m3_round
from test_kernels import cases as int8_cases
from test_kernels import finfo

from equarx_mpi import kernels as K
from equarx_mpi.bench.native import Native
from equarx_mpi.call import options
from equarx_mpi.names import kernel_view as _kernel_view
from equarx_mpi.wire import formats

DTYPES = [np.float32, np.float64, np.float16, BF16]
WIRES = list(CODECS)
#: the wires native/equarx_formats.c implements
C_WIRES = ["int4", "fp8", "int8-affine", "int4-affine"]
OPS = {"sum": K.OP_SUM, "max": K.OP_MAX, "min": K.OP_MIN}
ROUND = {"nearest": K.ROUND_NEAREST, "up": K.ROUND_UP, "down": K.ROUND_DOWN}


def ro(a):
    return _kernel_view(np.ascontiguousarray(a), writable=False)


def cases(dtype, rng):
    """test_kernels' limits, plus what the new formats add: offsets (a
    range far smaller than the values), blocks spanning -max..max, ranges
    that need the lift, odd lengths (a half-filled last byte)."""
    yield from int8_cases(dtype, rng)
    big = float(finfo(dtype).max)
    yield "offset", 101325.0 + 100.0 * rng.standard_normal(777)
    yield "offset-one-ulp", 1000.0 + np.round(rng.random(300)) * 2.0 ** -7
    yield "-max..max", np.r_[-big, rng.uniform(-1, 1, 62) * big, big, np.full(64, -big),
                             np.r_[big, -big] * 0.75]
    yield "negative-offset", -3.0 - rng.random(301)
    yield "mixed-zero-blocks", np.r_[np.zeros(40), -np.zeros(24), -np.zeros(64), [0.0, -0.0] * 32]
    yield "odd-length", rng.standard_normal(65)
    if np.dtype(dtype) == np.float64:
        yield "f64-offset-tiny-range", 1.0 + rng.standard_normal(256) * 1e-15
        yield "f64-lift", rng.standard_normal(300) * 1e-302
        yield "f64-halves-midpoints", 1.0625 + np.array([2.0 ** -40, -2.0 ** -40, 0, 2 ** -30] * 8)


def as_dtype(raw, dtype):
    with np.errstate(over="ignore"):
        return raw.astype(dtype)


def encode(wire, x, block, rounding="nearest"):
    """(format, wire views) holding Q(x); the buffer starts as garbage, so
    an unwritten byte shows."""
    kx = ro(x)
    fmt = formats.make_format(wire, block, kx.dtype)
    buf = np.full(fmt.nbytes(x.size), 0xA5, np.uint8)
    w = fmt.views(buf, x.size)
    fmt.encode(kx, w, ROUND[rounding])
    return fmt, w


def ref_wire(w, n):
    """The kernel's bytes as the reference's wire tuple."""
    return w[0], w[1].view(np.uint8), n


def same_bits(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                          np.ascontiguousarray(b).view(np.uint8))


def finite_blocks(codec, wire, block, n):
    """Per value: is its block not flagged?"""
    return np.isfinite(codec.magnitude(wire, block, n))


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", WIRES)
def test_encode_decode_match_reference(wire, dtype, block):
    codec = CODECS[wire]
    rng = np.random.default_rng(1)
    for name, raw in cases(dtype, rng):
        x = as_dtype(raw, dtype)
        v = to_acc(x)
        for rounding in ROUND:
            fmt, w = encode(wire, x, block, rounding)
            want = codec.quantize(v, block, rounding)
            assert same_bits(w[0], want[0]), f"{name} {rounding}: headers"
            assert same_bits(w[1], want[1]), f"{name} {rounding}: codes"
        out = np.full_like(x, 7)
        skipped = fmt.decode(w, _kernel_view(out, True))
        ref = codec.dequantize(want, block)
        ok = ~_over_limit(codec.magnitude(want, block, x.size), 1, dtype)
        assert list(skipped) == [b for b in range(-(-x.size // block)) if not ok[b * block]], name
        assert same_bits(out[ok], ref[ok].astype(dtype)), name
        assert same_bits(out[~ok], np.full_like(x, 7)[~ok]), f"{name}: skipped blocks untouched"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", WIRES)
def test_format_promises(wire, dtype):
    """Block extremes decode exactly (both for affine), nothing finite
    decodes to Inf or past the block's extremes, every value is within the
    reference's bound, directed rounding never crosses, all-zero blocks
    keep their signs, constant blocks are exact."""
    codec, block = CODECS[wire], 64
    affine = "affine" in wire
    rng = np.random.default_rng(2)
    for name, raw in cases(dtype, rng):
        x = as_dtype(raw, dtype)
        v = to_acc(x)
        for rounding in ROUND:
            fmt, w = encode(wire, x, block, rounding)
            out = np.empty(x.size, v.dtype)
            fmt.decode(w, out)
            live = finite_blocks(codec, ref_wire(w, x.size), block, x.size)
            d, xv = out[live].astype(np.float64), v[live].astype(np.float64)
            if not xv.size:
                continue
            assert np.isfinite(d).all(), f"{name}: a finite value decoded to Inf"
            bound = codec.bound(v, ref_wire(w, x.size), block, rounding)[live]
            assert (np.abs(d - xv) <= bound).all(), (name, rounding)
            rows = [slice(i, i + block) for i in range(0, x.size, block)]
            lo = np.concatenate([np.full(len(v[s]), v[s].min()) for s in rows])[live]
            hi = np.concatenate([np.full(len(v[s]), v[s].max()) for s in rows])[live]
            if affine:
                assert ((d >= lo) & (d <= hi)).all(), f"{name}: inside [min, max]"
            else:
                amax = np.maximum(np.abs(lo), np.abs(hi))
                assert (np.abs(d) <= amax).all(), f"{name}: |x'| <= a"
            if rounding == "up":
                assert (d >= xv).all(), name
            elif rounding == "down":
                assert (d <= xv).all(), name
            else:
                ext = (xv == hi) | (xv == lo) if affine else np.abs(xv) == np.maximum(
                    np.abs(lo), np.abs(hi))
                assert (d[ext] == xv[ext]).all(), f"{name}: block extremes exact"
                const = lo == hi
                assert same_bits(d[const], xv[const]), f"{name}: constant blocks exact"
                zero = (hi == 0) & (lo == 0)
                assert (np.signbit(d[zero]) == np.signbit(xv[zero])).all(), f"{name}: zeros"


@pytest.mark.parametrize("rounding", sorted(ROUND))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", WIRES)
def test_fused_hop_and_decode_reduce_match_reference(wire, dtype, op, rounding):
    codec, block = CODECS[wire], 128
    rng = np.random.default_rng(3)
    for (name, a), (_, b) in zip(cases(dtype, rng), cases(dtype, rng)):
        own, other = as_dtype(a, dtype), as_dtype(b[::-1] * 0.5, dtype)
        fmt, w_in = encode(wire, other, block)
        wire_in = codec.quantize(to_acc(other), block)
        with np.errstate(invalid="ignore", over="ignore"):
            acc = reduce(op, to_acc(own), codec.dequantize(wire_in, block))
        if op != "sum":         # MIN(+Inf, x) is x: an own Inf or NaN keeps the block flagged
            acc = np.where(_nonfinite_blocks(to_acc(own), block), np.nan, acc)
        want = codec.quantize(acc, block, rounding)
        h, c = w_in[0].copy(), w_in[1].copy()        # in place: the ring's use
        fmt.decode_reduce_encode(ro(own), (h, c), (h, c), OPS[op], ROUND[rounding])
        assert same_bits(h, want[0]) and same_bits(c, want[1]), name
        out = np.full_like(own, 9)
        skipped = fmt.decode_reduce(ro(own), w_in, _kernel_view(out, True), OPS[op])
        good = ~_over_limit(acc, block, dtype)
        assert len(skipped) == (~good[::block]).sum(), name
        assert same_bits(out[good], as_dtype(acc, dtype)[good]), name
        assert same_bits(out[~good], np.full_like(own, 9)[~good]), name


def test_decode_extremes_identities():
    """The checks the formats rest on: fl(L * fl(1/L)) == 1 in float32 and
    float64, for L = 7 (int4), 3 (int3), 15 (int5), 31 (int6), 448 (fp8),
    15 and 255 (affine)."""
    for t in (np.float32, np.float64):
        for L in (7, 3, 15, 31, 448, 255):
            assert t(L) * (t(1) / t(L)) == 1, (t, L)


def test_e4m3_rounding():
    """The kernels' e4m3 rounding (blocks [448, y]: the scale is exactly 1)
    against ml_dtypes' float8_e4m3fn from float32 (correctly rounded there)
    and the reference's arithmetic from float64 (ml_dtypes rounds float64
    through float32: 1.0625 + 2^-40 -> 1)."""
    grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(4)
    for dt in (np.float32, np.float64):
        y = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 500),
                            rng.uniform(-448, 448, 5000), rng.uniform(-1, 1, 5000) * 2.0 ** -6,
                            [0.0, -0.0, 448.0]]).astype(dt)
        y = np.concatenate([y, -y])
        _, w = encode("fp8", np.stack([np.full_like(y, 448), y], axis=1).reshape(-1), 2)
        assert (w[0] == 448).all()
        got = w[1][1::2]
        assert (got == e4m3_round(y)).all(), dt
        if dt == np.float32:
            assert (got == y.astype(E4M3).view(np.uint8)).all()
    assert e4m3_round(np.array([1.0625 + 2.0 ** -40]))[0] == np.array(1.125, E4M3).view(np.uint8)


def test_layout_and_bytes_per_value():
    """Headers first, then the codes, padded to 8 bytes."""
    n = 1001                      # 4 blocks of 256, the last one short and odd
    codes = {"int4": 501, "fp8": 1001, "int8-affine": 1001, "int4-affine": 501,
             "int3": 376, "int2": 251,        # ceil(3 n / 8), ceil(2 n / 8)
             "int5": 626, "int6": 751}        # ceil(5 n / 8), ceil(6 n / 8)
    for wire, c in codes.items():
        heads = 2 if "affine" in wire else 1
        for dt, size in ((np.float32, 4), (np.float64, 8)):
            fmt = formats.make_format(wire, 256, dt)
            assert fmt.nbytes(n) == (4 * heads * size + c + 7) // 8 * 8, (wire, dt)
            h, w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
            assert h.size == 4 * heads and h.dtype == dt and w.nbytes == c, (wire, dt)
        assert formats.max_block_bytes(wire, 256) == formats.make_format(
            wire, 256, np.float64).nbytes(256)


def test_default_block_per_wire():
    """block_size=None (the default) is the wire's own; a given size wins;
    bits=4 is int4."""
    want = {"int8": 256, "int4": 64, "fp8": 256, "int8-affine": 256, "int4-affine": 128,
            "bf16": 256, "int3": 64, "int2": 64, "int5": 64, "int6": 64}
    for wire, block in want.items():
        assert options.resolve(dict(wire=wire))["block_size"] == block, wire
        assert options.resolve(dict(wire=wire, block_size=1024))["block_size"] == 1024
    assert options.resolve(dict(bits=4)) == options.resolve(dict(wire="int4"))
    assert options.resolve(dict(bits=3)) == options.resolve(dict(wire="int3"))
    assert options.resolve(dict(bits=2)) == options.resolve(dict(wire="int2"))
    assert options.resolve(dict(bits=5)) == options.resolve(dict(wire="int5"))
    assert options.resolve(dict(bits=6)) == options.resolve(dict(wire="int6"))
    with pytest.raises(ValueError, match="power of two"):
        options.resolve(dict(wire="int4", block_size=48))


# --- C reference ------------------------------------------------------------------------

class CFormats:
    """ctypes wrappers of native/equarx_formats.c with the numba argument order."""

    def __init__(self, native):
        lib = native.lib
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        for pre in ("i4", "f8"):
            self._sig(lib, f"eqx_{pre}_encode_f32", [p, i64, i64, p, p], None)
            self._sig(lib, f"eqx_{pre}_decode_f32", [p, p, i64, i64, p], i64)
            self._sig(lib, f"eqx_{pre}_decode_reduce_sum_f32", [p, p, p, i64, i64, p, p], i64)
            self._sig(lib, f"eqx_{pre}_decode_reduce_encode_sum_f32",
                      [p, p, p, p, p, i64, i64, p], None)
        self._sig(lib, "eqx_af_encode_f32", [p, i64, i64, i32, p, p], None)
        self._sig(lib, "eqx_af_decode_f32", [p, p, i64, i64, i32, p], i64)
        self._sig(lib, "eqx_af_decode_reduce_sum_f32", [p, p, p, i64, i64, i32, p, p], i64)
        self._sig(lib, "eqx_af_decode_reduce_encode_sum_f32",
                  [p, p, p, p, p, i64, i64, i32, p], None)
        self.lib = lib

    @staticmethod
    def _sig(lib, name, args, res):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = res

    def ops(self, wire, block):
        """(encode, decode, decode_reduce, fused) on (float32 arrays, wire views)."""
        L, P = self.lib, (lambda a: a.ctypes.data)
        if "affine" in wire:
            lv = 255 if wire == "int8-affine" else 15
            return (lambda x, w: L.eqx_af_encode_f32(P(x), x.size, block, lv, P(w[0]), P(w[1])),
                    lambda w, o: L.eqx_af_decode_f32(P(w[0]), P(w[1]), o.size, block, lv, P(o)),
                    lambda x, w, o, s: L.eqx_af_decode_reduce_sum_f32(
                        P(x), P(w[0]), P(w[1]), x.size, block, lv, P(o), P(s)),
                    lambda x, wi, wo, s: L.eqx_af_decode_reduce_encode_sum_f32(
                        P(x), P(wi[0]), P(wi[1]), P(wo[0]), P(wo[1]), x.size, block, lv, P(s)))
        pre = {"int4": "i4", "fp8": "f8"}[wire]
        enc, dec, red, fused = (getattr(L, f"eqx_{pre}_{f}_f32") for f in (
            "encode", "decode", "decode_reduce_sum", "decode_reduce_encode_sum"))
        return (lambda x, w: enc(P(x), x.size, block, P(w[0]), P(w[1])),
                lambda w, o: dec(P(w[0]), P(w[1]), o.size, block, P(o)),
                lambda x, w, o, s: red(P(x), P(w[0]), P(w[1]), x.size, block, P(o), P(s)),
                lambda x, wi, wo, s: fused(P(x), P(wi[0]), P(wi[1]), P(wo[0]), P(wo[1]),
                                           x.size, block, P(s)))


@pytest.fixture(scope="module")
def cformats():
    # Builds the library if needed; a failed build fails the tests, never skips.
    return CFormats(Native(build=True))


@pytest.mark.parametrize("block", [2, 32, 256, 4096])
@pytest.mark.parametrize("wire", C_WIRES)
def test_c_and_numba_agree(cformats, wire, block):
    from test_native import cases as native_cases
    c_enc, c_dec, c_red, c_fused = cformats.ops(wire, block)
    rng = np.random.default_rng(11)

    def more(rng):
        yield from native_cases(rng)
        yield "offset", 101325.0 + 100.0 * rng.standard_normal(1001)
        yield "-max..max", np.r_[-3.4e38, rng.uniform(-1, 1, 300) * 3.4e38, 3.4e38]

    for (name, a), (_, b) in zip(more(rng), more(rng)):
        own = as_dtype(a, np.float32)
        other = as_dtype(b[::-1] * 0.75, np.float32)
        msg = f"{name}, block {block}"
        fmt = formats.make_format(wire, block, np.float32)
        nbytes = fmt.nbytes(own.size)
        ws = [fmt.views(np.full(nbytes, 0xA5, np.uint8), own.size) for _ in range(2)]
        fmt.encode(own, ws[0], K.ROUND_NEAREST)
        c_enc(own, ws[1])
        assert same_bits(ws[0][0], ws[1][0]) and same_bits(ws[0][1], ws[1][1]), msg

        w_in = fmt.views(np.zeros(nbytes, np.uint8), own.size)
        fmt.encode(other, w_in, K.ROUND_NEAREST)
        scratch = np.empty(block, np.float32)
        d_nb, d_c = np.zeros_like(own), np.zeros_like(own)
        r_nb, r_c = np.zeros_like(own), np.zeros_like(own)
        counts = (len(fmt.decode(w_in, d_nb)), c_dec(w_in, d_c),
                  len(fmt.decode_reduce(own, w_in, r_nb, K.OP_SUM)), c_red(own, w_in, r_c, scratch))
        assert counts[0] == counts[1] and counts[2] == counts[3], msg
        assert same_bits(d_nb, d_c) and same_bits(r_nb, r_c), msg

        # the fused hop, in place as the ring uses it
        outs = []
        for fused in (lambda wi, wo: fmt.decode_reduce_encode(own, wi, wo, K.OP_SUM,
                                                               K.ROUND_NEAREST),
                      lambda wi, wo: c_fused(own, wi, wo, scratch)):
            w = tuple(v.copy() for v in w_in)
            fused(w, w)
            outs.append(w)
        assert same_bits(outs[0][0], outs[1][0]) and same_bits(outs[0][1], outs[1][1]), msg
