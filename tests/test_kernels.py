"""Numba kernels against the numpy reference: codes and scales bit for bit.

Serial: python -m pytest tests/test_kernels.py
"""
import numpy as np
import pytest

from equarx_mpi import kernels as K
from equarx_mpi.comm import _kernel_view

from reference import BF16, dequantize, quantize, reduce, to_acc

DTYPES = [np.float32, np.float64, np.float16, BF16]
OPS = {"sum": K.OP_SUM, "max": K.OP_MAX, "min": K.OP_MIN}


def ro(a):
    v = _kernel_view(np.ascontiguousarray(a), writable=False)
    return v


def cases(dtype, rng):
    """Inputs that stress the format: random, short last block, zeros,
    outliers, subnormals, values near the type's max, non-finite."""
    info = np.finfo(np.float32 if dtype == BF16 else dtype)
    big = float(info.max) / 4
    yield "normal", rng.standard_normal(1000)
    yield "one", np.array([1.5])
    yield "zeros", np.zeros(300)
    yield "mixed-scale", rng.standard_normal(700) * np.repeat(10.0 ** rng.integers(-6, 6, 3), 256)[:700]
    outlier = rng.standard_normal(512)
    outlier[7] = 1e4
    yield "outlier", outlier
    yield "tiny", rng.standard_normal(300) * float(info.tiny) * 4
    yield "subnormal", np.full(40, float(info.tiny) / 8)
    yield "near-max", rng.uniform(-1, 1, 300) * big
    x = rng.standard_normal(600)
    x[[3, 300, 301]] = [np.inf, np.inf, -np.inf]
    x[[520]] = np.nan
    yield "nonfinite", x
    x = rng.standard_normal(256)
    x[5] = -np.inf
    yield "neg-inf", x
    # exact half steps: scale 1, so rint's ties (to even) decide the codes
    yield "halves", np.concatenate([np.arange(-127, 127) + 0.5, [127, -127]])
    # many blocks whose float32 scale rounds down or up: the kernels skip the
    # clamp for normal scales and must still never exceed +-127
    yield "many-scales", (rng.uniform(-1, 1, 64 * 37)
                          * np.repeat(10.0 ** rng.uniform(-3, 3, 64), 37))
    x = np.full(300, float(info.max) * 0.9)
    x[::7] *= -1
    yield "overflowing-sum", x


def scales_bits(s):
    return np.asarray(s, np.float32).view(np.uint32)


@pytest.mark.parametrize("block", [32, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_encode_decode_match_reference(dtype, block):
    rng = np.random.default_rng(1)
    for name, raw in cases(dtype, rng):
        x = raw.astype(dtype)
        v = to_acc(x)
        ref_s, ref_c = quantize(v, block)
        nb = ref_s.size
        sc, co = np.empty(nb, np.float32), np.empty(x.size, np.int8)
        scratch = np.empty(block, v.dtype)
        K.i8_encode(ro(x), sc, co, block, scratch)
        np.testing.assert_array_equal(scales_bits(sc), scales_bits(ref_s), err_msg=name)
        np.testing.assert_array_equal(co, ref_c, err_msg=name)
        out = np.empty_like(x)
        K.i8_decode(sc, co, _kernel_view(out, True), block, scratch)
        ref = dequantize(ref_s, ref_c, block, dtype).astype(dtype)
        np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_fused_hop_matches_reference(dtype, op):
    block = 128
    rng = np.random.default_rng(2)
    for (name, a), (_, b) in zip(cases(dtype, rng), cases(dtype, rng)):
        own = a.astype(dtype)
        other = (b[::-1] * 0.5).astype(dtype)
        s_in, c_in = quantize(to_acc(other), block)
        acc = reduce(op, to_acc(own), dequantize(s_in, c_in, block, dtype))
        ref_s, ref_c = quantize(acc, block)
        scratch = np.empty(block, to_acc(own).dtype)
        so, co = s_in.copy(), c_in.copy()      # in place: the ring's use
        K.i8_decode_reduce_encode(ro(own), so, co, so, co, block, OPS[op], scratch)
        np.testing.assert_array_equal(scales_bits(so), scales_bits(ref_s), err_msg=name)
        np.testing.assert_array_equal(co, ref_c, err_msg=name)
        out = np.empty_like(own)
        K.i8_decode_reduce(ro(own), s_in, c_in, _kernel_view(out, True), block, OPS[op],
                           scratch)
        np.testing.assert_array_equal(out.view(np.uint8), acc.astype(dtype).view(np.uint8),
                                      err_msg=name)


def test_all_zero_block_has_zero_scale_and_codes():
    sc, co = np.ones(2, np.float32), np.ones(300, np.int8)
    K.i8_encode(ro(np.zeros(300, np.float32)), sc, co, 256, np.empty(256, np.float32))
    assert not sc.any() and not co.any()


def test_nonfinite_never_decodes_finite():
    x = np.array([1.0, np.inf, 2.0, -3.0] * 64, np.float32)
    x[100] = np.nan
    sc, co = np.empty(1, np.float32), np.empty(x.size, np.int8)
    scratch = np.empty(256, np.float32)
    K.i8_encode(ro(x), sc, co, 256, scratch)
    out = np.empty_like(x)
    K.i8_decode(sc, co, out, 256, scratch)
    assert (~np.isfinite(out) == ~np.isfinite(x)).all()
    finite = np.isfinite(x)
    assert np.abs(out[finite] - x[finite]).max() <= abs(sc[0]) / 2
    # one sign of infinity only: the sign survives
    y = np.where(np.isnan(x), 0, x).astype(np.float32)
    K.i8_encode(ro(y), sc, co, 256, scratch)
    K.i8_decode(sc, co, out, 256, scratch)
    assert (out[np.isinf(y)] == np.inf).all()


def test_codes_within_range_and_half_step_error():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 16) * 100).astype(np.float32)
    sc, co = np.empty(256, np.float32), np.empty(x.size, np.int8)
    K.i8_encode(ro(x), sc, co, 256, np.empty(256, np.float32))
    assert co.min() >= -127 and co.max() <= 127
    err = np.abs(co.astype(np.float64) * np.repeat(sc, 256) - x).reshape(256, 256).max(1)
    assert (err <= sc.astype(np.float64) / 2 * (1 + 1e-6)).all()


def test_bf16_and_f16_conversions_exhaustive():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for dt, kview in ((BF16, np.uint16), (np.float16, np.int16)):
        vals = bits.view(dt)
        out = np.empty(bits.size, np.float32)
        K.plain_decode(bits.view(kview), out)
        ref = vals.astype(np.float32)
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


@pytest.mark.parametrize("wire", [np.float32, BF16])
def test_plain_wire_formats(wire):
    rng = np.random.default_rng(5)
    own = rng.standard_normal(1001).astype(np.float32)
    other = rng.standard_normal(1001).astype(np.float32)
    kw = np.uint16 if wire == BF16 else np.float32
    w = np.empty(own.size, kw)
    K.plain_encode(ro(other), w)
    np.testing.assert_array_equal(w.view(wire), other.astype(wire))
    K.plain_decode_reduce_encode(ro(own), w, w, K.OP_SUM)
    ref = (own + other.astype(wire).astype(np.float32)).astype(wire)
    np.testing.assert_array_equal(w.view(wire).view(np.uint16 if wire == BF16 else np.uint32),
                                  ref.view(np.uint16 if wire == BF16 else np.uint32))


def test_mixed_nonfinite_kinds_in_one_block_keep_their_kind():
    x = np.linspace(-3, 3, 256).astype(np.float32)
    x[[1, 2, 3]] = [np.inf, -np.inf, np.nan]
    sc, co = np.empty(1, np.float32), np.empty(256, np.int8)
    scratch = np.empty(256, np.float32)
    K.i8_encode(ro(x), sc, co, 256, scratch)
    assert np.signbit(sc[0]) and co[1] == 127 and co[2] == -127 and co[3] == -128
    assert np.abs(co[4:]).max() == 126
    out = np.empty_like(x)
    K.i8_decode(sc, co, out, 256, scratch)
    assert out[1] == np.inf and out[2] == -np.inf and np.isnan(out[3])
    finite = np.isfinite(x)
    assert np.abs(out[finite] - x[finite]).max() <= abs(sc[0]) / 2
