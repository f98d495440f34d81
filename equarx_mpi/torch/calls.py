"""What each collective does once checked and agreed (group.py): run in the
caller's thread or the group's queue (work.py), on tensors that passed the
checks.  Reductions whose policy may quantize (all_reduce and
reduce_scatter: QuantizedComm's Allreduce and Reduce_scatter_block) go
through the group's QuantizedComm; everything else is MPI's own, exact, on
the group's data communicator: reduce with MPI's Reduce, the rest moves
bytes, in messages of any size (MPI's counts are C ints: above 2 GiB the
bytes go as one derived datatype).  A contiguous copy is made here, when
the call runs, not when it is queued: an earlier queued call may still be
writing the tensor."""
import contextlib
import threading

import numpy as np
import torch
from mpi4py import MPI

from equarx_mpi.comm import QuantizedComm
from equarx_mpi.torch.tensors import AVG, array, contiguous, from_bytes, mpi_op, raw, stage

_IN_PLACE = MPI.IN_PLACE


class GroupComm(QuantizedComm):
    """A group's QuantizedComm.  A call the group runs agrees once: its
    agreement goes through the group's (``agreeing``), with the group's
    fields and time limit, on every path (MPI's own too, as with
    check="all"); a call made on it directly (``qcomm``) agrees on its own."""

    def __init__(self, comm, **options):
        super().__init__(comm, **options)
        self._setup.agree_all = bool(self.check)
        self._through = threading.local()

    @contextlib.contextmanager
    def agreeing(self, through):
        """Within: this thread's calls agree by ``through(meta, err, most)``."""
        self._through.fn = through
        try:
            yield
        finally:
            self._through.fn = None

    def _agree(self, what, meta, err, most=None):
        through = getattr(self._through, "fn", None)
        if through is None:
            return super()._agree(what, meta, err, most)
        return through(meta, err, most)


def _exactly(qc, exact):
    return qc.exact() if exact else contextlib.nullcontext()


def _average(c, size):
    """The sum c divided by the group's size; integers as NCCL does (an
    integer division, rounded toward zero), exactly."""
    if c.is_floating_point() or c.is_complex():
        c.detach().div_(size)
    else:
        c.detach().div_(size, rounding_mode="trunc")


# --- through QuantizedComm: lossy where its policy says it pays -------------------
def allreduce(qc, size, tensors, op, exact):
    """Several tensors (all_reduce_coalesced, one dtype) are reduced as one
    buffer, as gloo does: a tensor passed twice is summed once."""
    if len(tensors) == 1:
        t = tensors[0]
    else:
        t = torch.cat([x.detach().reshape(-1) for x in tensors])
    with stage(t) as c, _exactly(qc, exact):
        qc.Allreduce(_IN_PLACE, array(c), mpi_op(op, t.dtype))
    if op == AVG:
        _average(t, size)
    if len(tensors) > 1:
        at = 0
        with torch.no_grad():
            for x in tensors:
                x.copy_(t[at:at + x.numel()].view(x.shape))
                at += x.numel()


def reduce_scatter(qc, size, out, inp, op, exact):
    """out (m values) = op over the ranks of block ``rank`` of inp (P m
    values; a tensor, or a list of P tensors of m values each).  out may
    be a part of inp (ZeRO's and Megatron's in-place pattern): the result
    then goes through a buffer of its own."""
    if isinstance(inp, (list, tuple)):
        inp = torch.cat([x.detach().reshape(-1) for x in inp])
    src = contiguous(inp)
    shared = out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    target = torch.empty_like(out, memory_format=torch.contiguous_format) if shared else out
    with stage(target, read=False) as c, _exactly(qc, exact):
        qc.Reduce_scatter_block(array(src), array(c), mpi_op(op, out.dtype))
    if op == AVG:
        _average(target, size)
    if shared:
        with torch.no_grad():
            out.copy_(target)


# --- MPI's own, exact -------------------------------------------------------------
def reduce(comm, tensors, op, root):
    """MPI's Reduce onto root; bfloat16, which MPI lacks, in float32 then
    rounded (as the library's exact path does)."""
    mine = comm.Get_rank() == root
    for t in tensors:
        with stage(t, read=True) as c:
            a = array(c)
            wide = a.astype(np.float32) if c.dtype == torch.bfloat16 else a
            if mine:
                comm.Reduce(_IN_PLACE, wide, mpi_op(op, t.dtype), root)
                if wide is not a:
                    a[...] = wide
            else:
                comm.Reduce(wide, None, mpi_op(op, t.dtype), root)
        if mine and op == AVG:
            _average(t, comm.Get_size())


#: the most bytes one message of MPI.BYTE may count (a C int)
INT_MAX = 2**31 - 1
_CHUNK = 1 << 30


@contextlib.contextmanager
def _bytes(n):
    """(count, datatype) for n bytes: n MPI.BYTE while n fits a C int, else
    one datatype of n bytes (blocks of 1 GiB and the rest)."""
    if n <= INT_MAX:
        yield n, MPI.BYTE
        return
    q, r = divmod(n, _CHUNK)
    block = MPI.BYTE.Create_contiguous(_CHUNK)
    t = MPI.Datatype.Create_struct([q, r], [0, q * _CHUNK], [block, MPI.BYTE]).Commit()
    block.Free()
    try:
        yield 1, t
    finally:
        t.Free()        # (a pending send or receive keeps what it needs)


def _msg(buf, n, kind):
    return [buf, n, kind]


def broadcast(comm, tensors, root):
    for t in tensors:
        with stage(t, read=comm.Get_rank() == root) as c, _bytes(c.nbytes) as (n, kind):
            comm.Bcast(_msg(raw(c), n, kind), root)


def _scatter_out(buf, outs):
    """Copy consecutive pieces of the uint8 array buf into tensors outs."""
    at = 0
    for o in outs:
        n = o.numel() * o.element_size()
        if n:
            with torch.no_grad():
                o.copy_(from_bytes(buf[at:at + n], o))
        at += n


def allgather(comm, out_lists, ins):
    for outs, t in zip(out_lists, ins):
        src = raw(contiguous(t))
        buf = np.empty(src.size * comm.Get_size(), np.uint8)
        with _bytes(src.size) as (n, kind):
            comm.Allgather(_msg(src, n, kind), _msg(buf, n, kind))
        _scatter_out(buf, outs)


def allgather_base(comm, out, inp):
    """all_gather_into_tensor: out holds P times inp's elements."""
    src = raw(contiguous(inp))
    with stage(out, read=False) as c, _bytes(src.size) as (n, kind):
        comm.Allgather(_msg(src, n, kind), _msg(raw(c), n, kind))


def gather(comm, out_lists, ins, root):
    mine = comm.Get_rank() == root
    for i, t in enumerate(ins):
        src = raw(contiguous(t))
        buf = np.empty(src.size * comm.Get_size(), np.uint8) if mine else None
        with _bytes(src.size) as (n, kind):
            comm.Gather(_msg(src, n, kind), _msg(buf, n, kind) if mine else None, root)
        if mine:
            _scatter_out(buf, out_lists[i])


def scatter(comm, outs, in_lists, root):
    mine = comm.Get_rank() == root
    for i, o in enumerate(outs):
        buf = None
        if mine:
            buf = raw(torch.cat([contiguous(x).detach().reshape(-1).view(torch.uint8)
                                 for x in in_lists[i]]))
        with stage(o, read=False) as c, _bytes(c.nbytes) as (n, kind):
            comm.Scatter(_msg(buf, n, kind) if mine else None, _msg(raw(c), n, kind), root)


def _alltoallv(comm, send, scounts, recv, rcounts):
    sd = np.concatenate(([0], np.cumsum(scounts)[:-1])).astype(np.int64)
    rd = np.concatenate(([0], np.cumsum(rcounts)[:-1])).astype(np.int64)
    if max(send.size, recv.size) <= INT_MAX:
        comm.Alltoallv([send, (list(scounts), sd.tolist()), MPI.BYTE],
                       [recv, (list(rcounts), rd.tolist()), MPI.BYTE])
        return
    # displacements past a C int: one message per pair of ranks
    reqs = []
    with contextlib.ExitStack() as stack:
        for j in range(comm.Get_size()):
            for buf, at, k, post in ((recv, rd[j], rcounts[j], comm.Irecv),
                                     (send, sd[j], scounts[j], comm.Isend)):
                n, kind = stack.enter_context(_bytes(int(k)))
                reqs.append(post(_msg(buf[at:at + k], n, kind), j, 0))
        MPI.Request.Waitall(reqs)


def alltoall(comm, outs, ins):
    """Rank r's ins[j] goes to rank j's outs[r]; sizes may differ."""
    send = raw(torch.cat([contiguous(x).detach().reshape(-1).view(torch.uint8) for x in ins]))
    rcounts = [o.numel() * o.element_size() for o in outs]
    recv = np.empty(sum(rcounts), np.uint8)
    _alltoallv(comm, send, [x.numel() * x.element_size() for x in ins], recv, rcounts)
    _scatter_out(recv, outs)


def alltoall_base(comm, out, inp, out_rows, in_rows):
    """all_to_all_single: rows (along dim 0) ``in_rows[j]`` of inp go to
    rank j, ``out_rows[j]`` of out come from it."""
    src = raw(contiguous(inp))
    with stage(out, read=False) as c:
        _alltoallv(comm, src, [n * _row_bytes(inp) for n in in_rows],
                   raw(c), [n * _row_bytes(out) for n in out_rows])


def _row_bytes(t):
    return t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0


def barrier(comm):
    comm.Barrier()


def send(comm, t, dst, tag):
    """An Isend of t's bytes; returns (request, the buffer to keep alive)."""
    src = raw(contiguous(t))
    with _bytes(src.size) as (n, kind):
        return comm.Isend(_msg(src, n, kind), dst, tag), src


def recv(comm, t, src, tag):
    """An Irecv into t; returns (request, what to run once it has arrived)."""
    s = stage(t, read=False)
    with _bytes(s.c.nbytes) as (n, kind):
        req = comm.Irecv(_msg(raw(s.c), n, kind), src, tag)
    return req, lambda: s.__exit__(None, None, None)
