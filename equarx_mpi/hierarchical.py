"""Node-aware AllReduce: exact inside each node, quantized between nodes.

Local rank i of every node owns slice i of the message (the shared window's
slices: whole cache lines, the same on every node of the same size):

 1. inside each node, an exact reduce-scatter through an MPI-3 shared
    window (shm.ShmAllreduce): local rank i sums slice i straight from its
    neighbours' memory, in a fixed order;
 2. between nodes, local rank i of every node runs the quantized AllReduce
    of slice i over the communicator of the i-th ranks (one per node), so
    every rank and every link works at once;
 3. inside each node, every rank copies the finished slices out.

Only traffic between nodes is quantized, so the error is that of the node
count, not the rank count.  The node sums travel in the input type (16-bit
input is rounded to it once before step 2), so a block that would overflow
a 16-bit result is caught by step 2's decode like any other.  Nodes must
hold the same number of ranks; ``usable`` says whether they do.
EQUARX_MPI_FAKE_NODES fakes a layout ("2x2": ranks 0-1 and 2-3 as two
nodes) so tests cover it on one machine.
"""
from mpi4py import MPI

from .shm import ShmAllreduce, split_nodes


class Hierarchy:
    """The communicators and window of the node-aware schedule on ``comm``
    (collective).  ``free()`` releases them."""

    def __init__(self, comm):
        local = split_nodes(comm)
        sizes = comm.allgather(local.Get_size())
        #: every node holds the same number of ranks (else the schedule is unusable)
        self.usable = len(set(sizes)) == 1
        leader = local.bcast(comm.Get_rank())          # names the node
        self.inter = comm.Split(local.Get_rank(), leader)
        self.nodes = self.inter.Get_size()
        self.ranks_per_node = local.Get_size()
        self.shm = ShmAllreduce(local) if self.usable else None
        local.Free()

    def free(self):
        if self.shm is not None:
            self.shm.free()
            self.shm = None
        if self.inter is not None:
            self.inter.Free()
            self.inter = None

    def allreduce(self, src, recv, op, between_nodes):
        """recv = op over every rank of src (src may be recv itself).
        ``between_nodes(comm, values)`` reduces a node's slice over the
        communicator of one rank per node, in place; every rank of that
        communicator holds a slice of the same size."""
        mine = self.shm.reduce_scatter(src, op)
        if self.nodes > 1 and mine.size:
            between_nodes(self.inter, mine)
        self.shm.allgather(recv)
