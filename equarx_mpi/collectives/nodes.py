"""Where the ranks are: the communicator of a rank's node, and a faked
layout for tests (several "nodes" on one machine)."""
import os

import numpy as np
from mpi4py import MPI

from equarx_mpi.names import Layout

#: Fake node layout for tests, over COMM_WORLD ranks: "2x2" is 2 nodes of 2
#: ranks (ranks 0-1 node 0, 2-3 node 1), "3,1" nodes of 3 and 1 rank.
FAKE_NODES_ENV = "EQUARX_MPI_FAKE_NODES"


def layout(comm, node):
    """(the Layout of comm, this node's leader: the comm rank of its node
    rank 0), for ``node`` from split_nodes(comm).  Collective."""
    sizes = comm.allgather(node.Get_size())
    leader = node.bcast(comm.Get_rank())
    nodes = len(set(comm.allgather(leader)))
    return Layout(nodes, node.Get_size(), len(set(sizes)) == 1), leader


def in_turn(first, comm, fn):
    """fn() on the ``first`` ranks (one per node), then, after a Barrier on
    comm, on the others: numba's on-disk cache is written by one rank per
    node, never by several at once, and the others load it."""
    if first:
        fn()
    comm.Barrier()
    if not first:
        fn()


def parse_nodes(spec, size):
    """Node sizes from a layout string ("AxB" or "s0,s1,..."), checked
    against the world size."""
    try:
        if "x" in spec:
            a, b = spec.split("x")
            sizes = [int(b)] * int(a)
        else:
            sizes = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ValueError(f"{FAKE_NODES_ENV}={spec!r}: expected 'AxB' (A nodes of B ranks) "
                         f"or node sizes 's0,s1,...'") from None
    if min(sizes) < 1 or sum(sizes) != size:
        raise ValueError(f"node layout {spec!r} has {sum(sizes)} ranks in nodes of "
                         f"{sizes}; COMM_WORLD has {size}")
    return sizes


def split_nodes(comm, nodes=None):
    """The communicator of comm's ranks on this rank's node, ranked as in comm
    (collective; the caller frees it).  ``nodes`` (or $EQUARX_MPI_FAKE_NODES)
    fakes a layout over COMM_WORLD ranks, within the real nodes, so that node
    aware schedules can be tested on one machine."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    spec = (os.environ.get(FAKE_NODES_ENV) if nodes is None else nodes) or ""
    # a layout on some ranks only would have them Split alone: a hang
    specs = comm.allgather(spec)
    if len(set(specs)) > 1:
        local.Free()
        shown = ", ".join(f"rank {r}: {s!r}" for r, s in enumerate(specs))
        raise ValueError(f"equarx_mpi: {FAKE_NODES_ENV} differs between ranks ({shown})")
    if not spec:
        return local
    world = MPI.COMM_WORLD
    ends = np.cumsum(parse_nodes(spec, world.Get_size()))
    color = int(np.searchsorted(ends, world.Get_rank(), side="right"))
    fake = local.Split(color, comm.Get_rank())
    local.Free()
    return fake
