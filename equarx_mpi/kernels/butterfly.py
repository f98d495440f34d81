"""The butterflies of the fast Walsh-Hadamard transform (kernels/rotate.py
has the maths): stage h turns each pair (a, b) = (v[i], v[i + h]), i's
bit h clear, into (a + b, a - b).  The stages of eight values or more are
written as LLVM vectors of eight: LLVM vectorizes neither the pairs closer
than a vector (h = 1, 2, 4) nor, by SLP, the unrolled runs of eight of
h = 8; these do, with the scalar butterfly's sums in its order, so the
results are the same bits.  Stages run two at a time where they can (half
the loads and stores).  Chunks of 64 or more take h64: the stages inside a
vector become stages across eight vectors after a transpose in registers
(a third of the shuffles of h8's three stages per vector).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from equarx_mpi.kernels.common import CACHE

_U = np.uint64


class _Vec:
    """LLVM IR of eight-lane vectors of an array's element type (float32 or
    float64), loaded and stored unaligned."""

    def __init__(self, context, builder, dtype):
        self.cx, self.b = context, builder
        self.bits = 32 if dtype == types.float32 else 64
        self.ity, self.elt = ir.IntType(self.bits), context.get_value_type(dtype)

    def lanes(self, *vals, ty=ir.IntType(32)):
        return ir.Constant(ir.VectorType(ty, len(vals)), list(vals))

    def _ptr(self, aryty, ary, off):
        data = self.cx.make_array(aryty)(self.cx, self.b, value=ary).data
        p = self.b.gep(data, [off], inbounds=True)
        return self.b.bitcast(p, ir.VectorType(self.elt, 8).as_pointer())

    def load(self, aryty, ary, off):
        return self.b.load(self._ptr(aryty, ary, off), align=self.bits // 8)

    def store(self, v, aryty, ary, off):
        self.b.store(v, self._ptr(aryty, ary, off), align=self.bits // 8)

    def splat(self, v, ty):
        one = self.b.insert_element(ir.Constant(ir.VectorType(ty, 8), ir.Undefined), v,
                                    ir.Constant(ir.IntType(32), 0))
        return self.b.shuffle_vector(one, one, self.lanes(*[0] * 8))

    def flip(self, v, bits):
        """Lane k's sign bit xor-ed with bit k of the uint32 ``bits``."""
        b, ity = self.b, self.ity
        m = self.splat(b.zext(bits, ity) if self.bits == 64 else bits, ity)
        m = b.shl(b.and_(b.lshr(m, self.lanes(*range(8), ty=ity)), self.lanes(*[1] * 8, ty=ity)),
                  self.lanes(*[self.bits - 1] * 8, ty=ity))
        return b.bitcast(b.xor(b.bitcast(v, ir.VectorType(ity, 8)), m), v.type)

    def scaled(self, v, c, last):
        return self.b.select(last, self.b.fmul(v, self.splat(c, self.elt)), v)


def _floats(a, x=None):
    """a (and x) arrays of one float type: what the vectors are made of."""
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.float64) and (
        x is None or isinstance(x, types.Array) and x.dtype == a.dtype)


@intrinsic
def h8(typingctx, a, ao, x, xo, bits, c, last):
    """x[xo:xo+8] = stages 1, 2 and 4 of the eight values a[ao:ao+8], each
    first flipped by its bit of ``bits`` (bit k: value k), then times c if
    ``last``.  A stage is v + swap_h(v) where i's bit h is clear, swap_h(v)
    - v where set (the scalar butterfly's sums); stage 4 adds two halves."""
    if not _floats(a, x):
        return None

    def codegen(context, builder, sig, args):
        va, vao, vx, vxo, vbits, vc, vlast = args
        V = _Vec(context, builder, a.dtype)
        v = V.flip(V.load(sig.args[0], va, vao), vbits)
        halves = []
        for half in ((0, 1, 2, 3), (4, 5, 6, 7)):
            w = builder.shuffle_vector(v, v, V.lanes(*half))
            for h in (1, 2):
                sw = builder.shuffle_vector(w, w, V.lanes(*[i ^ h for i in range(4)]))
                w = builder.shuffle_vector(builder.fadd(w, sw), builder.fsub(sw, w),
                                           V.lanes(*[i + 4 if i & h else i for i in range(4)]))
            halves.append(w)
        lo, hi = halves
        v = builder.shuffle_vector(builder.fadd(lo, hi), builder.fsub(lo, hi), V.lanes(*range(8)))
        V.store(V.scaled(v, vc, vlast), sig.args[2], vx, vxo)
        return context.get_dummy_value()
    return types.none(a, ao, x, xo, bits, c, last), codegen


def _vertical(builder, rows, bits):
    """Stages across the eight rows (row i pairs with i + b, i's bit b
    clear), for b in bits in that order: plain vector adds."""
    rows = list(rows)
    for b in bits:
        for i in range(8):
            if not i & b:
                u, v = rows[i], rows[i + b]
                rows[i], rows[i + b] = builder.fadd(u, v), builder.fsub(u, v)
    return rows


def _transpose(builder, V, rows):
    """The 8 x 8 transpose of eight rows: unpack pairs, then pairs of
    pairs, then halves (three shuffles deep, as x86 does it)."""
    def sh(a, b, idx):
        return builder.shuffle_vector(a, b, V.lanes(*idx))
    t = []
    for i in range(0, 8, 2):
        t += [sh(rows[i], rows[i + 1], (0, 8, 1, 9, 4, 12, 5, 13)),
              sh(rows[i], rows[i + 1], (2, 10, 3, 11, 6, 14, 7, 15))]
    lo, hi = (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)
    s = []
    for q in (0, 4):                    # t[q], t[q+2] -> columns 0, 1; t[q+1], t[q+3] -> 2, 3
        s.append([sh(t[q], t[q + 2], lo), sh(t[q], t[q + 2], hi),
                  sh(t[q + 1], t[q + 3], lo), sh(t[q + 1], t[q + 3], hi)])
    first, second = (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)
    return ([sh(s[0][k], s[1][k], first) for k in range(4)]
            + [sh(s[0][k], s[1][k], second) for k in range(4)])


@intrinsic
def h64(typingctx, a, ao, x, xo, bits, c, last):
    """The 64 values a[ao:ao+64] as eight rows of eight, each value first
    flipped by its bit of the uint64 ``bits``: stages 8, 16, 32 (across
    rows), the transpose, stages 1, 2, 4 (across the rows again), times c
    if ``last``; row k stored at x[xo+8k] (value 8r + k lands at 8k + r:
    kernels/rotate.py)."""
    if not _floats(a, x):
        return None

    def codegen(context, builder, sig, args):
        va, vao, vx, vxo, vbits, vc, vlast = args
        V = _Vec(context, builder, a.dtype)
        i64 = ir.IntType(64)
        rows = []
        for r in range(8):
            off = builder.add(vao, ir.Constant(vao.type, 8 * r))
            byte = builder.trunc(builder.lshr(vbits, ir.Constant(i64, 8 * r)), ir.IntType(32))
            rows.append(V.flip(V.load(sig.args[0], va, off), byte))
        rows = _vertical(builder, _transpose(builder, V, _vertical(builder, rows, (1, 2, 4))),
                         (1, 2, 4))
        for k in range(8):
            off = builder.add(vxo, ir.Constant(vxo.type, 8 * k))
            V.store(V.scaled(rows[k], vc, vlast), sig.args[2], vx, off)
        return context.get_dummy_value()
    return types.none(a, ao, x, xo, bits, c, last), codegen


@intrinsic
def b4(typingctx, x, k, h, c, last, four):
    """Stages h and 2h (``four``) or stage h alone of the values k + j,
    k + j + h (+ 2h, 3h) of x, j = 0..7, in place, times c if ``last``."""
    if not (_floats(x) and isinstance(four, types.BooleanLiteral)):
        return None
    n = 4 if four.literal_value else 2

    def codegen(context, builder, sig, args):
        vx, vk, vh, vc, vlast, _ = args
        V = _Vec(context, builder, x.dtype)
        offs = [vk]
        for _ in range(n - 1):
            offs.append(builder.add(offs[-1], vh))
        v = [V.load(sig.args[0], vx, o) for o in offs]
        for p in range(0, n, 2):        # stage h: (v0, v1), (v2, v3)
            v[p], v[p + 1] = builder.fadd(v[p], v[p + 1]), builder.fsub(v[p], v[p + 1])
        if n == 4:                      # stage 2h: (v0, v2), (v1, v3)
            v = [builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]),
                 builder.fsub(v[0], v[2]), builder.fsub(v[1], v[3])]
        for o, w in zip(offs, v):
            V.store(V.scaled(w, vc, vlast), sig.args[0], vx, o)
        return context.get_dummy_value()
    return types.none(x, k, h, c, last, four), codegen


@intrinsic
def flip8(typingctx, a, ao, x, xo, bits):
    """x[xo:xo+8] = a[ao:ao+8] with value k's sign flipped by bit k of bits."""
    if not _floats(a, x):
        return None

    def codegen(context, builder, sig, args):
        va, vao, vx, vxo, vbits = args
        V = _Vec(context, builder, a.dtype)
        V.store(V.flip(V.load(sig.args[0], va, vao), vbits), sig.args[2], vx, vxo)
        return context.get_dummy_value()
    return types.none(a, ao, x, xo, bits), codegen


@njit(inline='always', **CACHE)
def _stage(x, o, m, h, c, last):
    """Stage h of x[o:o+m], in place (chunks below 8 values)."""
    for i in range(0, m, 2 * h):
        p = o + i
        for j in range(h):
            u, v = x[_U(p + j)], x[_U(p + j + h)]
            if last:
                x[_U(p + j)], x[_U(p + j + h)] = (u + v) * c, (u - v) * c
            else:
                x[_U(p + j)], x[_U(p + j + h)] = u + v, u - v


@njit(inline='always', **CACHE)
def small_stages(x, o, m, c):
    """All stages of x[o:o+m], m < 8, in place; the last times c."""
    h = 1
    while h < m:
        _stage(x, o, m, h, c, 2 * h == m)
        h *= 2


@njit(inline='always', **CACHE)
def upper_stages(x, o, m, c, h):
    """Stages h, 2h, ..., m/2 of x[o:o+m] in place (h >= 8), the last
    times c."""
    while h < m:
        four = 4 * h <= m
        last = h * (4 if four else 2) == m
        for i in range(0, m, 4 * h if four else 2 * h):
            for j in range(0, h, 8):
                if four:
                    b4(x, _U(o + i + j), _U(h), c, last, True)
                else:
                    b4(x, _U(o + i + j), _U(h), c, last, False)
        h *= 4 if four else 2
