"""Numba kernels: pure functions on contiguous 1-D arrays, nothing else.

Element types seen by the kernels (the Python layer makes these views):

    float32, float64    as themselves
    bfloat16            as uint16 bits;  float32 = bitcast(uint32(bits) << 16)
    float16             as int16 bits;   converted by integer arithmetic
                        (numba has no float16 on the CPU, and a distinct
                        integer type lets one generic kernel dispatch on it)

Values are accumulated in float64 for float64 input and in float32 otherwise.

int8 wire format of one piece of ``n`` values cut into blocks of ``B``
(the last block may be short), see docs/FORMAT.md:

    scale[b] = float32(absmax_b / 127)        absmax over the finite values
    code[i]  = clamp(rint(x[i] / scale[b]), -127, 127)      (half to even)
    x'[i]    = code[i] * scale[b]

An all-zero block has scale 0 and codes 0.  A block holding Inf or NaN is
*flagged*: its scale has the sign bit set and is float32(absmax / 126), its
finite values take codes in [-126, 126], and the codes 127, -127 and -128
stand for +Inf, -Inf and NaN.  Unflagged blocks never contain -128.

The ``op`` argument is 0 for SUM, 1 for MAX, 2 for MIN.  Kernels that read
and write a wire piece may be given the same piece twice (in place): each
block is read completely into ``scratch`` before any of it is written.
"""
import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

OP_SUM, OP_MAX, OP_MIN = 0, 1, 2
# Codes with a meaning of their own in flagged blocks (scale sign bit set).
CODE_POS_INF, CODE_NEG_INF, CODE_NAN = 127, -127, -128
_CACHE = dict(cache=True, nogil=True)


# --- bit casts --------------------------------------------------------------

def _make_bitcast(src_ty, dst_ty):
    # numba widens integer arithmetic to 64 bits, so integer arguments of any
    # width are first converted (truncated) to src_ty.
    @intrinsic
    def bitcast(typingctx, x):
        if not (x == src_ty or (isinstance(src_ty, types.Integer)
                                and isinstance(x, types.Integer))):
            return None

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], src_ty)
            return builder.bitcast(v, context.get_value_type(dst_ty))
        return dst_ty(x), codegen
    return bitcast


u32_as_f32 = _make_bitcast(types.uint32, types.float32)
f32_as_u32 = _make_bitcast(types.float32, types.uint32)
u64_as_f64 = _make_bitcast(types.uint64, types.float64)
f64_as_u64 = _make_bitcast(types.float64, types.uint64)


@njit(**_CACHE)
def bf16_to_f32(h):
    return u32_as_f32(np.uint32(h) << np.uint32(16))


@njit(**_CACHE)
def f32_to_bf16(f):
    u = f32_as_u32(f)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))  # quiet NaN
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@njit(**_CACHE)
def f16_to_f32(h):
    # Exact; after F. Giesen's half_to_float_fast.
    h32 = np.uint32(np.uint16(h))
    u = (h32 & np.uint32(0x7FFF)) << np.uint32(13)
    exp = u & np.uint32(0x0F800000)
    u = u + np.uint32(112 << 23)
    if exp == np.uint32(0x0F800000):          # Inf or NaN
        u = u + np.uint32(112 << 23)
        f = u32_as_f32(u)
    elif exp == np.uint32(0):                 # zero or subnormal
        u = u + np.uint32(1 << 23)
        f = u32_as_f32(u) - u32_as_f32(np.uint32(113 << 23))
    else:
        f = u32_as_f32(u)
    return u32_as_f32(f32_as_u32(f) | ((h32 & np.uint32(0x8000)) << np.uint32(16)))


@njit(**_CACHE)
def f32_to_f16(f):
    # Round to nearest even; after F. Giesen's float_to_half_fast3_rtne.
    u = f32_as_u32(f)
    sign = u & np.uint32(0x80000000)
    u = u ^ sign
    if u >= np.uint32((127 + 16) << 23):      # overflow, Inf or NaN
        o = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif u < np.uint32(113 << 23):            # subnormal or zero result
        magic = u32_as_f32(np.uint32(((127 - 15) + (23 - 10) + 1) << 23))
        o = f32_as_u32(u32_as_f32(u) + magic) - f32_as_u32(magic)
    else:
        odd = (u >> np.uint32(13)) & np.uint32(1)
        u = u + np.uint32(((15 - 127) << 23) + 0xFFF) + odd
        o = u >> np.uint32(13)
    return np.int16(np.uint16(o | (sign >> np.uint32(16))))


# --- generic element access, resolved per array type at compile time --------

def load(arr, i):
    """arr[i] as the accumulation type."""


@overload(load, jit_options=_CACHE)
def _load(arr, i):
    dt = arr.dtype
    if dt == types.float32 or dt == types.float64:
        return lambda arr, i: arr[i]
    if dt == types.uint16:
        return lambda arr, i: bf16_to_f32(arr[i])
    if dt == types.int16:
        return lambda arr, i: f16_to_f32(arr[i])


def store(arr, i, v):
    """arr[i] = v, rounded to nearest even in arr's type."""


@overload(store, jit_options=_CACHE)
def _store(arr, i, v):
    dt = arr.dtype
    if dt == types.float32 or dt == types.float64:
        def impl(arr, i, v):
            arr[i] = v
    elif dt == types.uint16:
        def impl(arr, i, v):
            arr[i] = f32_to_bf16(np.float32(v))
    elif dt == types.int16:
        def impl(arr, i, v):
            arr[i] = f32_to_f16(np.float32(v))
    return impl


def abs_bits(x):
    """The IEEE bits of |x| as an unsigned integer of x's width."""


@overload(abs_bits, jit_options=_CACHE)
def _abs_bits(x):
    if x == types.float32:
        # typed uint32 again: numba widens the & to 64 bits, and 64-bit
        # lanes halve the vector width of the loops that take maxima
        return lambda x: np.uint32(f32_as_u32(x) & np.uint32(0x7FFFFFFF))
    if x == types.float64:
        return lambda x: f64_as_u64(x) & np.uint64(0x7FFFFFFFFFFFFFFF)


def from_abs_bits(u, like):
    """Inverse of abs_bits; ``like`` (a value) only selects the type."""


@overload(from_abs_bits, jit_options=_CACHE)
def _from_abs_bits(u, like):
    if like == types.float32:
        return lambda u, like: u32_as_f32(np.uint32(u))
    if like == types.float64:
        return lambda u, like: u64_as_f64(np.uint64(u))


def as_acc(arr, v):
    """v converted to the accumulation type of arr's elements."""


@overload(as_acc, jit_options=_CACHE)
def _as_acc(arr, v):
    if arr.dtype == types.float64:
        return lambda arr, v: np.float64(v)
    return lambda arr, v: np.float32(v)


@njit(**_CACHE)
def _reduce(op, a, b):
    # Comparisons keep a NaN from either side, like numpy's maximum/minimum.
    if op == OP_SUM:
        return a + b
    if a != a or b != b:
        return a + b
    if op == OP_MAX:
        return a if a >= b else b
    return a if a <= b else b


# --- int8 block format --------------------------------------------------------
#
# Per block: one pass writes the values (in the accumulation type) to scratch
# and takes the maximum of their magnitude bits; a second pass quantizes
# scratch into the codes.  The rare cases (a reserved code in the input,
# non-finite values, all-zero or tiny blocks) are decided once per block and
# get loops of their own, so that the common loops are branch- and
# select-free and LLVM vectorizes them well.  Other measured speed notes:
#  - indices are cast to uint64: numba then skips the negative-index
#    wraparound, which otherwise turns vector loads into gathers; slicing
#    instead costs atomic reference-count updates on every block;
#  - inner loops call no helper that returns a tuple: LLVM does not
#    vectorize through those.

@njit(**_CACHE)
def _emit_block(acc, m, max_u, scales, b, codes, lo):
    """Quantize acc[:m], whose largest magnitude bits are max_u, into
    scales[b] and codes[lo:lo+m]."""
    inf_u = abs_bits(as_acc(acc, np.inf))
    finite = max_u < inf_u
    if not finite:
        max_u = inf_u - inf_u            # the absmax is over finite values
        for j in range(m):
            u = abs_bits(acc[j])
            if u < inf_u and u > max_u:
                max_u = u
    amax = from_abs_bits(max_u, as_acc(acc, 0))
    scale = np.float32(amax / (127 if finite else 126))
    if scale == 0 and amax > 0:
        scale = np.float32(1e-45)   # smallest subnormal; tiny blocks
    if finite:
        scales[b] = scale
        _quantize(acc, m, scale, codes, lo)
    else:
        scales[b] = u32_as_f32(f32_as_u32(scale) | np.uint32(0x80000000))
        _quantize_flagged(acc, m, scale, codes, lo)


@njit(error_model="numpy", **_CACHE)
def _quantize(acc, m, scale, codes, lo):
    """codes[lo:lo+m] = clamp(rint(acc[:m] / scale), -127, 127), all finite.

    With a normal finite scale no clamp is needed: the scale is absmax/127
    rounded once to float32, so |acc/scale| <= 127 (1 + 2**-23) and rint
    gives at most 127.  Other scales (subnormal, or infinite from a float64
    absmax) clamp first, which equals clamping after since rint is monotone
    and fixes +-127.  (error_model="numpy" drops the division-by-zero check:
    the scale is not 0 there.)"""
    s = as_acc(acc, scale)
    if s >= as_acc(acc, np.float32(1.1754944e-38)) and s < as_acc(acc, np.inf):
        for j in range(m):
            codes[np.uint64(lo + j)] = np.int8(np.rint(acc[j] / s))
    elif s == 0:
        for j in range(m):
            codes[np.uint64(lo + j)] = np.int8(0)
    else:
        lim = as_acc(acc, 127)
        for j in range(m):
            q = acc[j] / s
            q = q if q > -lim else -lim
            q = q if q < lim else lim
            codes[np.uint64(lo + j)] = np.int8(np.rint(q))


@njit(**_CACHE)
def _quantize_flagged(acc, m, scale, codes, lo):
    """A block holding Inf or NaN (rare): finite values clamp to +-126,
    +Inf -> 127, -Inf -> -127, NaN -> -128."""
    s = as_acc(acc, scale)
    lim = as_acc(acc, 126)
    for j in range(m):
        x = acc[j]
        if abs(x) < np.inf:
            if s == 0:
                c = 0
            else:
                q = x / s
                q = q if q > -lim else -lim
                q = q if q < lim else lim
                c = int(np.rint(q))
        elif x > 0:
            c = CODE_POS_INF
        elif x < 0:
            c = CODE_NEG_INF
        else:
            c = CODE_NAN
        codes[np.uint64(lo + j)] = np.int8(c)


@njit(**_CACHE)
def _decoder(acc, scale):
    """(|scale| in acc's type, whether the block is flagged)."""
    return as_acc(acc, abs(scale)), (f32_as_u32(scale) & np.uint32(0x80000000)) != 0


@njit(**_CACHE)
def _dequant_flagged(c, s, inf, nan):
    """Decoded code c of a flagged block; inf and nan typed like s."""
    if c == CODE_POS_INF:
        return inf
    if c == CODE_NEG_INF:
        return -inf
    if c == CODE_NAN:
        return nan
    return c * s


@njit(**_CACHE)
def i8_encode(src, scales, codes, block, scratch):
    """(scales, codes) = quantize(src)."""
    n = src.size
    nb = (n + block - 1) // block
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        max_u = abs_bits(as_acc(scratch, 0))
        for j in range(m):
            v = load(src, np.uint64(lo + j))
            scratch[j] = v
            max_u = max(max_u, abs_bits(v))
        _emit_block(scratch, m, max_u, scales, b, codes, lo)


@njit(**_CACHE)
def i8_decode(scales, codes, out, block, scratch):
    """out = dequantize(scales, codes)."""
    n = out.size
    nb = (n + block - 1) // block
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        s, flagged = _decoder(scratch, scales[b])
        inf, nan = as_acc(scratch, np.inf), as_acc(scratch, np.nan)
        if flagged:
            for j in range(m):
                i = np.uint64(lo + j)
                store(out, i, _dequant_flagged(codes[i], s, inf, nan))
        else:
            for j in range(m):
                i = np.uint64(lo + j)
                store(out, i, codes[i] * s)


@njit(**_CACHE)
def i8_decode_reduce(own, scales, codes, out, block, op, scratch):
    """out = own (op) dequantize(scales, codes); out may be own."""
    n = own.size
    nb = (n + block - 1) // block
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        s, flagged = _decoder(scratch, scales[b])
        inf, nan = as_acc(scratch, np.inf), as_acc(scratch, np.nan)
        if op != OP_SUM:
            for j in range(m):
                i = np.uint64(lo + j)
                d = _dequant_flagged(codes[i], s, inf, nan) if flagged else codes[i] * s
                store(out, i, _reduce(op, load(own, i), d))
        elif flagged:
            for j in range(m):
                i = np.uint64(lo + j)
                store(out, i, load(own, i) + _dequant_flagged(codes[i], s, inf, nan))
        else:
            for j in range(m):
                i = np.uint64(lo + j)
                store(out, i, load(own, i) + codes[i] * s)


@njit(**_CACHE)
def i8_decode_reduce_encode(own, scales_in, codes_in, scales_out, codes_out,
                            block, op, scratch):
    """(scales_out, codes_out) = quantize(own (op) dequantize(scales_in, codes_in)).

    The fused ring hop: one pass per block, in place allowed."""
    n = own.size
    nb = (n + block - 1) // block
    for b in range(nb):
        lo = b * block
        m = min(block, n - lo)
        s, flagged = _decoder(scratch, scales_in[b])
        inf, nan = as_acc(scratch, np.inf), as_acc(scratch, np.nan)
        max_u = abs_bits(as_acc(scratch, 0))
        if op != OP_SUM:
            for j in range(m):
                i = np.uint64(lo + j)
                d = _dequant_flagged(codes_in[i], s, inf, nan) if flagged else codes_in[i] * s
                v = _reduce(op, load(own, i), d)
                scratch[j] = v
                max_u = max(max_u, abs_bits(v))
        elif flagged:
            for j in range(m):
                i = np.uint64(lo + j)
                v = load(own, i) + _dequant_flagged(codes_in[i], s, inf, nan)
                scratch[j] = v
                max_u = max(max_u, abs_bits(v))
        else:
            for j in range(m):
                i = np.uint64(lo + j)
                v = load(own, i) + codes_in[i] * s
                scratch[j] = v
                max_u = max(max_u, abs_bits(v))
        _emit_block(scratch, m, max_u, scales_out, b, codes_out, lo)


# --- uncompressed wire formats (bfloat16 bits as uint16, or float32) --------

@njit(**_CACHE)
def plain_encode(src, wire):
    for i in range(src.size):
        store(wire, i, load(src, i))


@njit(**_CACHE)
def plain_decode(wire, out):
    for i in range(out.size):
        store(out, i, load(wire, i))


@njit(**_CACHE)
def plain_decode_reduce(own, wire, out, op):
    if op == OP_SUM:
        for i in range(own.size):
            store(out, i, load(own, i) + load(wire, i))
    else:
        for i in range(own.size):
            store(out, i, _reduce(op, load(own, i), load(wire, i)))


@njit(**_CACHE)
def plain_decode_reduce_encode(own, wire_in, wire_out, op):
    if op == OP_SUM:
        for i in range(own.size):
            store(wire_out, i, load(own, i) + load(wire_in, i))
    else:
        for i in range(own.size):
            store(wire_out, i, _reduce(op, load(own, i), load(wire_in, i)))
