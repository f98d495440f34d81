"""Stochastic rounding (rounding="stochastic") of the int8 and int4 wires:
the kernels against the numpy reference bit for bit, and the rounding's
promises: unbiased (the mean error of many draws shrinks like 1/sqrt(draws),
where rounding to nearest keeps its bias), block extremes exact, codes a
pure function of (seed, call, rank, value index) whatever the pieces, and
the options that turn it on.

Serial: python -m pytest tests/test_stochastic.py
"""
import numpy as np
import pytest
import reference as R
from reference import BF16, to_acc, unit_roundoff
from reference_formats import INT4, unpack4
from test_formats import as_dtype, cases

from equarx_mpi import kernels as K
from equarx_mpi.call import options
from equarx_mpi.names import kernel_view
from equarx_mpi.wire import formats

DTYPES = [np.float32, np.float64, np.float16, BF16]
WIRES = {"int8": (R.INT8, 127), "int4": (INT4, 7)}
SR = K.ROUND_STOCHASTIC


def ro(a):
    return kernel_view(np.ascontiguousarray(a), writable=False)


def codes_of(wire, w, n):
    return w[1].copy() if wire == "int8" else unpack4(w[1], n, signed=True).astype(np.int8)


def ref_codes(wire, c, n):
    return c if wire == "int8" else unpack4(c, n, signed=True).astype(np.int8)


def fresh(wire, block, kx, n):
    fmt = formats.make_format(wire, block, kx.dtype)
    return fmt, fmt.views(np.full(fmt.nbytes(n), 0xA5, np.uint8), n)


@pytest.mark.parametrize("block", [32, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", list(WIRES))
def test_encode_matches_reference(wire, dtype, block):
    """A whole message and a piece of it (at a block edge), as the
    reference keys them: by (seed, call, rank) and the value's index."""
    codec, _ = WIRES[wire]
    rng = np.random.default_rng(5)
    for name, raw in cases(dtype, rng):
        x = as_dtype(raw, dtype)
        kx = ro(x)
        for at in (0, block * (x.size // block // 2)):
            fmt, w = fresh(wire, block, kx, x.size - at)
            fmt.begin_call(seed=99, rank=3, own=kx, own_offset=1000)
            fmt.calls = 0
            fmt.begin_call(seed=99, rank=3, own=kx, own_offset=1000)   # call 0 again
            fmt.encode(kx[at:], w, SR)
            key = (R.call_key(99, 0, 3), 1000 + at)
            h, c = codec.quantize(to_acc(x)[at:], block, "stochastic", key)[:2]
            np.testing.assert_array_equal(w[0].view(np.uint8), h.view(np.uint8), err_msg=name)
            np.testing.assert_array_equal(codes_of(wire, w, x.size - at),
                                          ref_codes(wire, c, x.size - at), err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", list(WIRES))
def test_hop_matches_reference(wire, dtype):
    """The fused ring hop, in place: Q(own + D(w)) stochastically."""
    codec, _ = WIRES[wire]
    block = 64
    rng = np.random.default_rng(6)
    for name, raw in cases(dtype, rng):
        own = as_dtype(raw, dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            other = as_dtype(rng.standard_normal(own.size) * np.abs(raw).max(initial=1), dtype)
        kown = ro(own)
        fmt, w = fresh(wire, block, kown, own.size)
        fmt.encode(ro(other), w, K.ROUND_NEAREST)
        wire_in = (w[0].copy(), w[1].view(np.uint8).copy(), own.size)
        fmt.begin_call(7, 1, kown, 0)
        with np.errstate(over="ignore", invalid="ignore"):
            fmt.decode_reduce_encode(kown, w, w, K.OP_SUM, SR)
            if wire == "int8":
                part = to_acc(own) + R.dequantize(wire_in[0], wire_in[1].view(np.int8), block)
            else:
                part = to_acc(own) + codec.dequantize(wire_in, block)
            h, c = codec.quantize(part, block, "stochastic", (R.call_key(7, 0, 1), 0))[:2]
        ok = np.isfinite(h)
        np.testing.assert_array_equal(np.isfinite(w[0]), ok, err_msg=name)
        keep = np.repeat(ok, block)[:own.size]
        np.testing.assert_array_equal(w[0][ok], h[ok], err_msg=name)
        np.testing.assert_array_equal(codes_of(wire, w, own.size)[keep],
                                      ref_codes(wire, c, own.size)[keep], err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", list(WIRES))
def test_extremes_constants_and_codes_stay_exact(wire, dtype):
    """+-a maps to +-L for every draw (not only with probability ~1), so a
    block's extremes, constant blocks and 0/1 masks decode exactly; so do
    zeros (a q on a code keeps it); every decoded value is within one step."""
    _, L = WIRES[wire]
    block = 64
    rng = np.random.default_rng(7)
    a = rng.uniform(0.5, 2.0, 16)
    x = rng.uniform(-1, 1, (16, block)) * a[:, None]
    x[:, 3], x[:, 40], x[:, 41] = a, -a, a           # the maximum, both signs, twice
    x[:, 10] = 0
    x[0] = a[0]                                      # a constant block
    x[1] = (rng.random(block) < 0.5).astype(dtype)   # a mask
    x = x.reshape(-1).astype(dtype)
    kx = ro(x)
    fmt, w = fresh(wire, block, kx, x.size)
    step = np.repeat(np.abs(x.reshape(16, block)).max(axis=1) / L, block)
    u = unit_roundoff(dtype)
    out = np.empty_like(x)
    for call in range(200):
        fmt.begin_call(call, call % 5, kx, 0)
        fmt.encode(kx, w, SR)
        fmt.decode(w, out)
        c = codes_of(wire, w, x.size)
        extremes = np.abs(x) == np.repeat(np.abs(x.reshape(16, block)).max(axis=1), block)
        assert (c[extremes] == np.sign(x[extremes]) * L).all()
        assert (out[extremes] == x[extremes]).all()
        assert (out[:2 * block] == x[:2 * block]).all()
        assert (out[2 * block + 10::block] == 0).all()
        assert (np.abs(out - x) <= step * (1 + 640 * u)).all()


def _mean_errors(wire, rounding, draws):
    """RMS over values of the mean error of the first t draws, in steps, for
    t in draws; the values 0.3 of a step above a code (a = 1 per block)."""
    _, L = WIRES[wire]
    block, n = 64, 4096
    rng = np.random.default_rng(8)
    codes = rng.integers(-L + 1, L - 1, n)
    x = ((codes + 0.3) / L).astype(np.float32)
    x[::block] = 1.0
    kx = ro(x)
    fmt, w = fresh(wire, block, kx, n)
    out, total, rms = np.empty_like(x), np.zeros(n), {}
    for t in range(1, max(draws) + 1):
        fmt.begin_call(seed=1, rank=0, own=kx, own_offset=0)     # call t - 1
        fmt.encode(kx, w, rounding)
        fmt.decode(w, out)
        total += out - x.astype(np.float64)
        if t in draws:
            mean = (total / t) * L
            rms[t] = float(np.sqrt(np.mean(mean[1::] ** 2)))
    return rms, total.sum() * L / (n * max(draws))


@pytest.mark.parametrize("wire", list(WIRES))
def test_mean_error_shrinks_like_one_over_sqrt_draws(wire):
    """Values 0.3 of a step above a code: nearest rounding loses 0.3 steps
    every time; stochastic rounding's mean over t draws has error
    sqrt(0.3 * 0.7 / t) steps (the slope of log error against log t is
    -1/2), and its overall mean is within a few standard errors of 0."""
    draws = [16, 64, 256, 1024, 4096]
    sr, overall = _mean_errors(wire, SR, draws)
    slope = np.polyfit(np.log(draws), np.log([sr[t] for t in draws]), 1)[0]
    assert -0.55 < slope < -0.45, (slope, sr)
    for t in draws:
        assert abs(sr[t] / np.sqrt(0.21 / t) - 1) < 0.1, (t, sr[t])
    # 4096 * 4096 draws: standard error 0.46 / 4096 steps; the bias (U's
    # 2^-24 granularity, the scale's rounding) is far below it
    assert abs(overall) < 5 * np.sqrt(0.21) / 4096, overall
    near, _ = _mean_errors(wire, K.ROUND_NEAREST, [16, 256])
    assert abs(near[16] - 0.3) < 0.01 and abs(near[256] - 0.3) < 0.01, near


def test_rounds_up_with_probability_of_the_fraction():
    """Over many values, the share rounded up equals the fraction."""
    n = 1 << 16
    for frac in (0.05, 0.5, 0.9):
        x = np.full(n, (10 + frac) / 127, np.float32)
        x[::256] = 1.0
        kx = ro(x)
        fmt, w = fresh("int8", 256, kx, n)
        fmt.begin_call(3, 0, kx, 0)
        fmt.encode(kx, w, SR)
        up = (w[1] == 11).sum() / (n - n // 256)
        assert abs(up - frac) < 5 * np.sqrt(frac * (1 - frac) / n), (frac, up)
        assert ((w[1] == 10) | (w[1] == 11) | (x == 1)).all()


def test_codes_depend_on_key_not_on_pieces():
    """Same seed, call, rank and values: the same codes whatever the cut
    into pieces; another seed, call or rank: other codes."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal(256 * 40 + 17).astype(np.float32)
    kx = ro(x)

    def encode(seed, rank, cuts, call=0):
        fmt = formats.make_format("int8", 256, kx.dtype)
        fmt.calls = call
        fmt.begin_call(seed, rank, kx, 0)
        codes = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            w = fmt.views(np.zeros(fmt.nbytes(hi - lo), np.uint8), hi - lo)
            fmt.encode(kx[lo:hi], w, SR)
            codes.append(w[1].copy())
        return np.concatenate(codes)

    whole = encode(1, 0, [0, x.size])
    for cuts in ([0, 256, x.size], [0, 256 * 13, 256 * 14, x.size], [0, 256 * 40, x.size]):
        assert (encode(1, 0, cuts) == whole).all()
    for other in (encode(2, 0, [0, x.size]), encode(1, 1, [0, x.size]),
                  encode(1, 0, [0, x.size], call=1)):
        differ = (other != whole).mean()
        assert 0.2 < differ < 0.6, differ         # about 2 f (1 - f) averaged: 1/3


def test_options():
    o = options.resolve(dict(rounding="stochastic", seed=12))
    assert o["rounding"] == "stochastic" and o["seed"] == 12
    assert options.resolve({})["rounding"] == "nearest"
    assert options.resolve(dict(wire="int4", rounding="stochastic"))["wire"] == "int4"
    for wire in ("fp8", "int8-affine", "int4-affine", "bf16", "fp32", "int3", "int2", "int5",
                 "int6"):
        with pytest.raises(ValueError, match="rounding='stochastic' takes the wires"):
            options.resolve(dict(wire=wire, rounding="stochastic"))
    with pytest.raises(ValueError, match="rounding must be one of"):
        options.resolve(dict(rounding="up"))
    for seed in (-1, 2 ** 64, 1.5, True, "1"):
        with pytest.raises(ValueError, match="seed must be an integer"):
            options.resolve(dict(seed=seed))
    assert options.resolve(dict(seed=np.uint64(2 ** 64 - 1)))["seed"] == 2 ** 64 - 1


def test_options_from_environment(monkeypatch):
    monkeypatch.setenv("EQUARX_MPI_ROUNDING", "stochastic")
    monkeypatch.setenv("EQUARX_MPI_SEED", "0x2a")
    o = options.resolve({})
    assert (o["rounding"], o["seed"]) == ("stochastic", 42)
    monkeypatch.setenv("EQUARX_MPI_SEED", "minus one")
    with pytest.warns(UserWarning, match="EQUARX_MPI_SEED"):
        assert options.resolve({})["seed"] == 0
