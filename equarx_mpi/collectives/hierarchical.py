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

Blocks step 2 flags (Inf/NaN inside, or beyond the output's range) are
reduced afterwards by MPI over the whole communicator from every rank's
own input, not from the node results, so they are what MPI_Allreduce
gives, bit for bit.  A node's MAX or MIN can drop an infinity (MIN(+Inf,
x) is x), so for those each rank first notes the blocks of its input
holding Inf or NaN, and the owner of a slice makes them NaN in its node
result, which step 2 flags.  Every slice's flagged count travels in the
shared table; only when one is flagged do ranks share where.
EQUARX_MPI_FAKE_NODES fakes a layout ("2x2": ranks 0-1 and 2-3 as two
nodes) so tests cover it on one machine.

Error bound (docs/ERROR.md): a node sum of L values is off by at most
bound.mpi_sum(dtype, L, S), S the sum over local ranks of each one's
largest magnitude in the slice (one pass over each rank's input); the
quantized step between nodes carries that as its input's error, so its
bound covers both.  Ranks share the per-slice numbers through a small
shared window of their own, at the synchronizations steps 1 and 3 already
make: no extra message (an in-place call makes one barrier more inside the
node, to learn the flagged counts before step 3 overwrites its input).
"""

import numpy as np
from mpi4py import MPI

from equarx_mpi.bounds import bound
from equarx_mpi.collectives import exact
from equarx_mpi.collectives.counting import Counting
from equarx_mpi.collectives.nodes import layout, split_nodes
from equarx_mpi.collectives.shm import ShmAllreduce


class Hierarchy:
    """The communicators and window of the node-aware schedule on ``comm``
    (collective).  ``free()`` releases them."""

    def __init__(self, comm):
        self.comm = comm
        self.local = local = split_nodes(comm)
        lay, leader = layout(comm, local)
        #: every node holds the same number of ranks (else the schedule is unusable)
        self.usable = lay.uniform
        # the library's counting kind (Split makes a plain one): its bytes
        # and its polite waits are the call's too
        self.inter = Counting(comm.Split(local.Get_rank(), leader))
        self.nodes = self.inter.Get_size()
        self.ranks_per_node = L = local.Get_size()
        self.shm = ShmAllreduce(local) if self.usable else None
        self._win = None
        if self.usable:
            # row k: node rank k's largest magnitude in every slice (SUM),
            # or its count of blocks holding Inf/NaN there (MAX, MIN); then
            # the bound of its slice and its count of flagged values
            nbytes = 8 * L * (L + 2) if local.Get_rank() == 0 else 0
            self._win = MPI.Win.Allocate_shared(nbytes, 8, comm=local)
            mem, _ = self._win.Shared_query(0)
            self._table = np.frombuffer(mem, np.float64, L * (L + 2)).reshape(L, L + 2)
            self._win.Lock_all(MPI.MODE_NOCHECK)      # Sync is defined inside an epoch

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
            self.local.Free()
            self.inter = self.local = None

    def allreduce(self, src, recv, op, between_nodes, block):
        """recv = op over every rank of src (src may be recv itself), flat.
        ``between_nodes(comm, values, e)`` reduces a node's slice over the
        communicator of one rank per node, in place, given e, the bound of
        the values' own error; it leaves the blocks of ``block`` values it
        flags alone and returns (their (lo, hi) ranges, the same on every
        rank of that communicator; the error bound of the others).  Every
        rank of that communicator holds a slice of the same size.  Returns
        (the error bound of recv, the same on every rank; per slice (lo,
        hi, bound); the number of values reduced by MPI)."""
        L, me, n = self.ranks_per_node, self.shm.rank, src.size
        slices = [self.shm.bounds(n, src.dtype, k) for k in range(L)]
        sums = op == MPI.SUM and L > 1     # a node's MAX or MIN is exact
        table, kd = self._table, bound.kernel_dtype(src.dtype)
        if sums:
            table[me, :L] = [bound.largest(src[lo:hi].view(kd)) for lo, hi in slices]
        elif L > 1:
            held = [np.flatnonzero(bound.block_magnitudes(src[lo:hi].view(kd), block) == np.inf)
                    for lo, hi in slices]
            table[me, :L] = [h.size for h in held]
        self._win.Sync()
        mine = self.shm.reduce_scatter(src, op)        # synchronizes: rows written before
        self._win.Sync()
        e = 0.0
        if sums:
            # a plain float sum: Inf beyond float64 (fsum would raise); SLACK
            # covers its L roundings
            e = bound.mpi_sum(src.dtype, L, sum(table[:, me].tolist()) * bound.SLACK)
        elif L > 1 and table[:, :L].any():             # the same decision on the node
            for h in self.local.alltoall(held):
                mine[h * block] = np.nan
        flagged, b = between_nodes(self.inter, mine, e) if self.nodes > 1 and mine.size \
            else ([], e)
        table[me, L], table[me, L + 1] = b, sum(hi - lo for lo, hi in flagged)
        self._win.Sync()
        # step 3 overwrites an input in place: read the flagged values first
        early = np.may_share_memory(src, recv)
        if early:
            self.local.Barrier()
            self._win.Sync()
            idx = self._positions(slices[me][0], flagged)
            vals = src[idx]
        self.shm.allgather(recv)                       # synchronizes: bounds written before
        self._win.Sync()
        if not early:
            idx = self._positions(slices[me][0], flagged)
            vals = src[idx]
        fixed, fix = 0, 0.0
        if idx.size:         # every rank of every node agrees: slices flag alike
            fixed, fix = exact.fix_allreduce(self.comm, [(0, idx.size)], vals, vals, op)
            recv[idx] = vals
        per_slice = [(lo, hi, max(float(table[k, L]), fix if table[k, L + 1] else 0.0))
                     for k, (lo, hi) in enumerate(slices)]
        return max(b for _, _, b in per_slice), per_slice, fixed

    def _positions(self, lo, flagged):
        """Every slice's flagged positions, sorted, the same on every rank
        (this rank's slice starts at ``lo``)."""
        if not self._table[:, -1].any():
            return np.empty(0, np.int64)
        every = self.local.allgather([(lo + a, lo + b) for a, b in flagged])
        return np.concatenate([np.arange(a, b, dtype=np.int64)
                               for a, b in sorted(r for rs in every for r in rs)])
