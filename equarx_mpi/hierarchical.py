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

Error bound (docs/ERROR.md): a node sum of L values is off by at most
bound.mpi_sum(dtype, L, S), S the sum over local ranks of each one's
largest magnitude in the slice (one pass over each rank's input); the
quantized step between nodes carries that as its input's error, so its
bound covers both.  Ranks share the per-slice numbers through a small
shared window of their own, at the synchronizations steps 1 and 3 already
make: no extra message.
"""

import numpy as np
from mpi4py import MPI

from . import bound
from .calls import Counting
from .nodes import split_nodes
from .shm import ShmAllreduce


class Hierarchy:
    """The communicators and window of the node-aware schedule on ``comm``
    (collective).  ``free()`` releases them."""

    def __init__(self, comm):
        local = split_nodes(comm)
        sizes = comm.allgather(local.Get_size())
        #: every node holds the same number of ranks (else the schedule is unusable)
        self.usable = len(set(sizes)) == 1
        leader = local.bcast(comm.Get_rank())          # names the node
        # the library's counting kind (Split makes a plain one): its bytes
        # and its polite waits are the call's too
        self.inter = Counting(comm.Split(local.Get_rank(), leader))
        self.nodes = self.inter.Get_size()
        self.ranks_per_node = L = local.Get_size()
        self.shm = ShmAllreduce(local) if self.usable else None
        self._win = None
        if self.usable:
            # row k: node rank k's largest magnitude in every slice, then
            # the bound of its slice
            nbytes = 8 * L * (L + 1) if local.Get_rank() == 0 else 0
            self._win = MPI.Win.Allocate_shared(nbytes, 8, comm=local)
            mem, _ = self._win.Shared_query(0)
            self._table = np.frombuffer(mem, np.float64, L * (L + 1)).reshape(L, L + 1)
            self._win.Lock_all(MPI.MODE_NOCHECK)      # Sync is defined inside an epoch
        local.Free()

    def free(self):
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
        if self.shm is not None:
            self.shm.free()
            self.shm = None
        if self.inter is not None:
            self.inter.Free()
            self.inter = None

    def allreduce(self, src, recv, op, between_nodes):
        """recv = op over every rank of src (src may be recv itself), flat.
        ``between_nodes(comm, values, e)`` reduces a node's slice over the
        communicator of one rank per node, in place, and returns its error
        bound, given e, the bound of the values' own error; every rank of
        that communicator holds a slice of the same size.  Returns (the
        error bound of recv, the same on every rank; per slice (lo, hi,
        bound))."""
        L, me, n = self.ranks_per_node, self.shm.rank, src.size
        slices = [self.shm.bounds(n, src.dtype, k) for k in range(L)]
        sums = op == MPI.SUM and L > 1     # a node's MAX or MIN is exact
        table = self._table
        if sums:
            kd = bound.kernel_dtype(src.dtype)
            table[me, :L] = [bound.largest(src[lo:hi].view(kd)) for lo, hi in slices]
            self._win.Sync()
        mine = self.shm.reduce_scatter(src, op)        # synchronizes: rows written before
        e = 0.0
        if sums:
            self._win.Sync()
            # a plain float sum: Inf beyond float64 (fsum would raise); SLACK
            # covers its L roundings
            e = bound.mpi_sum(src.dtype, L, sum(table[:, me].tolist()) * bound.SLACK)
        table[me, L] = between_nodes(self.inter, mine, e) if self.nodes > 1 and mine.size else e
        self._win.Sync()
        self.shm.allgather(recv)                       # synchronizes: bounds written before
        self._win.Sync()
        per_slice = [(lo, hi, float(table[k, L])) for k, (lo, hi) in enumerate(slices)]
        return max(b for _, _, b in per_slice), per_slice
