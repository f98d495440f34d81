"""The pipelined ring: reduce-scatter then all-gather, on any wire format.

Rank r owns shard r.  Reduce-scatter step k (k = 0..P-2): send the partial
sum of shard (r-k-1) to the right neighbour, receive shard (r-k-2) from the
left, reduce our own values into it and requantize it for the next step.
After the last step rank r holds shard r fully reduced; it quantizes it once
and the all-gather forwards those bytes unchanged around the ring, so every
rank (the owner included) decodes identical bytes into identical results,
and knows the same flagged blocks.

Every shard is cut into block-aligned pieces, each its own message: the
kernel of one piece runs while the next is on the wire, and a piece is
forwarded as soon as it is reduced (chunks of consecutive steps overlap).
All receives are posted up front into their own workspace slots.  Each link
carries messages in one order on both sides, so one tag suffices (MPI's
non-overtaking rule matches them in order).

Every message ends in the error bound of its values (bound.TRAILER): each
hop adds its own rounding to the trailer it received (bound.Tally), so the
all-gathered trailers bound the result, the same on every rank.
"""

from equarx_mpi.collectives import terms
from equarx_mpi.collectives.pieces import Piece, block_ranges, cut, message_bytes, waitall

TAG = 7


class Route:
    """Where each piece of each shard lives, for one rank, one message shape
    and one kind of operation.  Built once, reused by every call of that shape.

    kind: "allreduce" (2P slots), "reduce_scatter" (P slots: step 0 and one
    per receive step) or "allgather" (P slots, one per shard)."""

    def __init__(self, kind, fmt, shards, rank, chunks, block, max_piece_bytes,
                 workspace):
        P = len(shards)
        self.kind, self.P, self.rank = kind, P, rank
        cuts = cut(fmt, shards, chunks, block, max_piece_bytes)
        layout = []
        for pieces in cuts:
            offs, at = [], 0
            for lo, hi in pieces:
                offs.append(at)
                at += message_bytes(fmt, hi - lo)
            layout.append((offs, at))
        slot = max(total for _, total in layout)
        nslots = {"allreduce": 2 * P, "reduce_scatter": P, "allgather": P}[kind]
        self.workspace_bytes = nslots * slot
        ws = workspace(self.workspace_bytes)

        def pieces_in(k, s):
            base = k * slot
            out = []
            for (lo, hi), b in zip(cuts[s], layout[s][0]):
                nb = message_bytes(fmt, hi - lo)
                buf = ws[base + b:base + b + nb]
                out.append(Piece(lo, hi, buf, fmt.views(buf, hi - lo)))
            return out

        r = rank
        rs = kind in ("allreduce", "reduce_scatter")
        ag_base = P if kind == "allreduce" else 0
        self.rs_first = pieces_in(0, (r - 1) % P) if rs else []
        self.rs_steps = [pieces_in(k + 1, (r - k - 2) % P)
                         for k in range(P - 1)] if rs else []
        ag = kind in ("allreduce", "allgather")
        self.ag_own = pieces_in(ag_base + r, r) if ag else []
        self.ag_steps = [pieces_in(ag_base + (r - k - 1) % P, (r - k - 1) % P)
                         for k in range(P - 1)] if ag else []


def run(comm, route, fmt, own, out, op, rmode, tally, own_offset=0, out_offset=0):
    """Execute ``route``.  own is the read-only input and out the output (kernel
    views); own[i] is global element i + own_offset, out[i] is i + out_offset.
    Returns the global (lo, hi) ranges of the blocks the final decodes
    skipped (flagged: Inf or NaN inside), for an exact fix-up.  ``tally``
    (a bound.Tally) keeps the error bound."""
    P = route.P
    left, right = (route.rank - 1) % P, (route.rank + 1) % P
    recvs = [comm.Irecv(p.buf, left, TAG)
             for step in route.rs_steps + route.ag_steps for p in step]
    sends, flagged = [], []
    nxt = iter(recvs)

    def decode(p, dst):
        skipped = fmt.decode(p.w, dst)
        if skipped.size:
            flagged.extend(block_ranges(p, skipped, fmt.block))

    for p in route.rs_first:
        fmt.encode(own[p.lo:p.hi], p.w, rmode)
        tally.start(p)
        sends.append(comm.Isend(p.buf, right, TAG))
    for k, step in enumerate(route.rs_steps):
        last = k == P - 2
        for j, p in enumerate(step):
            next(nxt).Wait()
            mine = own[p.lo:p.hi]
            e_in = float(p.t[1])     # before the payload is rewritten in place
            if not last:
                fmt.decode_reduce_encode(mine, p.w, p.w, op, rmode)
                tally.hop(e_in, p)
                sends.append(comm.Isend(p.buf, right, TAG))
            elif route.kind == "reduce_scatter":
                res = out[p.lo - out_offset:p.hi - out_offset]
                skipped = fmt.decode_reduce(mine, p.w, res, op)
                tally.result(p.lo, p.hi, res, skipped, fmt.block, e_in=e_in)
                flagged.extend(block_ranges(p, skipped, fmt.block))
            else:
                q = route.ag_own[j]
                fmt.decode_reduce_encode(mine, p.w, q.w, op, rmode)
                tally.hop(e_in, q, final=True)
                sends.append(comm.Isend(q.buf, right, TAG))
                decode(q, out[q.lo:q.hi])
    if route.kind == "allgather":
        for q in route.ag_own:
            fmt.encode(own[q.lo - own_offset:q.hi - own_offset], q.w, rmode)
            tally.start(q, final=True)
            sends.append(comm.Isend(q.buf, right, TAG))
            decode(q, out[q.lo:q.hi])
    for k, step in enumerate(route.ag_steps):
        for p in step:
            next(nxt).Wait()
            if k < P - 2:
                sends.append(comm.Isend(p.buf, right, TAG))
            tally.final.append(p)
            decode(p, out[p.lo:p.hi])
    waitall(sends)
    return flagged


def seconds(hw, v, s, w, P, chunks):
    """Every rank encodes its pieces, runs P-1 fused hops and decodes P
    shards, while 2(P-1) ring steps move a shard's bytes each."""
    piece = v / P
    c = piece / chunks          # values per kernel call (the threads' parts)
    comp = piece * (hw.k("encode", c) + (P - 1) * hw.k("hop", c) + P * hw.k("decode", c))
    comm = 2 * (P - 1) * terms.step(hw, w * piece, chunks)
    return terms.overlap(comm, comp, chunks)


def variance(P):
    """Every value is requantized at P-1 hops holding partial sums of 1, 2,
    ..., P-1 inputs, and the owner quantizes the whole sum."""
    return (P + 1) / 2


SCHEDULE = terms.Schedule(
    "ring", seconds, variance, Route=Route, run=run,
    needs={"allreduce": ("encode", "decode_reduce_encode", "decode"),
           "reduce_scatter": ("encode", "decode_reduce_encode", "decode_reduce"),
           "allgather": ("encode", "decode")})
