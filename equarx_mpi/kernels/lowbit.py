"""The low-bit blocks int2, int3, int5 and int6 (docs/FORMAT.md "int3 and
int2", "int5 and int6"): int4's format with L = 1, 3, 15 or 31 levels
each side, packed tighter; one set of kernels for all (``levels`` = L, a
kernel argument).  Per block of B values (B a multiple of 8; the last
block of a piece may be short), in the accumulation type A:

    header  a  = max |x|                     in A
    code    c  = rint(x * r),  r = L / a     in [-L, L], ties to even (r
                                             rounded once, exponent unbounded)
    decoded x' = (c * k) * a,  k = 1 / L     (k rounded once to A)

Codes are W-bit two's complement, packed in groups of G codes in GB bytes
(_shape): int2 (W 2) 4 codes in 1 byte, int3 (W 3) 8 in 3, int5 (W 5) 8
in 5, int6 (W 6) 4 in 3; code j of a group sits at bits W*j of the
group's little-endian word, whose type follows the group (_word, _field):
32 bits for int2, int3 and int6, 64 for int5's 40-bit group.  A piece's
codes take ceil(W n / 8) bytes (a short last group only the bytes it
needs, its unused high bits 0).  fl(L * fl(1/L)) == 1 in float32 and
float64 for L = 3, 15 and 31 (tested; k = 1 for L = 1), so code +-L
decodes to exactly +-a.  Zeros, flagged blocks, the 16-bit output limit
and directed rounding work as in int4 (kernels/int4.py); no stochastic
rounding.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels import loops
from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    KERNEL,
    ROUND_NEAREST,
    abs_bits,
    as_acc,
    from_abs_bits,
    sign_code,
    store,
    wide_tiny_lift,
    wide_vectors,
)
from equarx_mpi.kernels.stochastic import symmetric_code as _code

_U = np.uint64


def _word(v, like):
    """v as the group word's type: like's, uint32 or uint64."""


@overload(_word, jit_options=CACHE)
def _ov_word(v, like):
    if like == types.uint32:
        return lambda v, like: np.uint32(v)
    return lambda v, like: np.uint64(v)


def _field(word, i, W, like):
    """Code i of the word (its W bits at W*i), sign-extended: shifted to
    the top of a signed integer of like's width (the group's word type)
    and back.  numba types the word itself uint64 either way (it widens
    uint32 shifts); 32-bit sign extension keeps int3's decode as fast as
    before int5 came (a cast of the word back to uint32 at every step cost
    it 5%)."""


@overload(_field, jit_options=CACHE)
def _ov_field(word, i, W, like):
    if like == types.uint32:
        return lambda word, i, W, like: (np.int32(word << np.uint32(32 - W * (i + 1)))
                                         >> np.int32(32 - W))
    return lambda word, i, W, like: (np.int64(word << np.uint64(64 - W * (i + 1)))
                                     >> np.int64(64 - W))


@njit(inline='always', **CACHE)
def _group(vals, at, cnt, W, mode, lift, r, a, k, L, rmode, word):
    """The word of codes of vals[at:at+cnt], code i at bits W*i (word: a
    zero of the word's type); mode 0: the signs of an all-zero block, 1: to
    nearest, 2: directed."""
    for i in range(cnt):
        x = vals[_U(at + i)]
        if mode == 0:                                # zeros keep their sign: -0.0 -> -1
            c = np.int32(sign_code(x))
        elif mode == 1:
            c = np.int32(np.rint((x * lift) * r))
        else:
            c = np.int32(_code(x, (x * lift) * r, a, k, L, rmode, np.uint64(0), 0))
        word |= _word(np.uint32(c) & np.uint32((1 << W) - 1), word) << _word(W * i, word)
    return word


@njit(inline='always', **CACHE)
def _put(codes, at, word, nbytes):
    for t in range(nbytes):
        codes[_U(at + t)] = np.uint8((word >> _word(8 * t, word)) & _word(255, word))


@njit(inline='always', **CACHE)
def _pack(vals, off, m, codes, lo, W, G, GB, mode, lift, r, a, k, L, rmode, zero):
    """Codes of vals[off:off+m] into codes from value lo (a group's start)
    on, in groups of G codes of W bits in GB bytes (constants where the
    group loops should unroll), in words of zero's type."""
    at = (lo // G) * GB
    full = m // G
    for g in range(full):
        _put(codes, at + g * GB,
             _group(vals, off + g * G, G, W, mode, lift, r, a, k, L, rmode, zero), GB)
    rest = m - full * G
    if rest:
        _put(codes, at + full * GB,
             _group(vals, off + full * G, rest, W, mode, lift, r, a, k, L, rmode, zero),
             (W * rest + 7) // 8)


@njit(inline='always', **CACHE)
def _shape(levels):
    """(W bits a code, G codes a group, GB bytes a group) for L = levels."""
    if levels == 3:
        return 3, 8, 3
    if levels == 15:
        return 5, 8, 5
    if levels == 31:
        return 6, 4, 3
    return 2, 4, 1


@njit(**HELPER)
def emit(vals, off, m, max_u, header, b, codes, lo, rmode, stream, levels, tail):
    """Quantize vals[off:off+m] (accumulation type, largest magnitude bits
    max_u) into header[b] and the codes of values lo..lo+m-1 (lo a multiple
    of the group); the loops' emit (stream, tail unused)."""
    wide_vectors()
    zero, one = as_acc(header, 0), as_acc(header, 1)
    if max_u >= abs_bits(as_acc(header, np.inf)):
        header[b] = np.inf                       # flagged: Inf or NaN inside, codes 0
        W = _shape(levels)[0]
        at = _U(W * lo // 8)
        for j in range((W * m + 7) // 8):
            codes[at + _U(j)] = 0
        return
    L = as_acc(header, levels)
    k = one / L
    W, G, GB = _shape(levels)
    if max_u == abs_bits(zero):
        _pack(vals, off, m, codes, lo, W, G, GB, 0, one, one, zero, k, L, rmode, _U(0))
        header[b] = zero
        return
    a = from_abs_bits(max_u, zero)
    tiny, lift = wide_tiny_lift(zero)
    if not a < tiny:
        lift = one
    r = L / (a * lift)
    # to nearest (the sums) with each width's constants and word type, so
    # its group loops unroll; directed rounding (MAX/MIN) and zero blocks
    # with the shapes as variables and 64-bit words: fewer copies to compile
    # (docs/PERFORMANCE.md "Cold start")
    if rmode != ROUND_NEAREST:
        _pack(vals, off, m, codes, lo, W, G, GB, 2, lift, r, a, k, L, rmode, _U(0))
    elif levels == 3:
        _pack(vals, off, m, codes, lo, 3, 8, 3, 1, lift, r, a, k, L, rmode, np.uint32(0))
    elif levels == 15:
        _pack(vals, off, m, codes, lo, 5, 8, 5, 1, lift, r, a, k, L, rmode, _U(0))
    elif levels == 31:
        _pack(vals, off, m, codes, lo, 6, 4, 3, 1, lift, r, a, k, L, rmode, np.uint32(0))
    else:
        _pack(vals, off, m, codes, lo, 2, 4, 1, 1, lift, r, a, k, L, rmode, np.uint32(0))
    header[b] = a


@njit(inline='always', **CACHE)
def _ungroup(codes, c0, nbytes, cnt, W, k, a, dst, at, like, zero):
    """dst[at:at+cnt] = the decoded codes of the group at codes[c0:] (zero:
    of the word's type)."""
    word = zero
    for t in range(nbytes):
        word |= _word(codes[_U(c0 + t)], zero) << _word(8 * t, zero)
    for i in range(cnt):
        c = _field(word, i, W, zero)
        store(dst, _U(at + i), (as_acc(like, c) * k) * a)


@njit(inline='always', **CACHE)
def _unpack(header, codes, b, lo, m, levels, dst, at, W, G, GB, zero):
    """dst[at:at+m] = D(block b); W, G, GB, zero as in _pack."""
    k = as_acc(header, 1) / as_acc(header, levels)
    a = header[b]
    base = (lo // G) * GB
    full = m // G
    for g in range(full):
        _ungroup(codes, base + g * GB, GB, G, W, k, a, dst, at + g * G, header, zero)
    rest = m - full * G
    if rest:
        _ungroup(codes, base + full * GB, (W * rest + 7) // 8, rest, W, k, a, dst,
                 at + full * G, header, zero)


@njit(inline='always', **CACHE)
def decode_block(header, codes, b, lo, m, levels, dst, at):
    if levels == 3:
        _unpack(header, codes, b, lo, m, levels, dst, at, 3, 8, 3, np.uint32(0))
    elif levels == 15:
        _unpack(header, codes, b, lo, m, levels, dst, at, 5, 8, 5, _U(0))
    elif levels == 31:
        _unpack(header, codes, b, lo, m, levels, dst, at, 6, 4, 3, np.uint32(0))
    else:
        _unpack(header, codes, b, lo, m, levels, dst, at, 2, 4, 1, np.uint32(0))


@njit(inline='always', **CACHE)
def _head(header, codes, b, lo, m, levels, scratch):
    """Decodes the block into scratch, then the loop reduces."""
    decode_block(header, codes, b, lo, m, levels, scratch, np.int64(0))
    return header[b]


@njit(**HELPER)
def _reduce(own, header, codes, b, lo, m, op, levels, scratch):
    """loops.reduce_block with this format's steps."""
    return loops.reduce_block(loops.skip_magnitude, _head, loops.scratch_value, own, header, codes,
                              b, lo, m, op, levels, scratch)


@njit(**KERNEL)
def lb_encode(src, header, codes, block, scratch, rmode, levels):
    """(header, codes) = Q(src) with L = levels (1: int2, 3: int3, 15:
    int5, 31: int6)."""
    loops.encode(loops.block_values, emit, src, header, codes, block, scratch, rmode, _U(0),
                 np.int64(levels))


@njit(**KERNEL)
def lb_decode(header, codes, out, block, levels, skipped):
    """loops.decode: out = D(header, codes)."""
    return loops.decode(loops.skip_magnitude, decode_block, header, codes, out, block,
                        np.int64(levels), skipped)


@njit(**KERNEL)
def lb_decode_reduce(own, header, codes, out, block, levels, op, scratch, skipped):
    """loops.decode_reduce: out = own (op) D(header, codes)."""
    return loops.decode_reduce(_reduce, own, header, codes, out, block, op, np.int64(levels),
                               scratch, skipped)


@njit(**KERNEL)
def lb_decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, levels, op, scratch, rmode):
    """loops.decode_reduce_encode: (h_out, c_out) = Q(own (op) D(h_in, c_in))."""
    loops.decode_reduce_encode(_reduce, emit, own, h_in, c_in, h_out, c_out, block, op,
                               np.int64(levels), scratch, rmode, _U(0))
