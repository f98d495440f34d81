"""What a quantized schedule declares (Schedule), and the cost terms the
schedules share.

A schedule's module declares one Schedule at its end; registry.py lists
them.  The cost model (model/physical.py, model/errors.py), the policy,
the options, the engine and the runner read that list, so a schedule is
one module plus one line in registry.py.

Cost terms are plain arithmetic on a layout's parameters ``hw`` (the cost
model's Hw: messages on the node ``alpha``/``beta``, over a node's link
``net_alpha``/``net_beta``, ``copy`` seconds per byte, ``sync`` a
barrier, ``nodes`` x ``rpn`` ranks, ``threads``, and ``k(name, values per
call)`` a kernel's seconds per value), so this layer imports no model.
Ranks are placed node by node (rank r on node r // rpn): a pair at
distance d < rpn exchanges on the node, and from rpn every rank of a node
crosses its link at once (``exchange``).  Pipelining in pieces overlaps
transfers with kernels (``overlap``).  No module here imports MPI: the
cost model and the policy read the declarations without starting it.
"""
from dataclasses import dataclass, field
from typing import Callable, Optional

#: shm.py's one-shot limit: below it every rank reduces all slots
ONESHOT_BYTES = 64 << 10


def _anywhere(layout, auto):
    return True


@dataclass(frozen=True)
class Schedule:
    """One quantized schedule, as the rest of the library sees it."""
    name: str
    #: seconds(hw, v, s, w, P, chunks): an Allreduce of v values of s bytes,
    #: w wire bytes per value, shards cut into ``chunks`` pieces; a
    #: ``nested`` one also gets the inner schedule's seconds function
    seconds: Callable
    #: variance(P): the sum of the variances quantized over the result's
    #: (model/errors.py: error = E1 sqrt(variance)); None for ``nested``
    variance: Optional[Callable] = None
    #: kind ("allreduce", "reduce_scatter", "allgather") -> the format's
    #: kernels run() calls (engine.warm compiles them); empty: the engine
    #: does not run it
    needs: dict = field(default_factory=dict)
    Route: Optional[type] = None          #: Route(kind, fmt, shards, rank, chunks, block, ...)
    run: Optional[Callable] = None        #: run(comm, route, fmt, own, out, op, rmode, tally, ...)
    kinds: tuple = ()                     #: the kinds it runs (default: those of ``needs``)
    feedback: bool = True                 #: it can carry an ErrorFeedback
    #: fits(layout, auto): whether it runs on this layout (``auto``: and
    #: whether algorithm="auto" should consider it there)
    fits: Callable = _anywhere
    #: in words, the calls it covers where ``fits`` says no
    covers: str = ""
    #: exact on each node, names.between_nodes' schedule between them
    nested: bool = False
    #: the schedule whose measured corrections it borrows where no profile
    #: measured it (costmodel.CORRECTED_LIKE)
    corrected_like: Optional[str] = None

    def __post_init__(self):
        if not self.kinds:
            object.__setattr__(self, "kinds", tuple(self.needs))

    def requantizes(self, kind):
        """Whether it requantizes partial sums at every hop for ``kind``:
        its kernels include the one-input fused hop (the ring's and
        rabenseifner's reductions; not two-shot's, whose owner quantizes a
        sum once, nor an all-gather's forwarding)."""
        return "decode_reduce_encode" in self.needs.get(kind, ())


def overlap(comm, comp, chunks):
    """A pipelined phase: the longer of the two, plus the part of the
    shorter that the pieces cannot hide."""
    return max(comm, comp) + min(comm, comp) / chunks


def step(hw, b, chunks):
    """One ring step moving b bytes in ``chunks`` messages: on a node a
    copy between neighbours; across nodes one pair per node crosses the
    link at the same time, the others copy."""
    t = chunks * hw.alpha + b * hw.beta if hw.rpn > 1 else 0.0
    if hw.nodes > 1:
        t = max(t, chunks * hw.net_alpha + b * hw.net_beta)
    return t


def crossing(hw, d):
    """How many ranks of a node have their partner at distance d (rank
    r ^ d) on another node, ranks placed node by node: none below rpn and
    all from rpn when rpn is a power of two; counted otherwise."""
    L = hw.rpn
    if hw.nodes == 1:
        return 0
    if L & (L - 1) == 0:
        return L if d >= L else 0
    return sum(1 for r in range(L) if (r ^ d) // L != 0)


def exchange(hw, b, msgs, d):
    """One step in which every rank swaps b bytes, in ``msgs`` messages,
    with rank r ^ d: a copy on the node, and the node's ranks whose
    partner is on another node share its link."""
    c = crossing(hw, d)
    t = msgs * hw.alpha + b * hw.beta if hw.rpn > c else 0.0
    if c:
        t = max(t, msgs * hw.net_alpha + c * b * hw.net_beta)
    return t


def pow2_floor(P):
    """P', the largest power of two <= P: the ranks left to recursive
    halving / doubling once the other P - P' are folded into partners."""
    return 1 << (int(P).bit_length() - 1)


def halving(P, far_first):
    """[(distance, fraction of the message)] of each step of a recursive
    halving reduce-scatter on P' = pow2_floor(P) ranks; its recursive
    doubling all-gather takes the same steps in reverse."""
    Pp = pow2_floor(P)
    return [((Pp >> k) if far_first else (1 << (k - 1)), 1.0 / (1 << k))
            for k in range(1, Pp.bit_length())]


def window(hw, n, P):
    """shm.py's exact Allreduce of n bytes through a shared window."""
    if n <= ONESHOT_BYTES:       # copy in, sync, every rank reduces all P slots
        return n * hw.copy + P * n * hw.copy / 2 + hw.sync
    # copy in, reduce (read every slot's slice, write one), copy out
    return 3 * n * hw.copy + 2 * hw.sync


def variant(hw, **changes):
    """A copy of hw with some parameters changed."""
    out = type(hw).__new__(type(hw))
    out.__dict__.update(hw.__dict__, **changes)
    return out
