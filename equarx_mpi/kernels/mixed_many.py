"""The two-shot owner's many-input kernels of the "mixed" format
(kernels/mixed.py, docs/FORMAT.md): the rank-order sum of its own values
and the P-1 received messages (2-D views, one row per message), encoded
per block within a room (allreduce) or stored at full precision
(reduce-scatter)."""
import numpy as np
from numba import njit

from equarx_mpi.kernels.common import (
    CACHE,
    KERNEL,
    OP_SUM,
    abs_bits,
    as_acc,
    out_limit,
    readonly,
    store,
    wide_vectors,
)
from equarx_mpi.kernels.loops import fold
from equarx_mpi.kernels.mixed import (
    FLAG,
    META,
    _finish,
    decode_block,
    emit_block,
    n_heads,
    pad8,
    payload,
)

_U = np.uint64


@njit(**KERNEL)
def _reduce_many_block(own, pos, u8, i8, i16, acc, cur, b, lo, m, scratch, tmp):
    """scratch[:m] = the rank-order sum of block b of own (in place pos) and
    of every message (row t, t - 1 past pos), advancing each row's cursor
    cur[t] = (payload byte, head index).  Returns the largest magnitude
    bits: those of Inf when a message's block is FLAG or the sum is not
    finite."""
    inf_u = abs_bits(as_acc(scratch, np.inf))
    rows = u8.shape[0]
    flag = False
    for t in range(rows + 1):
        if t == pos:
            fold(own, t, lo, m, OP_SUM, scratch)
            continue
        row = t if t < pos else t - 1
        tag = u8[row, META + b]
        pay, hd = cur[row, 0], cur[row, 1]
        if tag == FLAG:
            flag = True
            continue
        decode_block(tag, u8[row], i8[row], i16[row], acc[row], pay, hd, m, tmp)
        cur[row, 0] = pay + payload(tag, m, acc.itemsize, u8[row], pay)
        cur[row, 1] = hd + n_heads(tag)
        if t == 0:
            for j in range(m):
                scratch[j] = tmp[j]
        else:
            for j in range(m):
                scratch[j] = scratch[j] + tmp[j]
    if flag:
        return inf_u
    mx = abs_bits(as_acc(scratch, 0))
    for j in range(m):
        mx = max(mx, abs_bits(scratch[j]))
    return mx


@njit(inline='always', **CACHE)
def _start(u8, i64, acc, nb, cur):
    """Every row's cursor at its first block."""
    for row in range(u8.shape[0]):
        cur[row, 0] = META + pad8(nb)
        cur[row, 1] = i64[row, 1] // acc.itemsize


@njit(**KERNEL)
def mx_decode_reduce_encode_many(own, pos, u8, i8, i16, acc, i64, o8, oi8, oi16, oacc, oi64,
                                 of64, block, room, u, eta, scratch, heads, cur, qs, predict):
    """The two-shot owner: the rank-order sum of own and the messages,
    encoded per block with the cheapest tag whose bound b keeps b * SAFE
    <= room (tolerance.owner_room: what the senders' trailers left).  A
    block FLAG in any message or not finite ends FLAG.  Returns the bytes
    used.  scratch holds 4 * block values, heads 3 per block, cur 2 per
    message, qs 2 * block int64."""
    wide_vectors()
    n = own.size
    nb = (n + block - 1) // block
    _start(u8, i64, acc, nb, cur)
    pay = META + pad8(nb)
    nh = 0
    worst = 0.0
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        mx = _reduce_many_block(own, pos, u8, i8, i16, acc, cur, b, lo, m, scratch,
                                scratch[block:])
        if mx >= abs_bits(as_acc(scratch, np.inf)):
            o8[META + b] = FLAG
            continue
        tag, bnd, pay, nh = emit_block(readonly(scratch), np.int64(0), m, room, u, eta, o8, oi8, oi16,
                                       oacc, pay, heads, np.int64(nh), scratch[2 * block:], qs,
                                       predict)
        o8[META + b] = tag
        worst = max(worst, bnd)
    return _finish(o8, oacc, oi64, of64, pay, heads, nh, worst)


@njit(**KERNEL)
def mx_decode_reduce_many(own, pos, u8, i8, i16, acc, i64, out, block, scratch, cur, skipped):
    """out = the rank-order sum of own and the messages, at full precision
    (the two-shot reduce-scatter); blocks FLAG in a message, not finite,
    or reaching out's overflow limit are skipped.  Returns the number
    skipped, indices in skipped[:number]."""
    wide_vectors()
    n = own.size
    nb = (n + block - 1) // block
    _start(u8, i64, acc, nb, cur)
    limit_u = abs_bits(out_limit(out))
    flagged = 0
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        mx = _reduce_many_block(own, pos, u8, i8, i16, acc, cur, b, lo, m, scratch,
                                scratch[block:])
        if mx >= limit_u:
            skipped[flagged] = b
            flagged += 1
            continue
        for j in range(m):
            store(out, _U(lo + j), scratch[j])
    return flagged
