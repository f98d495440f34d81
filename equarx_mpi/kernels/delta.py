"""The error-bounded mode's prediction tag, DELTA (kernels/mixed.py,
docs/FORMAT.md "mixed"): a block quantized to a uniform grid of step s,
then coded as the differences of consecutive grid indices (1-D Lorenzo
prediction from the previous reconstructed value, restarted per block),
in a bit width chosen per group of 32 values.

    q_j = rint(fl64(x_j * fl64(1/s)))          integers, computed in float64
    d_0 = 0,  d_j = q_j - q_{j-1}              exact (int64)
    z_j = (d_j << 1) ^ (d_j >> 63)             zigzag: small |d| -> small z
    x'_j = fl_A(fl64(q_j * s)), clamped to [-a, a]    the decoded value

Quantizing first and predicting the integers after (ZCCL's order) keeps
both sides vectorizable and exact: the prediction error of integers needs
no rounding, and the decoder's prefix sum of integers gives the encoder's
q_j bit for bit, so every rank decodes the same values.

Headers (accumulation type A): s, a = max |x| of the block, q_0.  s keeps
12 significant bits and lies in A's normal range; |q_j| <= 2^p - 2 (p = 24
for float32, 53 for float64), so q_0 is an exact integer of A, |d_j| <
2^(p+1) and z_j < 2^(p+2) (w <= 55 bits).  Payload: one width byte per
group of 32 values, then each group's z_j in w bits, least significant
first, in little-endian 32-bit words (a full group takes w words, a short
one of c values ceil(c w / 32)), padded to 8.  Only blocks of m >= 32
values go DELTA (mixed.emit_block): their payload, at most 5 ceil(m/32) +
m (p + 2) / 8 bytes, is then shorter than RAW's m p_A / 8 (3.4m against
4m for float32, 7.0m against 8m for float64), so the buffers sized for
RAW hold it.

Bound (u, eta of A; u64 = 2^-53): with r = fl64(1/s) = (1/s)(1+d1) and
t = fl64(x r) = (x/s)(1+d1)(1+d2) (+ 2^-1075 if t is subnormal), |q - x/s|
<= 1/2 + |x/s|(2u64 + u64^2) + 2^-1075, so |x - q s| <= s/2 + |x|(2u64 +
u64^2) + s 2^-1075.  Decoding rounds q s twice (float64, then A):
|x' - q s| <= (u + 2u64)|q s| + eta, and |q s| <= a + s.  Clamping to
[-a, a] (a = max |x|) only moves x' towards x, and keeps every decoded
value within the block's largest magnitude, as the other tags do (nothing
finite decodes to Inf, a 16-bit output's limit test on a holds).  Together

    |x - x'| <= s (1/2 + u + 2^-50) + a (u + 5 u64) + eta      (``bound``)
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    abs_bits,
    as_acc,
    f64_as_u64,
    from_abs_bits,
    u64_as_f64,
    wide_vectors,
)

#: budgets are compared with bounds times this, so the float64 rounding of
#: the bound arithmetic (a few units in 2^-53) can never let a block through
SAFE = 1.0 + 2.0 ** -30
GROUP = 32                      # values per bit width
#: a block goes DELTA only where its estimated bytes are at least SAVE
#: bytes per value fewer than the cheapest fixed tag's (so never in place of
#: int8 or int4): its kernels cost about 5x int8's per value, and on 4
#: emulated hosts x 1 Gbit/s sharing 2 cores smaller savings did not pay
#: (Gaussian data at abs_tol 0.4, 0.86 against 0.97 bytes per value: 78 ms
#: against 61; a smooth 3-D field, 0.59 against 1.04: 104 against 68;
#: 0.97 against 1.99: 116 against 114; the 2-D field, 0.62 against 2.0:
#: 99-119 against 120-142; docs/results/zccl-cluster-4x1gbit.txt).  A
#: machine whose kernels run on their own cores would gain from less.
SAVE = 1
HEADS = 3                       # s, a, q_0
U64 = 2.0 ** -53
#: s keeps 12 significant bits: its low 41 mantissa bits cleared
_LOW = np.uint64((1 << 41) - 1)
_U = np.uint64


@njit(inline='always', **CACHE)
def pad8(n):
    return (n + 7) & ~7


@njit(inline='always', **CACHE)
def bound(s, a, u, eta):
    """The per-value bound of a DELTA block of step s and largest magnitude
    a (float64; the module's docstring derives it)."""
    return s * (0.5 + u + 2.0 ** -50) + a * (u + 5 * U64) + eta


def grid_limits(like):
    """(smallest step, largest step, bound on |x / s|) of the accumulation
    type of ``like`` (an array): s in A's normal range, |q| <= 2^p - 2."""


@overload(grid_limits, jit_options=CACHE)
def _grid_limits(like):
    if like.dtype == types.float32:
        return lambda like: (2.0 ** -126, 2.0 ** 127, 2.0 ** 24 - 2)
    return lambda like: (2.0 ** -1022, 2.0 ** 1023, 2.0 ** 53 - 2)


@njit(inline='always', **CACHE)
def step(a, room, u, eta, like):
    """The coarsest step s (12 significant bits) whose bound b keeps b *
    SAFE <= room for a finite block of largest magnitude a > 0; 0 when
    none fits A's range or the grid indices' range."""
    s0 = (room / SAFE - a * (u + 5 * U64) - eta) / (0.5 + u + 2.0 ** -50) * (1 - 2.0 ** -40)
    smin, smax, qmax = grid_limits(like)
    if not (s0 >= smin and s0 <= smax):          # also NaN, Inf, negative
        return 0.0
    s = u64_as_f64(f64_as_u64(s0) & ~_LOW)      # rounded down to 12 bits
    if not a * (1.0 / s) < qmax:
        return 0.0
    if not bound(s, a, u, eta) * SAFE <= room:
        return 0.0
    return s


@njit(inline='always', **CACHE)
def bit_length(z):
    w = 0
    while (z >> _U(w)) != _U(0):
        w += 1
    return w


@njit(inline='always', **CACHE)
def estimate(spread, s, m):
    """Payload bytes of an m-value block whose consecutive values differ by
    at most ``spread`` (float64), at step s, if every group took the width
    of the largest difference: |d| <= spread / s + 1 (each q within about
    1/2 of x/s).  What the choice of tag compares; the bytes written may be
    fewer (each group its own width)."""
    t = spread / s + 2.0
    if not t < 2.0 ** 60:
        return 1 << 40
    w = bit_length(_U(2 * np.int64(t)))
    return pad8((m + GROUP - 1) // GROUP + (m * w + 7) // 8)     # about: groups take words


@njit(inline='always', **CACHE)
def spread(vals, off, m):
    """max |x_j - x_{j-1}| over the block (accumulation type, as float64):
    what DELTA's estimate needs.  A maximum of abs_bits: unsigned integers
    vectorize where a float maximum (NaN rules) does not, 5x faster."""
    zero = as_acc(vals, 0)
    d = abs_bits(zero)
    for j in range(1, m):
        d = max(d, abs_bits(vals[_U(off + j)] - vals[_U(off + j - 1)]))
    return np.float64(from_abs_bits(d, zero))


@njit(inline='always', **CACHE)
def payload(u8, pay, m):
    """Payload bytes (padded) of an m-value DELTA block at byte ``pay``."""
    groups = (m + GROUP - 1) // GROUP
    total = groups
    for k in range(groups):
        c = min(GROUP, m - k * GROUP)
        total += ((c * np.int64(u8[pay + k]) + 31) >> 5) << 2
    return pad8(total)


@njit(inline='always', **CACHE)
def _put32(u8, p, v):
    u8[p] = np.uint8(v & _U(0xFF))
    u8[p + 1] = np.uint8((v >> _U(8)) & _U(0xFF))
    u8[p + 2] = np.uint8((v >> _U(16)) & _U(0xFF))
    u8[p + 3] = np.uint8((v >> _U(24)) & _U(0xFF))


@njit(inline='always', **CACHE)
def _get32(u8, p):
    return (_U(u8[p]) | (_U(u8[p + 1]) << _U(8)) | (_U(u8[p + 2]) << _U(16))
            | (_U(u8[p + 3]) << _U(24)))


@njit(**HELPER)
def emit(vals, off, m, s, a, heads, nh, u8, pay, qs):
    """DELTA of vals[off:off+m] (accumulation type, finite, max |x| = a) at
    step s (from ``step``): headers at heads[nh:nh+3], payload at byte
    ``pay``; qs holds 2 * m int64.  Returns the payload bytes (padded)."""
    wide_vectors()
    r = 1.0 / s
    for j in range(m):
        qs[_U(j)] = np.int64(np.rint(np.float64(vals[_U(off + j)]) * r))
    zs = qs[m:]
    zs[0] = 0
    for j in range(1, m):
        d = qs[_U(j)] - qs[_U(j - 1)]
        zs[_U(j)] = (d << np.int64(1)) ^ (d >> np.int64(63))
    heads[nh] = as_acc(heads, s)
    heads[nh + 1] = as_acc(heads, a)
    heads[nh + 2] = as_acc(heads, qs[0])
    groups = (m + GROUP - 1) // GROUP
    p = pay + groups
    for k in range(groups):
        lo = k * GROUP
        c = min(GROUP, m - lo)
        both = np.int64(0)
        for j in range(c):
            both |= zs[_U(lo + j)]
        w = bit_length(_U(both))
        u8[pay + k] = w
        if w == 0:
            continue
        # 32-bit words, least significant bits first: with w <= 32 the
        # held bits (< 32 + w) fit the 64-bit register; wider (float64's
        # far-apart values) goes through it in halves
        bits = _U(0)
        held = 0
        for j in range(c):
            z = _U(zs[_U(lo + j)])
            if w > 32:
                bits |= (z & _U(0xFFFFFFFF)) << _U(held)
                _put32(u8, p, bits)
                p += 4
                bits = (bits >> _U(32)) | ((z >> _U(32)) << _U(held))
                held += w - 32
            else:
                bits |= z << _U(held)
                held += w
            if held >= 32:
                _put32(u8, p, bits)
                p += 4
                bits >>= _U(32)
                held -= 32
        if held > 0:
            _put32(u8, p, bits)
            p += 4
    end = pay + pad8(p - pay)
    for j in range(p, end):
        u8[j] = 0
    return end - pay


@njit(**HELPER)
def decode(u8, pay, acc, hd, m, dst):
    """dst[:m] = the values of the DELTA block whose payload starts at byte
    ``pay`` and headers at acc[hd:] (in dst's type, the accumulation type)."""
    wide_vectors()
    s = np.float64(acc[hd])
    a = acc[hd + 1]
    q = np.int64(acc[hd + 2])
    groups = (m + GROUP - 1) // GROUP
    p = pay + groups
    for k in range(groups):
        lo = k * GROUP
        c = min(GROUP, m - lo)
        w = np.int64(u8[pay + k])
        if w == 0:
            v = as_acc(dst, q)
            for j in range(c):
                dst[_U(lo + j)] = v
            continue
        mask = (_U(1) << _U(w)) - _U(1)
        bits = _U(0)
        held = 0
        for j in range(c):
            if w > 32:                  # two words at least: low 32 bits first
                while held < 32:
                    bits |= _get32(u8, p) << _U(held)
                    p += 4
                    held += 32
                z = bits & _U(0xFFFFFFFF)
                bits >>= _U(32)
                held -= 32
                while held < w - 32:
                    bits |= _get32(u8, p) << _U(held)
                    p += 4
                    held += 32
                z |= (bits & ((_U(1) << _U(w - 32)) - _U(1))) << _U(32)
                bits >>= _U(w - 32)
                held -= w - 32
            else:
                if held < w:
                    bits |= _get32(u8, p) << _U(held)
                    p += 4
                    held += 32
                z = bits & mask
                bits >>= _U(w)
                held -= w
            q += np.int64(z >> _U(1)) ^ -np.int64(z & _U(1))
            dst[_U(lo + j)] = as_acc(dst, q)        # exact: |q| < 2^p
    # the values from the grid indices in a second pass, which vectorizes
    for j in range(m):
        dst[_U(j)] = min(max(as_acc(dst, np.float64(dst[_U(j)]) * s), -a), a)
