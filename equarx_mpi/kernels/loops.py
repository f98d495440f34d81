"""The block loops of the block formats (int8, int4, fp8, affine), each
written once: encode, decode, decode_reduce, decode_reduce_encode and the
reduce of one block (its tail: own (op) decoded, the largest magnitude,
the MAX/MIN flag rule of kernels/int8.py).

A format plugs in its per-block steps, passed as the loops' first
arguments by the format's kernels:

    values(src, lo, m, scratch) -> (vals, off, max_u)
        src[lo:lo+m] in the accumulation type (src itself, or a converted
        copy in scratch) and, for an emit that uses it, their largest
        magnitude bits (block_values)
    emit(vals, off, m, max_u, header, b, codes, lo, rmode, stream, levels, tail)
        quantize vals[off:off+m] as block b of a piece (values lo..lo+m-1);
        max_u at least Inf's bits: flag the block.  tail: scratch past the
        first block.
    skip(header, b, limit) -> whether block b is flagged or reaches limit
    decode(header, codes, b, lo, m, levels, dst, at)
        dst[at:at+m] = D(block b), stored in dst's type
    head(header, codes, b, lo, m, levels, scratch) -> h
        what ``value`` needs of block b (a format that decodes a block at a
        time decodes it into scratch here)
    value(header, codes, h, i, j, scratch)
        value i of the piece (j of its block) decoded, accumulation type
    reduce(own, header, codes, b, lo, m, op, levels, scratch) -> max_u
        the format's own compiled ``reduce_block`` (below) with its steps

``levels`` is the kernels' levels argument (affine's 15 or 255; 0 for the
others).  The loops are inline='always': numba inlines them into the
calling kernel before typing, so a kernel compiles as one function, as when
each format wrote its loops out, and numba's disk cache, keyed on the
kernel (whose arguments are arrays), hits in the next process.  A compiled
function taking the steps as arguments, or kernels made in a factory, would
recompile in every new process (numba 0.68.1).
docs/results/kernels-issue37-before-after.txt measures rates and cold start.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels import common

_U = np.uint64


def block_values(src, lo, m, scratch):
    """The ``values`` step of a format whose emit takes the largest
    magnitude: src[lo:lo+m] in the accumulation type and the bits of their
    largest magnitude, found while converting."""


@overload(block_values, jit_options=common.CACHE, inline='always')
def _block_values(src, lo, m, scratch):
    if src.dtype == types.float32 or src.dtype == types.float64:
        def direct(src, lo, m, scratch):
            mx = common.abs_bits(common.as_acc(scratch, 0))
            for j in range(m):
                mx = max(mx, common.abs_bits(src[_U(lo + j)]))
            return src, lo, mx
        return direct

    def converted(src, lo, m, scratch):
        mx = common.abs_bits(common.as_acc(scratch, 0))
        for j in range(m):
            v = common.load(src, _U(lo + j))
            scratch[j] = v
            mx = max(mx, common.abs_bits(v))
        return scratch, 0, mx
    return converted


@njit(inline='always', **common.CACHE)
def encode(values, emit, src, header, codes, block, scratch, rmode, stream, levels):
    """(header, codes) = Q(src), block by block."""
    common.wide_vectors()
    n = src.size
    for b in range((n + block - 1) // block):
        lo = b * block
        m = min(block, n - lo)
        vals, off, max_u = values(src, lo, m, scratch)
        emit(common.readonly(vals), np.int64(off), m, max_u, header, b, codes, lo, rmode, stream,
             levels, scratch[block:])


@njit(inline='always', **common.CACHE)
def decode(skip, decode_block, header, codes, out, block, levels, skipped):
    """out = D(header, codes); flagged blocks (and blocks too large for
    out's type) are skipped.  Returns their number; their indices are in
    skipped[:number]."""
    common.wide_vectors()
    n = out.size
    limit = common.out_limit(out)
    flagged = 0
    for b in range((n + block - 1) // block):
        lo = b * block
        m = min(block, n - lo)
        if skip(header, b, limit):
            skipped[flagged] = b
            flagged += 1
            continue
        decode_block(header, codes, b, lo, m, levels, out, lo)
    return flagged


@njit(inline='always', **common.CACHE)
def reduce_block(skip, head, value, own, header, codes, b, lo, m, op, levels, scratch):
    """scratch[:m] = own[lo:lo+m] (op) D(block b); returns the largest
    magnitude bits (at least those of Inf for a flagged block, scratch
    unset, and for a MAX or MIN whose own values hold Inf or NaN: MIN(+Inf,
    x) is x, and the block must stay flagged).  A format compiles it once
    as its ``reduce`` step (kernels.common.HELPER), which both reducing
    loops call."""
    common.wide_vectors()
    inf_u = common.abs_bits(common.as_acc(scratch, np.inf))
    if skip(header, b, common.as_acc(scratch, np.inf)):
        return inf_u
    h = head(header, codes, b, lo, m, levels, scratch)
    mx = common.abs_bits(common.as_acc(scratch, 0))
    if op == common.OP_SUM:
        for j in range(m):
            i = _U(lo + j)
            v = common.load(own, i) + value(header, codes, h, i, j, scratch)
            scratch[j] = v
            mx = max(mx, common.abs_bits(v))
    else:
        mo = mx
        for j in range(m):
            i = _U(lo + j)
            x = common.load(own, i)
            v = common.reduce2(op, x, value(header, codes, h, i, j, scratch))
            scratch[j] = v
            mx = max(mx, common.abs_bits(v))
            mo = max(mo, common.abs_bits(x))
        if mo >= inf_u:
            return mo
    return mx


@njit(inline='always', **common.CACHE)
def decode_reduce(reduce, own, header, codes, out, block, op, levels, scratch, skipped):
    """out = own (op) D(header, codes), at full precision; blocks whose
    input is flagged or whose result does not fit out are skipped (out may
    be own, and stays the input there).  Returns their number; their
    indices are in skipped[:number]."""
    common.wide_vectors()
    n = own.size
    limit_u = common.abs_bits(common.out_limit(out))
    flagged = 0
    for b in range((n + block - 1) // block):
        lo = b * block
        m = min(block, n - lo)
        max_u = reduce(common.readonly(own), header, codes, b, lo, m, op, levels, scratch)
        flagged = common.keep_or_skip(out, lo, m, scratch, max_u, limit_u, b, skipped, flagged)
    return flagged


@njit(inline='always', **common.CACHE)
def decode_reduce_encode(reduce, emit, own, h_in, c_in, h_out, c_out, block, op, levels, scratch,
                         rmode, stream):
    """(h_out, c_out) = Q(own (op) D(h_in, c_in)): the fused ring hop, one
    pass per block; in place allowed (a block is read whole into scratch
    before it is written).  A flagged input block, or a result holding Inf
    or NaN, gives a flagged output block."""
    common.wide_vectors()
    n = own.size
    for b in range((n + block - 1) // block):
        lo = b * block
        m = min(block, n - lo)
        max_u = reduce(common.readonly(own), h_in, c_in, b, lo, m, op, levels, scratch)
        emit(common.readonly(scratch), np.int64(0), m, max_u, h_out, b, c_out, lo, rmode, stream,
             levels, scratch[block:])


@njit(inline='always', **common.CACHE)
def skip_magnitude(header, b, limit):
    """The ``skip`` step of a format whose header is the block's largest
    magnitude (Inf when flagged)."""
    return not abs(header[b]) < limit


@njit(inline='always', **common.CACHE)
def scratch_value(header, codes, h, i, j, scratch):
    """The ``value`` step of a format whose ``head`` decodes the block into
    scratch."""
    return scratch[j]


@njit(inline='always', **common.CACHE)
def fold(src, t, lo, m, op, scratch):
    """Input t of a many-input kernel's rank-order reduction:
    scratch[:m] = src[lo:lo+m] for the first (t = 0), else scratch (op)
    src[lo:lo+m]."""
    if t == 0:
        for j in range(m):
            scratch[j] = common.load(src, _U(lo + j))
    elif op == common.OP_SUM:
        for j in range(m):
            scratch[j] = scratch[j] + common.load(src, _U(lo + j))
    else:
        for j in range(m):
            scratch[j] = common.reduce2(op, scratch[j], common.load(src, _U(lo + j)))
