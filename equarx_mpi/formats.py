"""Wire formats: how a piece of values is laid out in a message, and which
kernels turn values into that layout and back.  The one place schedules
go through; they never look inside a format.

A format is bound to the kernel element type of the input (the header of
an int8 block is in the accumulation type, so its size depends on it) and
offers, on pieces (1-D kernel views; ``w`` is what ``views`` returns):

    encode(src, w, rmode)                  w = Q(src)
    decode(w, out) -> skipped              out = D(w)
    decode_reduce(own, w, out, op) -> skipped     out = own (op) D(w)
    decode_reduce_encode(own, wi, wo, op, rmode)  wo = Q(own (op) D(wi)); wi may be wo

and, for a schedule that reduces many messages at once (two_shot.py), on
``count`` messages of one piece lying back to back (``ws`` is what
``stack_views`` returns), reduced in rank order with own in place ``pos``:

    decode_reduce_many(own, pos, ws, out, op) -> skipped
    decode_reduce_encode_many(own, pos, ws, wo, op, rmode)

Decodes skip (leave untouched) the blocks holding Inf or NaN, or whose
values would overflow out's type, and return their indices (valid until
the next decode); the caller reduces those blocks exactly (exact.py).  A piece's bytes are
padded to a multiple of 8 so the next piece's views stay aligned.

Error bounds (bound.py, docs/ERROR.md), from a piece's headers (plain
wires: from one pass over its values):

    piece_error(w, rmode, limit) -> (q, m)   q bounds |x - D(Q(x))| and m
        |x| for every value x of the blocks a decode keeps (finite, below
        ``limit``: out's overflow threshold, for block formats); floats
    block_errors(w, rmode) -> (q, m)         the same per block (arrays;
        m is Inf for a flagged block); None: no bound (Inf)

Stochastic rounding: streams.py says how each piece's random numbers are keyed.
"""
import math

import numpy as np

from . import bound
from . import kernels as K
from .streams import Streams

WIRES = ("int8", "bf16", "fp32", "int4", "fp8", "int8-affine", "int4-affine")
#: the legacy ``bits=`` option
BITS_TO_WIRE = {4: "int4", 8: "int8", 16: "bf16", 32: "fp32"}
#: wires whose codes can round up or down (MAX / MIN with ``lossy_ops``)
DIRECTED_WIRES = ("int8", "int4", "fp8", "int8-affine", "int4-affine")
#: wires with many-input reductions (decode_reduce_many...): algorithm="two_shot"
MANY_INPUT_WIRES = ("int8", "bf16", "fp32")
#: wires that can round stochastically (rounding="stochastic")
STOCHASTIC_WIRES = ("int8", "int4")
#: block_size when none is given: 256, except for the int4 wires, where a
#: smaller block buys less error for few bytes (headers 1/8 of the codes:
#: 0.5625 bytes per value); measured in docs/FORMAT.md "int4 blocks"
DEFAULT_BLOCK = {"int4": 64, "int4-affine": 128}


def default_block(wire):
    return DEFAULT_BLOCK.get(wire, 256)


def pad8(n):
    return (n + 7) & ~7


def acc_dtype(kdtype):
    """Accumulation type for a kernel element type."""
    return np.dtype(np.float64) if kdtype == np.float64 else np.dtype(np.float32)


def _largest_below(h, limit):
    """The largest of the nonnegative h below limit (0 if none)."""
    a = float(h.max()) if h.size else 0.0
    if not a < limit:               # a flagged block, or one the decode skips
        h = h[h < limit]
        a = float(h.max()) if h.size else 0.0
    return a


class _Format(Streams):
    #: codes two per byte: blocks must then start on a byte
    nibbles = False
    #: whether decoding into a 16-bit output rounds (not for plain 16-bit wires)
    decode_rounds = True
    #: whether the final decode skips blocks beyond a 16-bit output's range
    #: (plain wires skip only blocks holding Inf or NaN)
    skips_overflow = True

    def piece_error(self, w, rmode, limit=math.inf):
        """A format without its own bound reports none (Inf)."""
        return math.inf, math.inf

    def block_errors(self, w, rmode):
        return None

    def __init__(self, block, kdtype):
        if self.nibbles and block % 2:
            raise ValueError(f"{self.name} packs two codes per byte: block {block} must be even")
        self.block = block
        self.scratch = np.empty(block, acc_dtype(kdtype))
        self._skipped = np.empty(0, np.int64)
        Streams.__init__(self)

    def _skip(self, n):
        """A buffer for the indices of skipped blocks of an n-value piece."""
        nb = -(-n // self.block)
        if self._skipped.size < nb:
            self._skipped = np.empty(nb, np.int64)
        return self._skipped


class _Symmetric(_Format):
    """A block format whose header is the block's largest magnitude ``a``
    and whose quantization error is at most coef * a + eta (docs/FORMAT.md):
    coef from ``_coefs(u)`` = (to nearest, directed)."""

    def __init__(self, block, kdtype):
        super().__init__(block, kdtype)
        self.head = acc_dtype(kdtype)
        u, self._eta = bound.acc_rounding(self.head)
        self._coef = self._coefs(u)

    def block_errors(self, w, rmode):
        a = w[0].astype(np.float64)
        return self._coef[rmode != K.ROUND_NEAREST] * a + self._eta, a

    def piece_error(self, w, rmode, limit=math.inf):
        a = _largest_below(w[0], limit)
        return self._coef[rmode != K.ROUND_NEAREST] * a + self._eta, a


class Int8Block(_Symmetric):
    """Dynamic block-wise symmetric int8: per block its largest magnitude
    in the accumulation type, then the int8 codes (docs/FORMAT.md)."""
    name = "int8"

    @staticmethod
    def _coefs(u):
        return (0.5 + 640 * u) / 127, (1 + 640 * u) / 127

    def nbytes(self, n):
        return pad8(self.head.itemsize * -(-n // self.block) + n)

    def views(self, buf, n):
        h = self.head.itemsize * -(-n // self.block)
        return buf[:h].view(self.head), buf[h:h + n].view(np.int8)

    def encode(self, src, w, rmode):
        K.i8_encode(src, w[0], w[1], self.block, self.scratch, rmode, self._stream(src, rmode))

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.i8_decode(w[0], w[1], out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.i8_decode_reduce(own, w[0], w[1], out, self.block, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode):
        K.i8_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, op,
                                  self.scratch, rmode, self._stream(own, rmode))

    def stack_views(self, buf, n, count, stride=None):
        # (headers, one row each; whole messages as int8 rows; where codes
        # start); messages ``stride`` bytes apart (default: back to back)
        size = stride or self.nbytes(n)
        rows = buf[:count * size].reshape(count, size)
        h = self.head.itemsize * -(-n // self.block)
        return rows[:, :h].view(self.head), rows.view(np.int8), h

    def decode_reduce_many(self, own, pos, ws, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.i8_decode_reduce_many(own, pos, ws[0], ws[1], ws[2], out, self.block,
                                                op, self.scratch, skipped)]

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        K.i8_decode_reduce_encode_many(own, pos, ws[0], ws[1], ws[2], wo[0], wo[1], self.block,
                                       op, self.scratch, rmode, self._stream(own, rmode))



class Int4Block(_Symmetric):
    """Symmetric int4, two codes per byte: per block its largest magnitude
    in the accumulation type, then the codes (kernels/int4.py)."""
    name = "int4"
    nibbles = True

    @staticmethod
    def _coefs(u):
        return (0.5 + 40 * u) / 7, (1 + 40 * u) / 7

    def nbytes(self, n):
        return pad8(self.head.itemsize * -(-n // self.block) + (n + 1) // 2)

    def views(self, buf, n):
        h = self.head.itemsize * -(-n // self.block)
        return buf[:h].view(self.head), buf[h:h + (n + 1) // 2].view(np.int8)

    def encode(self, src, w, rmode):
        K.i4_encode(src, w[0], w[1], self.block, self.scratch, rmode, self._stream(src, rmode))

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.i4_decode(w[0], w[1], out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.i4_decode_reduce(own, w[0], w[1], out, self.block, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode):
        K.i4_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, op,
                                  self.scratch, rmode, self._stream(own, rmode))


class Fp8Block(_Symmetric):
    """e4m3 codes scaled per block so its largest magnitude maps to 448:
    per block that magnitude in the accumulation type, then one code byte
    per value (kernels/fp8.py)."""
    name = "fp8"

    @staticmethod
    def _coefs(u):
        # relative per value (|x| <= a) plus the subnormal codes' spacing
        return 1 / 17 + 6 * u + (1 + 4 * u) / 458752, 1 / 8 + 16 * u + (1 + 4 * u) / 229376

    def nbytes(self, n):
        return pad8(self.head.itemsize * -(-n // self.block) + n)

    def views(self, buf, n):
        h = self.head.itemsize * -(-n // self.block)
        return buf[:h].view(self.head), buf[h:h + n].view(np.uint8)

    def encode(self, src, w, rmode):
        K.f8_encode(src, w[0], w[1], self.block, self.scratch, rmode)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.f8_decode(w[0], w[1], out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.f8_decode_reduce(own, w[0], w[1], out, self.block, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode):
        K.f8_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, op,
                                  self.scratch, rmode)


class AffineBlock(_Format):
    """Unsigned levels between each block's minimum and maximum, for data
    with an offset: per block (lo, hi) in the accumulation type, then one
    code per byte ("int8-affine", 255 levels) or two ("int4-affine", 15)
    (kernels/affine.py)."""

    def __init__(self, name, block, kdtype):
        self.name = name
        self.nibbles = name == "int4-affine"
        super().__init__(block, kdtype)
        self.levels = 15 if self.nibbles else 255
        self.head = acc_dtype(kdtype)
        self.scratch = np.empty(2 * block, self.head)     # values and their codes
        u, self._eta = bound.acc_rounding(self.head)
        L = self.levels
        # (range / 2, largest magnitude) coefficients, to nearest and directed
        self._coef = ((1 / L + 32 * u, 2 * u), (2 / L + 64 * u, 4 * u))

    def block_errors(self, w, rmode):
        h = w[0].astype(np.float64)
        lo, hi = h[0::2], h[1::2]
        M = np.maximum(-lo, hi)                 # max(|lo|, |hi|), as lo <= hi
        c_range, c_mag = self._coef[rmode != K.ROUND_NEAREST]
        # half the range without overflow; one more eta for its rounding
        return (hi * 0.5 - lo * 0.5) * c_range + c_mag * M + 3 * self._eta, M

    def piece_error(self, w, rmode, limit=math.inf):
        q, M = self.block_errors(w, rmode)
        keep = M < limit
        if not keep.all():
            q, M = q[keep], M[keep]
        return (float(q.max()), float(M.max())) if q.size else (0.0, 0.0)

    def _code_bytes(self, n):
        return (n + 1) // 2 if self.nibbles else n

    def nbytes(self, n):
        return pad8(2 * self.head.itemsize * -(-n // self.block) + self._code_bytes(n))

    def views(self, buf, n):
        h = 2 * self.head.itemsize * -(-n // self.block)
        return buf[:h].view(self.head), buf[h:h + self._code_bytes(n)]

    def encode(self, src, w, rmode):
        K.af_encode(src, w[0], w[1], self.block, self.levels, self.scratch, rmode)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.af_decode(w[0], w[1], out, self.block, self.levels, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.af_decode_reduce(own, w[0], w[1], out, self.block, self.levels, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode):
        K.af_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, self.levels,
                                  op, self.scratch, rmode)


class Plain(_Format):
    """Uncompressed values on the wire: the baselines the paper compares
    against.  "bf16" carries bfloat16, except for float16 input, which
    travels as float16 (bfloat16 would lose three of its bits and overflow
    its largest values); "fp32" carries float32."""

    def __init__(self, name, block, kdtype):
        super().__init__(block, kdtype)
        self.name = name
        if name == "fp32":
            self.wire = np.dtype(np.float32)
        else:
            self.wire = np.dtype(np.int16 if kdtype == np.int16 else np.uint16)
        self.decode_rounds = self.wire.itemsize != 2
        self.skips_overflow = False
        # rounding to the wire type: none from float32 to float32, twice
        # from float64 to 16 bits (through float32), else once
        acc = acc_dtype(kdtype)
        u, eta = bound.ROUNDING[self.wire]
        times = 0 if self.wire == acc else 2 if acc == np.float64 and self.wire.itemsize == 2 else 1
        self._round = (times * u, times * eta)

    def block_errors(self, w, rmode):
        mag = bound.block_magnitudes(w, self.block)   # Inf where Inf or NaN is inside
        with np.errstate(invalid="ignore"):            # 0 * Inf: such blocks are skipped
            q = self._round[0] * mag + self._round[1]
        return q, mag + q

    def piece_error(self, w, rmode, limit=math.inf):
        # the decode skips only blocks holding Inf or NaN
        q, m = self.block_errors(w, rmode)
        keep = m < math.inf
        if not keep.all():
            q, m = q[keep], m[keep]
        return (float(q.max()), float(m.max())) if q.size else (0.0, 0.0)

    def nbytes(self, n):
        return pad8(n * self.wire.itemsize)

    def views(self, buf, n):
        return buf[:n * self.wire.itemsize].view(self.wire)

    def encode(self, src, w, rmode):
        K.plain_encode(src, w)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.plain_decode(w, out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.plain_decode_reduce(own, w, out, self.block, op, self.scratch,
                                              skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode):
        K.plain_decode_reduce_encode(own, wi, wo, op)

    def stack_views(self, buf, n, count, stride=None):
        size = stride or self.nbytes(n)
        return buf[:count * size].view(self.wire).reshape(count, size // self.wire.itemsize)

    def decode_reduce_many(self, own, pos, ws, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.plain_decode_reduce_many(own, pos, ws, out, self.block, op,
                                                   self.scratch, skipped)]

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        K.plain_decode_reduce_encode_many(own, pos, ws, wo, self.block, op, self.scratch)


def make_format(wire, block, kdtype):
    """The format for wire name ``wire`` and inputs of kernel type ``kdtype``."""
    kdtype = np.dtype(kdtype)
    if wire == "int8":
        return Int8Block(block, kdtype)
    if wire in ("bf16", "fp32"):
        return Plain(wire, block, kdtype)
    if wire == "int4":
        return Int4Block(block, kdtype)
    if wire == "fp8":
        return Fp8Block(block, kdtype)
    if wire in ("int8-affine", "int4-affine"):
        return AffineBlock(wire, block, kdtype)
    raise ValueError(f"wire must be one of {WIRES}, not {wire!r}")


def max_block_bytes(wire, block):
    """The most bytes one block can take on the wire (any input type)."""
    return max(make_format(wire, block, dt).nbytes(block) for dt in (np.float32, np.float64))
