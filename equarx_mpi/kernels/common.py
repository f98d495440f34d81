"""Element helpers shared by every kernel: bit casts, 16-bit float
conversions, loads and stores in the accumulation type, reductions.

Element types seen by the kernels (the Python layer makes these views):

    float32, float64    as themselves
    bfloat16            as uint16 bits;  float32 = bitcast(uint32(bits) << 16)
    float16             as int16 bits;   converted by integer arithmetic
                        (numba has no float16 on the CPU, and a distinct
                        integer type lets one generic kernel dispatch on it)

Values are accumulated in float64 for float64 input and in float32 otherwise.
"""
import numpy as np
from numba import njit, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload

from equarx_mpi.names import (  # noqa: F401 (the kernels' codes)
    OP_MAX,
    OP_MIN,
    OP_SUM,
    ROUND_DOWN,
    ROUND_NEAREST,
    ROUND_STOCHASTIC,
    ROUND_UP,
)

CACHE = dict(cache=True, nogil=True)
#: For the kernels that allocate nothing: without numba's reference counting
#: (NRT), an array handed to an inlined helper costs no atomic incref/decref
#: calls, which LLVM cannot remove and which cost as much as a small block.
#: Such a kernel must not create arrays (views of its arguments are fine).
KERNEL = dict(CACHE, _nrt=False)
#: For the per-block helpers (emit, the block reductions): compiled once per
#: signature, inlined by LLVM (forceinline); numba's inline='always' retyped
#: them in every caller, half the warm-up (docs/PERFORMANCE.md "Cold start").
#: A helper calls wide_vectors() itself (LLVM vectorizes it before inlining);
#: callers pass arrays through ``readonly`` and constants as np.int64, so one
#: signature serves them all.
HELPER = dict(KERNEL, forceinline=True)


@intrinsic
def wide_vectors(typingctx):
    """Called first in a kernel: LLVM may vectorize it with the widest
    registers the CPU has.  LLVM's tuning for recent Xeons prefers 256 bits
    even where 512-bit registers exist (gcc -march=native does not); the
    function attribute "prefer-vector-width"="512" lifts that for this
    function only.  A CPU without AVX-512 keeps its widest (256 bits)."""
    def codegen(context, builder, sig, args):
        # llvmlite's attribute set (a set) admits only enum attributes by
        # name; a string attribute is printed as given, so add it past the
        # check.  Only a hint: should llvmlite change, the kernel stays right.
        attrs = builder.function.attributes
        if isinstance(attrs, set):
            set.add(attrs, '"prefer-vector-width"="512"')
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def readonly(typingctx, arr):
    """arr typed as a read-only array (the same data, no copy)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])
    return arr.copy(readonly=True)(arr), codegen


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


@njit(**CACHE)
def bf16_to_f32(h):
    return u32_as_f32(np.uint32(h) << np.uint32(16))


@njit(**CACHE)
def f32_to_bf16(f):
    u = f32_as_u32(f)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))  # quiet NaN
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@njit(**CACHE)
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


@njit(**CACHE)
def f32_to_f16(f):
    # Round to nearest even; after F. Giesen's float_to_half_fast3_rtne.
    # Branch-free (all three cases computed, then selected; uint32 kept
    # explicitly, numba widens integer arithmetic), so that loops storing
    # float16 vectorize.
    u = f32_as_u32(f)
    sign = u & np.uint32(0x80000000)
    u = np.uint32(u ^ sign)
    big = np.uint32(0x7E00) if u > np.uint32(0x7F800000) else np.uint32(0x7C00)
    magic = u32_as_f32(np.uint32(((127 - 15) + (23 - 10) + 1) << 23))
    small = np.uint32(f32_as_u32(u32_as_f32(u) + magic) - f32_as_u32(magic))
    odd = (u >> np.uint32(13)) & np.uint32(1)
    normal = np.uint32(np.uint32(u + np.uint32(((15 - 127) << 23) + 0xFFF) + odd)
                       >> np.uint32(13))
    o = big if u >= np.uint32((127 + 16) << 23) else (
        small if u < np.uint32(113 << 23) else normal)
    return np.int16(np.uint16(o | (sign >> np.uint32(16))))


# --- generic element access, resolved per array type at compile time --------

def load(arr, i):
    """arr[i] as the accumulation type."""


@overload(load, jit_options=CACHE)
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


@overload(store, jit_options=CACHE)
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
    """The IEEE bits of |x| as an unsigned integer of x's width; their
    unsigned order is the order of |x|, with Inf above every finite value
    and NaN above Inf."""


@overload(abs_bits, jit_options=CACHE)
def _abs_bits(x):
    if x == types.float32:
        # typed uint32 again: numba widens the & to 64 bits, and 64-bit
        # lanes halve the vector width of the loops that take maxima
        return lambda x: np.uint32(f32_as_u32(x) & np.uint32(0x7FFFFFFF))
    if x == types.float64:
        return lambda x: f64_as_u64(x) & np.uint64(0x7FFFFFFFFFFFFFFF)


def sign_code(x):
    """-1 if x's sign bit is set, else 0, as an int8 (the code of a zero in
    an all-zero block: it keeps -0.0)."""


@overload(sign_code, jit_options=CACHE)
def _sign_code(x):
    if x == types.float32:
        return lambda x: np.int8(-np.int32(f32_as_u32(x) >> np.uint32(31)))
    if x == types.float64:
        return lambda x: np.int8(-np.int64(f64_as_u64(x) >> np.uint64(63)))


def from_abs_bits(u, like):
    """Inverse of abs_bits; ``like`` (a value) only selects the type."""


@overload(from_abs_bits, jit_options=CACHE)
def _from_abs_bits(u, like):
    if like == types.float32:
        return lambda u, like: u32_as_f32(np.uint32(u))
    if like == types.float64:
        return lambda u, like: u64_as_f64(np.uint64(u))


def as_acc(arr, v):
    """v converted to the accumulation type of arr's elements."""


@overload(as_acc, jit_options=CACHE)
def _as_acc(arr, v):
    if arr.dtype == types.float64:
        return lambda arr, v: np.float64(v)
    return lambda arr, v: np.float32(v)


def out_limit(arr):
    """The smallest magnitude (accumulation type) that storing into arr
    rounds to Inf: Inf for float32/float64, the 16-bit types' overflow
    thresholds (65520 for float16) otherwise.  A decoded block whose
    largest magnitude reaches it is left to the exact path, so a value
    whose exact result is finite never comes back as Inf."""


@overload(out_limit, jit_options=CACHE)
def _out_limit(arr):
    dt = arr.dtype
    if dt == types.float32 or dt == types.float64:
        return lambda arr: as_acc(arr, np.inf)
    if dt == types.int16:
        return lambda arr: np.float32(65520.0)
    if dt == types.uint16:
        return lambda arr: u32_as_f32(np.uint32(0x7F7F8000))


def wire_abs_bits(arr, i):
    """|arr[i]|'s bits in arr's own element type, widened to uint64 (for a
    finiteness test without conversion); see ``wire_inf_bits``."""


@overload(wire_abs_bits, jit_options=CACHE)
def _wire_abs_bits(arr, i):
    dt = arr.dtype
    if dt == types.float32:
        return lambda arr, i: np.uint64(f32_as_u32(arr[i]) & np.uint32(0x7FFFFFFF))
    if dt == types.float64:
        return lambda arr, i: f64_as_u64(arr[i]) & np.uint64(0x7FFFFFFFFFFFFFFF)
    if dt == types.uint16 or dt == types.int16:
        return lambda arr, i: np.uint64(np.uint16(arr[i]) & np.uint16(0x7FFF))


def wire_inf_bits(arr):
    """The bits of +Inf in arr's element type (uint64)."""


@overload(wire_inf_bits, jit_options=CACHE)
def _wire_inf_bits(arr):
    inf = {types.float32: 0x7F800000, types.float64: 0x7FF0000000000000,
           types.uint16: 0x7F80, types.int16: 0x7C00}[arr.dtype]
    return lambda arr: np.uint64(inf)


@njit(inline='always', **CACHE)
def keep_or_skip(out, lo, m, vals, max_u, limit_u, b, skipped, flagged):
    """The end of a decode: store vals[:m] into out[lo:lo+m], unless their
    largest magnitude bits max_u reach limit_u (Inf/NaN, or too big for
    out); then leave out alone and note block b in skipped.  Returns the
    new count of skipped blocks."""
    if max_u >= limit_u:
        skipped[flagged] = b
        return flagged + 1
    for j in range(m):
        store(out, np.uint64(lo + j), vals[j])
    return flagged


@njit(**CACHE)
def reduce2(op, a, b):
    # Comparisons keep a NaN from either side, like numpy's maximum/minimum.
    if op == OP_SUM:
        return a + b
    if a != a or b != b:
        return a + b
    if op == OP_MAX:
        return a if a >= b else b
    return a if a <= b else b


# --- helpers of the int4, fp8 and affine formats ---------------------------------

def wide_tiny_lift(like):
    """(TINY, LIFT) in like's type for the int4, fp8 and affine formats: a
    block scale L / a with a < TINY could overflow (L up to 448), so the
    values and a are first multiplied by the power of two LIFT, which
    changes no rounding."""


@overload(wide_tiny_lift, jit_options=CACHE)
def _wide_tiny_lift(like):
    if like == types.float32:
        return lambda like: (np.float32(2.0 ** -100), np.float32(2.0 ** 64))
    if like == types.float64:
        return lambda like: (np.float64(2.0 ** -1000), np.float64(2.0 ** 128))


def acc_block(src, lo, m, scratch):
    """(values, offset): src[lo:lo+m] in the accumulation type, as src
    itself when it holds that type, else a converted copy in scratch."""


@overload(acc_block, jit_options=CACHE, inline='always')
def _acc_block(src, lo, m, scratch):
    if src.dtype == types.float32 or src.dtype == types.float64:
        return lambda src, lo, m, scratch: (src, lo)

    def converted(src, lo, m, scratch):
        for j in range(m):
            scratch[j] = load(src, np.uint64(lo + j))
        return scratch, 0
    return converted


def order_key(x):
    """A signed integer of x's width whose order is IEEE totalOrder of x:
    -NaN < -Inf < ... < -0.0 < +0.0 < ... < +Inf < +NaN (so block minima
    and maxima keep the sign of zeros and see every NaN)."""


@overload(order_key, jit_options=CACHE)
def _order_key(x):
    if x == types.float32:
        def k32(x):
            s = np.int32(f32_as_u32(x))
            return np.int32(s ^ ((s >> np.int32(31)) & np.int32(0x7FFFFFFF)))
        return k32
    if x == types.float64:
        def k64(x):
            s = np.int64(f64_as_u64(x))
            return s ^ ((s >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF))
        return k64


def from_order_key(k, like):
    """Inverse of order_key; ``like`` (a value) only selects the type."""


@overload(from_order_key, jit_options=CACHE)
def _from_order_key(k, like):
    if like == types.float32:
        def f32(k, like):
            s = np.int32(k)
            return u32_as_f32(np.int32(s ^ ((s >> np.int32(31)) & np.int32(0x7FFFFFFF))))
        return f32
    if like == types.float64:
        def f64(k, like):
            s = np.int64(k)
            return u64_as_f64(s ^ ((s >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF)))
        return f64


def cast_like(like, v):
    """v converted to the type of the float scalar ``like``."""


@overload(cast_like, jit_options=CACHE)
def _cast_like(like, v):
    if like == types.float32:
        return lambda like, v: np.float32(v)
    if like == types.float64:
        return lambda like, v: np.float64(v)
