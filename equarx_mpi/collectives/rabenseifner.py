"""Recursive halving then recursive doubling (Rabenseifner), quantized.

Why: the ring takes 2(P-1) steps and two-shot sends P-1 messages per rank
per phase, so at hundreds of ranks latency dominates; MPI libraries use
recursive halving / doubling there, 2 log2 P steps at the ring's bytes.
Quantized, every partial sum of 1, 2, 4, ... P/2 contributions is
quantized once by its sender and the finished shard once by its owner:
each halving step adds the rounding of P/2 senders, so the error grows
like E1 sqrt(1 + log2(P)/2) (docs/ALGORITHMS.md), between two-shot's
(flat) and the ring's (sqrt(P)).

Reduce-scatter by recursive halving on P' = 2^L ranks: at step k (distance
d = P'/2^(k+1)) a rank splits its region of shards in two, sends the half
its partner r ^ d keeps (quantized) and reduces the partner's half into
its own partial sums; the lower rank keeps the lower half, so rank r ends
owning shard r.  Partial sums kept past a step live at full precision in
an accumulator of the accumulation type (float32, float64 for float64):
the values a rank sends at the next step come out of one fused pass
(decode_reduce_encode: partial (op) received, requantized in place in the
received message), the ones it keeps out of decode_reduce into the
accumulator.  The owner's last pass quantizes its finished shard once
(Allreduce) or stores it at full precision (Reduce_scatter_block).

All-gather by recursive doubling: the owners' bytes are forwarded
unchanged, so every rank (the owner too) decodes identical bytes: results
identical on every rank and from call to call, and every rank knows the
same flagged blocks.

Any P (MPICH's MPIR_Allreduce_intra_reduce_scatter_allgather): with
rem = P - P', ranks 2i and 2i+1 (i < rem) pair up; 2i sends its whole
input, quantized, to 2i+1, which reduces it in (its first quantization is
of that sum) and takes part as rank i of the P'.  An Allreduce splits the
message into P' shards; 2i+1 sends 2i the finished bytes unchanged at the
end.  A Reduce_scatter_block keeps the caller's P shards: rank i of the P'
owns shards 2i and 2i+1, and sends shard 2i to rank 2i quantized once
more, as an all-gathered shard would be (so the folded rank's result
carries one quantization more than its partner's full-precision one).

Pipelining: every owner's shards are cut into pieces by the ring's rules
(pieces.cut); a message is a run of consecutive pieces (about ``chunks``
messages per step, none above ``max_message_bytes``), each piece with its
own bound trailer.  A step sends first the pieces its partner forwards
soonest (ordered by (owner ^ rank) descending), so a message goes on as
soon as its pieces are reduced.  All receives are posted up front into
their own workspace slots; each (sender, receiver, phase) stream keeps one
order on both sides, so a tag per phase suffices.

Flagged blocks (Inf/NaN, an overflowing partial sum, a MAX/MIN whose
partial holds Inf/NaN): a decode into the accumulator skips them and we
write NaN there, so the next quantization flags them again; the final
decodes skip them and return their ranges for the exact fix-up.
"""
import numpy as np

from equarx_mpi.bounds.bound import largest
from equarx_mpi.collectives import pieces, terms
from equarx_mpi.collectives.pieces import Piece, block_ranges, cut, message_bytes, waitall
from equarx_mpi.names import acc_dtype

TAG_FOLD, TAG_HALVE, TAG_GATHER, TAG_BACK = 21, 22, 23, 24


class Route:
    """Where every piece lives and which messages carry it, for one rank,
    one message shape and one kind ("allreduce" or "reduce_scatter").
    ``me``: this rank among the P' = 2^L taking part; -1 for a folded
    rank (2i, i < P - P'), which sends its input and receives its result.

    Workspace: the accumulator (a quarter of the message in the
    accumulation type, half on a rank that folds one in), the messages of
    the halving (about E(n), E(x) the encoded size of x values) and the
    all-gathered result E(n)."""

    def __init__(self, kind, fmt, shards, rank, chunks, block, max_piece_bytes, workspace):
        if kind not in ("allreduce", "reduce_scatter"):
            raise ValueError(f"rabenseifner.Route: no kind {kind!r}")
        P = len(shards)
        P2 = 1 << (P.bit_length() - 1)
        rem, L = P - P2, P2.bit_length() - 1
        self.kind, self.P, self.rank, self.L = kind, P, rank, L
        me = (rank // 2 if rank % 2 else -1) if rank < 2 * rem else rank - rem
        self.me, self.folds = me, 0 <= me < rem
        self.real = [2 * i + 1 if i < rem else i + rem for i in range(P2)]
        if kind == "allreduce":                # P' shards of whole blocks
            n = sum(length for _, length in shards)
            nb = -(-n // block)
            e = [min(i * nb // P2 * block, n) for i in range(P2 + 1)]
            units = [[(e[i], e[i + 1] - e[i])] for i in range(P2)]
        else:                                  # the caller's shards, two per folded pair
            units = [[shards[2 * i], shards[2 * i + 1]] if i < rem else [shards[i + rem]]
                     for i in range(P2)]
        #: every piece ("atom") as (lo, hi), owner by owner: owner t's are
        #: ids first[t]..first[t+1]-1, of which the first nfold[t] lie in
        #: shard 2t (a Reduce_scatter's folded pair)
        self.atoms, first, nfold = [], [0], []
        for u in units:
            per_shard = cut(fmt, u, chunks, block, max_piece_bytes)
            nfold.append(len(per_shard[0]) if len(u) == 2 else 0)
            self.atoms += [c for cs in per_shard for c in cs]
            first.append(len(self.atoms))
        size = [message_bytes(fmt, hi - lo) for lo, hi in self.atoms]

        def ids(owners):
            return [a for t in owners for a in range(first[t], first[t + 1])]

        def order(owners, i, mask):
            # first what the receiver forwards soonest
            return sorted(owners, key=lambda t: -((t ^ i) & mask))

        def half(k, keep):
            d = P2 >> (k + 1)
            base = me & ~(2 * d - 1)
            return order([t for t in range(base, base + 2 * d)
                          if ((t & d) == (me & d)) == keep], me, d - 1)

        # partial sums kept past a step: owners K_0 on a rank that folds, else K_1
        acc_ids = ids(half(0 if self.folds else 1, True)) if me >= 0 and (
            L >= 2 or self.folds and L >= 1) else []
        acc_t = np.dtype(acc_dtype(fmt.scratch.dtype))
        # (their owners are consecutive, listed in send order)
        self.acc_lo = min(self.atoms[a][0] for a in acc_ids) if acc_ids else 0
        acc_n = max(self.atoms[a][1] for a in acc_ids) - self.acc_lo if acc_ids else 0
        regions = {}                   # name -> atom ids in workspace order
        i = me if me >= 0 else rank // 2     # a folded rank's: its partner's
        if self.folds or me == -1:
            regions["fold"] = ids(order(range(P2), i, P2 - 1))
        G = [ids(half(k, False)) for k in range(L)] if me >= 0 else []
        K = [ids(half(k, True)) for k in range(L)] if me >= 0 else []
        if L and me >= rem:
            regions["send0"] = G[0]
        for k in range(len(K)):
            regions[f"recv{k}"] = K[k]
        if kind == "allreduce":
            regions["final"] = list(range(len(self.atoms)))
        elif self.folds or me == -1:
            regions["back"] = ids([i])[:nfold[i]]
        at = -(-acc_n * acc_t.itemsize // 8) * 8
        off = {}
        for name, a_ids in regions.items():
            off[name] = {}
            for a in a_ids:
                off[name][a] = at
                at += size[a]
        self.workspace_bytes = at
        ws = workspace(at)
        self.acc = ws[:acc_n * acc_t.itemsize].view(acc_t)
        # read as a kernel's input through a read-only view: numba compiles
        # writable and read-only arrays apart, and the ring's kernels read
        # read-only inputs, so float32/float64 need no signature of their own
        self.acc_ro = self.acc.view()
        self.acc_ro.flags.writeable = False
        self.slot = {}
        for name, a_ids in regions.items():
            self.slot[name] = {}
            for a in a_ids:
                lo, hi = self.atoms[a]
                buf = ws[off[name][a]:off[name][a] + size[a]]
                self.slot[name][a] = Piece(lo, hi, buf, fmt.views(buf, hi - lo))

        def msgs(name, a_ids):
            """The messages over these atoms, consecutive in region ``name``."""
            out = []
            for a, b in pieces.runs([size[x] for x in a_ids], chunks, max_piece_bytes):
                run = a_ids[a:b]
                lo, hi = off[name][run[0]], off[name][run[-1]] + size[run[-1]]
                if hi - lo != sum(size[x] for x in run):
                    raise AssertionError("rabenseifner.Route: a message's slots are not contiguous")
                out.append(pieces.Msg(ws[lo:hi], [(x, self.slot[name][x]) for x in run]))
            return out

        def gather(s, j):
            """What newrank s sends at all-gather step j (j = L: back to
            its folded partner): the region it held at step j-1 anew, then
            what it received at step j-1, forwarded as it arrives."""
            if j == 0:
                return msgs("final", ids([s]))
            h = 1 << (j - 1)
            base = s & ~(h - 1)
            return msgs("final", ids(range(base, base + h))) + gather(s ^ h, j - 1)

        self.fold = msgs("fold", regions["fold"]) if "fold" in regions else []
        #: per halving step: (partner, its messages to us, ours to it)
        self.steps = []
        for k in range(L if me >= 0 else 0):
            src = f"recv{k - 1}" if k else "fold" if self.folds else "send0"
            self.steps.append((self.real[me ^ (P2 >> (k + 1))], msgs(f"recv{k}", K[k]),
                               msgs(src, G[k])))
        self.G = [set(g) for g in G]

        def held(j):
            """Messages over the region newrank me held before all-gather step j."""
            h = 1 << j
            base = me & ~(h - 1)
            return msgs("final", ids(range(base, base + h)))

        #: all-gather step j: (partner, the held region's messages, the
        #: partner's messages to us); step 0's held region is ours, sent as
        #: each message is quantized
        self.gathers = [(self.real[me ^ (1 << j)], held(j - 1) if j else gather(me, 0),
                         gather(me ^ (1 << j), j))
                        for j in range(L)] if kind == "allreduce" and me >= 0 else []
        self.back_held, self.back_recv = [], []
        if kind == "allreduce" and self.folds:
            self.back_held = held(L - 1)
        elif kind == "allreduce" and me == -1:
            self.back_recv = gather(i, L)
        elif kind == "reduce_scatter" and (self.folds or me == -1):
            self.back_recv = msgs("back", regions["back"])   # the same on both sides


def run(comm, route, fmt, own, out, op, rmode, tally, own_offset=0, out_offset=0):
    """Execute ``route``.  own is the read-only input and out the output (kernel
    views); own[i] is global element i + own_offset, out[i] is i + out_offset.
    Returns the global (lo, hi) ranges of the blocks the final decodes
    skipped (flagged), for an exact fix-up.  ``tally`` (a bound.Tally)
    keeps the error bound, carried in every message's trailer."""
    B, me, rank = fmt.block, route.me, route.rank
    sends, flagged = [], []

    def post(msgs, src, tag):
        return [(m, comm.Irecv(m.buf, src, tag)) for m in msgs]

    def own_of(p):
        return own[p.lo - own_offset:p.hi - own_offset]

    def out_of(p):
        return out[p.lo - out_offset:p.hi - out_offset]

    def decode(p):
        skipped = fmt.decode(p.w, out_of(p))
        flagged.extend(block_ranges(p, skipped, B))

    def decode_final(m):
        """m holds finished bytes of owners: each piece part of the result."""
        for _, p in m.slots:
            tally.final.append(p)
            decode(p)

    if route.P == 1:                        # nothing to reduce (the engine copies instead)
        out[...] = own
        return flagged
    if me == -1:                            # folded: send the input, receive the result
        back = post(route.back_recv, rank + 1, TAG_BACK)
        for m in route.fold:
            for _, p in m.slots:
                fmt.encode(own_of(p), p.w, rmode)
                tally.start(p)
            sends.append(comm.Isend(m.buf, rank + 1, TAG_FOLD))
        for m, req in back:
            req.Wait()
            decode_final(m)
        waitall(sends)
        return flagged

    fold = post(route.fold, rank - 1, TAG_FOLD) if route.folds else []
    halves = [post(theirs, partner, TAG_HALVE) for partner, theirs, _ in route.steps]
    gathered = [post(theirs, partner, TAG_GATHER) for partner, _, theirs in route.gathers]
    # a message goes out as soon as its last piece is written
    trigger = {}
    for k, (partner, _, ours) in enumerate(route.steps):
        if k or route.folds:
            trigger.update((id(m.slots[-1][1]), (m, partner, TAG_HALVE)) for m in ours)
    if route.gathers:
        partner, ours, _ = route.gathers[0]
        trigger.update((id(m.slots[-1][1]), (m, partner, TAG_GATHER)) for m in ours)
    if route.kind == "reduce_scatter" and route.folds:
        trigger.update((id(m.slots[-1][1]), (m, rank - 1, TAG_BACK)) for m in route.back_recv)
    acc, acc_ro, acc_lo, L = route.acc, route.acc_ro, route.acc_lo, route.L
    e_acc = {}                              # atom -> bound of its partial sum in acc

    def written(p):
        t = trigger.get(id(p))
        if t is not None:
            sends.append(comm.Isend(t[0].buf, t[1], t[2]))

    def fused(a, p, q, final=False, held=True):
        """q = Q(partial of atom a (op) D(p)), q may be p."""
        e_in = float(p.t[1])                # before the payload is rewritten in place
        src = acc_ro[p.lo - acc_lo:p.hi - acc_lo] if a in e_acc else own_of(p)
        fmt.decode_reduce_encode(src, p.w, q.w, op, rmode, at=own_of(p))
        tally.fused(e_in, e_acc.get(a, tally.e), q, final, held)
        written(q)

    def accumulate(a, p):
        src = acc_ro[p.lo - acc_lo:p.hi - acc_lo] if a in e_acc else own_of(p)
        dst = acc[p.lo - acc_lo:p.hi - acc_lo]
        skipped = fmt.decode_reduce(src, p.w, dst, op)
        for b in skipped:                   # the next quantization flags them again
            dst[b * B:(b + 1) * B] = np.nan
        e_acc[a] = tally.partial(float(p.t[1]), e_acc.get(a, tally.e),
                                 largest(dst, finite_only=True))

    def finish(a, p):
        """Atom a of our own shard(s), fully reduced but for p."""
        if route.kind == "allreduce":
            q = route.slot["final"][a]
            fused(a, p, q, final=True)
            decode(q)
        elif a in route.slot.get("back", ()):
            fused(a, p, route.slot["back"][a], final=True, held=False)
        else:
            e_in = float(p.t[1])
            src = acc_ro[p.lo - acc_lo:p.hi - acc_lo] if a in e_acc else own_of(p)
            res = out_of(p)
            skipped = fmt.decode_reduce(src, p.w, res, op)
            tally.result(p.lo, p.hi, res, skipped, B, e_in=e_in, e_own=e_acc.get(a, tally.e))
            flagged.extend(block_ranges(p, skipped, B))

    def take(k, m):
        """A message of halving step k (k = -1: the fold) arrived."""
        for a, p in m.slots:
            if k + 1 < L and a in route.G[k + 1]:
                fused(a, p, p)              # in place: it is next step's message
            elif k == L - 1:
                finish(a, p)
            else:
                accumulate(a, p)

    for m, req in fold:
        req.Wait()
        take(-1, m)
    first = route.steps[0][2] if route.steps and not route.folds else []

    def post_first(j):
        # one message ahead of the one awaited: all at once, MPI interleaves
        # them on the link and the first arrives near the end (two_shot.py)
        if j < len(first):
            for _, p in first[j].slots:
                fmt.encode(own_of(p), p.w, rmode)
                tally.start(p)
            sends.append(comm.Isend(first[j].buf, route.steps[0][0], TAG_HALVE))

    post_first(0)
    for k, reqs in enumerate(halves):
        for j, (m, req) in enumerate(reqs):
            if k == 0:
                post_first(j + 1)
            req.Wait()
            take(k, m)
        if k == 0:
            for j in range(len(reqs) + 1, len(first)):
                post_first(j)
    if route.kind == "allreduce":
        steps = [(partner, ours, TAG_GATHER) for partner, ours, _ in route.gathers[1:]]
        if route.folds:
            steps.append((rank - 1, route.back_held, TAG_BACK))
        for j, (dest, ours, tag) in enumerate(steps):
            for m in ours:                  # what we held before: ready
                sends.append(comm.Isend(m.buf, dest, tag))
            for m, req in gathered[j]:      # what we just received: forwarded as it comes
                req.Wait()
                sends.append(comm.Isend(m.buf, dest, tag))
                decode_final(m)
        for m, req in gathered[len(steps)] if len(steps) < len(gathered) else ():
            req.Wait()
            decode_final(m)
    waitall(sends)
    return flagged


#: pairs ranks at distance P'/2 first (halving the distance with the
#: message); MPICH and Open MPI at distance 1 first (doubling it), which
#: keeps the large early steps on the node
FAR_FIRST = True


def seconds(hw, v, s, w, P, chunks):
    """Halving (a fused hop pass per received value), then doubling (every
    rank decodes all); P - P' ranks fold in: 2 steps of the whole message,
    an encode and a decode-reduce more."""
    Pp, halves = terms.pow2_floor(P), terms.halving(P, FAR_FIRST)
    comm = 2 * sum(terms.exchange(hw, w * v * f, chunks, d) for d, f in halves)
    if hw.threads == 1:
        comp = v * (hw.k("encode") / 2 + (1 - 1 / Pp) * hw.k("hop") + hw.k("decode"))
    else:
        # the same passes, in calls as large as each step's pieces: the
        # late steps' small pieces get fewer threads (costmodel.Hw.k)
        comp = v / 2 * hw.k("encode", v / 2 / chunks) + v / Pp * hw.k("decode", v / Pp / chunks)
        for _, f in halves:
            c = v * f / chunks
            comp += v * f * (hw.k("hop", c) + hw.k("decode", c))
    if P > Pp:
        comm += 2 * terms.exchange(hw, w * v, chunks, 1)
        comp += v * (hw.k("encode", v / chunks) + hw.k("decode_reduce", v / chunks))
    return terms.overlap(comm, comp, chunks)


def variance(P):
    """P'/2 per halving step (P'/2^k senders of sums of 2^(k-1) inputs), the
    owner's sum, a folded rank's input once more (model/errors.py)."""
    Pp = terms.pow2_floor(P)
    return 1 + (Pp.bit_length() - 1) / 2 + (P - Pp) / P


# "partial": the same kernels on partial sums in the accumulation type;
# its accumulator is one error feedback cannot follow
_NEEDS = ("encode", "decode_reduce_encode", "decode_reduce", "decode", "partial")
SCHEDULE = terms.Schedule("rabenseifner", seconds, variance, Route=Route, run=run,
                          needs={"allreduce": _NEEDS, "reduce_scatter": _NEEDS},
                          feedback=False, corrected_like="ring")
