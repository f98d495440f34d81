"""Plain numpy simulation of algorithm="two_shot"
(equarx_mpi/collectives/two_shot.py) on every wire, from the formats'
references (reference.py: int8, reference_formats.py: the block wires;
bf16 and fp32 are casts), and what a value sent once on a wire becomes
(reference_rabenseifner.py sends the same way)."""
import numpy as np
from reference import (
    BF16,
    _half_tiny,
    _nonfinite_blocks,
    _over_limit,
    alone,
    dequantize,
    finished,
    quantize,
    reduce,
    shard_cuts,
    shards,
    start,
    step_bound,
    unit_roundoff,
)
from reference_formats import CODECS


def _wire_dtype(wire, dtype):
    if wire == "fp32":
        return np.dtype(np.float32)
    return np.dtype(np.float16) if np.dtype(dtype) == np.float16 else BF16


def _send(x, block, rounding, wire, dtype, key=None):
    """(what the receiver decodes, the bound on its error) for values x
    (accumulation type) sent once on ``wire``."""
    if wire == "int8":
        h, c = quantize(x, block, rounding, key)
        return dequantize(h, c, block), step_bound(h, block, x.size, rounding)
    codec = CODECS.get(wire)
    if codec is not None:
        w = codec.quantize(x, block, rounding, key)
        return codec.dequantize(w, block), codec.bound(x, w, block, rounding)
    wd = _wire_dtype(wire, dtype)
    with np.errstate(over="ignore"):
        # the kernels store 16-bit wires through float32, as here
        w = (x.astype(np.float32) if wd.itemsize == 2 else x).astype(wd)
    back = w.astype(x.dtype)
    # twice the unit roundoff and the absolute floor: a float64 value may
    # round twice (via float32)
    tiny = 2.0 ** -150 if wd == np.float32 else _half_tiny(wd)
    return back, 2 * (unit_roundoff(wd) * np.abs(back.astype(np.float64)) + tiny)


def two_shot_allreduce(inputs, block, op="sum", with_bound=False, kind="allreduce",
                       wire="int8", keys=None):
    """What every rank of the two-shot schedule returns, for a list of
    per-rank arrays.  Owner s of shard s (shards as the ring's) reduces in
    rank order 0..P-1 the other ranks' values of shard s, each sent once on
    ``wire`` (quantized by its sender), and its own raw values, then sends
    the result once more; flagged blocks (Inf/NaN in any input or in the
    result) are NaN here.  kind "reduce_scatter": P shards of n/P values,
    and the owner's reduction is the result (not sent again).

    With with_bound, also (bound, flagged) like ring_allreduce: per value,
    the senders' quantization bounds, the rounding of every float addition
    (u |partial sum|), the owner's quantization bound and the final cast.
    ``keys``: each rank's call_key, for a SUM rounded stochastically."""
    if len(inputs) == 1:
        return alone(inputs, with_bound)
    P, dtype, u, own, rounding, result, bound = start(inputs, op, keys)
    edges = shard_cuts(result.size, P, block, kind)
    for s, sl, key in shards(edges, keys):
        if edges[s + 1] == edges[s]:
            continue
        part, bad = None, np.zeros(edges[s + 1] - edges[s], bool)
        for q in range(P):
            x = own[q][sl]
            bad |= _nonfinite_blocks(x, block)
            val = x
            if q != s:
                val, b = _send(x, block, rounding, wire, dtype, key(q))
                bound[sl] += b
            if part is None:
                part = val.copy()
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                part = reduce(op, part, val)
            if op == "sum":
                bound[sl] += u * np.abs(part.astype(np.float64))
        part = np.where(bad, np.nan, part).astype(result.dtype)
        if kind == "reduce_scatter":
            result[sl] = np.where(_over_limit(part, block, dtype), np.nan, part)
            continue
        dec, b = _send(part, block, rounding, wire, dtype, key(s))
        bound[sl] += b
        result[sl] = np.where(gone(part, dec, block, rounding, wire, dtype, key(s)), np.nan, dec)
    return finished(result, bound, inputs, with_bound)


def gone(part, dec, block, rounding, wire, dtype, key):
    """Which values of an owner's finished shard ``part`` (decoded by the
    others as ``dec``) the final decode into dtype skips: blocks whose
    header (largest magnitude) reaches out_limit(dtype), or that hold Inf
    or NaN."""
    if wire == "int8":
        heads = np.repeat(quantize(part, block, rounding, key)[0], block)[:part.size]
        return _over_limit(heads, 1, dtype)
    codec = CODECS.get(wire)
    if codec is not None:
        mags = codec.magnitude(codec.quantize(part, block, rounding, key), block, part.size)
        return _over_limit(mags, 1, dtype)
    return _nonfinite_blocks(dec, block)
