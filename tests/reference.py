"""Plain numpy reference of the wire formats (docs/FORMAT.md) and of the
ring schedule, written from the spec and independent of the numba kernels.

Besides the bits, ``ring_allreduce(..., with_bound=True)`` gives a rigorous
per-value error bound along each value's path: for every quantization half
a step plus the roundoff of encode and decode, for every float addition
its rounding, and the final cast to the output type."""
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
LEVELS = 127
#: |x - D(Q(x))| <= a/127 * (1/2 + STEP_ROUNDOFF * u) + TINY_ABS, for a block
#: with largest magnitude a, unit roundoff u of the accumulation type
#: (derivation in docs/FORMAT.md)
STEP_ROUNDOFF = 640


def acc_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def unit_roundoff(dtype):
    return {np.dtype(np.float64): 2.0 ** -53, np.dtype(np.float32): 2.0 ** -24,
            np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8}[np.dtype(dtype)]


def tiny_abs(acc):
    """Half the smallest subnormal of the accumulation type."""
    return 2.0 ** -150 if acc == np.float32 else 2.0 ** -1075


def to_acc(x):
    return np.asarray(x).reshape(-1).astype(acc_dtype(np.asarray(x).dtype))


def _tiny_lift(acc):
    return (acc(2.0 ** -120), acc(2.0 ** 64)) if acc == np.float32 else (
        acc(2.0 ** -1000), acc(2.0 ** 128))


# --- stochastic rounding (kernels/stochastic.py, formats.py) ---------------------------
GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def mix64(z):
    """splitmix64's finalizer, on a Python int or a uint64 array."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def call_key(seed, call, rank):
    """The key of a rank's call: seed, the call's number (0 for the first
    stochastic call of a QuantizedComm with that input type) and the rank
    absorbed in turn: z = mix64((z ^ v) + GOLDEN) from z = 0."""
    z = 0
    for v in (seed, call, rank):
        z = mix64(((z ^ v) + GOLDEN) & _MASK)
    return z


def uniforms(key, shape, acc):
    """The uniform numbers of values offset .. offset + size - 1 of the
    message (key = (call key, offset)), shaped: top bits of
    mix64(call key + (index + 1) * GOLDEN), k * 2^-24 (float32) or k * 2^-53."""
    base, offset = key
    n = int(np.prod(shape))
    g = np.arange(offset + 1, offset + 1 + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = mix64(np.uint64(base) + g * np.uint64(GOLDEN))
    if acc == np.float32:
        u = (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    else:
        u = (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return u.reshape(shape)


def stochastic(vp, q, a, levels, key):
    """Codes rounded stochastically: floor(q) + 1 with probability
    frac(q), clamped to +-levels, and +-a (the block's largest magnitude,
    a[:, None]) always +-levels."""
    acc = vp.dtype.type
    f = np.floor(q)
    u = uniforms(key, vp.shape, acc)
    c = f + np.where(u < q - f, acc(1), acc(0))
    c = np.clip(c, acc(-levels), acc(levels))
    return np.where(vp == a, acc(levels), np.where(vp == -a, acc(-levels), c))


def quantize(v, block, rounding="nearest", key=None):
    """v: 1-D float32/float64 values (already in the accumulation type).
    Returns (headers in v's type, int8 codes).  Vectorized over blocks; the
    arithmetic is the spec's, value by value.  rounding "stochastic" takes
    key = (call key, index of v[0] in the message)."""
    v = np.asarray(v)
    acc = v.dtype.type
    n = v.size
    nb = -(-n // block)
    vp = np.concatenate([v, np.zeros(nb * block - n, v.dtype)]).reshape(nb, block)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        finite = np.isfinite(vp).all(axis=1)
        a = np.where(finite, np.abs(np.where(np.isfinite(vp), vp, 0)).max(axis=1, initial=0),
                     acc(np.inf)).astype(v.dtype)
        tiny, big_lift = _tiny_lift(acc)
        lift = np.where(a < tiny, big_lift, acc(1)).astype(v.dtype)
        r = (acc(LEVELS) / (a * lift)).astype(v.dtype)
        q = (vp * lift[:, None]) * r[:, None]
        k = acc(1) / acc(LEVELS)
        if rounding == "nearest":
            c = np.rint(q)
        elif rounding == "stochastic":
            c = stochastic(vp, q, a[:, None], LEVELS, key)
        elif rounding == "up":
            c = np.minimum(np.ceil(q), acc(LEVELS))
            c = np.where((c * k) * a[:, None] < vp, c + 1, c)
        else:
            c = np.maximum(np.floor(q), acc(-LEVELS))
            c = np.where((c * k) * a[:, None] > vp, c - 1, c)
        c = np.where(finite[:, None] & (a[:, None] > 0), c, 0)
        c = np.where((a[:, None] == 0), -np.signbit(vp).astype(v.dtype), c)
    return a, c.astype(np.int8).reshape(-1)[:n]


def dequantize(heads, codes, block):
    """Values in the headers' type; flagged blocks decode as NaN here (the
    library leaves them to an exact reduction)."""
    acc = heads.dtype.type
    k = acc(1) / acc(LEVELS)
    a = np.repeat(heads, block)[:codes.size]
    with np.errstate(invalid="ignore"):
        out = (codes.astype(heads.dtype) * k) * a
    return np.where(np.isfinite(a), out, np.nan).astype(heads.dtype)


def step_bound(heads, block, n, rounding="nearest"):
    """Per value, the bound on |x - D(Q(x))| of its block (inf if flagged):
    half a step when rounding to nearest, a whole step when directed or
    stochastic."""
    acc = heads.dtype.type
    u = unit_roundoff(heads.dtype)
    a = np.repeat(heads.astype(np.float64), block)[:n]
    part = 0.5 if rounding == "nearest" else 1.0
    return a / LEVELS * (part + STEP_ROUNDOFF * u) + tiny_abs(acc)


def reduce(op, a, b):
    if op == "sum":
        return a + b
    with np.errstate(invalid="ignore"):
        nan = np.isnan(a) | np.isnan(b)
        pick = np.where(a >= b, a, b) if op == "max" else np.where(a <= b, a, b)
        return np.where(nan, a + b, pick)


def shard_edges(n, P, block):
    nb = -(-n // block)
    return [min(s * nb // P * block, n) for s in range(P + 1)]


ROUNDING = {"sum": "nearest", "max": "up", "min": "down"}


def start(inputs, op, keys):
    """What every simulated schedule starts from: (P, the input type, the
    accumulation type's unit roundoff, each rank's values in it, the
    rounding: stochastic for a SUM with ``keys``, else op's, and the
    result and bound to fill, in the accumulation type and float64)."""
    dtype = inputs[0].dtype
    acc = acc_dtype(dtype)
    own = [to_acc(x) for x in inputs]
    rounding = "stochastic" if keys is not None and op == "sum" else ROUNDING[op]
    n = own[0].size
    return len(inputs), dtype, unit_roundoff(acc), own, rounding, np.empty(n, acc), np.zeros(n)


def shard_cuts(n, P, block, kind):
    """Where the ring's and two-shot's P shards start and end: whole blocks
    balanced (Allreduce), or n/P values each (Reduce_scatter_block)."""
    return shard_edges(n, P, block) if kind == "allreduce" else [s * (n // P) for s in range(P + 1)]


def shards(edges, keys):
    """Per shard s: s, its slice, and key(r), rank r's key for its values
    (``keys``: each rank's call_key; None without)."""
    for s in range(len(edges) - 1):
        lo = edges[s]
        yield s, slice(lo, edges[s + 1]), (lambda r, lo=lo: None if keys is None else (keys[r], lo))


def alone(inputs, with_bound):
    """A simulated schedule on one rank: its input back, nothing lost."""
    out, n = inputs[0].copy(), inputs[0].size
    return (out, np.zeros(n), np.zeros(n, bool)) if with_bound else out


class Int8Codec:
    """The int8 format as a codec for ring_allreduce; other formats'
    codecs (reference_formats.py) have the same four methods."""

    @staticmethod
    def quantize(v, block, rounding="nearest", key=None):
        return quantize(v, block, rounding, key)

    @staticmethod
    def dequantize(wire, block):
        return dequantize(*wire, block)

    @staticmethod
    def bound(v, wire, block, rounding="nearest"):
        """Per value, the bound on |v - dequantize(quantize(v))|."""
        return step_bound(wire[0], block, v.size, rounding)

    @staticmethod
    def magnitude(wire, block, n):
        """Per value, the largest magnitude its block decodes to."""
        return np.repeat(wire[0], block)[:n]


INT8 = Int8Codec()


def ring_allreduce(inputs, block, op="sum", with_bound=False, kind="allreduce", codec=INT8,
                   keys=None):
    """What every rank of the ring returns, for a list of per-rank arrays
    and a wire format (``codec``, int8 by default): the same shards, order
    and requantization.  Blocks that end flagged (Inf/NaN) are NaN here;
    the library reduces them exactly.  ``keys``: each rank's call_key,
    for a SUM rounded stochastically.

    kind "reduce_scatter": the P*m inputs are cut into P shards of m (no
    block balancing) and the last hop reduces at full precision instead of
    quantizing; the full-length result is returned (rank s keeps shard s).

    With with_bound, also (bound, flagged): a rigorous per-value bound on
    |result - exact|, and which values were in flagged blocks."""
    if len(inputs) == 1:
        return alone(inputs, with_bound)
    P, dtype, u, own, rounding, result, bound = start(inputs, op, keys)
    edges = shard_cuts(result.size, P, block, kind)
    for s, sl, key in shards(edges, keys):
        m = edges[s + 1] - edges[s]
        # shard s starts at rank s+1 and travels right, ending at rank s
        first = (s + 1) % P
        wire = codec.quantize(own[first][sl], block, rounding, key(first))
        bound[sl] += codec.bound(own[first][sl], wire, block, rounding)
        for hop in range(1, P):
            r = (first + hop) % P
            with np.errstate(invalid="ignore", over="ignore"):
                part = reduce(op, own[r][sl], codec.dequantize(wire, block))
            if op != "sum":     # MIN(+Inf, x) is x: an own Inf or NaN keeps the block flagged
                part = np.where(_nonfinite_blocks(own[r][sl], block), np.nan, part)
            if op == "sum":                         # rounding of the addition
                bound[sl] += u * np.abs(part.astype(np.float64))
            if hop == P - 1 and kind == "reduce_scatter":
                result[sl] = np.where(_over_limit(part, block, dtype), np.nan, part)
                break
            wire = codec.quantize(part, block, rounding, key(r))
            bound[sl] += codec.bound(part, wire, block, rounding)
        else:
            dec = codec.dequantize(wire, block)
            heads = codec.magnitude(wire, block, m)
            result[sl] = np.where(_over_limit(heads, 1, dtype), np.nan, dec)
    return finished(result, bound, inputs, with_bound)


def finished(result, bound, inputs, with_bound):
    """A simulated schedule's return: the result (accumulation type, NaN
    where flagged) cast to the input type and shape, and with_bound also
    (bound plus the final cast's rounding, flagged)."""
    dtype = inputs[0].dtype
    flagged = np.isnan(result)
    with np.errstate(over="ignore", invalid="ignore"):
        out = result.astype(dtype)
    if np.dtype(dtype) != np.dtype(acc_dtype(dtype)):      # the final cast
        bound += unit_roundoff(dtype) * np.abs(out.astype(np.float64)) + _half_tiny(dtype)
    out = out.reshape(inputs[0].shape)
    return (out, bound, flagged) if with_bound else out


def out_limit(dtype):
    """Magnitudes from which a cast to dtype gives Inf (the library leaves
    blocks reaching it to the exact path)."""
    return {np.dtype(np.float16): 65520.0,
            BF16: float(np.array(0x7F7F8000, np.uint32).view(np.float32))}.get(
        np.dtype(dtype), np.inf)


def _over_limit(values, block, dtype):
    """Per value: does its block reach out_limit(dtype) (or hold Inf/NaN)?"""
    lim = out_limit(dtype)
    with np.errstate(invalid="ignore"):
        bad = [not (np.abs(values[i:i + block]) < lim).all() for i in range(0, values.size, block)]
    return np.repeat(bad, block)[:values.size]


def _half_tiny(dtype):
    """Half the smallest subnormal of a 16-bit type (the cast's absolute error floor)."""
    return 2.0 ** -25 if np.dtype(dtype) == np.float16 else 2.0 ** -134


def allgather(segments, block, codec=INT8, keys=None):
    """What the quantized Allgather returns: each segment quantized once by
    its owner (blocks start at the segment's start); ``keys``: each rank's
    call_key, for stochastic rounding."""
    out = []
    for r, seg in enumerate(segments):
        if keys is None:
            wire = codec.quantize(to_acc(seg), block)
        else:
            wire = codec.quantize(to_acc(seg), block, "stochastic", (keys[r], r * seg.size))
        out.append(codec.dequantize(wire, block).astype(seg.dtype))
    return np.concatenate(out)


def _nonfinite_blocks(x, block):
    """Per value: does its block (from x's start) hold Inf or NaN?"""
    bad = [not np.isfinite(x[i:i + block]).all() for i in range(0, x.size, block)]
    return np.repeat(bad, block)[:x.size]
