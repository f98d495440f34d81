"""A DDP communication hook for any process group (gloo, "equarx", ...):
each gradient bucket's AllReduce through a QuantizedComm over an mpi4py
communicator whose ranks are the DDP group's, with error feedback per
bucket if asked.

    state = equarx_mpi.torch.HookState(MPI.COMM_WORLD, feedback=True, wire="int8")
    model.register_comm_hook(state, equarx_mpi.torch.allreduce_hook)

The hook returns at once a future of the bucket, summed over the ranks and
divided by their number (DDP's average); the AllReduce runs in the state's
queue (work.py), so the backward pass goes on meanwhile.  The bucket's
traffic never touches the DDP group itself.  With ``feedback=True`` each
bucket keeps an ``equarx_mpi.ErrorFeedback`` (docs/ERROR_FEEDBACK.md): what
quantizing this rank's values lost joins its next step's values, as
PowerSGD's hook carries its error; a bucket whose size changes (DDP
rebuilds its buckets after the first step) starts a new residual.
"""
import contextlib

import torch
import torch.distributed as dist
from mpi4py import MPI

from equarx_mpi.comm import QuantizedComm
from equarx_mpi.feedback import ErrorFeedback
from equarx_mpi.torch.group import EXACT
from equarx_mpi.torch.tensors import array
from equarx_mpi.torch.work import Executor

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class HookState:
    """The state of ``allreduce_hook``: a QuantizedComm over ``comm``
    (default MPI.COMM_WORLD) made with ``options`` (QuantizedComm's, and
    EQUARX_MPI_* variables).  Collective over comm.  ``process_group``
    (default: torch's default group, if any): the DDP group, whose ranks
    must be comm's (checked, the same error on every rank).
    ``feedback``: carry each bucket's quantization residual to its next
    step."""

    def __init__(self, comm=None, feedback=False, process_group=None, **options):
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"equarx: HookState takes an mpi4py intra-communicator, not "
                            f"{type(comm).__name__}")
        errors = comm.allgather(_mismatch(comm, process_group))
        bad = [e for e in errors if e is not None]
        if bad:
            raise ValueError(bad[0])
        self.qc = QuantizedComm(comm, **options)
        self.feedback = bool(feedback)
        self._size = comm.Get_size()
        self._residuals = {}            # bucket index -> (count, dtype, ErrorFeedback)
        self._exec = Executor()

    def residual(self, index):
        """This rank's residual of bucket ``index`` (a copy), or None."""
        entry = self._residuals.get(index)
        return None if entry is None else entry[2].residual

    def _feedback(self, index, t):
        entry = self._residuals.get(index)
        if entry is None or entry[:2] != (t.numel(), t.dtype):
            entry = self._residuals[index] = (t.numel(), t.dtype, ErrorFeedback())
        return entry[2]

    def free(self):
        """Collective: finish queued buckets and free the QuantizedComm."""
        self._exec.close()
        self.qc.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __getstate__(self):
        # DDP pickles its state for checkpoints: a communicator cannot be
        raise TypeError("equarx: a HookState cannot be pickled; make a new one after loading")


def _mismatch(comm, process_group):
    """Why comm's ranks are not the DDP group's, or None."""
    pg = process_group
    if pg is None:
        if not dist.is_initialized():
            return None
        pg = dist.group.WORLD
    world = MPI.COMM_WORLD.Get_group()
    mine = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world)
    finally:
        mine.Free()
        world.Free()
    theirs = dist.get_process_group_ranks(pg)
    if list(ranks) != list(theirs):
        return (f"equarx: HookState's communicator holds MPI ranks {list(ranks)}, the process "
                f"group torch ranks {theirs}: pass comm= (or process_group=) with the same ranks")
    return None


def allreduce_hook(state, bucket):
    """DDP communication hook: a future of the bucket's average over the
    ranks, reduced by ``state.qc`` (quantized where its policy says)."""
    t = bucket.buffer()
    if t.device.type != "cpu" or t.dtype not in _FLOATS:
        raise TypeError(f"equarx: allreduce_hook takes CPU float gradients, not {t.dtype} on "
                        f"{t.device}")
    qc, size = state.qc, state._size
    fb = state._feedback(bucket.index(), t) if state.feedback else None
    exact = EXACT[0] > 0

    def run():
        with qc.exact() if exact else contextlib.nullcontext():
            qc.Allreduce(MPI.IN_PLACE, array(t), feedback=fb)
        t.div_(size)
    return state._exec.submit(run, t).get_future()
