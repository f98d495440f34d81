"""The "equarx" process group: torch.distributed's collectives over MPI.

A Python subclass of torch's ProcessGroup: torch routes a method through a
device's Backend only when Python does not override it, so every method a
caller may reach (DDP's reducer through the pybind trampoline too) is
defined here.  torch's C++ Backend has no Python constructor: the creator
given to ``Backend.register_backend`` returns the group itself (as torch's
own threaded test group and torchft's groups do).

Every collective checks its tensors where it is called, then, in the
thread that runs it (work.py: the caller's for a call waited at once, the
group's queue for ``async_op=True``), agrees across ranks once (the same
error everywhere, or none, within the group's timeout: call/agree.py) and
runs.  all_reduce and reduce_scatter go through the group's QuantizedComm,
the rest is MPI's own (calls.py).  Point-to-point calls are MPI's
nonblocking ones, checked locally (one rank's error is its own).
"""
import math
import time

import torch.distributed as dist
from mpi4py import MPI

from equarx_mpi.call.agree import agree, pairwise
from equarx_mpi.torch import calls
from equarx_mpi.torch.calls import GroupComm
from equarx_mpi.torch.tensors import (
    bad_root,
    check,
    check_p2p,
    check_reduce,
    fields,
    listed,
    per_rank,
    red_op,
    same_kind,
    splits,
)
from equarx_mpi.torch.work import KEPT, Executor, P2PWork, Work, free_soon

#: depth of ``equarx_mpi.torch.exact()`` blocks (every group and hook)
EXACT_DEPTH = [0]
#: the exception of a mismatch in these fields, as gloo's (else ValueError)
_KINDS = {"dtype": TypeError}


class ProcessGroupEquarx(dist.ProcessGroup):
    """A torch process group over an MPI communicator (``comm``, whose
    ranks are the group's, in order); ``options``: QuantizedComm's;
    ``timeout`` (a timedelta, or None): how long a call waits for the
    other ranks to make it (init_process_group's and new_group's)."""

    def __init__(self, comm, options, timeout=None):
        # (rank, size): torch's (store, rank, size) constructor makes no
        # Python subclass; the store is torch's to keep (gloo groups use it)
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._base = comm
        self._options = dict(options)
        # agreements, exact collectives: in the thread running calls in order
        self._ctl, self._data = comm.Dup(), comm.Dup()
        self._p2p = comm.Dup()          # send/recv, never queued
        self._qc = GroupComm(comm, **self._options)   # (its excepthook aborts the job)
        self._exec = Executor()
        self._size = comm.Get_size()
        self._timeout = timeout if timeout and timeout.total_seconds() > 0 else None
        self._broken = None             # why calls cannot run any more (a timeout)
        self._inflight = []             # sends and receives MPI may still be using
        self.exact_depth = 0

    # --- plumbing -------------------------------------------------------------------
    def getBackendName(self):
        return "equarx"

    def __repr__(self):
        return f"ProcessGroupEquarx(rank={self.rank()}, size={self._size})"

    # its name: torch keeps one in Backends, which this group has none of (DeviceMesh looks)
    _name = None

    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self) -> str:
        if self._name is None:
            raise RuntimeError("equarx: this process group has no name yet")
        return self._name

    @property
    def qcomm(self) -> GroupComm:
        """The QuantizedComm behind all_reduce and reduce_scatter."""
        self._usable()
        return self._qc

    def _usable(self):
        if self._qc is None:
            raise RuntimeError("equarx: this process group has been shut down")
        if self._broken is not None:
            raise dist.DistBackendError(self._broken)

    def _exact_now(self):
        """Whether a call made now must be exact (decided when it is made:
        a queued call runs after the caller may have left ``exact()``)."""
        return EXACT_DEPTH[0] > 0 or self.exact_depth > 0

    def _call(self, opts, what, meta, err, fn, result, counts=None, qc=None):
        """Agree on the call (``meta``: (name, value) pairs, the local error
        ``err``; ``counts``: the elements (sent, expected) to and from each
        rank), then fn(): now, or queued if the caller waits later; a Work.
        ``qc``: fn's calls of this GroupComm agree for it (once each, its
        fields after ``meta``).  With check=False, as MPI itself: a local
        error is raised here only; calls differing between ranks are not caught."""
        self._usable()
        if not self._qc.options["check"]:
            if err is not None:
                raise err
            return self._go(opts, fn, result)

        def agreed_then_run():
            self._usable()
            # a deadline even without a limit: the agreement is then nonblocking (call/agree.py)
            deadline = (time.monotonic() + self._timeout.total_seconds() if self._timeout
                        else math.inf)

            def through(more, e=None, most=None):
                return agree(self._ctl, what, meta + more, err or e, most, deadline, _KINDS)
            try:
                if qc is not None and err is None:
                    with qc.agreeing(through):
                        return fn()
                through([])
                if counts is not None:
                    pairwise(self._ctl, what, *counts, deadline)
            except TimeoutError:
                self._broken = (f"equarx: {what} on process group {self._name!r}: Timed out "
                                f"after {self._timeout} waiting for the other ranks of the group "
                                f"to make the same call; MPI cannot cancel a collective, so the "
                                f"group cannot be used any more: destroy it, or end the job")
                raise dist.DistBackendError(self._broken) from None
            fn()
        return self._go(opts, agreed_then_run, result)

    def _go(self, opts, fn, result):
        """Run fn now, or queue it if the caller waits later; a Work.  A
        call made in the queue's thread (a future's callback) runs at once:
        the queue cannot wait for itself (docs/TORCH.md: when such calls
        are ordered alike on every rank)."""
        if getattr(opts, "asyncOp", True) and self._exec.threaded and not self._exec.in_thread():
            return self._exec.submit(fn, result)
        self._exec.run(fn)
        return Work(result)

    def set_options(self, **options: object) -> dict:
        """Collective: a new QuantizedComm with these options updated."""
        self._usable()
        merged = dict(self._options, **options)
        self._exec.drain()
        qc = GroupComm(self._base, **merged)      # bad options: raised on every rank
        self._qc.free()
        self._qc, self._options = qc, merged
        return qc.options

    def shutdown(self) -> None:
        """Finish queued calls and free the communicators
        (destroy_process_group).  Never waits for the other ranks: their
        shared-memory windows are freed collectively, so ranks that destroy
        groups in different orders free them in a thread of their own."""
        if self._qc is None:
            return
        self._exec.close()
        qc, self._qc = self._qc, None
        self._inflight = [w for w in self._inflight if not w.poll()]
        if self._broken is not None or self._inflight:
            # a timed-out agreement is still active on _ctl, or a message
            # nobody received is still using its buffer: keep them all
            KEPT.append(self)
            return
        comms = (self._ctl, self._data, self._p2p, self._base)

        def free():
            qc.free()
            for c in comms:
                c.Free()
        free_soon(free, self._exec.threaded)

    def abort(self) -> None:
        """End the group now, waiting for nothing: calls queued and not yet
        run fail, and nothing is freed (a running call may still use it)."""
        if self._qc is not None:
            self._broken = self._broken or "equarx: this process group was aborted"
            self._exec.closed, self._qc = True, None
            KEPT.append(self)

    # --- reductions: QuantizedComm's policy -----------------------------------------
    def allreduce(self, tensors, opts=None):
        tensors, op = listed(tensors), red_op(opts) if opts is not None else dist.ReduceOp.SUM
        err = check_reduce("all_reduce", tensors, op)
        if err is None and len({t.dtype for t in tensors}) > 1:
            err = TypeError("equarx: all_reduce_coalesced: tensors of several dtypes mixed")
        qc, exact = self._qc, self._exact_now()
        return self._call(opts, "all_reduce", [("op", str(op))] + fields(tensors), err,
                          lambda: calls.allreduce(qc, self._size, tensors, op, exact), tensors,
                          qc=qc)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = red_op(opts) if opts is not None else dist.ReduceOp.SUM
        err = check_reduce("reduce_scatter_tensor", [output, input], op) or (
            None if input.dtype == output.dtype and input.numel() == self._size * output.numel()
            else ValueError(f"equarx: reduce_scatter_tensor: the input must hold {self._size} "
                            f"times the output's {output.numel()} {output.dtype} elements, "
                            f"not {input.numel()} {input.dtype}"))
        qc, exact = self._qc, self._exact_now()
        return self._call(opts, "reduce_scatter_tensor",
                          [("op", str(op))] + fields([output, input]), err,
                          lambda: calls.reduce_scatter(qc, self._size, output, input, op, exact),
                          [output], qc=qc)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        outputs, op = listed(outputs), red_op(opts) if opts is not None else dist.ReduceOp.SUM
        flat = [x for lst in input_lists for x in lst]
        err = check_reduce("reduce_scatter", outputs + flat, op) or next(
            (ValueError(f"equarx: reduce_scatter: {len(lst)} input tensors, not the group's "
                        f"{self._size}") for lst in input_lists if len(lst) != self._size), None)
        for o, lst in zip(outputs, input_lists):
            err = err or same_kind("reduce_scatter", lst, o)
        qc, exact = self._qc, self._exact_now()

        def run():
            for o, lst in zip(outputs, input_lists):
                calls.reduce_scatter(qc, self._size, o, lst, op, exact)
        return self._call(opts, "reduce_scatter", [("op", str(op))] + fields(outputs), err,
                          run, outputs, qc=qc)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else Work([])

    def reduce(self, tensors, opts=None):
        tensors, op = listed(tensors), red_op(opts) if opts is not None else dist.ReduceOp.SUM
        root = getattr(opts, "rootRank", 0)
        err = check_reduce("reduce", tensors, op) or bad_root(self._size, "reduce", root)
        return self._call(opts, "reduce", [("op", str(op)), ("root", root)] + fields(tensors),
                          err, lambda: calls.reduce(self._data, tensors, op, root), tensors)

    # --- data movement: MPI's own ------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        tensors = listed(tensors)
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        err = check("broadcast", tensors, out=True) or bad_root(self._size, "broadcast", root)
        return self._call(opts, "broadcast", [("root", root)] + fields(tensors), err,
                          lambda: calls.broadcast(self._data, tensors, root), tensors)

    def allgather(self, output_lists, inputs, opts=None, result=None):
        """output_lists[i][r]: input i of rank r."""
        inputs = listed(inputs)
        err = check("all_gather", inputs) or check(
            "all_gather", [o for lst in output_lists for o in lst], out=True) or (
            None if len(output_lists) == len(inputs) else ValueError(
                f"equarx: all_gather: {len(output_lists)} output lists for {len(inputs)} inputs"))
        for lst, t in zip(output_lists, inputs):
            err = err or (None if len(lst) == self._size else ValueError(
                f"equarx: all_gather: {len(lst)} output tensors, not the group's {self._size}"))
            err = err or same_kind("all_gather", lst, t)
        if result is None:      # the future's value, as gloo's: one input's outputs
            result = output_lists[0] if len(output_lists) == 1 else output_lists
        return self._call(opts, "all_gather", fields(inputs), err,
                          lambda: calls.allgather(self._data, output_lists, inputs), result)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """output_lists[r][i]: input i of rank r (torch's layout, the
        transpose of allgather's)."""
        inputs = listed(inputs)
        if len(output_lists) != self._size or any(len(o) != len(inputs) for o in output_lists):
            err = ValueError(f"equarx: all_gather_coalesced: the outputs must be {self._size} "
                             f"lists (one per rank) of {len(inputs)} tensors (one per input)")
            return self._call(opts, "all_gather", fields(inputs), err, None, [])
        return self.allgather([[o[i] for o in output_lists] for i in range(len(inputs))],
                              inputs, opts, result=output_lists)

    def _allgather_base(self, output, input, opts=None):
        err = check("all_gather_into_tensor", [input]) or check(
            "all_gather_into_tensor", [output], out=True) or (
            None if output.dtype == input.dtype and output.numel() == self._size * input.numel()
            else ValueError(f"equarx: all_gather_into_tensor: the output must hold {self._size} "
                            f"times the input's {input.numel()} {input.dtype} elements, not "
                            f"{output.numel()} {output.dtype}"))
        return self._call(opts, "all_gather_into_tensor", fields([input]), err,
                          lambda: calls.allgather_base(self._data, output, input), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else Work([])

    def gather(self, output_lists, inputs, opts=None):
        inputs = listed(inputs)
        root = getattr(opts, "rootRank", 0)
        err = check("gather", inputs) or bad_root(self._size, "gather", root)
        if err is None and self.rank() == root:
            err = per_rank(self._size, "gather", output_lists, inputs, out=True)
        mine = self.rank() == root
        # the future's value, as gloo's: the root's outputs, nothing elsewhere
        result = (output_lists[0] if len(output_lists) == 1 else output_lists) if mine else []
        return self._call(opts, "gather", [("root", root)] + fields(inputs), err,
                          lambda: calls.gather(self._data, output_lists, inputs, root), result)

    def scatter(self, outputs, input_lists, opts=None):
        outputs = listed(outputs)
        root = getattr(opts, "rootRank", 0)
        err = check("scatter", outputs, out=True) or bad_root(self._size, "scatter", root)
        if err is None and self.rank() == root:
            err = per_rank(self._size, "scatter", input_lists, outputs, out=False)
        return self._call(opts, "scatter", [("root", root)] + fields(outputs), err,
                          lambda: calls.scatter(self._data, outputs, input_lists, root), outputs)

    def alltoall(self, outputs, inputs, opts=None):
        err = check("all_to_all", inputs) or check("all_to_all", outputs, out=True)
        if err is None and (len(inputs), len(outputs)) != (self._size, self._size):
            err = ValueError(f"equarx: all_to_all: {len(inputs)} inputs and {len(outputs)} "
                             f"outputs, not the group's {self._size} of each")
        if err is None and len({t.dtype for t in inputs + outputs}) > 1:
            err = TypeError("equarx: all_to_all: tensors of several dtypes mixed")
        ok = err is None
        counts = ([t.numel() for t in inputs] if ok else [0] * self._size,
                  [t.numel() for t in outputs] if ok else [0] * self._size)
        dtype = str(inputs[0].dtype) if ok and inputs else None
        return self._call(opts, "all_to_all", [("dtype", dtype)], err,
                          lambda: calls.alltoall(self._data, outputs, inputs), outputs, counts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        err = check("all_to_all_single", [input]) or check("all_to_all_single", [output],
                                                           out=True)
        send, recv = [0] * self._size, [0] * self._size
        if err is None:
            send, err = splits(self._size, input, input_split_sizes, "input")
        if err is None:
            recv, err = splits(self._size, output, output_split_sizes, "output")
        if err is None and input.dtype != output.dtype:
            err = TypeError(f"equarx: all_to_all_single: input {input.dtype}, output "
                            f"{output.dtype}")
        rows = (list(recv), list(send))
        row = (output[0].numel() if output.dim() and output.shape[0] else 0,
               input[0].numel() if input.dim() and input.shape[0] else 0)
        counts = ([n * row[1] for n in send], [n * row[0] for n in recv])
        return self._call(opts, "all_to_all_single",
                          [("dtype", str(input.dtype) if err is None else None)], err,
                          lambda: calls.alltoall_base(self._data, output, input, *rows),
                          [output], counts)

    def barrier(self, opts=None):
        return self._call(opts, "barrier", [], None, lambda: calls.barrier(self._data), [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        raise NotImplementedError("equarx: monitored_barrier is gloo's own; use barrier()")

    # torch >= 2.10 calls these names; older ones the underscored ones
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # --- point to point: MPI's nonblocking calls, local checks ---------------------------
    def _p2p_check(self, what, tensors, peer, tag):
        err = check_p2p(what, tensors, peer, self._size, tag, self._p2p.Get_attr(MPI.TAG_UB))
        self._usable()
        if err is not None:
            raise err
        # not after the queued calls: a peer's matching call may come after
        # later calls of its own (gloo's sends do not wait for them either)

    def send(self, tensors, dst, tag=0):
        tensors = listed(tensors)
        self._p2p_check("send", tensors, dst, tag)
        req, keep = calls.send(self._p2p, tensors[0], dst, tag)
        return self._track(P2PWork(tensors, req, keep=(keep,)))

    def recv(self, tensors, src, tag=0):
        tensors = listed(tensors)
        self._p2p_check("recv", tensors, src, tag)
        req, finish = calls.recv(self._p2p, tensors[0], src, tag)
        return self._track(P2PWork(tensors, req, finish))

    def recv_anysource(self, tensors, tag=0):
        tensors = listed(tensors)
        self._p2p_check("recv", tensors, None, tag)
        req, finish = calls.recv(self._p2p, tensors[0], MPI.ANY_SOURCE, tag)
        return self._track(P2PWork(tensors, req, finish))

    def _track(self, work):
        """Keep ``work`` (its tensors, its buffer) until MPI is done with it:
        the caller may drop it before the message has gone."""
        self._inflight = [w for w in self._inflight if not w.poll()]
        self._inflight.append(work)
        return work
