"""Two-shot: one quantization by every sender, one by every owner.

Rank r owns shard r.  Every rank quantizes each other shard of its input
once and sends it straight to that shard's owner (scatter).  The owner
reduces, in one fused pass per block, the P-1 decoded contributions and
its own raw values at full precision, always in rank order 0..P-1 (its
own values in place r), quantizes its finished shard once and sends those
bytes to every other rank (all-gather); every rank, the owner too,
decodes the same bytes, so results are identical on every rank and from
call to call, and every rank knows the same flagged blocks.  A value is
quantized at most twice whatever P (the ring: P times).

Shards are cut into block-aligned pieces like the ring's (ring.Plan's
rules: ``chunks``, and ``max_message_bytes`` per message), each its own
message, so the owner reduces piece j while piece j+1 is on the wire.
All receives are posted up front into their own workspace slots; each
(sender, receiver, phase) stream keeps one order on both sides, so a tag
per phase suffices.  Workspace per rank: the sender's encoded message, the
owner's P-1 contributions to its shard and the P-1 other finished shards,
about (3 - 2/P) times the encoded message (docs in two_shot.Plan).
"""
import numpy as np
from mpi4py import MPI

from . import policy
from .ring import Piece, _fail, block_ranges, split_blocks

TAG_SCATTER, TAG_GATHER = 11, 12


class Stack:
    """Elements [lo, hi) of the owner's shard as received from the P-1 other
    ranks: ``parts`` (sender, message bytes), back to back in one buffer,
    and ``w`` the format's stacked views of them (rows in rank order)."""
    __slots__ = ("lo", "hi", "parts", "w")

    def __init__(self, lo, hi, parts, w):
        self.lo, self.hi, self.parts, self.w = lo, hi, parts, w


def _cuts(fmt, shards, chunks, block, max_piece_bytes):
    """The global (lo, hi) of every piece of every shard, as the ring cuts
    them: ``chunks`` pieces, more if a piece would exceed max_piece_bytes."""
    most = max(1, max_piece_bytes // fmt.nbytes(block))   # blocks per message
    cuts = []
    for off, length in shards:
        blocks = -(-length // block)
        want = max(chunks, -(-blocks // most))
        cuts.append([(off + lo, off + hi) for lo, hi in split_blocks(length, block, want)])
    return cuts


class Plan:
    """Where every piece lives, for one rank, one message shape and one
    kind: "allreduce", "reduce_scatter" (no all-gather; the owner reduces
    into the caller's output at full precision) or "allgather" (no scatter:
    each rank's own values are its finished shard).

    Workspace bytes per rank, E(x) being the encoded size of x values:
    scatter sends E(n - shard r), contributions (P-1) E(shard r), finished
    shards E(n) (allreduce and allgather only): at most (3 - 2/P) E(n) for
    equal shards, 0.76x the float32 message for int8 at block 256."""

    def __init__(self, kind, fmt, shards, rank, chunks, block, max_piece_bytes, workspace):
        P = len(shards)
        self.kind, self.P, self.rank = kind, P, rank
        cuts = _cuts(fmt, shards, chunks, block, max_piece_bytes)
        scatter = kind != "allgather"
        gather = kind != "reduce_scatter"
        others = [(rank + d) % P for d in range(1, P)]       # staggered: not all to rank 0 first
        size = lambda lo, hi: fmt.nbytes(hi - lo)             # noqa: E731
        total = 0
        if scatter:
            total += sum(size(*c) for s in others for c in cuts[s])
            total += (P - 1) * sum(size(*c) for c in cuts[rank])
        if gather:
            total += sum(size(*c) for pieces in cuts for c in pieces)
        self.workspace_bytes = total
        ws = workspace(total)
        at = 0

        def take(nbytes):
            nonlocal at
            at += nbytes
            return ws[at - nbytes:at]

        def piece(lo, hi):
            buf = take(size(lo, hi))
            return Piece(lo, hi, buf, fmt.views(buf, hi - lo))

        #: scatter sends as (destination, piece): piece j to every owner
        #: before piece j+1, so owners can start reducing early
        self.sends = []
        self.stacks = []
        if scatter:
            for j in range(max(len(cuts[s]) for s in range(P))):
                self.sends += [(s, piece(*cuts[s][j])) for s in others if j < len(cuts[s])]
            senders = [q for q in range(P) if q != rank]
            for lo, hi in cuts[rank]:
                nb = size(lo, hi)
                buf = take((P - 1) * nb)
                parts = [(q, buf[i * nb:(i + 1) * nb]) for i, q in enumerate(senders)]
                self.stacks.append(Stack(lo, hi, parts, fmt.stack_views(buf, hi - lo, P - 1)))
        #: this rank's finished shard, and the others' as (owner, piece)
        self.own = [piece(*c) for c in cuts[rank]] if gather else []
        self.gathers = [(s, piece(*c)) for s in others for c in cuts[s]] if gather else []
        self.others = others


def run(comm, plan, fmt, own, out, op, rmode, own_offset=0, out_offset=0):
    """Execute ``plan``.  own is the read-only input and out the output (kernel
    views); own[i] is global element i + own_offset, out[i] is i + out_offset.
    Returns the global (lo, hi) ranges of the blocks the final decodes
    skipped (flagged: Inf or NaN inside), for an exact fix-up."""
    try:
        return _run(comm, plan, fmt, own, out, op, rmode, own_offset, out_offset)
    except BaseException as exc:
        _fail(comm, exc)
        raise


def _run(comm, plan, fmt, own, out, op, rmode, own_offset, out_offset):
    r = plan.rank
    scattered = [[comm.Irecv(buf, q, TAG_SCATTER) for q, buf in st.parts]
                 for st in plan.stacks]
    gathered = [comm.Irecv(p.buf, s, TAG_GATHER) for s, p in plan.gathers]
    sends, flagged = [], []

    def decode(p):
        skipped = fmt.decode(p.w, out[p.lo - out_offset:p.hi - out_offset])
        flagged.extend(block_ranges(p, skipped, fmt.block))

    # Every read of own for other owners happens here, before any decode
    # writes into out (which may be own: in place).
    for dest, p in plan.sends:
        fmt.encode(own[p.lo - own_offset:p.hi - own_offset], p.w, rmode)
        sends.append(comm.Isend(p.buf, dest, TAG_SCATTER))
    for j, st in enumerate(plan.stacks):
        MPI.Request.Waitall(scattered[j])
        mine = own[st.lo - own_offset:st.hi - own_offset]
        if plan.kind == "reduce_scatter":
            skipped = fmt.decode_reduce_many(mine, r, st.w,
                                             out[st.lo - out_offset:st.hi - out_offset], op)
            flagged.extend(block_ranges(st, skipped, fmt.block))
            continue
        q = plan.own[j]
        fmt.decode_reduce_encode_many(mine, r, st.w, q.w, op, rmode)
        sends += [comm.Isend(q.buf, d, TAG_GATHER) for d in plan.others]
        decode(q)
    if plan.kind == "allgather":
        for q in plan.own:
            fmt.encode(own[q.lo - own_offset:q.hi - own_offset], q.w, rmode)
            sends += [comm.Isend(q.buf, d, TAG_GATHER) for d in plan.others]
            decode(q)
    for _ in gathered:                # decode pieces in the order they arrive
        decode(plan.gathers[MPI.Request.Waitany(gathered)][1])
    MPI.Request.Waitall(sends)
    return flagged


def warm(fmt, kdtype):
    """Compile (or load from cache) the many-input kernels for one element
    type, with the layouts ``run`` uses (one received message, at 2 ranks,
    makes contiguous header views; more make strided ones)."""
    n = 2 * fmt.block + 3
    src = np.zeros(n, kdtype)
    src.flags.writeable = False
    out = np.zeros_like(src)
    w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    for count in (1, 2):
        stack = fmt.stack_views(np.zeros(count * fmt.nbytes(n), np.uint8), n, count)
        fmt.decode_reduce_many(src, 1, stack, out, policy.KERNEL_OP["sum"])
        fmt.decode_reduce_encode_many(src, 1, stack, w, policy.KERNEL_OP["sum"],
                                      policy.ROUNDING["sum"])
