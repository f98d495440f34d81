"""The quantized schedules, by name: the one list that options, policy,
engine, runner and cost model read (docs/ALGORITHMS.md "Adding a schedule
or a wire").  Each module declares its terms.Schedule; the order is
algorithm="auto"'s order of candidates.

The node-aware schedule is declared here: it runs on the shared window
(shm.py) and another schedule between nodes, by its own runner
(running.py), so it has no kernels or route of its own, and its module
needs MPI, which the declarations do without."""
from equarx_mpi.collectives import rabenseifner, ring, terms, two_shot

#: a call's name -> the kind of collective a schedule runs for it
KINDS = {"Allreduce": "allreduce", "Reduce_scatter_block": "reduce_scatter",
         "Allgather": "allgather"}


def _hierarchical_seconds(hw, v, s, w, P, chunks, inner):
    """Exact halves on each node; between them one rank per node runs
    ``inner`` on 1/L of the message, L such groups sharing a link."""
    between = terms.variant(hw, rpn=1, net_beta=hw.net_beta * hw.rpn)
    return (terms.window(terms.variant(hw, nodes=1), v * s, hw.rpn)
            + inner(between, v / hw.rpn, s, w, hw.nodes, chunks))


def _hierarchical_fits(layout, auto):
    """Nodes of equal size; with one rank per node it is two-shot plus a
    window step that sums nothing: never worth it under auto."""
    return (layout.uniform and not layout.one_node
            and (not auto or layout.ranks_per_node > 1))


HIERARCHICAL = terms.Schedule(
    "hierarchical", _hierarchical_seconds, kinds=("allreduce",), feedback=False,
    fits=_hierarchical_fits, covers="Allreduce across nodes of equal size", nested=True)

SCHEDULES = {s.name: s for s in (ring.SCHEDULE, two_shot.SCHEDULE, rabenseifner.SCHEDULE,
                                 HIERARCHICAL)}
