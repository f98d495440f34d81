"""The rotation kernels (kernels/rotate.py) against the numpy reference bit
for bit, their promises (inverse, norm, signs, bad input) and what the
rotation buys on a real wire format.

Serial: python -m pytest -q tests/test_rotate.py
"""
import json
import warnings

import ml_dtypes
import numpy as np
import pytest
import reference_rotate as ref
from reference import BF16, to_acc

from equarx_mpi import kernels as K
from equarx_mpi.kernels import rotate as R
from equarx_mpi.wire import formats

DTYPES = [np.float32, np.float64, np.float16, BF16]
#: every chunk length the kernels take a distinct path for: 2 and 4 (stage
#: by stage), 8 (the radix-8 pass alone), 16 (one stage after it), 32 and
#: 64 (one radix-4 pass), 256, and the largest
SIZES = [2, 4, 8, 16, 32, 64, 256, 4096]


def acc(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def lengths(size):
    return sorted({0, 1, 7, size - 1, size, 3 * size, 3 * size + 13, 2 * size + size // 2 + 3})


def data(n, dtype, rng):
    with np.errstate(over="ignore"):
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-2, 3, n)).astype(dtype)


def same(a, b):
    """Bit for bit, but any NaN matches any NaN (the NaN an addition returns
    depends on its operands' order, which LLVM may swap)."""
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a.astype(np.float64))
    if not np.array_equal(nan, np.isnan(b.astype(np.float64))):
        return False
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.array_equal(a[~nan].view(u), b[~nan].view(u))


def rot(x, size, seed=1, key=2, start=0):
    out = np.empty(x.size, acc(x.dtype))
    R.rotate(x, out, size, seed, key, start)
    return out


def unrot(y, size, dtype, seed=1, key=2, start=0):
    out = np.empty(y.size, dtype)
    R.unrotate(y, out, size, seed, key, start)
    return out


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kernels_match_the_reference_bit_for_bit(dtype, size):
    rng = np.random.default_rng(size)
    for n in lengths(size):
        x = data(n, dtype, rng)
        y = rot(x, size, 5, 9)
        assert same(y, ref.rotate(x, size, 5, 9)), (n, "rotate")
        back = unrot(y, size, dtype, 5, 9)
        assert same(back, ref.unrotate(y, size, 5, 9, dtype=dtype)), (n, "unrotate")


def test_tail_chunks_are_the_powers_of_two_of_the_rest():
    assert ref.chunks(3 * 64 + 13, 64) == [(0, 64), (64, 64), (128, 64), (192, 8), (200, 4),
                                           (204, 1)]
    x = np.zeros(13, np.float32)
    x[12] = 3.0                         # the last value is a chunk of its own: only its sign
    y = rot(x, 64)
    assert np.abs(y[12]) == 3.0 and not y[:12].any()


def test_start_is_the_index_of_the_first_value():
    """A piece starting on a chunk boundary, rotated with its offset, is
    that part of the whole piece's rotation (and so is its inverse)."""
    rng = np.random.default_rng(3)
    x = data(1000, np.float32, rng)
    whole = rot(x, 64)
    assert same(rot(x[192:], 64, start=192), whole[192:])
    assert same(unrot(whole[192:], 64, np.float32, start=192), unrot(whole, 64, np.float32)[192:])
    assert not same(rot(x[192:], 64), whole[192:])
    # starts off a 64-value sign word: the signs of a chunk come from two words
    for size, start in ((32, 32), (8, 200), (64, 96), (256, 4072)):
        y = rot(x, size, start=start)
        assert same(y, ref.rotate(x, size, 1, 2, start)), (size, start)
        assert same(unrot(y, size, np.float32, start=start),
                    ref.unrotate(y, size, 1, 2, start, dtype=np.float32)), (size, start)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_rotate_returns_the_largest_finite_magnitude(dtype):
    """What the rotation's rounding bound needs (collectives/rotation.py),
    found as the kernel reads: Inf and NaN skipped, 0 with none."""
    rng = np.random.default_rng(6)
    x = data(1000, dtype, rng)
    x[[3, 500]] = x[[3, 500]] * 0 + np.array([np.inf, np.nan], dtype)
    x[700] = x[700] * 0 + ml_dtypes.finfo(dtype).max / 2
    for v in (x, x[:3], x[3:4], np.zeros(5, dtype), x[:0]):
        want = np.abs(v.astype(np.float64))
        want = float(want[np.isfinite(want)].max(initial=0.0))
        assert R.rotate(v, np.empty(v.size, acc(dtype)), 16, 1, 2) == want, v.size


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_in_place(dtype):
    rng = np.random.default_rng(4)
    x = data(777, dtype, rng)
    y = x.copy()
    R.rotate(y, y, 32, 1, 2)
    assert same(y, rot(x, 32))
    R.unrotate(y, y, 32, 1, 2)
    assert same(y, unrot(rot(x, 32), 32, dtype))


@pytest.mark.parametrize("size", [2, 8, 32, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_inverse_and_norm(dtype, size):
    """unrotate(rotate(x)) is x within a few units of roundoff of the
    chunk's norm (each butterfly stage rounds once, the scale and its
    constant once each); each chunk keeps its norm as closely.  A 16-bit
    result is x but where that error crosses a rounding midpoint (often,
    for values far below their chunk's norm)."""
    rng = np.random.default_rng(5)
    x = data(5 * size + 7, dtype, rng)
    v = to_acc(x).astype(np.float64)
    u = 2.0 ** -53 if np.dtype(dtype) == np.float64 else 2.0 ** -24
    y = rot(x, size)
    back = unrot(y, size, acc(dtype)).astype(np.float64)
    back16 = unrot(y, size, dtype).astype(np.float64)
    half16 = {2: 2.0 ** -11 if np.dtype(dtype) == np.float16 else 2.0 ** -8}.get(x.itemsize, 0)
    for lo, m in ref.chunks(x.size, size):
        c = slice(lo, lo + m)
        norm = np.linalg.norm(v[c])
        tol = (np.log2(m) + 4) * u * norm          # and the norms' own rounding
        assert abs(np.linalg.norm(y[c].astype(np.float64)) - norm) <= tol, (lo, m)
        assert np.abs(back[c] - v[c]).max() <= 2 * tol, (lo, m)
        assert (np.abs(back16[c] - v[c]) <= 2 * tol + half16 * (np.abs(v[c]) + 2 * tol)).all()


def test_signs_follow_seed_and_key():
    rng = np.random.default_rng(6)
    x = data(4096, np.float32, rng)
    base = rot(x, 64, 1, 2)
    assert same(rot(x, 64, 1, 2), base)
    for seed, key in ((1, 3), (2, 2), (1, 2 + 2 ** 40)):
        assert not same(rot(x, 64, seed, key), base), (seed, key)
    assert same(rot(x, 64, 1 + 2 ** 64, 2 - 2 ** 64), base)      # both taken mod 2^64
    # one 64-sign word per key and chunk: no two keys (nor chunks) share one
    words = np.stack([np.packbits(ref.sign_bits(4096, 7, k)).view(np.uint64)
                      for k in range(512)])
    assert np.unique(words).size == words.size
    assert len({R.sign_stream(s, k) for s in range(16) for k in range(256)}) == 16 * 256
    assert R.sign_stream(7, 11) == ref.sign_stream(7, 11)


def test_zero_spike_and_subnormal_chunks():
    z = np.zeros(300, np.float32)
    z[::3] = -0.0
    assert not rot(z, 64).any() and not unrot(rot(z, 64), 64, np.float32).any()
    spike = np.zeros(256, np.float32)
    spike[17] = -3.0e5
    y = rot(spike, 256)
    assert (np.abs(y) == np.float32(3.0e5) * np.float32(1 / 16)).all()
    assert np.array_equal(unrot(y, 256, np.float32), spike)   # zeros' signs are not kept
    sub = np.float32(np.finfo(np.float32).smallest_subnormal)
    rng = np.random.default_rng(7)
    x = (rng.integers(-1000, 1000, 512) * sub).astype(np.float32)
    y = rot(x, 128)
    assert same(y, ref.rotate(x, 128, 1, 2))
    # the butterfly of subnormals is exact; the two scales round once each
    assert np.abs(unrot(y, 128, np.float32).astype(np.float64) - x).max() <= (
        (np.sqrt(128) + 1) * sub)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_inf_and_nan_spread_over_their_chunk_only(dtype):
    rng = np.random.default_rng(8)
    x = data(64 * 4, np.float32, rng).astype(dtype)
    x[5] = np.inf                      # chunk 0: one Inf -> +-Inf everywhere
    x[64 + 9] = np.nan                 # chunk 1: NaN everywhere
    x[128 + 1], x[128 + 2] = np.inf, np.inf     # chunk 2: Inf - Inf somewhere: NaN
    y = rot(x, 64)
    assert same(y, ref.rotate(x, 64, 1, 2))
    assert np.isinf(y[:64]).all() and np.isnan(y[64:128]).all()
    assert np.isnan(y[128:192]).any() and not np.isfinite(y[128:192]).any()
    assert np.isfinite(y[192:]).all()
    back = unrot(y, 64, dtype)
    assert not np.isfinite(back[:192].astype(np.float64)).any()
    assert same(back[192:], x[192:]) or np.allclose(back[192:].astype(np.float64),
                                                    x[192:].astype(np.float64), rtol=1e-2)


def test_rotated_16_bit_values_beyond_their_range_stay_finite():
    """float16 rotates in float32: 4096 values of 65504 whose signs D
    undoes sum to 65504 * 4096 / 64, far beyond float16's range."""
    flips = np.where(ref.sign_bits(4096, 1, 2) == 1, -1.0, 1.0)
    x = (65504.0 * flips).astype(np.float16)
    y = rot(x, 4096)
    assert np.isfinite(y).all() and y[0] == np.float32(65504 * 64)
    assert same(y, ref.rotate(x, 4096, 1, 2))
    assert same(unrot(y, 4096, np.float16), x)
    # bfloat16 reaches float32's range: the sums overflow before the scale
    big = (float(np.array(0x7F7F, np.uint16).view(BF16)) * flips[:256]).astype(BF16)
    yb = rot(big, 256)
    assert same(yb, ref.rotate(big, 256, 1, 2)) and yb[0] == np.inf


@pytest.mark.parametrize("bad, match", [
    (dict(size=3), "power of two"), (dict(size=8192), "power of two"), (dict(size=1), "power"),
    (dict(out=np.empty(10, np.float64)), "out must be float32"),
    (dict(out=np.empty(9, np.float32)), "10 values and out 9"),
    (dict(src=np.zeros((2, 5), np.float32)), "1-D")])
def test_bad_arguments(bad, match):
    args = dict(src=np.zeros(10, np.float32), out=np.empty(10, np.float32), size=4)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        R.rotate(args["src"], args["out"], args["size"], 0, 0)


def test_overlap_is_refused_but_the_same_array_is_not():
    a = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        R.rotate(a[:10], a[5:15], 4, 0, 0)
    R.rotate(a, a, 4, 0, 0)
    with pytest.raises(ValueError, match="src must be float32"):
        R.unrotate(np.zeros(4, np.float64), np.empty(4, np.float16), 4, 0, 0)


# --- what the rotation buys, through the library's own formats ---------------

def through(wire, block, x, size=None):
    """x after one encode/decode of ``wire`` (float32), rotated by size
    first (and back after) when size is given."""
    fmt = formats.make_format(wire, block, np.float32)
    w = fmt.views(np.zeros(fmt.nbytes(x.size), np.uint8), x.size)
    v = x.reshape(-1)
    if size:
        v = rot(v, size, 11, 0)
    fmt.encode(v, w, K.ROUND_NEAREST)
    out = np.empty(x.size, np.float32)
    assert fmt.decode(w, out).size == 0
    if size:
        out = unrot(out, size, np.float32, 11, 0)
    return out.reshape(x.shape)


def heavy_tailed(rng, rows=512, cols=384):
    """Student-t (3 degrees of freedom) activations with outlier channels."""
    x = rng.standard_t(3, (rows, cols))
    x[:, rng.choice(cols, 6, replace=False)] *= rng.uniform(20, 100, 6)
    return x.astype(np.float32)


def one_minus_cos(x, y):
    x, y = x.astype(np.float64), y.astype(np.float64)
    return float(np.mean(1 - np.sum(x * y, 1) / np.linalg.norm(x, axis=1) /
                         np.linalg.norm(y, axis=1)))


def rel_l2(x, y):
    return float(np.linalg.norm((y - x).astype(np.float64)) / np.linalg.norm(x))


def test_rotation_helps_int8_on_outlier_channels_and_costs_nothing_on_gaussian():
    rng = np.random.default_rng(12)
    x = heavy_tailed(rng)
    plain, rotated = (one_minus_cos(x, through("int8", 256, x, s)) for s in (None, 256))
    assert rotated * 10 <= plain, (plain, rotated)
    g = rng.standard_normal((512, 384)).astype(np.float32)
    plain, rotated = (rel_l2(g, through("int8", 256, g, s)) for s in (None, 256))
    assert rotated <= 1.1 * plain, (plain, rotated)


def test_bench_quality(tmp_path, capsys, monkeypatch):
    """python -m equarx_mpi.bench quality: a row per wire, rotated or not,
    and the MiniLM row skipped with its reason when the model is not there."""
    from equarx_mpi.bench import quality
    monkeypatch.setattr(quality, "EXAMPLES", str(tmp_path))     # no examples/minilm_tp.py
    path = tmp_path / "q.json"
    assert quality.main(["--n", "38400", "--wires", "int8,int4", "--ranks", "2",
                         "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# minilm: skipped: " in out and "minilm_tp.py" in out
    rows = {(r["data"], r["wire"], r["rotate"]): r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {(d, w, s) for d in ("gaussian", "heavy") for w, b in
                         (("int8", 256), ("int4", 64)) for s in (0, b)}
    r = rows["heavy", "int8", 256]
    assert r["bytes_per_value"] == (256 + 4) / 256 and r["rd_limit"] == 2 ** (-8 * (260 / 256))
    assert r["one_minus_cos"] * 10 < rows["heavy", "int8", 0]["one_minus_cos"]
    assert r["sum_rel_l2"] * 3 < rows["heavy", "int8", 0]["sum_rel_l2"]
    wires = quality.block_wires()
    assert wires == list(formats.ROTATE_WIRES) and {"int8", "int4", "fp8", "int3", "int2"} <= \
        set(wires) and not {"bf16", "fp32"} & set(wires)


def test_rotate_option_values_and_environment(monkeypatch):
    """rotate= takes False, True, "auto" or a power of two up to the block;
    EQUARX_MPI_ROTATE the same spelt as text; a bad value is a ValueError
    in code and a warning from the environment."""
    from equarx_mpi.call import options
    assert options.resolve({})["rotate"] is False
    for given in (True, "auto", 2, 64, 256):
        assert options.resolve(dict(rotate=given))["rotate"] == given
    assert options.resolve(dict(rotate=np.bool_(True)))["rotate"] is True
    for bad, text in ((1, "power of two"), (3, "power of two"), (512, "power of two"),
                      ("yes", "power of two"), (128, "power of two")):
        with pytest.raises(ValueError, match=text):
            options.resolve(dict(rotate=bad, wire="int4") if bad == 128 else dict(rotate=bad))
    for text, want in (("1", True), ("0", False), ("auto", "auto"), ("64", 64), ("on", True)):
        monkeypatch.setenv("EQUARX_MPI_ROTATE", text)
        assert options.resolve({})["rotate"] == want, text
    monkeypatch.setenv("EQUARX_MPI_ROTATE", "3")
    with pytest.warns(UserWarning, match="EQUARX_MPI_ROTATE"):
        assert options.resolve({})["rotate"] is False


def test_auto_estimate_measures_what_rotating_buys():
    """rotation.errors, auto's evidence: one quantization's squared error
    of a sample, as it is and rotated.  Gaussian blocks: about equal (no
    rotation); outlier channels: int8 loses far more as it is, wherever the
    channels lie in a row (no sampling stride aliases them); a spike in every
    block: int8 gains, int4 and int3 lose (their small values round to zero
    as they are, rotated each carries the spike's step); zeros, NaN and Inf
    blocks never make it rotate, nor hide the finite blocks."""
    from equarx_mpi.collectives import rotation
    from equarx_mpi.wire import formats
    rng = np.random.default_rng(5)
    f32 = np.dtype(np.float32)

    def gain(x, wire, block=None):
        block = block or formats.default_block(wire)
        rot = rotation.Rotation(block, 7, block)
        e0, e1 = rotation.errors(x, formats.make_format(wire, block, f32), rot)
        return e0 / e1 if e1 else 0.0
    g = rng.standard_normal(1 << 16).astype(np.float32)
    for wire in ("int8", "int4", "int3"):
        assert 0.8 < gain(g, wire) < 1.25, wire
    h = rng.standard_t(3, 1 << 16).astype(np.float32)
    h[::97] *= 40
    assert gain(h, "int8") > 10 * rotation.AUTO_GAIN
    # 1024 tokens x 1024 channels, two channels 100x: a stride of 32 blocks
    # of 256 would only ever see channels 0-255
    t = rng.standard_normal((1024, 1024)).astype(np.float32)
    t[:, [300, 700]] *= 100
    assert gain(t.reshape(-1), "int8") > 10 * rotation.AUTO_GAIN
    s = rng.standard_normal(1 << 16).astype(np.float32)
    s[::61] *= 300
    assert gain(s, "int8") > rotation.AUTO_GAIN
    assert gain(s, "int4") < 1 and gain(s, "int3") < 1
    for x in (np.zeros(4096, np.float32), np.full(4096, np.nan, np.float32)):
        assert gain(x, "int8") == 0.0
    h[0], h[300] = np.nan, np.inf
    assert gain(h, "int8") > 10 * rotation.AUTO_GAIN
    # finite values that rotated overflow float32: never rotated, no warning
    big = g * np.float32(3e37)
    big[::97] = np.float32(3.3e38)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gain(big, "int8") > rotation.AUTO_GAIN


def test_numpy_integer_sizes_become_ints():
    from equarx_mpi.call import options
    o = options.resolve(dict(rotate=np.int64(32), block_size=np.int32(64), chunks=np.int64(2)))
    assert (o["rotate"], o["block_size"], o["chunks"]) == (32, 64, 2)
    assert all(type(o[k]) is int for k in ("rotate", "block_size", "chunks"))
