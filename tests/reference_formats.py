"""Plain numpy reference of the int4, int3, int2, int5, int6, fp8 and affine wire formats
(docs/FORMAT.md), written from the spec and independent of the kernels:
e4m3 rounding by frexp/ldexp arithmetic, e4m3 bits from ml_dtypes'
float8_e4m3fn (its own conversion is correctly rounded from float32 but not
from float64, which it rounds through float32 first), block minima and
maxima from numpy on the IEEE total order.  Each format is a *codec* object that
reference.ring_allreduce can run the ring with:

    quantize(v, block, rounding) -> wire      v: 1-D float32/float64 values;
                                              wire = (headers, codes, n)
    dequantize(wire, block) -> values         NaN in flagged blocks
    bound(v, wire, block, rounding) -> per value, a rigorous bound on
                                        |v - dequantize(quantize(v))| (float64)
    magnitude(wire, block, n) -> per value, the largest magnitude its block
                                 decodes to (for the 16-bit output limit)

Arithmetic is the spec's, value by value, in the accumulation type (numpy
float32 operations are IEEE single precision)."""
import ml_dtypes
import numpy as np
from reference import stochastic, tiny_abs, unit_roundoff

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448
E4M3_MAX_CODE = 0x7E


def tiny_lift(acc):
    """Below TINY a block's scale L / a (or L / range) would overflow: values
    are first multiplied by the power of two LIFT (changes no rounding)."""
    return (acc(2.0 ** -100), acc(2.0 ** 64)) if acc == np.float32 else (
        acc(2.0 ** -1000), acc(2.0 ** 128))


def _blocks(v, block, fill=0):
    """v cut into rows of block values; the short last row padded with fill
    (a value of that row when fill is None)."""
    n = v.size
    nb = -(-n // block)
    pad = np.full(nb * block - n, v[-1] if fill is None and n else (fill or 0), v.dtype)
    return np.concatenate([v, pad]).reshape(nb, block)


def pack4(c):
    """Codes (integers in [-8, 15]) two per byte, the even index in the low nibble."""
    c = np.asarray(c).astype(np.int64) & 15
    if c.size % 2:
        c = np.append(c, 0)
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def unpack4(b, n, signed):
    b = np.asarray(b).view(np.uint8).astype(np.int64)
    c = np.empty(2 * b.size, np.int64)
    c[0::2], c[1::2] = b & 15, b >> 4
    c = c[:n]
    return np.where(c > 7, c - 16, c) if signed else c


# --- symmetric: int4 and fp8 -------------------------------------------------------

def _abs_max(vp):
    """Per block: the largest magnitude, +Inf when the block holds Inf or NaN."""
    acc = vp.dtype.type
    finite = np.isfinite(vp).all(axis=1)
    a = np.abs(np.where(np.isfinite(vp), vp, 0)).max(axis=1, initial=0)
    return np.where(finite, a, acc(np.inf)).astype(vp.dtype), finite


def _scaled(vp, a, levels):
    """(x * lift) * fl(levels / (a * lift)) per value, lift per block."""
    acc = vp.dtype.type
    tiny, big = tiny_lift(acc)
    lift = np.where(a < tiny, big, acc(1)).astype(vp.dtype)
    r = (acc(levels) / (a * lift)).astype(vp.dtype)
    return (vp * lift[:, None]) * r[:, None]


def _symmetric(v, block, levels):
    """A symmetric format's start: v's blocks, their largest magnitudes
    (+Inf where a block holds Inf or NaN), which blocks are finite, and the
    values scaled to +-levels."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        vp = _blocks(v, block)
        a, finite = _abs_max(vp)
        return vp, a, finite, _scaled(vp, a, levels)


class Int4:
    """Symmetric int4: header a = max |x|; code c = rint(x * fl(7 / a)) in
    [-7, 7], two per byte; decoded (c * fl(1/7)) * a."""
    L = 7
    ROUNDOFF = 40        # bound: a/7 * (1/2 + 40 u) + eta (docs/FORMAT.md)

    def quantize(self, v, block, rounding="nearest", key=None):
        v = np.asarray(v)
        acc = v.dtype.type
        n = v.size
        vp, a, finite, q = _symmetric(v, block, self.L)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            k = acc(1) / acc(self.L)
            A = a[:, None]
            if rounding == "nearest":
                c = np.rint(q)
            elif rounding == "stochastic":
                c = stochastic(vp, q, A, self.L, key)
            elif rounding == "up":
                c = np.minimum(np.ceil(q), acc(self.L))
                c = np.where((c * k) * A < vp, c + 1, c)
            else:
                c = np.maximum(np.floor(q), acc(-self.L))
                c = np.where((c * k) * A > vp, c - 1, c)
            c = np.where(finite[:, None] & (A > 0), c, 0)
            c = np.where(A == 0, -np.signbit(vp).astype(v.dtype), c)
        return a, self.pack(c.reshape(-1)[:n].astype(np.int64)), n

    def pack(self, c):
        return pack4(c)

    def unpack(self, b, n):
        return unpack4(b, n, signed=True)

    def dequantize(self, wire, block):
        a, packed, n = wire
        acc = a.dtype.type
        c = self.unpack(packed, n).astype(a.dtype)
        A = np.repeat(a, block)[:n]
        with np.errstate(invalid="ignore"):
            out = (c * (acc(1) / acc(self.L))) * A
        return np.where(np.isfinite(A), out, np.nan).astype(a.dtype)

    def bound(self, v, wire, block, rounding="nearest"):
        a = np.repeat(wire[0].astype(np.float64), block)[:v.size]
        u = unit_roundoff(wire[0].dtype)
        part = 0.5 if rounding == "nearest" else 1.0
        return a / self.L * (part + self.ROUNDOFF * u) + tiny_abs(wire[0].dtype.type)

    def magnitude(self, wire, block, n):
        return np.repeat(np.abs(wire[0]), block)[:n]


def pack_bits(c, width):
    """Codes as width-bit two's complement in one little-endian bit stream:
    code j at bits width*j.. of the piece (int3: 8 codes in 3 bytes, int2: 4
    in a byte, int5: 8 in 5 bytes, int6: 4 in 3); the last byte's unused
    high bits 0."""
    c = np.asarray(c).astype(np.int64) & ((1 << width) - 1)
    bits = ((c[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(bits, bitorder="little")


def unpack_bits(b, n, width):
    bits = np.unpackbits(np.asarray(b).view(np.uint8), bitorder="little")
    c = (bits[:width * n].reshape(n, width).astype(np.int64) << np.arange(width)).sum(axis=1)
    return np.where(c >= 1 << (width - 1), c - (1 << width), c)


class LowBit(Int4):
    """int3 (L = 3, 3-bit codes), int2 (L = 1, ternary, 2-bit codes), int5
    (L = 15, 5-bit) and int6 (L = 31, 6-bit): int4's coding with L levels
    each side, codes packed in a bit stream; bound a/L * (1/2 + (5L + 1) u)
    + eta (docs/FORMAT.md "int3 and int2")."""

    def __init__(self, levels, width):
        self.L, self.width, self.ROUNDOFF = levels, width, 5 * levels + 1

    def pack(self, c):
        return pack_bits(c, self.width)

    def unpack(self, b, n):
        return unpack_bits(b, n, self.width)


def e4m3_round(y):
    """y rounded to nearest even on the e4m3 grid (3 mantissa bits, smallest
    normal 2^-6, subnormal spacing 2^-9), saturating at 448, as e4m3 bits."""
    a = np.abs(y).astype(np.float64)          # exact: y is float32 or float64
    _, e = np.frexp(a)                        # a = f 2^e, f in [0.5, 1)
    e = np.maximum(e - 1, -6)                 # binade; subnormals share 2^-6's
    q = np.ldexp(np.rint(np.ldexp(a, 3 - e)), e - 3)
    q = np.minimum(q, E4M3_MAX)
    return np.copysign(q, y).astype(E4M3).view(np.uint8).astype(np.int64)


def e4m3_value(c, acc):
    """The value of e4m3 bits c, in acc (exact)."""
    return np.asarray(c, np.uint8).view(E4M3).astype(acc)


def _next_code(c, up):
    """The e4m3 code next above (up) or below c in value; +-448 stay."""
    c = c.astype(np.int64)
    neg, mag = c >= 0x80, c & 0x7F
    grow = np.minimum(mag + 1, E4M3_MAX_CODE)
    if up:
        return np.where(neg, np.where(mag == 0, 0x01, 0x80 | (mag - 1)), grow)
    return np.where(neg, 0x80 | grow, np.where(mag == 0, 0x81, mag - 1))


class Fp8:
    """e4m3 codes (ml_dtypes float8_e4m3fn bits): header a = max |x|; code =
    e4m3(x * fl(448 / a)), round to nearest even; decoded
    (e4m3_value(c) * fl(1/448)) * a."""

    def quantize(self, v, block, rounding="nearest", key=None):
        v = np.asarray(v)
        acc = v.dtype.type
        n = v.size
        vp, a, finite, y = _symmetric(v, block, E4M3_MAX)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            A = a[:, None]
            ok = finite[:, None] & (A > 0)
            c = e4m3_round(np.where(ok, y, 0))
            if rounding != "nearest":
                up = rounding == "up"
                k = acc(1) / acc(E4M3_MAX)
                val = e4m3_value(c, acc)
                c = np.where((val < y) if up else (val > y), _next_code(c, up), c)
                dec = (e4m3_value(c, acc) * k) * A
                c = np.where((dec < vp) if up else (dec > vp), _next_code(c, up), c)
            c = np.where(ok, c, 0)
            c = np.where(A == 0, np.signbit(vp) * 0x80, c)
        return a, c.reshape(-1)[:n].astype(np.uint8), n

    def dequantize(self, wire, block):
        a, c, _ = wire
        acc = a.dtype.type
        A = np.repeat(a, block)[:c.size]
        with np.errstate(invalid="ignore"):
            out = (e4m3_value(c, acc) * (acc(1) / acc(E4M3_MAX))) * A
        return np.where(np.isfinite(A), out, np.nan).astype(a.dtype)

    def bound(self, v, wire, block, rounding="nearest"):
        """Nearest: |x| (1/17 + 6u) + a/448 * 2^-10 (1 + 4u) + eta;
        directed: |x| (1/8 + 16u) + a/448 * 2^-9 (1 + 4u) + eta."""
        a = np.repeat(wire[0].astype(np.float64), block)[:v.size]
        u = unit_roundoff(wire[0].dtype)
        x = np.abs(v.astype(np.float64))
        if rounding == "nearest":
            rel, sub, c = 1 / 17, 2.0 ** -10, 6
        else:
            rel, sub, c = 1 / 8, 2.0 ** -9, 16
        return x * (rel + c * u) + a / E4M3_MAX * sub * (1 + 4 * u) + tiny_abs(
            wire[0].dtype.type)

    def magnitude(self, wire, block, n):
        return np.repeat(np.abs(wire[0]), block)[:n]


# --- affine: int8-affine and int4-affine ----------------------------------------------

def order_key(x):
    """Integers whose order is IEEE totalOrder of x: -NaN < -Inf < ... < -0 <
    +0 < ... < +Inf < +NaN."""
    s = x.view(np.int32 if x.dtype == np.float32 else np.int64)
    return s ^ ((s >> (8 * x.itemsize - 1)) & np.iinfo(s.dtype).max)


def from_order_key(k, dtype):
    s = k ^ ((k >> (8 * k.itemsize - 1)) & np.iinfo(k.dtype).max)
    return s.view(dtype)


class Affine:
    """Per block lo = min x, hi = max x (IEEE total order, so -0.0 < +0.0);
    codes t in [0, L] (L = 255, or 15 two per byte); decoded lo for t = 0,
    hi for t = L, else (lo*s + fl(t * fl(1/L)) * (hi*s - lo*s)) / s clamped
    to [lo, hi], where the power of two s is 1/2 when hi - lo overflows,
    LIFT when hi - lo < TINY, else 1 (docs/FORMAT.md)."""

    def __init__(self, levels):
        self.L = levels
        self.nibbles = levels < 16

    def _scale(self, lo, hi):
        """(base, range, 1/s, s) per block, all in the accumulation type."""
        acc = lo.dtype.type
        tiny, big = tiny_lift(acc)
        with np.errstate(invalid="ignore", over="ignore"):
            d = hi - lo
            s = np.where(d == np.inf, acc(0.5), np.where(d < tiny, big, acc(1))).astype(lo.dtype)
            base = lo * s
            return base, hi * s - base, (acc(1) / s).astype(lo.dtype), s

    def _decode(self, t, lo, hi, base, ds, inv_s):
        """Values of codes t (float array, per row of blocks); lo etc. [:, None]."""
        acc = lo.dtype.type
        k = acc(1) / acc(self.L)
        with np.errstate(invalid="ignore", over="ignore"):
            v = (base + (t * k) * ds) * inv_s
            v = np.where(v > hi, hi, v)
            v = np.where(v < lo, lo, v)
        return np.where(t == 0, lo, np.where(t == self.L, hi, v))

    def quantize(self, v, block, rounding="nearest", key=None):
        v = np.asarray(v)
        acc = v.dtype.type
        n = v.size
        L = acc(self.L)
        vp = _blocks(v, block, fill=None)
        key = order_key(vp)
        kinf = order_key(np.array([np.inf, -np.inf], v.dtype))
        klo, khi = key.min(axis=1), key.max(axis=1)
        flagged = (khi >= kinf[0]) | (klo <= kinf[1])
        lo = np.where(flagged, -np.inf, from_order_key(klo, v.dtype)).astype(v.dtype)
        hi = np.where(flagged, np.inf, from_order_key(khi, v.dtype)).astype(v.dtype)
        base, ds, inv_s, s = self._scale(lo, hi)
        LO, HI, B, DS, IS = (z[:, None] for z in (lo, hi, base, ds, inv_s))
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            q = (vp * s[:, None] - B) * (L / DS)
            if rounding == "nearest":
                t = np.rint(q)
            else:
                up = rounding == "up"
                t = np.minimum(np.ceil(q), L) if up else np.maximum(np.floor(q), acc(0))
                live = ~flagged[:, None] & (DS > 0)
                while True:      # decoded values rise with t; t = L (0) is exact
                    dec = self._decode(t, LO, HI, B, DS, IS)
                    move = live & ((t < L) & (dec < vp) if up else (t > 0) & (dec > vp))
                    if not move.any():
                        break
                    t = np.where(move, t + (1 if up else -1), t)
            const = (hi - lo == 0)[:, None]
        t = np.where(const, np.where(np.signbit(vp) == np.signbit(LO), 0, L), t)
        t = np.where(flagged[:, None], 0, t).reshape(-1)[:n].astype(np.int64)
        heads = np.stack([lo, hi], axis=1).reshape(-1)
        return heads, (pack4(t) if self.nibbles else t.astype(np.uint8)), n

    def codes(self, wire):
        heads, c, n = wire
        return unpack4(c, n, signed=False) if self.nibbles else c.astype(np.int64)

    def dequantize(self, wire, block):
        heads, _, n = wire
        lo, hi = heads[0::2], heads[1::2]
        base, ds, inv_s, _ = self._scale(lo, hi)
        rep = [np.repeat(z, block)[:n] for z in (lo, hi, base, ds, inv_s)]
        t = self.codes(wire).astype(heads.dtype)
        out = self._decode(t, *rep)
        return np.where(np.isfinite(rep[0]) & np.isfinite(rep[1]), out, np.nan).astype(
            heads.dtype)

    def bound(self, v, wire, block, rounding="nearest"):
        """Nearest: D/(2L) + 16 u D + 2 u M + 2 eta; directed: D/L + 32 u D
        + 4 u M + 2 eta, with D = hi - lo, M = max(|lo|, |hi|)."""
        heads = wire[0].astype(np.float64)
        lo = np.repeat(heads[0::2], block)[:v.size]
        hi = np.repeat(heads[1::2], block)[:v.size]
        u = unit_roundoff(wire[0].dtype)
        half = hi / 2 - lo / 2                   # D / 2 without overflow
        M = np.maximum(np.abs(lo), np.abs(hi))
        eta = tiny_abs(wire[0].dtype.type)
        if rounding == "nearest":
            return half * (1 / self.L + 32 * u) + 2 * u * M + 2 * eta
        return half * (2 / self.L + 64 * u) + 4 * u * M + 2 * eta

    def magnitude(self, wire, block, n):
        heads = np.abs(wire[0])
        return np.repeat(np.maximum(heads[0::2], heads[1::2]), block)[:n]


INT4, FP8, INT8_AFFINE, INT4_AFFINE = Int4(), Fp8(), Affine(255), Affine(15)
INT3, INT2, INT5, INT6 = LowBit(3, 3), LowBit(1, 2), LowBit(15, 5), LowBit(31, 6)
CODECS = {"int4": INT4, "fp8": FP8, "int8-affine": INT8_AFFINE, "int4-affine": INT4_AFFINE,
          "int3": INT3, "int2": INT2, "int5": INT5, "int6": INT6}
