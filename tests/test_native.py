"""The C reference (native/) and the numba kernels agree bit for bit, with
the C built for this CPU and for plain AVX2, and numba compiled for this CPU
and (in a child process) for plain AVX2.

Serial: python -m pytest tests/test_native.py   (builds native/ with make)
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from equarx_mpi import kernels as K
from equarx_mpi.bench.native import ISAS, Native

F32 = np.finfo(np.float32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=sorted(ISAS))
def native(request):
    # Builds the library if needed; a failed build fails the tests, never skips.
    return Native.for_isa(request.param, build=True)


def cases(rng):
    """float32 inputs that stress the format."""
    yield "normal", rng.standard_normal(1000)
    yield "one", np.array([1.5])
    yield "zeros", np.zeros(300)
    yield "neg-zeros", -np.zeros(40)
    yield "mixed-zeros", np.where(rng.random(300) < 0.5, -0.0, 0.0)
    yield "short-last-block", rng.standard_normal(4096 + 37)
    yield "mixed-scale", (rng.standard_normal(64 * 37)
                          * np.repeat(10.0 ** rng.uniform(-30, 30, 64), 37))
    x = rng.standard_normal(512)
    x[7] = 1e4
    yield "outlier", x
    yield "halves", np.concatenate([np.arange(-127, 127) + 0.5, [127, -127]])
    yield "constant", np.full(300, 0.1)
    yield "mask", (rng.random(300) < 0.5).astype(float)
    yield "max", np.full(300, float(F32.max))
    yield "subnormal", np.full(40, float(F32.tiny) / 8)
    yield "subnormal-scale", rng.standard_normal(300) * float(F32.tiny) * 4
    yield "tiny-path", rng.standard_normal(300) * 2.0 ** -121
    yield "underflowing-scale", np.array([1e-44, -3e-45, 0.0] * 50)
    yield "near-max", rng.uniform(-1, 1, 300) * float(F32.max)
    x = rng.standard_normal(600)
    x[[3, 300, 301]] = [np.inf, np.inf, -np.inf]
    x[520] = np.nan
    yield "nonfinite", x
    yield "all-nonfinite", np.array([np.inf, -np.inf, np.nan, np.inf] * 16)
    x = rng.standard_normal(700)
    x[rng.integers(0, 700, 40)] = rng.choice([np.inf, -np.inf, np.nan], 40)
    yield "random-nonfinite", x


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint8)


def encode(native, x, block):
    nb = -(-x.size // block)
    got = []
    for run in (lambda s, c: K.i8_encode(x, s, c, block, np.empty(block, np.float32),
                                         K.ROUND_NEAREST),
                lambda s, c: native.i8_encode(x, s, c, block)):
        s, c = np.full(nb, 7, np.float32), np.full(x.size, 7, np.int8)
        run(s, c)
        got.append((s, c))
    return got


@pytest.mark.parametrize("block", [1, 7, 32, 256, 4096])
def test_c_and_numba_agree(native, block):
    rng = np.random.default_rng(11)
    pairs = list(zip(cases(rng), cases(rng)))
    for (name, a), (_, b) in pairs:
        with np.errstate(over="ignore"):
            own = a.astype(np.float32)
            other = (b[::-1] * 0.75).astype(np.float32)
        msg = f"{name}, block {block}"
        (s_nb, c_nb), (s_c, c_c) = encode(native, own, block)
        np.testing.assert_array_equal(bits(s_nb), bits(s_c), err_msg=msg)
        np.testing.assert_array_equal(c_nb, c_c, err_msg=msg)

        (si, ci), _ = encode(native, other, block)
        scratch = np.empty(block, np.float32)
        outs = []
        skip = np.empty(own.size + 1, np.int64)
        for dec, red in ((lambda o: K.i8_decode(si, ci, o, block, skip),
                          lambda o: K.i8_decode_reduce(own, si, ci, o, block, K.OP_SUM,
                                                       scratch, skip)),
                         (lambda o: native.i8_decode(si, ci, o, block),
                          lambda o: native.i8_decode_reduce(own, si, ci, o, block, scratch))):
            d, r = np.zeros_like(own), np.zeros_like(own)
            counts = dec(d), red(r)
            outs.append((d, r, counts))
        (d_nb, r_nb, n_nb), (d_c, r_c, n_c) = outs
        assert n_nb == n_c, msg
        np.testing.assert_array_equal(bits(d_nb), bits(d_c), err_msg=msg)
        np.testing.assert_array_equal(bits(r_nb), bits(r_c), err_msg=msg)

        # the fused hop, in place as the ring uses it and out of place
        res = []
        for fused in (lambda *w: K.i8_decode_reduce_encode(own, *w, block, K.OP_SUM,
                                                            scratch, K.ROUND_NEAREST),
                      lambda *w: native.i8_decode_reduce_encode(own, *w, block,
                                                                scratch)):
            so, co = si.copy(), ci.copy()
            fused(so, co, so, co)
            so2, co2 = np.empty_like(si), np.empty_like(ci)
            fused(si, ci, so2, co2)
            res.append((so, co, so2, co2))
        for got_nb, got_c in zip(*res):
            np.testing.assert_array_equal(bits(got_nb), bits(got_c), err_msg=msg)


def test_copy(native):
    x = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    y = np.empty_like(x)
    native.copy(x, y)
    np.testing.assert_array_equal(bits(x), bits(y))


def test_numba_for_avx2_agrees():
    """The tests above in a process whose numba compiles for a haswell CPU
    (other vector instructions: conversions, packing, maxima)."""
    env = {**os.environ, **ISAS["avx2"][2]}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", "c_and_numba_agree and avx2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout + r.stderr
