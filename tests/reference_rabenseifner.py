"""Plain numpy simulation of algorithm="rabenseifner"
(equarx_mpi/collectives/rabenseifner.py), written from its description and
the wire formats' references (reference.py, reference_formats.py), used bit
for bit by tests/test_mpi_schedules.py.

Per shard, value by value: P' = the largest power of two <= P ranks take
part (rank i of them is rank 2i+1 for i < rem = P - P', else i + rem);
rank 2i first sends its input quantized to 2i+1, which adds it in.  At
halving step k (distance d = P'/2^(k+1)) every holder of the shard's
partial sum whose bit d differs from the owner's sends it, quantized once,
to its partner, which adds it to its own partial sum at full precision
(the accumulation type).  The owner quantizes the finished shard once
(Allreduce) or keeps it at full precision (Reduce_scatter_block; the
folded rank 2i's shard is quantized once more by 2i+1, which sends it).
Blocks that hold Inf or NaN at any point end flagged (NaN here)."""
import numpy as np
from reference import _nonfinite_blocks, _over_limit, alone, finished, reduce, start
from reference_two_shot import _send, gone


def owners(n, P, block, kind):
    """Per rank i of the P' taking part, the (lo, hi) segments it owns
    (blocks counted from each segment's start); and the map to real ranks."""
    P2 = 1 << (P.bit_length() - 1)
    rem = P - P2
    real = [2 * i + 1 if i < rem else i + rem for i in range(P2)]
    if kind == "allreduce":
        nb = -(-n // block)
        e = [min(i * nb // P2 * block, n) for i in range(P2 + 1)]
        return [[(e[i], e[i + 1])] for i in range(P2)], real
    m = n // P
    sh = [(s * m, (s + 1) * m) for s in range(P)]
    return [[sh[2 * i], sh[2 * i + 1]] if i < rem else [sh[i + rem]] for i in range(P2)], real


def _add(op, mine, dec, block):
    """mine (op) dec at full precision, whole blocks NaN where the result
    or (MAX/MIN) mine holds Inf or NaN: the kernels flag them."""
    with np.errstate(invalid="ignore", over="ignore"):
        part = reduce(op, mine, dec)
    bad = _nonfinite_blocks(part, block) | _nonfinite_blocks(mine, block)
    return np.where(bad, np.nan, part).astype(mine.dtype)


def rabenseifner_allreduce(inputs, block, op="sum", with_bound=False, kind="allreduce",
                           wire="int8", keys=None):
    """What the schedule returns (kind "reduce_scatter": the full-length
    result, rank s keeping shard s of n/P); with with_bound also (bound,
    flagged): per value the senders' quantization bounds along its tree,
    u |partial sum| per addition (SUM), the owner's quantization and the
    final cast.  ``keys``: each rank's call_key, for a SUM rounded
    stochastically."""
    if len(inputs) == 1:
        return alone(inputs, with_bound)
    P, dtype, u, own, rounding, result, bound = start(inputs, op, keys)
    segs, real = owners(result.size, P, block, kind)
    P2 = len(real)
    rem, L = P - P2, P2.bit_length() - 1
    for t, mine in enumerate(segs):
        for which, (lo, hi) in enumerate(mine):
            if hi == lo:
                continue
            sl = slice(lo, hi)

            def send(x, r):
                return _send(x, block, rounding, wire, dtype,
                             None if keys is None else (keys[r], lo))
            part, bnd = {}, {}
            for i in range(P2):
                x, b = own[real[i]][sl], np.zeros(hi - lo)
                if i < rem:                        # the fold
                    dec, q = send(own[2 * i][sl], 2 * i)
                    x = _add(op, x, dec, block)
                    b = q + (u * np.abs(x.astype(np.float64)) if op == "sum" else 0)
                part[i], bnd[i] = x, b
            for k in range(L):
                d = P2 >> (k + 1)
                for i in [i for i in part if (i & d) != (t & d)]:
                    j = i ^ d
                    dec, q = send(part.pop(i), real[i])
                    part[j] = _add(op, part[j], dec, block)
                    bnd[j] = bnd[j] + bnd.pop(i) + q
                    if op == "sum":
                        bnd[j] += u * np.abs(part[j].astype(np.float64))
            v, b = part[t], bnd[t]
            if kind == "reduce_scatter" and not (t < rem and which == 0):
                result[sl] = np.where(_over_limit(v, block, dtype), np.nan, v)
                bound[sl] = b
                continue
            key = None if keys is None else (keys[real[t]], lo)
            dec, q = _send(v, block, rounding, wire, dtype, key)
            result[sl] = np.where(gone(v, dec, block, rounding, wire, dtype, key), np.nan, dec)
            bound[sl] = b + q
    return finished(result, bound, inputs, with_bound)
