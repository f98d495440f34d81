"""Two-shot: one quantization by every sender, one by every owner.

Rank r owns shard r (the ring's shards).  Every rank quantizes each other
shard of its input once and sends it straight to that shard's owner
(scatter).  The owner reduces, in one fused pass per block, the P-1
decoded contributions and its own raw values at full precision, always
in rank order 0..P-1 with its own values in place r, and quantizes its
finished shard once.  Those bytes travel unchanged around the ring
(all-gather, as in ring.py), and every rank, the owner too, decodes the
same bytes: results are identical on every rank and from call to call,
and every rank knows the same flagged blocks.  A value is quantized at
most twice whatever P (the ring: P times).

Shards are cut into pieces by the ring's rules (``chunks``, and
``max_message_bytes`` per message), each its own message, so the owner
reduces piece j while piece j+1 is on the wire.  All receives are posted
up front into their own workspace slots; each (sender, receiver, phase)
stream keeps one order on both sides, so a tag per phase suffices.

A format whose pieces vary in length (the error-bounded mode's "mixed")
sends only the bytes a piece uses (``fmt.message``) and restores a received
one (``fmt.received``); receives stay posted at the largest size.

Why the all-gather forwards around the ring instead of sending straight
to every rank: on the emulated 4 x 1 Gbit/s cluster the direct sends put
P-1 more TCP streams on every receiving link while the scatter's P-1 are
still arriving, and the whole call was 1.13x-1.25x slower at 16-64 MiB
(docs/results/two-shot-gather.txt); on shared memory the two were within
noise at those sizes.
"""
from equarx_mpi.collectives import terms
from equarx_mpi.collectives.pieces import Piece, block_ranges, cut, message_bytes, waitall

TAG_SCATTER, TAG_GATHER = 11, 12


class Stack:
    """Elements [lo, hi) of the owner's shard as received from the P-1 other
    ranks: ``parts`` (sender, message bytes), back to back in one buffer,
    ``w`` the format's stacked views of them (rows in rank order) and
    ``ts`` their trailers (bound.TRAILER)."""
    __slots__ = ("lo", "hi", "parts", "w", "ts")

    def __init__(self, lo, hi, parts, w):
        self.lo, self.hi, self.parts, self.w = lo, hi, parts, w
        self.ts = [Piece(lo, hi, buf, None).t for _, buf in parts]


class Route:
    """Where every piece lives, for one rank, one message shape and one
    kind: "allreduce" or "reduce_scatter" (no all-gather: the owner reduces
    into the caller's output at full precision, not requantized).

    Workspace bytes per rank, E(x) being the encoded size of x values and
    m the own shard: scatter sends E(n - m), contributions (P-1) E(m), and
    for an allreduce the finished shards E(n): (3 - 2/P) E(n) for equal
    shards, at most 0.76x the float32 message at int8 block 256 (the
    ring: 2 E(n))."""

    def __init__(self, kind, fmt, shards, rank, chunks, block, max_piece_bytes, workspace):
        if kind not in ("allreduce", "reduce_scatter"):
            raise ValueError(f"two_shot.Route: no kind {kind!r}")
        P = len(shards)
        self.kind, self.P, self.rank = kind, P, rank
        cuts = cut(fmt, shards, chunks, block, max_piece_bytes)
        others = [(rank + d) % P for d in range(1, P)]     # staggered: not all to rank 0 first
        size = lambda lo, hi: message_bytes(fmt, hi - lo)   # noqa: E731
        rest = sum(size(*c) for s in others for c in cuts[s])
        mine = sum(size(*c) for c in cuts[rank])
        total = rest + (P - 1) * mine
        if kind == "allreduce":
            total += mine + rest
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

        #: per piece index j, the scatter sends (owner, piece) of piece j
        self.sends = [[(s, piece(*cuts[s][j])) for s in others if j < len(cuts[s])]
                      for j in range(max(len(c) for c in cuts))]
        senders = [q for q in range(P) if q != rank]
        self.stacks = []
        for lo, hi in cuts[rank]:
            nb = size(lo, hi)
            buf = take((P - 1) * nb)
            parts = [(q, buf[i * nb:(i + 1) * nb]) for i, q in enumerate(senders)]
            self.stacks.append(Stack(lo, hi, parts, fmt.stack_views(buf, hi - lo, P - 1, nb)))
        #: this rank's finished shard; then, all-gather step k bringing
        #: shard r-k-1 from the left, as (k, piece)
        ag = kind == "allreduce"
        self.own = [piece(*c) for c in cuts[rank]] if ag else []
        self.gathers = [(k, piece(*c)) for k in range(P - 1)
                        for c in cuts[(rank - k - 1) % P]] if ag else []


def run(comm, route, fmt, own, out, op, rmode, tally, own_offset=0, out_offset=0):
    """Execute ``route``.  own is the read-only input and out the output (kernel
    views); own[i] is global element i + own_offset, out[i] is i + out_offset.
    Returns the global (lo, hi) ranges of the blocks the final decodes
    skipped (flagged: Inf or NaN inside), for an exact fix-up.  ``tally``
    (a bound.Tally) keeps the error bound, carried in every message's
    trailer as in ring.py."""
    P, r = route.P, route.rank
    left, right = (r - 1) % P, (r + 1) % P
    scattered = [[comm.Irecv(buf, q, TAG_SCATTER) for q, buf in st.parts]
                 for st in route.stacks]
    gathered = [comm.Irecv(p.buf, left, TAG_GATHER) for _, p in route.gathers]
    sends, flagged = [], []

    def post(j):
        # Own is read for other owners only here, and every piece is posted
        # before any decode writes other shards into out (own, in place).
        for dest, p in route.sends[j] if j < len(route.sends) else ():
            fmt.encode(own[p.lo - own_offset:p.hi - own_offset], p.w, rmode)
            tally.start(p)
            sends.append(comm.Isend(fmt.message(p.buf), dest, TAG_SCATTER))

    def decode(p):
        skipped = fmt.decode(p.w, out[p.lo:p.hi])
        flagged.extend(block_ranges(p, skipped, fmt.block))

    post(0)
    for j in range(max(len(route.sends), len(route.stacks))):
        # Piece j+1 goes out just before we wait for piece j: with every
        # piece posted at once, MPI interleaves them all on a link and the
        # first arrives near the end (measured on the emulated cluster),
        # leaving nothing to overlap.
        post(j + 1)
        if j >= len(route.stacks):
            continue
        st = route.stacks[j]
        waitall(scattered[j])
        for _, buf in st.parts:
            fmt.received(buf)
        mine = own[st.lo - own_offset:st.hi - own_offset]
        if route.kind == "reduce_scatter":
            res = out[st.lo - out_offset:st.hi - out_offset]
            skipped = fmt.decode_reduce_many(mine, r, st.w, res, op)
            tally.result(st.lo, st.hi, res, skipped, fmt.block, trailers=st.ts)
            flagged.extend(block_ranges(st, skipped, fmt.block))
            continue
        q = route.own[j]
        fmt.decode_reduce_encode_many(mine, r, st.w, q.w, op, rmode)
        tally.many(st.ts, q, final=True)
        sends.append(comm.Isend(fmt.message(q.buf), right, TAG_GATHER))
        decode(q)
    for (k, p), req in zip(route.gathers, gathered):
        req.Wait()
        fmt.received(p.buf)
        if k < P - 2:
            sends.append(comm.Isend(fmt.message(p.buf), right, TAG_GATHER))
        tally.final.append(p)
        decode(p)
    waitall(sends)
    return flagged


def seconds(hw, v, s, w, P, chunks):
    """Every rank encodes its input, its shard's owner reduces P-1 pieces in
    one pass, every rank decodes the result; the scatter sends P-1 pieces
    at once (across nodes over the node's one link), the all-gather takes
    the ring's P-1 steps."""
    piece = v / P
    c = piece / chunks
    comp = v * hw.k("encode", c) + (P - 1) * piece * hw.k("many", c) + v * hw.k("decode", c)
    b = w * piece
    scatter = (P - 1) * (chunks * hw.alpha + b * hw.beta) if hw.rpn > 1 else 0.0
    if hw.nodes > 1:
        # every rank of a node sends its pieces for the other nodes' ranks
        # over the node's one link
        away = P - hw.rpn
        scatter = max(scatter, away * chunks * hw.net_alpha + hw.rpn * away * b * hw.net_beta)
    gather = (P - 1) * terms.step(hw, b, chunks)
    return terms.overlap(scatter + gather, comp, chunks)


def variance(P):
    """P-1 senders quantize one input each, the owner the sum."""
    return 2 - 1 / P


SCHEDULE = terms.Schedule(
    "two_shot", seconds, variance, Route=Route, run=run,
    needs={"allreduce": ("encode", "decode_reduce_encode_many", "decode"),
           "reduce_scatter": ("encode", "decode_reduce_many")})
