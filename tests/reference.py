"""Plain numpy reference of the int8 wire format (docs/FORMAT.md) and of the
ring schedule, written from the spec and independent of the numba kernels."""
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def acc_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def to_acc(x):
    return np.asarray(x).reshape(-1).astype(acc_dtype(np.asarray(x).dtype))


def quantize(v, block):
    """v: 1-D float32/float64 values (already in the accumulation type)."""
    v = np.asarray(v)
    n = v.size
    nb = -(-n // block)
    scales = np.zeros(nb, np.float32)
    codes = np.zeros(n, np.int8)
    for b in range(nb):
        blk = v[b * block:(b + 1) * block]
        finite = np.isfinite(blk)
        flagged = not finite.all()
        levels = 126 if flagged else 127
        amax = np.abs(blk[finite]).max() if finite.any() else blk.dtype.type(0)
        scale = np.float32(np.float64(amax) / levels)
        if scale == 0 and amax > 0:
            scale = np.float32(1e-45)
        s = blk.dtype.type(scale)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            q = np.zeros(blk.size) if s == 0 else np.clip(np.rint(blk / s), -levels, levels)
        q = np.where(blk == np.inf, 127, np.where(blk == -np.inf, -127, q))
        q = np.where(np.isnan(blk), -128, q)
        codes[b * block:(b + 1) * block] = q.astype(np.int8)
        scales[b] = -scale if flagged else scale
    return scales, codes


def dequantize(scales, codes, block, dtype=np.float32):
    """Values in the accumulation type of ``dtype``."""
    acc = acc_dtype(dtype)
    out = np.empty(codes.size, acc)
    for b in range(scales.size):
        sc = scales[b]
        flagged = bool(int(sc.view(np.uint32)) & 0x80000000)
        c = codes[b * block:(b + 1) * block]
        v = c.astype(acc) * acc(abs(sc))
        if flagged:
            v = np.where(c == 127, np.inf, np.where(c == -127, -np.inf, v))
            v = np.where(c == -128, np.nan, v).astype(acc)
        out[b * block:(b + 1) * block] = v
    return out


def reduce(op, a, b):
    if op == "sum":
        return a + b
    with np.errstate(invalid="ignore"):
        nan = np.isnan(a) | np.isnan(b)
        pick = np.where(a >= b, a, b) if op == "max" else np.where(a <= b, a, b)
        return np.where(nan, a + b, pick)


def cast_out(acc_values, dtype):
    return acc_values.astype(dtype)


def half_steps(scales, block, n):
    """Per value, half the quantization step its block used."""
    return np.repeat(np.abs(scales.astype(np.float64)) / 2, block)[:n]


def shard_edges(n, P, block):
    nb = -(-n // block)
    return [min(s * nb // P * block, n) for s in range(P + 1)]


def ring_allreduce(inputs, block, op="sum", with_bound=False):
    """What every rank of the int8 ring returns, for a list of per-rank
    arrays: simulates the same shards, order and requantization.  With
    with_bound, also the per-value error bound: half a step per quantization
    along the value's path."""
    P = len(inputs)
    dtype = inputs[0].dtype
    own = [to_acc(x) for x in inputs]
    n = own[0].size
    result = np.empty(n, acc_dtype(dtype))
    bound = np.zeros(n)
    if P == 1:
        result = inputs[0].copy()
        return (result, bound) if with_bound else result
    edges = shard_edges(n, P, block)
    for s in range(P):
        sl = slice(edges[s], edges[s + 1])
        m = edges[s + 1] - edges[s]
        # shard s starts at rank s+1 and travels right, ending at rank s
        first = (s + 1) % P
        wire = quantize(own[first][sl], block)
        bound[sl] += half_steps(wire[0], block, m)
        for hop in range(1, P):
            r = (first + hop) % P
            acc = reduce(op, own[r][sl], dequantize(*wire, block, dtype))
            wire = quantize(acc, block)
            bound[sl] += half_steps(wire[0], block, m)
        result[sl] = dequantize(*wire, block, dtype)
    result = cast_out(result, dtype).reshape(inputs[0].shape)
    return (result, bound) if with_bound else result
