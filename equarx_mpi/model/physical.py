"""The physical model: each method's seconds from a layout's parameters
(costmodel.Hw: messages on the node ``alpha``/``beta``, over a node's link
``net_alpha``/``net_beta``, copies, kernels ``k(name, values per call)``
over the rank's threads, barriers), and the
ideal exact MPI the speedups are measured against (``mpi_parts``).

Ranks are placed node by node (rank r on node r // rpn): a pair at
distance d < rpn exchanges on the node, and from rpn every rank of a node
crosses its link at once (``_exchange``).  Pipelining in pieces overlaps
transfers with kernels (``_overlap``).
"""
from equarx_mpi.model.errors import pow2_floor

#: shm.ONESHOT_BYTES (kept here so the model imports no MPI; a test checks)
ONESHOT_BYTES = 64 << 10


def _overlap(comm, comp, chunks):
    """A pipelined phase: the longer of the two, plus the part of the
    shorter that the pieces cannot hide."""
    return max(comm, comp) + min(comm, comp) / chunks


def _step(hw, b, chunks):
    """One ring step moving b bytes in ``chunks`` messages: on a node a
    copy between neighbours; across nodes one pair per node crosses the
    link at the same time, the others copy."""
    t = chunks * hw.alpha + b * hw.beta if hw.rpn > 1 else 0.0
    if hw.nodes > 1:
        t = max(t, chunks * hw.net_alpha + b * hw.net_beta)
    return t


def _ring(hw, v, s, w, P, chunks):
    piece = v / P
    c = piece / chunks          # values per kernel call (the threads' parts)
    comp = piece * (hw.k("encode", c) + (P - 1) * hw.k("hop", c) + P * hw.k("decode", c))
    comm = 2 * (P - 1) * _step(hw, w * piece, chunks)
    return _overlap(comm, comp, chunks)


def _two_shot(hw, v, s, w, P, chunks):
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
    gather = (P - 1) * _step(hw, b, chunks)
    return _overlap(scatter + gather, comp, chunks)


def _shm(hw, n, P):
    if n <= ONESHOT_BYTES:       # copy in, sync, every rank reduces all P slots
        return n * hw.copy + P * n * hw.copy / 2 + hw.sync
    # copy in, reduce (read every slot's slice, write one), copy out
    return 3 * n * hw.copy + 2 * hw.sync


def _crossing(hw, d):
    """How many ranks of a node have their partner at distance d (rank
    r ^ d) on another node, ranks placed node by node: none below rpn and
    all from rpn when rpn is a power of two; counted otherwise."""
    L = hw.rpn
    if hw.nodes == 1:
        return 0
    if L & (L - 1) == 0:
        return L if d >= L else 0
    return sum(1 for r in range(L) if (r ^ d) // L != 0)


def _exchange(hw, b, msgs, d):
    """One step in which every rank swaps b bytes, in ``msgs`` messages,
    with rank r ^ d: a copy on the node, and the node's ranks whose
    partner is on another node share its link."""
    c = _crossing(hw, d)
    t = msgs * hw.alpha + b * hw.beta if hw.rpn > c else 0.0
    if c:
        t = max(t, msgs * hw.net_alpha + c * b * hw.net_beta)
    return t


#: collectives/rabenseifner.py pairs ranks at distance P'/2 first (halving
#: the distance with the message); MPICH and Open MPI at distance 1 first
#: (doubling it), which keeps the large early steps on the node
RABENSEIFNER_FAR_FIRST = True


def _halving(P, far_first):
    """[(distance, fraction of the message)] of each step of a recursive
    halving reduce-scatter on P' = pow2_floor(P) ranks; its recursive
    doubling all-gather takes the same steps in reverse."""
    Pp = pow2_floor(P)
    return [((Pp >> k) if far_first else (1 << (k - 1)), 1.0 / (1 << k))
            for k in range(1, Pp.bit_length())]


def _rabenseifner(hw, v, s, w, P, chunks):
    """Recursive halving (each received value one fused hop pass), then
    recursive doubling of the owners' bytes, every rank decoding them all;
    P - P' ranks first send their whole input to a partner and get the
    result back at the end (2 steps of the whole message, an encode and a
    decode-reduce more)."""
    Pp = pow2_floor(P)
    comm = 2 * sum(_exchange(hw, w * v * f, chunks, d)
                   for d, f in _halving(P, RABENSEIFNER_FAR_FIRST))
    if hw.threads == 1:
        comp = v * (hw.k("encode") / 2 + (1 - 1 / Pp) * hw.k("hop") + hw.k("decode"))
    else:
        # the same passes, in calls as large as each step's pieces: the
        # late steps' small pieces get fewer threads (physical.Hw.k)
        comp = v / 2 * hw.k("encode", v / 2 / chunks) + v / Pp * hw.k("decode", v / Pp / chunks)
        for _, f in _halving(P, RABENSEIFNER_FAR_FIRST):
            c = v * f / chunks
            comp += v * f * (hw.k("hop", c) + hw.k("decode", c))
    if P > Pp:
        comm += 2 * _exchange(hw, w * v, chunks, 1)
        comp += v * (hw.k("encode", v / chunks) + hw.k("decode_reduce", v / chunks))
    return _overlap(comm, comp, chunks)


def mpi_parts(hw, n, P):
    """An ideal exact Allreduce's three algorithms, seconds each: "ring"
    (reduce-scatter + all-gather, 2(P-1) steps of n/P), "doubling"
    (recursive doubling, log2 P' steps of n) and "rabenseifner" (recursive
    halving + doubling at distance 1 first, 2 log2 P' steps moving
    2(1 - 1/P') n), sums at copy speed; the last two fold P - P' ranks in
    first (2 steps of n and a sum more), as MPICH does."""
    Pp = pow2_floor(P)
    fold = 2 * _exchange(hw, n, 1, 1) + n * hw.copy if P > Pp else 0.0
    steps = _halving(P, False)
    return {"ring": 2 * (P - 1) * _step(hw, n / P, 1) + n * hw.copy,
            "doubling": fold + sum(_exchange(hw, n, 1, d) + n * hw.copy for d, _ in steps),
            "rabenseifner": (fold + 2 * sum(_exchange(hw, n * f, 1, d) for d, f in steps)
                             + n * hw.copy)}


def _mpi(hw, n, P):
    """An ideal exact Allreduce: the best of mpi_parts."""
    return min(mpi_parts(hw, n, P).values())


def _variant(hw, **changes):
    """A copy of hw (costmodel.Hw) with some parameters changed."""
    out = type(hw).__new__(type(hw))
    out.__dict__.update(hw.__dict__, **changes)
    return out


def _physical(method, hw, v, s, w, chunks, inner="two_shot"):
    """Seconds for an Allreduce of v values of s bytes, w wire bytes per
    value, on hw's layout, shards cut into ``chunks`` pieces; ``inner``:
    hierarchical's schedule between nodes (names.between_nodes)."""
    P = hw.nodes * hw.rpn
    n = v * s
    if method == "mpi":
        return _mpi(hw, n, P)
    if method == "shm":
        return _shm(hw, n, P)
    if method in SCHEDULES:
        return SCHEDULES[method](hw, v, s, w, P, chunks)
    if method == "hierarchical":
        # exact halves on each node; between them one rank per node runs
        # ``inner`` on 1/L of the message, L such groups sharing a link
        between = _variant(hw, rpn=1, net_beta=hw.net_beta * hw.rpn)
        return (_shm(_variant(hw, nodes=1), n, hw.rpn)
                + SCHEDULES[inner](between, v / hw.rpn, s, w, hw.nodes, chunks))
    raise ValueError(f"no method {method!r}")


#: the quantized schedules over all ranks, by name
SCHEDULES = {"ring": _ring, "two_shot": _two_shot, "rabenseifner": _rabenseifner}
