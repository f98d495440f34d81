"""Mixed blocks: the wire format of the error-bounded mode (docs/FORMAT.md
"mixed").  Every block travels in the cheapest encoding whose rigorous
error bound fits the budget of this quantization, named by a tag:

    tag       headers (accumulation type A)   payload for m values
    ZERO      -                               -        (all +0.0)
    INT4      a = max |x|                     ceil(m/2) bytes, int4's codes
    INT4A     lo, hi                          ceil(m/2) bytes, int4-affine's
    INT8      a                               m bytes, int8's codes
    INT8A     lo, hi                          m bytes, int8-affine's
    INT16     a                               2m bytes: rint(x * fl(32767/a))
    RAW       -                               m values of A, exact
    FLAG      -                               -        (Inf or NaN inside)
    DELTA     s, a, q_0                       grid steps' differences (delta.py)

INT4, INT8, INT4A and INT8A are the int4, int8 and affine formats' own
encodings (their emit functions), INT16 is int8's design with 32767 levels
(fl(32767 * fl(1/32767)) == 1 in float32 and float64, so +-32767 decodes to
exactly +-a).  Per-value bounds, the other formats' own (formats.py,
docs/ERROR.md; float64, u and eta of A):

    INT4   (1/2 + 40u)/7 a + eta        INT4A  (hi/2 - lo/2)(1/15 + 32u) + 2uM + 3eta
    INT8   (1/2 + 640u)/127 a + eta     INT8A  (hi/2 - lo/2)(1/255 + 32u) + 2uM + 3eta
    INT16  (1/2 + 163840u)/32767 a + eta    RAW, ZERO, and a symmetric block with a = 0: 0
    DELTA  s (1/2 + u + 2^-50) + a (u + 5 2^-53) + eta
    (M = max(|lo|, |hi|); INT16: int8's derivation with 32767 levels)

Piece layout (byte offsets; each region starts 8-byte aligned, so the
typed views of the whole buffer can read it):

    0    int64    bytes used (what is sent, then the trailer: bound.TRAILER;
                  the receive buffer is larger)
    8    int64    where the headers start
    16   float64  the largest per-value bound of the piece's blocks
    24   uint8    one tag per block, padded to 8
    ..   payloads in block order, each padded to 8 bytes
    ..   headers in block order (1 to 3 per block, none for ZERO/RAW/FLAG)

The headers follow the payloads so that one pass writes both: they are
collected in ``heads`` and copied behind the payloads at the end.

Only SUM with rounding to nearest: the mode quantizes nothing else.  The
kernels take the buffer as several typed views (u8, i8, i16, acc, i64,
f64) of the same bytes; the many-input kernels take 2-D views, one row
per received message.
"""
import numpy as np
from numba import njit

from equarx_mpi.kernels import affine, delta, int4, int8
from equarx_mpi.kernels.common import (
    CACHE,
    KERNEL,
    ROUND_NEAREST,
    abs_bits,
    acc_block,
    as_acc,
    from_abs_bits,
    from_order_key,
    order_key,
    out_limit,
    readonly,
    store,
    wide_tiny_lift,
    wide_vectors,
)

ZERO, INT4, INT4A, INT8, INT8A, INT16, RAW, FLAG, DELTA = range(9)
L16 = 32767
META = 24                      # bytes before the tags
SAFE = delta.SAFE
_U = np.uint64


@njit(inline='always', **CACHE)
def pad8(n):
    return (n + 7) & ~7


@njit(inline='always', **CACHE)
def n_heads(tag):
    if tag == INT4 or tag == INT8 or tag == INT16:
        return 1
    if tag == INT4A or tag == INT8A:
        return 2
    if tag == DELTA:
        return delta.HEADS
    return 0


@njit(inline='always', **CACHE)
def payload(tag, m, asz, u8, pay):
    """Payload bytes of an m-value block at byte ``pay``, padded to 8."""
    if tag == DELTA:
        return delta.payload(u8, pay, m)
    return pay_bytes(tag, m, asz)


@njit(inline='always', **CACHE)
def pay_bytes(tag, m, asz):
    """Payload bytes of an m-value block of a fixed-size tag, padded to 8."""
    if tag == INT4 or tag == INT4A:
        return pad8((m + 1) >> 1)
    if tag == INT8 or tag == INT8A:
        return pad8(m)
    if tag == INT16:
        return pad8(2 * m)
    if tag == RAW:
        return pad8(m * asz)
    return 0


@njit(inline='always', **CACHE)
def sym_bound(a, levels, c, u, eta):
    """formats._Symmetric's bound (the same float64 expression); a zero
    header (a block of signed zeros) decodes exactly."""
    if a == 0:
        return 0.0
    return (0.5 + c * u) / levels * a + eta


@njit(inline='always', **CACHE)
def aff_bound(lo, hi, levels, u, eta):
    """formats.AffineBlock's bound (the same float64 expression)."""
    return (hi * 0.5 - lo * 0.5) * (1.0 / levels + 32 * u) + 2 * u * max(-lo, hi) + 3 * eta


@njit(inline='always', **CACHE)
def tag_magnitude(tag, h0, h1):
    """A bound on |x| of the values of a block (not RAW) from its headers."""
    if tag == INT4A or tag == INT8A:
        return max(-h0, h1)
    if tag == INT4 or tag == INT8 or tag == INT16:
        return h0
    if tag == DELTA:
        return h1
    return 0.0


@njit(inline='always', **CACHE)
def tag_bound(tag, h0, h1, u, eta):
    """The per-value bound of a block (float64 headers h0, h1)."""
    if tag == INT4:
        return sym_bound(h0, 7.0, 40.0, u, eta)
    if tag == INT4A:
        return aff_bound(h0, h1, 15.0, u, eta)
    if tag == INT8:
        return sym_bound(h0, 127.0, 640.0, u, eta)
    if tag == INT8A:
        return aff_bound(h0, h1, 255.0, u, eta)
    if tag == INT16:
        return sym_bound(h0, 32767.0, 163840.0, u, eta)
    if tag == DELTA:
        return delta.bound(h0, h1, u, eta)
    return 0.0


@njit(inline='always', **CACHE)
def choose(a, lo, hi, room, u, eta):
    """The cheapest tag whose bound b keeps b * SAFE <= room, for a finite
    nonzero block with largest magnitude a and extremes lo, hi (float64)."""
    if tag_bound(INT4, a, 0.0, u, eta) * SAFE <= room:
        return INT4
    if tag_bound(INT4A, lo, hi, u, eta) * SAFE <= room:
        return INT4A
    if tag_bound(INT8, a, 0.0, u, eta) * SAFE <= room:
        return INT8
    if tag_bound(INT8A, lo, hi, u, eta) * SAFE <= room:
        return INT8A
    if tag_bound(INT16, a, 0.0, u, eta) * SAFE <= room:
        return INT16
    return RAW


@njit(inline='always', **CACHE)
def _stats(vals, off, m):
    """(largest magnitude bits, min key, max key) of vals[off:off+m] under
    IEEE total order (common.order_key)."""
    mx = abs_bits(as_acc(vals, 0))
    kmin = order_key(as_acc(vals, np.inf))
    kmax = order_key(as_acc(vals, -np.inf))
    for j in range(m):
        v = vals[_U(off + j)]
        mx = max(mx, abs_bits(v))
        key = order_key(v)
        kmin = min(kmin, key)
        kmax = max(kmax, key)
    return mx, kmin, kmax


@njit(inline='always', **CACHE)
def _emit16(vals, off, m, a, heads, h, codes, at):
    """INT16: heads[h] = a, codes[at:at+m] = rint(x * fl(32767 / a)) (a > 0
    finite; values and a lifted below TINY, as int8 does)."""
    heads[h] = a
    tiny, lift = wide_tiny_lift(a)
    if not a < tiny:
        lift = as_acc(heads, 1)
    r = as_acc(heads, L16) / (a * lift)
    for j in range(m):
        codes[_U(at + j)] = np.int16(np.rint((vals[_U(off + j)] * lift) * r))


# The per-block encoders are the other formats' own helpers (common.HELPER),
# compiled once per element type; emit_block is called, not inlined, by
# both kernels (docs/PERFORMANCE.md "Cold start").

@njit(**KERNEL)
def emit_block(vals, off, m, room, u, eta, u8, i8, i16, acc, pay, heads, nh, tcodes, qs, predict):
    """Encode vals[off:off+m] (accumulation type) with the cheapest tag that
    fits, its payload at byte ``pay``, its headers at heads[nh:]: the
    cheapest fixed-size tag, or DELTA where its estimated bytes are
    delta.SAVE per value fewer (a block that cannot gain goes as before;
    none with ``predict`` 0, the
    ablation of wire/mixed.py's PREDICT).  qs: 2 * block int64.
    Returns (tag, bound of the block or -1 for FLAG, next payload byte,
    next head)."""
    wide_vectors()
    asz = acc.itemsize
    mx, kmin, kmax = _stats(vals, off, m)
    zero = as_acc(acc, 0)
    if mx >= abs_bits(as_acc(acc, np.inf)):
        return FLAG, -1.0, pay, nh
    if mx == abs_bits(zero):
        if kmin >= order_key(zero):
            return ZERO, 0.0, pay, nh
        tag = INT4                  # -0.0 inside: int4's zero block keeps every sign
    else:
        a = np.float64(from_abs_bits(mx, zero))
        lo = np.float64(from_order_key(kmin, zero))
        hi = np.float64(from_order_key(kmax, zero))
        tag = choose(a, lo, hi, room, u, eta)
        # DELTA only for a whole group or more (its payload then fits RAW's
        # room) and where it could save SAVE bytes per value (its estimate
        # is a byte per group or more): int8 and int4 blocks skip it all
        fixed = pay_bytes(tag, m, asz) + n_heads(tag) * asz
        least = (m + delta.GROUP - 1) // delta.GROUP + delta.HEADS * asz + m * delta.SAVE
        s = 0.0
        if predict and m >= delta.GROUP and least <= fixed:
            s = delta.step(a, room, u, eta, acc)
        if s > 0 and (delta.estimate(delta.spread(vals, off, m), s, m) + delta.HEADS * asz
                      + m * delta.SAVE <= fixed):
            size = delta.emit(vals, off, m, s, a, heads, nh, u8, pay, qs)
            return (DELTA, delta.bound(np.float64(heads[nh]), a, u, eta), pay + size,
                    nh + delta.HEADS)
    zero_i = np.int64(0)
    if tag == INT4:
        int4.emit(vals, off, m, mx, heads, nh, i8[pay:], zero_i, np.int64(ROUND_NEAREST),
                  np.uint64(0), zero_i, tcodes)
    elif tag == INT8:
        int8.emit(vals, off, m, mx, heads, nh, i8[pay:], zero_i, None, np.uint64(0), zero_i,
                  tcodes)
    elif tag == INT4A or tag == INT8A:
        affine.emit(vals, off, m, mx, heads[nh:], zero_i, u8[pay:], zero_i,
                    np.int64(ROUND_NEAREST), np.uint64(0), np.int64(15 if tag == INT4A else 255),
                    tcodes)
    elif tag == INT16:
        _emit16(vals, off, m, from_abs_bits(mx, zero), heads, nh, i16, pay >> 1)
    else:                       # RAW
        at = pay // asz
        for j in range(m):
            acc[_U(at + j)] = vals[_U(off + j)]
    h0 = np.float64(heads[nh]) if n_heads(tag) > 0 else 0.0
    h1 = np.float64(heads[nh + 1]) if n_heads(tag) > 1 else 0.0
    return tag, tag_bound(tag, h0, h1, u, eta), pay + pay_bytes(tag, m, asz), nh + n_heads(tag)


@njit(**KERNEL)
def decode_block(tag, u8, i8, i16, acc, pay, hd, m, dst):
    """dst[:m] = the values of a block (not FLAG) whose payload starts at
    byte ``pay`` and headers at acc[hd:], in the accumulation type."""
    wide_vectors()
    zero_i = np.int64(0)
    if tag == ZERO:
        for j in range(m):
            dst[j] = 0
    elif tag == INT4:
        int4.decode_block(acc[hd:], i8[pay:], zero_i, zero_i, m, zero_i, dst, zero_i)
    elif tag == INT8:
        int8.decode_block(acc[hd:], i8[pay:], zero_i, zero_i, m, zero_i, dst, zero_i)
    elif tag == INT16:
        a = acc[hd]
        k = as_acc(acc, 1) / as_acc(acc, L16)
        at = pay >> 1
        for j in range(m):
            dst[j] = (as_acc(acc, i16[_U(at + j)]) * k) * a
    elif tag == INT4A or tag == INT8A:
        affine.decode_block(acc[hd:], u8[pay:], zero_i, zero_i, m,
                            np.int64(15 if tag == INT4A else 255), dst, zero_i)
    elif tag == DELTA:
        delta.decode(u8, pay, acc, hd, m, dst)
    else:
        at = pay // acc.itemsize
        for j in range(m):
            dst[j] = acc[_U(at + j)]


@njit(inline='always', **CACHE)
def _finish(u8, acc, i64, f64, pay, heads, nh, worst):
    """Copy the headers behind the payloads and write the piece's meta;
    returns the bytes used."""
    asz = acc.itemsize
    at = pay // asz
    for j in range(nh):
        acc[_U(at + j)] = heads[j]
    used = pay + pad8(nh * asz)
    i64[0] = used
    i64[1] = pay
    f64[2] = worst
    return used


@njit(**KERNEL)
def mx_encode(src, u8, i8, i16, acc, i64, f64, block, room, u, eta, scratch, heads, qs, predict):
    """Encode src (one piece) with per-value budget ``room``; scratch holds
    3 * block values of the accumulation type, heads 3 per block, qs 2 *
    block int64.  Returns the bytes used."""
    wide_vectors()
    n = src.size
    nb = (n + block - 1) // block
    pay = META + pad8(nb)
    nh = 0
    worst = 0.0
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        vals, off = acc_block(src, lo, m, scratch)
        tag, bnd, pay, nh = emit_block(readonly(vals), np.int64(off), m, room, u, eta, u8, i8, i16,
                                       acc, pay, heads, np.int64(nh), scratch[block:], qs,
                                       predict)
        u8[META + b] = tag
        worst = max(worst, bnd)
    return _finish(u8, acc, i64, f64, pay, heads, nh, worst)


@njit(**KERNEL)
def block_magnitude(tag, u8, acc, pay, hd, m):
    """A bound on |x| of block's values (float64): from its headers, or
    the largest raw value."""
    if tag == RAW:
        at = pay // acc.itemsize
        mx = abs_bits(as_acc(acc, 0))
        for j in range(m):
            mx = max(mx, abs_bits(acc[_U(at + j)]))
        return np.float64(from_abs_bits(mx, as_acc(acc, 0)))
    h0 = np.float64(acc[hd]) if n_heads(tag) > 0 else 0.0
    h1 = np.float64(acc[hd + 1]) if n_heads(tag) > 1 else 0.0
    return tag_magnitude(tag, h0, h1)


@njit(**KERNEL)
def mx_decode(u8, i8, i16, acc, i64, f64, out, block, scratch, skipped):
    """out = D(piece); FLAG blocks and blocks whose magnitude bound
    (block_magnitude) reaches out's overflow limit are skipped (left
    untouched), as piece_error leaves them out.  Returns their number;
    their indices are in skipped[:number]."""
    wide_vectors()
    n = out.size
    nb = (n + block - 1) // block
    pay = META + pad8(nb)
    hd = i64[1] // acc.itemsize
    limit = np.float64(out_limit(out))
    flagged = 0
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        tag = u8[META + b]
        if tag == FLAG or not block_magnitude(tag, u8, acc, pay, hd, m) < limit:
            skipped[flagged] = b           # (a FLAG block has no payload, no header)
            flagged += 1
        else:
            decode_block(tag, u8, i8, i16, acc, pay, hd, m, scratch)
            for j in range(m):
                store(out, _U(lo + j), scratch[j])
        pay += payload(tag, m, acc.itemsize, u8, pay)
        hd += n_heads(tag)
    return flagged


@njit(**KERNEL)
def mx_block_errors(u8, acc, i64, n, block, u, eta, q, mag):
    """Per block: q[b] bounds |x - D(Q(x))| and mag[b] |x| of its values
    (FLAG: q 0, mag Inf), the bounds formats.Mixed reports."""
    nb = (n + block - 1) // block
    pay = META + pad8(nb)
    hd = i64[1] // acc.itemsize
    for b in range(nb):
        m = min(block, n - b * block)
        tag = u8[META + b]
        if tag == FLAG:
            q[b] = 0.0
            mag[b] = np.inf
            continue
        h0 = np.float64(acc[hd]) if n_heads(tag) > 0 else 0.0
        h1 = np.float64(acc[hd + 1]) if n_heads(tag) > 1 else 0.0
        q[b] = tag_bound(tag, h0, h1, u, eta)
        mag[b] = block_magnitude(tag, u8, acc, pay, hd, m)
        pay += payload(tag, m, acc.itemsize, u8, pay)
        hd += n_heads(tag)
