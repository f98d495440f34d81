"""Certified error bounds: ``QuantizedComm.last_error_bound`` and
``block_bounds`` (docs/ERROR.md derives every term used here).

A quantized schedule carries its bound with its data.  Every message (one
piece of a shard) ends in a TRAILER of three float64:

    pre     bounds |value - exact| for every value of the piece's kept
            blocks before the message's own quantization
    total   the same after it: pre + the format's quantization bound
    mag     the largest magnitude of the values quantized (kept blocks)

"Kept" blocks are those the final decode keeps; flagged ones (Inf/NaN, or
beyond a 16-bit output's range) are reduced exactly afterwards and get
MPI's bound there.  A hop adds its own rounding to the trailer it
received, so the all-gathered bytes hold the bound of the finished values:
every rank reads the same trailers and computes the same number, with no
message of its own.  Bounds are maxima over a piece's blocks (a few
float64 operations per message); the per-block form re-reads the final
headers, only when asked for.

All bounds are computed in float64 with rounding to nearest and finally
multiplied by SLACK, which covers the relative error of up to 2^20 such
operations; they are upper bounds on the error in exact arithmetic.
"""
import functools
import math

import numpy as np

from equarx_mpi.kernels.magnitude import block_absmax
from equarx_mpi.names import BFLOAT16, kernel_dtype  # noqa: F401 (kernel_dtype: bound's word)

#: bytes of the trailer at the end of every message: float64 (pre, total, mag)
TRAILER = 24
SLACK = 1 + 2.0 ** -32

#: kernel element type -> (unit roundoff, half the smallest subnormal) of
#: the value type it stands for: float16 is int16 bits, bfloat16 uint16 bits
ROUNDING = {np.dtype(np.float64): (2.0 ** -53, 2.0 ** -1074),   # 2^-1075 is 0 in float64
            np.dtype(np.float32): (2.0 ** -24, 2.0 ** -150),
            np.dtype(np.int16): (2.0 ** -11, 2.0 ** -25),
            np.dtype(np.uint16): (2.0 ** -8, 2.0 ** -134)}
#: kernel element type -> the smallest magnitude that rounds to Inf in it
#: (kernels.common.out_limit): decodes leave blocks reaching it to MPI
OUT_LIMIT = {np.dtype(np.int16): 65520.0,
             np.dtype(np.uint16): float(np.array(0x7F7F8000, np.uint32).view(np.float32))}


def acc_rounding(kdtype):
    """(u, eta) of the accumulation type: float64 for float64, else float32."""
    return ROUNDING[np.dtype(np.float64) if kdtype == np.float64 else np.dtype(np.float32)]


def out_limit(kdtype):
    return OUT_LIMIT.get(np.dtype(kdtype), math.inf)


def cast(kdtype):
    """(u, eta) of rounding an accumulation-type value into kdtype: zero for
    float32 and float64 (no rounding), the 16-bit type's otherwise."""
    return ROUNDING[np.dtype(kdtype)] if np.dtype(kdtype).itemsize == 2 else (0.0, 0.0)


def gamma(k, u):
    """k u / (1 - k u): the relative bound of k roundings (Higham's gamma_k)."""
    return math.inf if k * u >= 1 else k * u / (1 - k * u)


# --- the largest magnitude of values, in one pass ---------------------------------

def block_magnitudes(values, block, finite_only=False):
    """Per block of ``block`` values of a kernel view (float32, float64, or
    the int16/uint16 bits of float16/bfloat16): the largest magnitude, as
    float64; blocks holding Inf or NaN give Inf (or, finite_only, the
    largest finite magnitude)."""
    out = np.empty(-(-values.size // block), np.float64)
    if out.size:
        block_absmax(values, block, finite_only, out)
    return out


def largest(values, finite_only=True):
    """The largest (finite) magnitude of a kernel view, as a float."""
    if not values.size:
        return 0.0
    return float(block_magnitudes(values, values.size, finite_only)[0])


def warm(kdtypes):
    """Compile (or load from numba's cache) the magnitude pass for the
    kernel element types ``kdtypes`` (python -m equarx_mpi.warmup: all)."""
    for kd in kdtypes:
        x = np.zeros(3, kd)
        block_magnitudes(x, 2, True)
        block_magnitudes(x, 2, False)


# --- float64 <-> int64 for a MAX reduction of nonnegative bounds ------------------

def to_bits(x):
    """A nonnegative float as an int64 whose order is the floats' order."""
    return int(np.array(float(x), np.float64).view(np.int64))


def from_bits(b):
    return float(np.array(int(b), np.int64).view(np.float64))


def unit(dtype):
    """Unit roundoff of a float dtype (of each component of a complex one)."""
    dtype = np.dtype(dtype)
    u = _UNIT.get(dtype)
    return float(np.finfo(dtype).eps) / 2 if u is None else u


#: unit roundoff of the common types (np.finfo is slow; it lacks bfloat16)
_UNIT = {np.dtype(np.float64): 2.0 ** -53, np.dtype(np.float32): 2.0 ** -24,
         np.dtype(np.float16): 2.0 ** -11, BFLOAT16: 2.0 ** -8}


def mpi_sum(dtype, P, S):
    """Bound on |MPI's sum - exact sum| of P values of ``dtype`` whose
    magnitudes add up to at most S, whatever order and tree MPI adds in
    (P-1 additions; finite results).  Complex: per component (S bounds
    the components), times sqrt(2) for the modulus.  16-bit types: MPI's
    own float16 arithmetic or a float32 sum rounded once
    (exact.collective), whichever ran; the bound covers both."""
    if P <= 1:
        return 0.0
    a, b = _sum_terms(np.dtype(dtype), P)
    return (a * S + b) * SLACK


@functools.lru_cache(maxsize=128)
def _sum_terms(dtype, P):
    """(a, b) with mpi_sum = (a S + b) SLACK (every exact call asks)."""
    if dtype.itemsize != 2:
        return gamma(P - 1, unit(dtype)) * (1.4142136 if dtype.kind == "c" else 1), 0.0
    u16, eta16 = ROUNDING[kernel_dtype(dtype)]
    u32 = ROUNDING[np.dtype(np.float32)][0]
    # each addition rounded to the 16-bit type, perhaps through float32
    # first; bfloat16, which MPI lacks, is always added in float32
    # (exact.collective) and rounded once
    g = gamma(P - 1, u32 if dtype == BFLOAT16 else u16 + u32)
    return g + u16 * (1 + g), eta16


def sum_of_nonnegatives(computed, P, dtype):
    """An upper bound on the exact sum of P nonnegative values of dtype
    whose MPI sum came back as ``computed``: each of the P-1 additions,
    rounded to nearest, lowered it at most by a factor 1 - u (u of the
    16-bit type plus float32's, to cover a float32 sum rounded once, or
    float16 arithmetic through float32), a subnormal result at most by
    half the smallest subnormal."""
    dtype = np.dtype(dtype)
    u = unit(dtype) + (ROUNDING[np.dtype(np.float32)][0] if dtype.itemsize == 2 else 0.0)
    eta = ROUNDING[kernel_dtype(dtype)][1] if kernel_dtype(dtype) in ROUNDING else 0.0
    if P * u >= 1:
        return math.inf
    return (float(computed) + eta) / (1 - u) ** P * SLACK


# --- the bound of one schedule run ----------------------------------------------------

class Tally:
    """The bound of one run of a quantized schedule (ring.py, two_shot.py,
    rabenseifner.py),
    written into the trailers while it runs and read by engine.py after.

    ``e_own`` bounds the error this rank's own input already carries (the
    node sums of the hierarchical schedule; 0 otherwise).  Each method is
    called right after the payload of a piece has been written; ``final``:
    the piece is all-gathered, so its kept blocks are those the final
    decode keeps (below the 16-bit output limit)."""

    def __init__(self, fmt, kdtype, op_sum, rmode, e_own=0.0, measured=None):
        self.fmt, self.rmode, self.sum, self.e = fmt, rmode, op_sum, float(e_own)
        #: a bounds.measured.Measured, or None: the format's bounds
        self.measured = measured
        self.u = acc_rounding(kdtype)[0]
        #: blocks the final decode keeps have magnitudes below this
        self.limit = out_limit(kdtype) if fmt.skips_overflow else math.inf
        #: rounding of the final decode into the output type
        self.cast = cast(kdtype) if fmt.decode_rounds else (0.0, 0.0)
        #: rounding of a full-precision reduction stored into the output
        self.store = cast(kdtype)
        self.final = []     # pieces all-gathered: their trailers bound the result
        self.results = []   # (lo, hi, bound per block, skipped): a reduce_scatter's result
        self.local = 0.0    # the largest bound of those

    def _combine(self, errors):
        return sum(errors) if self.sum else max(errors)

    def _error(self, p, final):
        """(quantization bound, largest magnitude quantized) of piece p."""
        q, m = self.fmt.piece_error(p.w, self.rmode, self.limit if final else math.inf)
        return (q, m) if self.measured is None else self.measured.adjust(p.w, q, m)

    def _write(self, p, pre, final):
        q, m = self._error(p, final)
        if self.sum:                 # the rounding of the addition that made these values
            pre += self.u * m
        p.t[0], p.t[1], p.t[2] = pre, pre + q, m
        if final:
            self.final.append(p)

    def start(self, p, final=False):
        """p holds this rank's own values, quantized."""
        q, m = self._error(p, final)
        p.t[0], p.t[1], p.t[2] = self.e, self.e + q, m
        if final:
            self.final.append(p)

    def hop(self, e_in, p, final=False):
        """p holds own (op) the decoded input, quantized; e_in bounds the
        input's error (its trailer's total)."""
        self._write(p, self._combine((e_in, self.e)), final)

    def partial(self, e_in, e_acc, mag):
        """The recursive halving's partial result kept at full precision
        (rabenseifner.py): acc (error e_acc) (op) a decoded input (error
        e_in), stored in the accumulation type; for a SUM plus the
        addition's rounding, u |result| with every kept |result| <= mag."""
        e = self._combine((e_in, e_acc))
        return e + self.u * mag if self.sum else e

    def fused(self, e_in, e_acc, p, final=False, held=True):
        """p holds a partial result (error e_acc) (op) the decoded input,
        quantized: hop's bound with e_acc in place of the raw input's.
        ``held=False``: a final piece this rank sends but whose values are
        not part of its own result (a folded rank's Reduce_scatter shard)."""
        q, m = self._error(p, final)
        pre = self._combine((e_in, e_acc)) + (self.u * m if self.sum else 0.0)
        p.t[0], p.t[1], p.t[2] = pre, pre + q, m
        if final and held:
            self.final.append(p)

    def _many(self, trailers):
        """(error of the inputs, number of additions k, A) for the two-shot
        owner's reduction of own and k decoded messages; A = the sum of the
        decoded values' largest magnitudes (each message's mag plus its
        quantization bound)."""
        e = self._combine([float(t[1]) for t in trailers] + [self.e])
        A = sum(float(t[2]) + (float(t[1]) - float(t[0])) for t in trailers)
        return e, len(trailers), A

    def _adds(self, k, F, A):
        """Bound on the rounding of k additions in rank order whose computed
        result is at most F in magnitude: every exact partial sum is at
        most 2(|exact result| + A) (own may come last), so the error E <=
        2uk(F + E + A) / (1 - uk), i.e. E <= 2uk(F + A) / (1 - 3uk)
        (docs/ERROR.md)."""
        u = self.u
        if 3 * k * u >= 1:
            return math.inf
        with np.errstate(over="ignore"):            # beyond float64: Inf, no bound
            return 2 * u * k * (F + A) / (1 - 3 * k * u)

    def many(self, trailers, p, final=False):
        """p holds the owner's reduction of own and the messages with these
        trailers, quantized."""
        e, k, A = self._many(trailers)
        q, m = self._error(p, final)
        if self.sum:
            e += self._adds(k, m, A)
        p.t[0], p.t[1], p.t[2] = e, e + q, m
        if final:
            self.final.append(p)

    def result(self, lo, hi, out, skipped, block, e_in=None, trailers=None, e_own=None):
        """out (kernel view, elements [lo, hi) of the result) holds own (op)
        the decoded input(s) at full precision: the ring's last hop (e_in:
        the input's error, one addition; ``e_own``: own's error when own is
        a partial result, else the input's) or the two-shot owner's
        reduction (trailers); ``skipped`` blocks are left to the exact
        fix-up."""
        if trailers is None:
            e, k, A = self._combine((e_in, self.e if e_own is None else e_own)), 1, 0.0
        else:
            e, k, A = self._many(trailers)
        us, etas = self.store
        # per value its own result bounds the rounding: the largest finite
        # one covers every value that came out finite (Inf ones are not bounded)
        F = block_magnitudes(out, block, finite_only=True)
        F[skipped] = 0.0
        part = (F + etas) / (1 - us)               # |value before the store| per block
        b = e + us * part + etas
        if self.sum:        # the ring's one addition: u |result|; two-shot's k: _adds
            b += self.u * part / (1 - self.u) if trailers is None else self._adds(k, part, A)
        b[skipped] = 0.0
        self.results.append((lo, hi, b, np.array(skipped)))
        if b.size:
            v = float(b.max())
            self.local = max(self.local, v) if v == v else math.inf

    def finish(self):
        """The bound of every value this run produced and kept, as a float:
        for an all-gathered result the same on every rank."""
        uc, etac = self.cast
        best = self.local
        for p in self.final:
            best = max(best, float(p.t[1]) + uc * float(p.t[2]) + etac)
        # NaN (an Inf - Inf among the terms) would compare false: no bound
        return best * SLACK if best == best else math.inf

    def segments(self, fix):
        """(lo, hi, bound per block) of every piece of the result this rank
        holds (global numbering); ``fix`` for the blocks reduced exactly
        afterwards.  Reads the final pieces' bytes: valid until the
        workspace is reused."""
        uc, etac = self.cast
        out = []
        for lo, hi, b, skipped in self.results:
            b = b * SLACK
            b[skipped] = fix
            out.append((lo, hi, b))
        for p in self.final:
            qm = self.fmt.block_errors(p.w, self.rmode)
            if qm is None:
                out.append((p.lo, p.hi, np.full(-(-(p.hi - p.lo) // self.fmt.block), math.inf)))
                continue
            q, m = qm
            with np.errstate(invalid="ignore", over="ignore"):   # 0 * Inf: flagged, fixed below
                b = (float(p.t[0]) + q + uc * m + etac) * SLACK
            b[~(m < self.limit)] = fix
            out.append((p.lo, p.hi, b))
        return out


def to_blocks(segments, n, block, offset=0):
    """Per block of ``block`` values of an n-value result (counted from its
    start), the largest bound of the segments' blocks that overlap it;
    segments are (lo, hi, bounds) with blocks of ``block`` values from lo
    (the last may be short), in numbering shifted by ``offset``."""
    out = np.zeros(-(-n // block))
    for lo, hi, b in segments:
        lo -= offset
        starts = lo + np.arange(b.size) * block
        first = starts // block
        if lo % block == 0:
            out[first] = np.maximum(out[first], b)
        else:
            last = (np.minimum(starts + block, lo + (hi - lo)) - 1) // block
            np.maximum.at(out, first, b)
            np.maximum.at(out, last, b)
    return out


class Record:
    """What ``QuantizedComm.block_bounds`` needs of the last call: the
    result's length n, the block size, and ``segments`` (a list of (lo,
    hi, bound per block of ``block`` values from lo) in numbering shifted
    by ``offset``, or a function returning one, evaluated on demand)."""

    def __init__(self, n, block, segments, offset=0):
        self.n, self.block, self.offset, self._segments = n, block, offset, segments

    @classmethod
    def constant(cls, n, block, value):
        return cls(n, block, [(0, n, np.full(-(-n // block), float(value)))])

    def blocks(self, out=None):
        """The bound per block, into ``out`` (float64, ceil(n/block)) if given."""
        seg = self._segments() if callable(self._segments) else self._segments
        b = to_blocks(seg, self.n, self.block, self.offset)
        b[np.isnan(b)] = math.inf           # an Inf - Inf among the terms: no bound
        if out is None:
            return b
        if not (isinstance(out, np.ndarray) and out.dtype == np.float64
                and out.shape == b.shape):
            raise ValueError(f"equarx_mpi: block_bounds fills a float64 array of shape "
                             f"{b.shape}, not {getattr(out, 'shape', type(out).__name__)} "
                             f"{getattr(out, 'dtype', '')}".rstrip())
        out[...] = b
        return out
