"""The block loops of the block formats (int8, int4, fp8, affine), each
written once: encode, decode, decode_reduce, decode_reduce_encode and the
reduce of one block (its tail: own (op) decoded, the largest magnitude,
the MAX/MIN flag rule of kernels/int8.py).

A format plugs in at compile time.  Its module defines its per-block steps
and registers them under a code of its own (``register``):

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

``levels`` is the kernels' levels argument (affine's 15 or 255; 0 for the
others).  The format's kernels are module-level functions that call these
loops with the code, a module global: numba types a global int as a
literal, so the loop's overload (prefer_literal) takes the format's steps
while compiling, and numba's disk cache, keyed on the calling kernel, hits
in the next process.  Passing the steps as arguments of a compiled
function, or making kernels in a factory, recompiles in every new process
(numba 0.68.1).  The price: on a cold cache each kernel signature compiles
one function more (the loop, apart from the kernel that calls it);
docs/results/kernels-issue37-before-after.txt.
"""
from types import SimpleNamespace

import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    KERNEL,
    OP_SUM,
    abs_bits,
    as_acc,
    keep_or_skip,
    load,
    out_limit,
    readonly,
    reduce2,
    wide_vectors,
)

_U = np.uint64
_FORMATS = {}
#: The loops' overloads are closures over a format's steps, left out of
#: numba's disk cache (the kernels calling them are cached whole) and not
#: inline='always': numba compiles an overload's implementation whole even
#: when it then inlines it, so that would compile every loop twice.
_LOOP = dict(jit_options={k: v for k, v in KERNEL.items() if k != "cache"})
_BLOCK = {k: v for k, v in HELPER.items() if k != "cache"}


def register(code, **steps):
    """Make ``code`` (an int no other format uses) name these steps."""
    if code in _FORMATS:
        raise ValueError(f"format code {code} is taken")
    _FORMATS[code] = SimpleNamespace(**steps)


def _steps(fmt):
    if isinstance(fmt, types.IntegerLiteral):
        return _FORMATS.get(fmt.literal_value)
    return None


def block_values(src, lo, m, scratch):
    """The ``values`` step of a format whose emit takes the largest
    magnitude: src[lo:lo+m] in the accumulation type and the bits of their
    largest magnitude, found while converting."""


@overload(block_values, jit_options=CACHE, inline='always')
def _block_values(src, lo, m, scratch):
    if src.dtype == types.float32 or src.dtype == types.float64:
        def direct(src, lo, m, scratch):
            mx = abs_bits(as_acc(scratch, 0))
            for j in range(m):
                mx = max(mx, abs_bits(src[_U(lo + j)]))
            return src, lo, mx
        return direct

    def converted(src, lo, m, scratch):
        mx = abs_bits(as_acc(scratch, 0))
        for j in range(m):
            v = load(src, _U(lo + j))
            scratch[j] = v
            mx = max(mx, abs_bits(v))
        return scratch, 0, mx
    return converted


def encode(fmt, src, header, codes, block, scratch, rmode, stream, levels):
    """(header, codes) = Q(src), block by block."""


@overload(encode, prefer_literal=True, **_LOOP)
def _encode(fmt, src, header, codes, block, scratch, rmode, stream, levels):
    s = _steps(fmt)
    if s is None:
        return None
    values, emit = s.values, s.emit

    def impl(fmt, src, header, codes, block, scratch, rmode, stream, levels):
        wide_vectors()
        n = src.size
        for b in range((n + block - 1) // block):
            lo = b * block
            m = min(block, n - lo)
            vals, off, max_u = values(src, lo, m, scratch)
            emit(readonly(vals), np.int64(off), m, max_u, header, b, codes, lo, rmode, stream,
                 levels, scratch[block:])
    return impl


def decode(fmt, header, codes, out, block, levels, skipped):
    """out = D(header, codes); flagged blocks (and blocks too large for
    out's type) are skipped.  Returns their number; their indices are in
    skipped[:number]."""


@overload(decode, prefer_literal=True, **_LOOP)
def _decode(fmt, header, codes, out, block, levels, skipped):
    s = _steps(fmt)
    if s is None:
        return None
    skip, decode_block = s.skip, s.decode

    def impl(fmt, header, codes, out, block, levels, skipped):
        wide_vectors()
        n = out.size
        limit = out_limit(out)
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
    return impl


def reduce_block(fmt, own, header, codes, b, lo, m, op, levels, scratch):
    """scratch[:m] = own[lo:lo+m] (op) D(block b); returns the largest
    magnitude bits (at least those of Inf for a flagged block, scratch
    unset, and for a MAX or MIN whose own values hold Inf or NaN: MIN(+Inf,
    x) is x, and the block must stay flagged)."""


@overload(reduce_block, prefer_literal=True, jit_options=_BLOCK)
def _reduce_block(fmt, own, header, codes, b, lo, m, op, levels, scratch):
    s = _steps(fmt)
    if s is None:
        return None
    skip, head, value = s.skip, s.head, s.value

    def impl(fmt, own, header, codes, b, lo, m, op, levels, scratch):
        wide_vectors()
        inf_u = abs_bits(as_acc(scratch, np.inf))
        if skip(header, b, as_acc(scratch, np.inf)):
            return inf_u
        h = head(header, codes, b, lo, m, levels, scratch)
        mx = abs_bits(as_acc(scratch, 0))
        if op == OP_SUM:
            for j in range(m):
                i = _U(lo + j)
                v = load(own, i) + value(header, codes, h, i, j, scratch)
                scratch[j] = v
                mx = max(mx, abs_bits(v))
        else:
            mo = mx
            for j in range(m):
                i = _U(lo + j)
                x = load(own, i)
                v = reduce2(op, x, value(header, codes, h, i, j, scratch))
                scratch[j] = v
                mx = max(mx, abs_bits(v))
                mo = max(mo, abs_bits(x))
            if mo >= inf_u:
                return mo
        return mx
    return impl


def decode_reduce(fmt, own, header, codes, out, block, op, levels, scratch, skipped):
    """out = own (op) D(header, codes), at full precision; blocks whose
    input is flagged or whose result does not fit out are skipped (out may
    be own, and stays the input there).  Returns their number; their
    indices are in skipped[:number]."""


@overload(decode_reduce, prefer_literal=True, **_LOOP)
def _decode_reduce(fmt, own, header, codes, out, block, op, levels, scratch, skipped):
    if _steps(fmt) is None:
        return None

    def impl(fmt, own, header, codes, out, block, op, levels, scratch, skipped):
        wide_vectors()
        n = own.size
        limit_u = abs_bits(out_limit(out))
        flagged = 0
        for b in range((n + block - 1) // block):
            lo = b * block
            m = min(block, n - lo)
            max_u = reduce_block(fmt, readonly(own), header, codes, b, lo, m, op, levels, scratch)
            flagged = keep_or_skip(out, lo, m, scratch, max_u, limit_u, b, skipped, flagged)
        return flagged
    return impl


def decode_reduce_encode(fmt, own, h_in, c_in, h_out, c_out, block, op, levels, scratch, rmode,
                         stream):
    """(h_out, c_out) = Q(own (op) D(h_in, c_in)): the fused ring hop, one
    pass per block; in place allowed (a block is read whole into scratch
    before it is written).  A flagged input block, or a result holding Inf
    or NaN, gives a flagged output block."""


@overload(decode_reduce_encode, prefer_literal=True, **_LOOP)
def _decode_reduce_encode(fmt, own, h_in, c_in, h_out, c_out, block, op, levels, scratch, rmode,
                          stream):
    s = _steps(fmt)
    if s is None:
        return None
    emit = s.emit

    def impl(fmt, own, h_in, c_in, h_out, c_out, block, op, levels, scratch, rmode, stream):
        wide_vectors()
        n = own.size
        for b in range((n + block - 1) // block):
            lo = b * block
            m = min(block, n - lo)
            max_u = reduce_block(fmt, readonly(own), h_in, c_in, b, lo, m, op, levels, scratch)
            emit(readonly(scratch), np.int64(0), m, max_u, h_out, b, c_out, lo, rmode, stream,
                 levels, scratch[block:])
    return impl


@njit(inline='always', **CACHE)
def skip_magnitude(header, b, limit):
    """The ``skip`` step of a format whose header is the block's largest
    magnitude (Inf when flagged)."""
    return not abs(header[b]) < limit


@njit(inline='always', **CACHE)
def scratch_value(header, codes, h, i, j, scratch):
    """The ``value`` step of a format whose ``head`` decodes the block into
    scratch."""
    return scratch[j]


@njit(inline='always', **CACHE)
def fold(src, t, lo, m, op, scratch):
    """Input t of a many-input kernel's rank-order reduction:
    scratch[:m] = src[lo:lo+m] for the first (t = 0), else scratch (op)
    src[lo:lo+m]."""
    if t == 0:
        for j in range(m):
            scratch[j] = load(src, _U(lo + j))
    elif op == OP_SUM:
        for j in range(m):
            scratch[j] = scratch[j] + load(src, _U(lo + j))
    else:
        for j in range(m):
            scratch[j] = reduce2(op, scratch[j], load(src, _U(lo + j)))
