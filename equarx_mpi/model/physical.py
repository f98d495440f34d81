"""The physical model: each method's seconds from a layout's parameters
(costmodel.Hw: messages on the node ``alpha``/``beta``, over a node's link
``net_alpha``/``net_beta``, copies, kernels ``k(name, values per call)``
over the rank's threads, barriers), and the
ideal exact MPI the speedups are measured against (``mpi_parts``).

A quantized schedule's time is its own declaration's (``seconds`` in its
module, collectives/registry.py lists them), from the terms they share
(collectives/terms.py: where ranks sit, pipelining in pieces).
"""
from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.collectives.terms import exchange, halving, pow2_floor, step, window


def mpi_parts(hw, n, P):
    """An ideal exact Allreduce's three algorithms, seconds each: "ring"
    (reduce-scatter + all-gather, 2(P-1) steps of n/P), "doubling"
    (recursive doubling, log2 P' steps of n) and "rabenseifner" (recursive
    halving + doubling at distance 1 first, 2 log2 P' steps moving
    2(1 - 1/P') n), sums at copy speed; the last two fold P - P' ranks in
    first (2 steps of n and a sum more), as MPICH does."""
    Pp = pow2_floor(P)
    fold = 2 * exchange(hw, n, 1, 1) + n * hw.copy if P > Pp else 0.0
    steps = halving(P, False)
    return {"ring": 2 * (P - 1) * step(hw, n / P, 1) + n * hw.copy,
            "doubling": fold + sum(exchange(hw, n, 1, d) + n * hw.copy for d, _ in steps),
            "rabenseifner": (fold + 2 * sum(exchange(hw, n * f, 1, d) for d, f in steps)
                             + n * hw.copy)}


def _mpi(hw, n, P):
    """An ideal exact Allreduce: the best of mpi_parts."""
    return min(mpi_parts(hw, n, P).values())


def _physical(method, hw, v, s, w, chunks, inner="two_shot"):
    """Seconds for an Allreduce of v values of s bytes, w wire bytes per
    value, on hw's layout, shards cut into ``chunks`` pieces; ``inner``:
    a nested schedule's schedule between nodes (names.between_nodes)."""
    P = hw.nodes * hw.rpn
    n = v * s
    if method == "mpi":
        return _mpi(hw, n, P)
    if method == "shm":
        return window(hw, n, P)
    sched = SCHEDULES.get(method)
    if sched is None:
        raise ValueError(f"no method {method!r}")
    if sched.nested:
        return sched.seconds(hw, v, s, w, P, chunks, SCHEDULES[inner].seconds)
    return sched.seconds(hw, v, s, w, P, chunks)
