"""The "equarx" process group: torch.distributed's collectives over MPI.

A Python subclass of torch's ProcessGroup whose methods torch.distributed
calls directly and whose C++ callers (DDP's reducer: the parameter check's
allgather, the broadcast of the module's state, each gradient bucket's
allreduce) reach through the pybind trampoline: torch's ProcessGroup
routes a method through a device's Backend only when Python does not
override it, so every method a caller may reach is defined here (the
"No backend type associated with device type cpu" of a partial group).
torch's C++ Backend has no Python constructor, so no Backend is
registered; torch builds the group through ``Backend.register_backend``'s
creator returning the group itself (what torch's own threaded test group
and torchft's groups do).

Every collective checks its tensors where it is called, agrees across
ranks (agree.py: the same error everywhere, or none) and then runs
(work.py: now, or queued for ``async_op=True``).  all_reduce and
reduce_scatter go through the group's QuantizedComm, the rest is MPI's
own (calls.py).  Point-to-point calls are MPI's nonblocking ones, checked
locally (one rank's error is its own).
"""

import torch.distributed as dist
from mpi4py import MPI

from equarx_mpi.comm import QuantizedComm
from equarx_mpi.torch import calls
from equarx_mpi.torch.agree import agree
from equarx_mpi.torch.tensors import check, check_reduce, red_op, same_kind
from equarx_mpi.torch.work import Executor, P2PWork, Work

#: depth of ``equarx_mpi.torch.exact()`` blocks (every group and hook)
EXACT = [0]


def _listed(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _fields(tensors):
    """The agreed (name, value) pairs of a list of tensors: dtypes and sizes."""
    out = [("number of tensors", len(tensors))]
    for t in tensors:
        out += [("dtype", str(t.dtype)), ("element count", t.numel())]
    return out


class ProcessGroupEquarx(dist.ProcessGroup):
    """A torch process group over an MPI communicator (``comm``, whose
    ranks are the group's, in order); ``options``: QuantizedComm's."""

    def __init__(self, comm, options):
        # (rank, size): torch's (store, rank, size) constructor makes no
        # Python subclass; the store is torch's to keep (gloo groups use it)
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._base = comm
        self._options = dict(options)
        self._data = comm.Dup()         # exact collectives, in the caller or the queue
        self._ctl = comm.Dup()          # agreements of calls made by the program
        # ... and of calls made by callbacks in the queue's thread (a future's
        # then()): two threads never share a communicator's collectives
        self._ctl_q = comm.Dup()
        self._p2p = comm.Dup()          # send/recv, never queued
        self._qc = QuantizedComm(comm, **self._options)   # (its excepthook aborts the job)
        self._exec = Executor()
        self._size = comm.Get_size()
        self.exact_depth = 0

    # --- plumbing -------------------------------------------------------------------
    def getBackendName(self):
        return "equarx"

    def __repr__(self):
        return f"ProcessGroupEquarx(rank={self.rank()}, size={self._size})"

    # torch keeps a group's name in its Backends, and this group has none:
    # the name lives here (functional collectives and DeviceMesh look it up)
    _name = None

    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        if self._name is None:
            raise RuntimeError("equarx: this process group has no name yet")
        return self._name

    @property
    def qcomm(self):
        """The QuantizedComm behind all_reduce and reduce_scatter."""
        if self._qc is None:
            raise RuntimeError("equarx: this process group has been shut down")
        return self._qc

    def _exact_now(self):
        """Whether a call made now must be exact (decided when it is made:
        a queued call runs after the caller may have left ``exact()``)."""
        return EXACT[0] > 0 or self.exact_depth > 0

    def _go(self, opts, fn, result):
        """Run fn now, or queue it if the caller waits later; a Work.  A
        call made in the queue's thread (a future's callback) runs at once:
        the queue cannot wait for itself (docs/TORCH.md: when such calls
        are ordered alike on every rank)."""
        if getattr(opts, "asyncOp", True) and self._exec.threaded and not self._exec.in_thread():
            return self._exec.submit(fn, result)
        self._exec.run(fn)
        return Work(result)

    def _control(self):
        return self._ctl_q if self._exec.in_thread() else self._ctl

    def _agree(self, what, fields, err):
        """The same error on every rank, or none (agree.py); with the
        option check=False, as MPI itself: a local error is raised here
        only, and calls that differ between ranks are not caught."""
        if self._qc is None:
            raise RuntimeError("equarx: this process group has been shut down")
        if self._qc.options["check"]:
            agree(self._control(), what, fields, err)
        elif err is not None:
            raise err

    def set_options(self, **options):
        """Collective: a new QuantizedComm with these options updated."""
        merged = dict(self._options, **options)
        self._exec.drain()
        qc = QuantizedComm(self._base, **merged)      # bad options: raised on every rank
        self._qc.free()
        self._qc, self._options = qc, merged
        return qc.options

    def shutdown(self):
        """Finish queued calls and free the communicators (destroy_process_group)."""
        if self._qc is None:
            return
        self._exec.close()
        self._qc.free()
        self._qc = None
        for c in (self._data, self._ctl, self._ctl_q, self._p2p, self._base):
            c.Free()

    abort = shutdown

    # --- reductions: QuantizedComm's policy -----------------------------------------
    def allreduce(self, tensors, opts=None):
        tensors, op = _listed(tensors), red_op(opts) if opts is not None else dist.ReduceOp.SUM
        err = check_reduce("all_reduce", tensors, op)
        self._agree("all_reduce", [("op", str(op))] + _fields(tensors), err)
        qc, exact = self._qc, self._exact_now()
        return self._go(opts, lambda: calls.allreduce(qc, self._size, tensors, op, exact),
                        tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = red_op(opts) if opts is not None else dist.ReduceOp.SUM
        err = check_reduce("reduce_scatter_tensor", [output, input], op) or (
            None if input.dtype == output.dtype and input.numel() == self._size * output.numel()
            else ValueError(f"equarx: reduce_scatter_tensor: the input must hold {self._size} "
                            f"times the output's {output.numel()} {output.dtype} elements, "
                            f"not {input.numel()} {input.dtype}"))
        self._agree("reduce_scatter_tensor", [("op", str(op))] + _fields([output, input]), err)
        qc, exact = self._qc, self._exact_now()
        return self._go(opts, lambda: calls.reduce_scatter(qc, self._size, output, input, op,
                                                           exact), [output])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        outputs, op = _listed(outputs), red_op(opts) if opts is not None else dist.ReduceOp.SUM
        flat = [x for lst in input_lists for x in lst]
        err = check_reduce("reduce_scatter", outputs + flat, op) or next(
            (ValueError(f"equarx: reduce_scatter: {len(lst)} input tensors, not the group's "
                        f"{self._size}") for lst in input_lists if len(lst) != self._size), None)
        for o, lst in zip(outputs, input_lists):
            err = err or same_kind("reduce_scatter", lst, o)
        self._agree("reduce_scatter", [("op", str(op))] + _fields(outputs), err)
        qc, exact = self._qc, self._exact_now()

        def run():
            for o, lst in zip(outputs, input_lists):
                calls.reduce_scatter(qc, self._size, o, lst, op, exact)
        return self._go(opts, run, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else Work([])

    def reduce(self, tensors, opts=None):
        tensors, op = _listed(tensors), red_op(opts) if opts is not None else dist.ReduceOp.SUM
        root = getattr(opts, "rootRank", 0)
        err = check_reduce("reduce", tensors, op) or self._bad_root("reduce", root)
        self._agree("reduce", [("op", str(op)), ("root", root)] + _fields(tensors), err)
        return self._go(opts, lambda: calls.reduce(self._data, tensors, op, root), tensors)

    # --- data movement: MPI's own ------------------------------------------------------
    def _bad_root(self, what, root):
        if 0 <= root < self._size:
            return None
        return ValueError(f"equarx: {what}: root {root} is not a rank of this group of "
                          f"{self._size}")

    def broadcast(self, tensors, opts=None):
        tensors = _listed(tensors)
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        err = check("broadcast", tensors, out=True) or self._bad_root("broadcast", root)
        self._agree("broadcast", [("root", root)] + _fields(tensors), err)
        return self._go(opts, lambda: calls.broadcast(self._data, tensors, root), tensors)

    def allgather(self, output_lists, inputs, opts=None):
        inputs = _listed(inputs)
        err = check("all_gather", inputs) or check(
            "all_gather", [o for lst in output_lists for o in lst], out=True)
        for lst, t in zip(output_lists, inputs):
            err = err or (None if len(lst) == self._size else ValueError(
                f"equarx: all_gather: {len(lst)} output tensors, not the group's {self._size}"))
            err = err or same_kind("all_gather", lst, t)
        self._agree("all_gather", _fields(inputs), err)
        return self._go(opts, lambda: calls.allgather(self._data, output_lists, inputs),
                        output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def _allgather_base(self, output, input, opts=None):
        err = check("all_gather_into_tensor", [input]) or check(
            "all_gather_into_tensor", [output], out=True) or (
            None if output.dtype == input.dtype and output.numel() == self._size * input.numel()
            else ValueError(f"equarx: all_gather_into_tensor: the output must hold {self._size} "
                            f"times the input's {input.numel()} {input.dtype} elements, not "
                            f"{output.numel()} {output.dtype}"))
        self._agree("all_gather_into_tensor", _fields([input]), err)
        return self._go(opts, lambda: calls.allgather_base(self._data, output, input), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else Work([])

    def _per_rank(self, what, lists, mine, out):
        """The root's error, or None, for gather's output lists or scatter's
        input lists: one tensor per rank, each of the kind of ``mine``'s."""
        err = check(what, [t for lst in lists for t in lst], out=out)
        for lst, t in zip(lists, mine):
            err = err or (None if len(lst) == self._size else ValueError(
                f"equarx: {what}: {len(lst)} {'output' if out else 'input'} tensors, not the "
                f"group's {self._size}"))
            err = err or same_kind(what, lst, t)
        return err

    def gather(self, output_lists, inputs, opts=None):
        inputs = _listed(inputs)
        root = getattr(opts, "rootRank", 0)
        err = check("gather", inputs) or self._bad_root("gather", root)
        if err is None and self.rank() == root:
            err = self._per_rank("gather", output_lists, inputs, out=True)
        self._agree("gather", [("root", root)] + _fields(inputs), err)
        return self._go(opts, lambda: calls.gather(self._data, output_lists, inputs, root),
                        output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        outputs = _listed(outputs)
        root = getattr(opts, "rootRank", 0)
        err = check("scatter", outputs, out=True) or self._bad_root("scatter", root)
        if err is None and self.rank() == root:
            err = self._per_rank("scatter", input_lists, outputs, out=False)
        self._agree("scatter", [("root", root)] + _fields(outputs), err)
        return self._go(opts, lambda: calls.scatter(self._data, outputs, input_lists, root),
                        outputs)

    def alltoall(self, outputs, inputs, opts=None):
        err = check("all_to_all", inputs) or check("all_to_all", outputs, out=True)
        if err is None and (len(inputs), len(outputs)) != (self._size, self._size):
            err = ValueError(f"equarx: all_to_all: {len(inputs)} inputs and {len(outputs)} "
                             f"outputs, not the group's {self._size} of each")
        if err is None and len({t.dtype for t in inputs + outputs}) > 1:
            err = TypeError("equarx: all_to_all: tensors of several dtypes mixed")
        send = [t.numel() for t in inputs] if err is None else [0] * self._size
        return self._pairwise("all_to_all", send, [t.numel() for t in outputs] if err is None
                              else [0] * self._size, err, opts,
                              lambda: calls.alltoall(self._data, outputs, inputs), outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        err = check("all_to_all_single", [input]) or check("all_to_all_single", [output],
                                                           out=True)
        send, recv = [0] * self._size, [0] * self._size
        if err is None:
            send, err = self._splits(input, input_split_sizes, "input")
        if err is None:
            recv, err = self._splits(output, output_split_sizes, "output")
        if err is None and input.dtype != output.dtype:
            err = TypeError(f"equarx: all_to_all_single: input {input.dtype}, output "
                            f"{output.dtype}")
        rows = (list(recv), list(send))
        row = (output[0].numel() if output.dim() and output.shape[0] else 0,
               input[0].numel() if input.dim() and input.shape[0] else 0)
        return self._pairwise(
            "all_to_all_single", [n * row[1] for n in send], [n * row[0] for n in recv], err,
            opts, lambda: calls.alltoall_base(self._data, output, input, *rows), [output])

    def _splits(self, t, sizes, name):
        """(rows per rank, error value) of a split of t along dim 0."""
        P = self._size
        if t.dim() == 0:
            return [0] * P, ValueError(f"equarx: all_to_all_single: a 0-d {name}")
        if not sizes:
            if t.shape[0] % P:
                return [0] * P, ValueError(f"equarx: all_to_all_single: the {name}'s "
                                           f"{t.shape[0]} rows do not split evenly over {P} ranks")
            return [t.shape[0] // P] * P, None
        sizes = [int(s) for s in sizes]
        if len(sizes) != P or sum(sizes) != t.shape[0] or min(sizes) < 0:
            return [0] * P, ValueError(f"equarx: all_to_all_single: {name} split sizes "
                                       f"{sizes} do not split {t.shape[0]} rows over {P} ranks")
        return sizes, None

    def _pairwise(self, what, send, recv, err, opts, fn, result):
        """Agree on the call, then that what rank r sends rank j is what j
        expects from r (an all-to-all of the counts), then run it."""
        self._agree(what, [], err)
        if not self._qc.options["check"]:
            return self._go(opts, fn, result)
        theirs = self._control().alltoall(send)
        bad = [j for j in range(self._size) if theirs[j] != recv[j]]
        err = None if not bad else ValueError(
            f"equarx: {what}: rank {self.rank()} expects {[recv[j] for j in bad]} elements "
            f"from rank(s) {bad}, which send {[theirs[j] for j in bad]}")
        self._agree(what, [], err)
        return self._go(opts, fn, result)

    def barrier(self, opts=None):
        self._agree("barrier", [], None)
        return self._go(opts, lambda: calls.barrier(self._data), [])

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
        err = check(what, tensors, out=what == "recv")
        if err is None and peer is not None and not 0 <= peer < self._size:
            err = ValueError(f"equarx: {what}: rank {peer} is not in this group of {self._size}")
        if err is None and not 0 <= tag <= self._p2p.Get_attr(MPI.TAG_UB):
            err = ValueError(f"equarx: {what}: tag {tag} is outside MPI's 0..TAG_UB")
        if err is None and len(tensors) != 1:
            err = ValueError(f"equarx: {what} takes one tensor, not {len(tensors)}")
        if self._qc is None:
            err = RuntimeError("equarx: this process group has been shut down")
        if err is not None:
            raise err
        # not after the queued calls: a peer's matching call may come after
        # later calls of its own (gloo's sends do not wait for them either)

    def send(self, tensors, dst, tag=0):
        tensors = _listed(tensors)
        self._p2p_check("send", tensors, dst, tag)
        req, keep = calls.send(self._p2p, tensors[0], dst, tag)
        return P2PWork(tensors, req, keep=(keep,))

    def recv(self, tensors, src, tag=0):
        tensors = _listed(tensors)
        self._p2p_check("recv", tensors, src, tag)
        req, finish = calls.recv(self._p2p, tensors[0], src, tag)
        return P2PWork(tensors, req, finish)

    def recv_anysource(self, tensors, tag=0):
        tensors = _listed(tensors)
        self._p2p_check("recv", tensors, None, tag)
        req, finish = calls.recv(self._p2p, tensors[0], MPI.ANY_SOURCE, tag)
        return P2PWork(tensors, req, finish)
