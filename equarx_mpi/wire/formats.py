"""The wire formats, one class each, and REGISTRY: every wire declared
once (its Format, default block, error, kernel speed; WIRES, BITS_TO_WIRE,
DIRECTED_WIRES and STOCHASTIC_WIRES come from it).  wire/base.py says what
a format offers; wire/mixed.py is the error-bounded mode's."""
import math
from typing import Callable, NamedTuple, Optional

import numpy as np

from equarx_mpi import kernels as K
from equarx_mpi.bounds import bound
from equarx_mpi.wire.base import Format, _Symmetric, acc_dtype, pad8
from equarx_mpi.wire.lowbit import LowBit
from equarx_mpi.wire.many import ComposedMany
from equarx_mpi.wire.mixed import Mixed


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

    def encode(self, src, w, rmode, at=None):
        K.i8_encode(src, w[0], w[1], self.block, self.scratch, rmode,
                    self._stream(src if at is None else at, rmode))

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.i8_decode(w[0], w[1], out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.i8_decode_reduce(own, w[0], w[1], out, self.block, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        K.i8_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, op,
                                  self.scratch, rmode, self._stream(own if at is None else at, rmode))

    def stack_views(self, buf, n, count, stride=None):
        # (headers, one row each; whole messages as int8 rows; where codes
        # start); messages ``stride`` bytes apart (default: back to back)
        size = stride or self.nbytes(n)
        rows = buf[:count * size].reshape(count, size)
        h = self.head.itemsize * -(-n // self.block)
        return rows[:, :h].view(self.head), rows.view(np.int8), h

    def part_stack(self, ws, lo, hi):
        # the kernel finds a value's code at column h + its index
        B = self.block
        return ws[0][:, lo // B:-(-hi // B)], ws[1], ws[2] + lo

    def decode_reduce_many(self, own, pos, ws, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.i8_decode_reduce_many(own, pos, ws[0], ws[1], ws[2], out, self.block,
                                                op, self.scratch, skipped)]

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        K.i8_decode_reduce_encode_many(own, pos, ws[0], ws[1], ws[2], wo[0], wo[1], self.block,
                                       op, self.scratch, rmode, self._stream(own, rmode))



class Int4Block(ComposedMany, _Symmetric):
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

    def encode(self, src, w, rmode, at=None):
        K.i4_encode(src, w[0], w[1], self.block, self.scratch, rmode,
                    self._stream(src if at is None else at, rmode))

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.i4_decode(w[0], w[1], out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.i4_decode_reduce(own, w[0], w[1], out, self.block, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        K.i4_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, op,
                                  self.scratch, rmode, self._stream(own if at is None else at, rmode))


class Fp8Block(ComposedMany, _Symmetric):
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

    def encode(self, src, w, rmode, at=None):
        K.f8_encode(src, w[0], w[1], self.block, self.scratch, rmode)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.f8_decode(w[0], w[1], out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.f8_decode_reduce(own, w[0], w[1], out, self.block, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        K.f8_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, op,
                                  self.scratch, rmode)


class AffineBlock(ComposedMany, Format):
    """Unsigned levels between each block's minimum and maximum, for data
    with an offset: per block (lo, hi) in the accumulation type, then one
    code per byte ("int8-affine", 255 levels) or two ("int4-affine", 15)
    (kernels/affine.py)."""

    def __init__(self, name, block, kdtype):
        self.name = name
        self.nibbles = name == "int4-affine"
        super().__init__(block, kdtype)
        self.levels = 15 if self.nibbles else 255
        self.heads_per_block = 2
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

    def encode(self, src, w, rmode, at=None):
        K.af_encode(src, w[0], w[1], self.block, self.levels, self.scratch, rmode)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.af_decode(w[0], w[1], out, self.block, self.levels, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.af_decode_reduce(own, w[0], w[1], out, self.block, self.levels, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        K.af_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, self.levels,
                                  op, self.scratch, rmode)


class Plain(Format):
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

    def part(self, w, lo, hi):
        return w[lo:hi]

    def views(self, buf, n):
        return buf[:n * self.wire.itemsize].view(self.wire)

    def encode(self, src, w, rmode, at=None):
        K.plain_encode(src, w)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.plain_decode(w, out, self.block, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.plain_decode_reduce(own, w, out, self.block, op, self.scratch,
                                              skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
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


class Wire(NamedTuple):
    """A wire, registered once in REGISTRY: what the options, the policy and
    the cost model know of it.  Its Format class (and its kernels, in
    kernels/) is the rest (docs/ALGORITHMS.md "Adding a schedule or a
    wire")."""
    make: Callable            #: (block, kernel element type) -> its Format
    #: relative L2 error of ONE quantization of standard-normal float32
    #: values, per block size (model/errors.py; docs/TUNING.md "Error model")
    e1: dict
    block: int = 256          #: block_size when none is given
    bits: Optional[int] = None  #: the legacy ``bits=`` value that names it
    directed: bool = False    #: its codes round up and down (MAX / MIN lossy)
    stochastic: bool = False  #: it rounds stochastically (rounding="stochastic")
    #: its kernels' times over int8's (encode, decode, decode_reduce and
    #: many, hop) where a profile measured int8's only (model/costmodel.py)
    slower: tuple = (1.0, 1.0, 1.0, 1.0)
    #: algorithm="auto" may run it on a schedule that requantizes partial
    #: sums at every hop (ring, rabenseifner); False for the 2-3-bit wires,
    #: whose step is too coarse to stack P - 1 times (policy.py)
    hops: bool = True


def _e1(*errors):
    return dict(zip((32, 64, 128, 256, 512, 1024, 2048, 4096), errors))


#: wire name -> Wire, in the order WIRES lists them.  e1: measured through
#: the library (docs/ACCURACY.md) within 0.5% of the model for int8, fp8 and
#: bf16; int4 lies 10-15% below it (an upper estimate there); int3, int2,
#: int5 and int6 measured (docs/results/lowbit-e1.txt, 2^22 values).
#: slower: docs/results/formats-kernels.txt, one core, wires interleaved,
#: default blocks; int3, int2, int5, int6: docs/results/lowbit-kernels.txt
#: (the same way, AMD EPYC; int3 and int2 from its first run, int5 and int6
#: from the current one, where int3 came out 2.39 2.05 2.06 5.19: 10-25%
#: run to run); bf16, fp32 (not there): as int8.  The int4 wires' smaller blocks
#: buy less error for few bytes (docs/FORMAT.md "int4").
REGISTRY = {
    "int8": Wire(Int8Block, _e1(0.005337, 0.005922, 0.006444, 0.00695, 0.007406, 0.007865,
                                0.008287, 0.008715), bits=8, directed=True, stochastic=True),
    "bf16": Wire(lambda b, kd: Plain("bf16", b, kd), _e1(*[0.001664] * 8), bits=16),
    "fp32": Wire(lambda b, kd: Plain("fp32", b, kd), _e1(*[3e-8] * 8), bits=32),
    "int4": Wire(Int4Block, _e1(0.09695, 0.1077, 0.1173, 0.1263, 0.1346, 0.142, 0.1499, 0.1574),
                 block=64, bits=4, directed=True, stochastic=True,
                 slower=(1.30, 1.11, 1.33, 1.72)),
    "fp8": Wire(Fp8Block, _e1(0.02398, 0.02506, 0.02571, 0.02612, 0.02629, 0.02644, 0.02646,
                              0.02645), directed=True, slower=(1.73, 1.19, 1.31, 2.38)),
    "int8-affine": Wire(lambda b, kd: AffineBlock("int8-affine", b, kd),
                        _e1(0.004595, 0.005269, 0.005869, 0.006388, 0.0069, 0.007335, 0.007865,
                            0.00823), directed=True, slower=(1.47, 1.35, 1.35, 2.63)),
    "int4-affine": Wire(lambda b, kd: AffineBlock("int4-affine", b, kd),
                        _e1(0.07826, 0.08951, 0.09965, 0.1092, 0.1173, 0.1248, 0.1325, 0.1398),
                        block=128, directed=True, slower=(1.75, 1.72, 1.60, 3.33)),
    "int3": Wire(lambda b, kd: LowBit("int3", b, kd),
                 _e1(0.2265, 0.2513, 0.2738, 0.2947, 0.3139, 0.3323, 0.3497, 0.3667), block=64, bits=3,
                 directed=True, slower=(2.18, 2.01, 2.26, 4.12), hops=False),
    "int2": Wire(lambda b, kd: LowBit("int2", b, kd),
                 _e1(0.6579, 0.7178, 0.7667, 0.807, 0.8398, 0.8672, 0.8894, 0.9084), block=64, bits=2,
                 directed=True, slower=(2.10, 1.97, 2.16, 3.81), hops=False),
    "int5": Wire(lambda b, kd: LowBit("int5", b, kd),
                 _e1(0.04528, 0.05025, 0.05476, 0.05891, 0.06279, 0.06648, 0.06994, 0.07332), block=64, bits=5,
                 directed=True, slower=(2.46, 2.08, 2.14, 4.83)),
    "int6": Wire(lambda b, kd: LowBit("int6", b, kd),
                 _e1(0.02191, 0.02431, 0.02649, 0.02852, 0.03039, 0.03216, 0.03384, 0.03548), block=64, bits=6,
                 directed=True, slower=(2.46, 2.37, 2.29, 5.68)),
}
WIRES = tuple(REGISTRY)
#: the error-bounded mode's wire (abs_tol/rel_tol picks it; wire/mixed.py)
MODE_WIRE = "mixed"
#: the legacy ``bits=`` option
BITS_TO_WIRE = dict(sorted((w.bits, name) for name, w in REGISTRY.items() if w.bits))
#: wires whose codes can round up or down (MAX / MIN with ``lossy_ops``)
DIRECTED_WIRES = tuple(name for name, w in REGISTRY.items() if w.directed)
#: wires that can round stochastically (rounding="stochastic")
STOCHASTIC_WIRES = tuple(name for name, w in REGISTRY.items() if w.stochastic)
#: wires algorithm="auto" keeps off schedules that requantize at every hop
NO_HOP_WIRES = tuple(name for name, w in REGISTRY.items() if not w.hops)


#: wires that can travel rotated (option rotate): the block wires, not the
#: plain ones (a rotation buys a 16- or 32-bit wire nothing)
ROTATE_WIRES = tuple(name for name, w in REGISTRY.items() if (w.bits or 0) < 16)


def default_block(wire):
    """block_size when none is given: the wire's own (the mode's: 256)."""
    w = REGISTRY.get(wire)
    return w.block if w else 256


def make_format(wire, block, kdtype):
    """The format for wire name ``wire`` and inputs of kernel type ``kdtype``."""
    if wire == MODE_WIRE:
        return Mixed(block, np.dtype(kdtype))
    w = REGISTRY.get(wire)
    if w is None:
        raise ValueError(f"wire must be one of {WIRES}, not {wire!r}")
    return w.make(block, np.dtype(kdtype))


def max_block_bytes(wire, block):
    """The most bytes one block can take on the wire (any input type)."""
    return max(make_format(wire, block, dt).nbytes(block) for dt in (np.float32, np.float64))
