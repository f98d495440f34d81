"""Block-diagonal randomized Hadamard rotation (docs/FORMAT.md "Rotation").

A piece of n values is cut into chunks of ``size`` (a power of two, 2 to
4096), the last n mod size values into the powers of two of their count,
largest first (13 = 8 + 4 + 1): every value lies in one chunk, so the
rotation is exactly invertible.  Per chunk of S values, in the
accumulation type A (float64 for float64 input, float32 otherwise), with
c = fl_A(fl64(1 / fl64(sqrt(S)))):

    rotate      y = (P H (D x)) * c
    unrotate    x = D ((P H y) * c)

H: Sylvester's Hadamard matrix, applied by the butterfly stage by stage
(kernels/butterfly.py), the scale one multiply after the last stage (none
for S = 1).  Below 64 values P is the identity and the stages run 1, 2,
..., S/2; from 64 on, each 64 values are eight vectors of eight: stages 8,
16, 32 across them, an 8 x 8 transpose, stages 1, 2, 4 across them again
(no stage inside a vector), then 64, ..., S/2, and P is the transpose,
stored as it is.  H = H_(S/64) (x) H_8 (x) H_8 commutes with P, P is its
own inverse: unrotate is the same procedure with the signs last.

D flips sign bits (exact, NaN and zeros too): value g of the
piece (g = start + its index) flips where bit g % 64 of
mix64(stream + (g // 64 + 1) * GOLDEN) is set, stream = (DOMAIN, seed,
key) absorbed splitmix64-style; each absorption is a bijection, so pieces
keyed apart share a 64-sign word only by a 2^-64 chance.

An Inf or NaN spreads over its chunk (one Inf: +-Inf everywhere; a NaN,
or Infs that meet: NaN).  Sums reach S * max|x| before the scale, so
float32 above FLT_MAX / S (bfloat16 near its maximum) can overflow where
the rotated value would fit: callers treat such chunks as Inf input.
16-bit inputs convert exactly to float32 (float16's largest sum fits).
Zeros keep their value, not their sign.
"""
import functools

import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels.butterfly import flip8, h8, h64, small_stages, upper_stages
from equarx_mpi.kernels.common import (
    CACHE,
    KERNEL,
    acc_block,
    as_acc,
    f32_as_u32,
    f64_as_u64,
    load,
    store,
    u32_as_f32,
    u64_as_f64,
    wide_vectors,
)
from equarx_mpi.kernels.magnitude import absmax_bits, mag_limits, mag_value
from equarx_mpi.kernels.stochastic import GOLDEN, mix64
from equarx_mpi.names import KERNEL_DTYPE, acc_dtype

MAX_SIZE = 4096
#: unrotate's flag of a block it left as it is for its magnitude
RISKY = np.uint8(2)
#: absorbed first, so no seed makes the signs replay stochastic rounding's stream
DOMAIN = 0x524F544154450001
_U, _MASK = np.uint64, (1 << 64) - 1


@functools.lru_cache(maxsize=256)        # a call's 7 us, where one piece may cost 2
def sign_stream(seed, key):
    """The 64-bit stream of the signs for (seed, key), both taken mod 2^64."""
    z = 0
    for v in (DOMAIN, seed, key):
        z = ((z ^ (v & _MASK)) + GOLDEN) & _MASK
        for shift, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 1)):
            z = ((z ^ (z >> shift)) * mul) & _MASK
    return z


@njit(inline='always', **CACHE)
def _word(stream, k):
    """The signs of values 64k .. 64k + 63, one bit each."""
    return mix64(stream + (k + _U(1)) * _U(GOLDEN))


def flip(v, bit):
    """v with bit (0 or 1) xor-ed into its sign bit."""


@overload(flip, jit_options=CACHE)
def _flip(v, bit):
    if v == types.float32:
        return lambda v, bit: u32_as_f32(np.uint32(f32_as_u32(v) ^ np.uint32(
            np.uint32(bit) << np.uint32(31))))
    if v == types.float64:
        return lambda v, bit: u64_as_f64(f64_as_u64(v) ^ (_U(bit) << _U(63)))


@njit(inline='always', **CACHE)
def _signs(src, so, dst, do, m, stream, g0):
    """dst[do:do+m] = D src[so:so+m] in dst's type (dst may be src),
    src[so] being value g0 of the piece."""
    k = 0
    while k < m:
        g = g0 + _U(k)
        w = _word(stream, g >> _U(6))
        e = min(m, k + np.int64(_U(64) - (g & _U(63))))
        b0 = g & _U(63)
        for j in range(e - k):
            store(dst, _U(do + k + j), flip(load(src, _U(so + k + j)),
                                            (w >> (b0 + _U(j))) & _U(1)))
        k = e


@njit(inline='always', **CACHE)
def _bits8(stream, g):
    """The sign bits of values g .. g + 7 (bit k: value g + k)."""
    s = g & _U(63)
    bits = _word(stream, g >> _U(6)) >> s
    if s > _U(56):                      # only for a piece not starting on 8 values
        bits |= _word(stream, (g >> _U(6)) + _U(1)) << (_U(64) - s)
    return np.uint32(bits & _U(0xFF))


@njit(inline='always', **CACHE)
def _bits64(stream, g):
    """The sign bits of values g .. g + 63 (bit k: value g + k)."""
    s = g & _U(63)
    bits = _word(stream, g >> _U(6)) >> s
    if s:                               # only for a piece not starting on 64 values
        bits |= _word(stream, (g >> _U(6)) + _U(1)) << (_U(64) - s)
    return bits


@njit(inline='always', **CACHE)
def _first(a, ao, x, xo, m, c, stream, g0, signed):
    """The stages below 64 of a chunk of m >= 8 values, a[ao:ao+m] ->
    x[xo:xo+m] (may be a), flipping signs first if ``signed``: per 64
    values the 8 x 8 form (h64: stored transposed), else stages 1, 2, 4."""
    if m >= 64:
        for i in range(0, m, 64):
            bits = _bits64(stream, g0 + _U(i)) if signed else _U(0)
            h64(a, _U(ao + i), x, _U(xo + i), bits, c, m == 64)
        return
    k, w = ~_U(0), _U(0)
    for i in range(0, m, 8):
        bits = np.uint32(0)
        if signed:
            g = g0 + _U(i)
            if g >> _U(6) != k:           # one hash per 64 values
                k, w = g >> _U(6), _word(stream, g >> _U(6))
            # _bits8 for the eights across two words (a piece not starting on 8)
            bits = _bits8(stream, g) if g & _U(63) > _U(56) else np.uint32(
                (w >> (g & _U(63))) & _U(0xFF))
        h8(a, _U(ao + i), x, _U(xo + i), bits, c, m == 8)


@njit(inline='always', **CACHE)
def _hadamard(a, ao, x, xo, m, c, stream, g0, signed):
    """x[xo:xo+m] = (H D a[ao:ao+m]) * c, D only if ``signed``; a and x of
    the accumulation type, x may be a."""
    if m < 8:
        if signed:
            _signs(a, ao, x, xo, m, stream, g0)
        else:
            for j in range(m):
                x[_U(xo + j)] = a[_U(ao + j)]
        small_stages(x, xo, m, c)
    else:
        _first(a, ao, x, xo, m, c, stream, g0, signed)
        upper_stages(x, xo, m, c, 64 if m >= 64 else 8)


@njit(inline='always', **CACHE)
def _scale(m, arr, cs, size):
    """c of a chunk of m: cs (size's, computed once per call: a square root
    and a division cost as much as a chunk of 8), or the tail's own."""
    return cs if m == size else as_acc(arr, 1.0 / np.sqrt(np.float64(m)))


@njit(inline='always', **CACHE)
def _chunk(n, lo, size):
    """The length of the chunk at lo: size, or in the tail the largest
    power of two that fits."""
    m = size
    while m > n - lo:
        m //= 2
    return m


@njit(**KERNEL)
def _rotate(src, out, size, stream, start):
    wide_vectors()
    n = src.size
    cs = as_acc(out, 1.0 / np.sqrt(np.float64(size)))
    most = mag_limits(src)[0]
    lo = 0
    while lo < n:
        m = _chunk(n, lo, size)
        most = max(most, absmax_bits(src, lo, m, True))
        a, ao = acc_block(src, lo, m, out[lo:])     # 16-bit: converted into out
        _hadamard(a, ao, out, lo, m, _scale(m, out, cs, size), stream, start + _U(lo), True)
        lo += m
    return mag_value(src, most)


def _unsign(work, at, out, lo, m, stream, g0):
    """out[lo:lo+m] = D work[at:at+m], eight at a time if no conversion."""


@overload(_unsign, jit_options=CACHE, inline='always')
def _unsign_impl(work, at, out, lo, m, stream, g0):
    if out.dtype != work.dtype:
        return lambda work, at, out, lo, m, stream, g0: _signs(work, at, out, lo, m, stream, g0)

    def vector(work, at, out, lo, m, stream, g0):
        if m < 8:
            _signs(work, at, out, lo, m, stream, g0)
            return
        for i in range(0, m, 64):       # one hash per 64 values, not per 8
            bits = _bits64(stream, g0 + _U(i))
            for j in range(i, min(m, i + 64), 8):
                flip8(work, _U(at + j), out, _U(lo + j), np.uint32(bits & _U(0xFF)))
                bits >>= _U(8)
    return vector


@njit(**KERNEL)
def _unrotate(src, out, work, size, stream, start, block, flags, most, mags):
    wide_vectors()
    n = src.size
    cs = as_acc(src, 1.0 / np.sqrt(np.float64(size)))
    lo = 0
    while lo < n:
        hi = n
        if mags.size:                           # by blocks: measured, some left as they are
            b = lo // block
            hi = min(lo + block, n)
            mags[b] = mag_value(src, absmax_bits(src, lo, hi - lo, True))
            if mags[b] >= most:
                flags[b] |= RISKY
            if flags[b]:
                lo = hi
                continue
        while lo < hi:
            m = _chunk(n, lo, size)             # chunks lie inside blocks (size divides block)
            at = lo if work.size == n else 0    # work: out itself or one chunk
            _hadamard(src, lo, work, at, m, _scale(m, src, cs, size), stream, start, False)
            _unsign(work, at, out, lo, m, stream, start + _U(lo))
            lo += m


def _check(name, src, out, size):
    """The kernels' views of src and out, or the ValueError saying why not."""
    bad = None
    if not (isinstance(size, (int, np.integer)) and 2 <= size <= MAX_SIZE
            and size & (size - 1) == 0):
        bad = f"size must be a power of two from 2 to {MAX_SIZE}, not {size!r}"
    elif not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.flags.c_contiguous
                 for a in (src, out)):
        bad = "src and out must be 1-D C-contiguous arrays"
    elif src.size != out.size or not out.flags.writeable:
        bad = f"src has {src.size} values and out {out.size}" if src.size != out.size \
            else "out is read-only"
    else:
        s, o = (a.view(KERNEL_DTYPE.get(a.dtype, a.dtype)) for a in (src, out))
        wide, narrow, what = (o, s, "out") if name == "rotate" else (s, o, "src")
        if narrow.dtype not in (np.float32, np.float64, np.int16, np.uint16):
            bad = f"{narrow.dtype} is not a float type"
        elif wide.dtype != acc_dtype(narrow.dtype):
            bad = (f"{what} must be {acc_dtype(narrow.dtype)} (the accumulation type of "
                   f"{narrow.dtype}), not {wide.dtype}")
        elif np.may_share_memory(s, o) and s.ctypes.data != o.ctypes.data:
            bad = "src and out overlap without being the same array"
    if bad:
        raise ValueError(f"{name}: {bad}")
    return s, o


def rotate(src, out, size, seed, key, start=0):
    """out = the rotation of src: chunks of ``size``, signs from (seed, key)
    and each value's index start + i.  out is of src's accumulation type
    and may be src (float32, float64).  src as float16 / bfloat16 or the
    kernels' int16 / uint16 views.  Returns src's largest finite magnitude
    (float; 0.0 if it has none), which the rotation's rounding bound needs."""
    s, o = _check("rotate", src, out, size)
    return _rotate(s, o, np.int64(size), _U(sign_stream(seed, key)), _U(start & _MASK))


def unrotate(src, out, size, seed, key, start=0, block=None, flags=None, most=np.inf):
    """out = the inverse rotation of src (of out's accumulation type; out
    may be src), stored in out's type (16-bit: rounded to nearest even).

    With ``block`` (a multiple of size) it goes block by block of src:
    returns each block's largest finite magnitude (float64); blocks whose
    ``flags`` (uint8 per block) are set, and those whose magnitude is at
    least ``most`` (flagged RISKY here), are left as they are in out."""
    s, o = _check("unrotate", src, out, size)
    work = o if o.dtype == s.dtype else np.empty(size, s.dtype)
    nb = 0 if block is None else -(-s.size // block)
    mags = np.empty(nb, np.float64)
    if flags is None:
        flags = np.zeros(nb, np.uint8)
    if block is not None and not (block % size == 0 and flags.shape == (nb,)
                                  and flags.dtype == np.uint8):
        raise ValueError(f"unrotate: block {block} must be a multiple of size {size}, "
                         f"flags {nb} uint8")
    _unrotate(s, o, work, np.int64(size), _U(sign_stream(seed, key)), _U(start & _MASK),
              np.int64(block or 1), flags, np.float64(most), mags)
    return mags
