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
PowerSGD's hook carries its error.

A residual belongs to the parameters, not to a bucket's index: it is kept
per bucket layout, the bucket's parameters in their order (held weakly, so
a dead parameter's reused id matches nothing).  When DDP rebuilds its
buckets (after the first step, in the order the gradients became ready,
perhaps regrouped) each parameter's slice of the residual moves to its new
place: nothing is lost, nothing lands on another parameter.  So one state
may serve several DDP models: their parameters differ, and so do their
residuals (each model behaves as with a state of its own; their buckets
share the state's queue and QuantizedComm).
"""
import contextlib
import weakref
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from equarx_mpi.comm import QuantizedComm
from equarx_mpi.feedback import ErrorFeedback
from equarx_mpi.torch.group import EXACT_DEPTH
from equarx_mpi.torch.tensors import array
from equarx_mpi.torch.work import Executor

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class HookState:
    """The state of ``allreduce_hook``: a QuantizedComm over ``comm``
    (default MPI.COMM_WORLD) made with ``options`` (QuantizedComm's, and
    EQUARX_MPI_* variables).  Collective over comm.  ``process_group``
    (default: torch's default group, if any): the DDP group, whose ranks
    must be comm's (checked, the same error on every rank).
    ``feedback``: carry each parameter's quantization residual to its
    next step (``residual(param)`` shows it)."""

    def __init__(self, comm: Optional[MPI.Intracomm] = None, feedback: bool = False,
                 process_group: Optional[dist.ProcessGroup] = None, **options: Any) -> None:
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
        self._layouts: "dict[tuple[int, ...], _Layout]" = {}    # by its parameters' ids
        # id(parameter) -> (the _Layout holding its residual, its index there)
        self._owner: "dict[int, tuple[_Layout, int]]" = {}
        self._exec = Executor()

    def residual(self, param: torch.Tensor) -> Optional[np.ndarray]:
        """This rank's residual of parameter ``param`` (a copy shaped like
        it, float32 or float64 for float64), or None."""
        lay, i = self._owner.get(id(param), (None, 0))
        if lay is None or lay.refs[i]() is not param or lay.fb.residual is None:
            return None
        at, n = lay.spans[i]
        return lay.fb.residual[at:at + n].reshape(param.shape)

    def _feedback(self, bucket, t):
        params = bucket.parameters()
        key = tuple(map(id, params))
        lay = self._layouts.get(key)
        if lay is None or not lay.fits(params, t):
            lay = self._relayout(key, params, bucket.gradients(), t)
        return lay.fb

    def _relayout(self, key, params, grads, t):
        """A new layout for this bucket, taking each parameter's residual
        from where it was.  DDP rebuilds its buckets in forward, after
        waiting for the last step's: no residual read here is in use."""
        new = _Layout(params, [(g.storage_offset() - t.storage_offset(), g.numel())
                               for g in grads], t)
        moved, losers, residuals = None, set(), {}
        for i, p in enumerate(params):
            old, j = self._owner.get(id(p), (None, 0))
            self._owner[id(p)] = (new, i)
            if old is None or old.refs[j]() is not p:
                continue
            losers.add(old)
            if old not in residuals:
                residuals[old] = old.fb.residual
            res, (src, n), (at, m) = residuals[old], old.spans[j], new.spans[i]
            if res is not None and old.dtype == new.dtype and n == m:
                if moved is None:
                    moved = np.zeros(new.count, res.dtype)
                moved[at:at + n] = res[src:src + n]
        if moved is not None:
            new.fb.load(moved, array(t).dtype)
        # a layout that lost a parameter is never current again; its other
        # parameters' residuals stay reachable through _owner until moved
        self._owner = {k: v for k, v in self._owner.items() if v[0].refs[v[1]]() is not None}
        self._layouts = {k: v for k, v in self._layouts.items()
                         if v not in losers and all(r() is not None for r in v.refs)}
        self._layouts[key] = new
        return new

    def free(self) -> None:
        """Collective: finish queued buckets and free the QuantizedComm."""
        self._exec.close()
        self.qc.free()

    def __enter__(self) -> "HookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __getstate__(self):
        # DDP pickles its state for checkpoints: a communicator cannot be
        raise TypeError("equarx: a HookState cannot be pickled; make a new one after loading")


class _Layout:
    """A bucket's parameters (weakly), where each lies in its flat buffer
    (offset, count), and the ErrorFeedback over that buffer."""

    __slots__ = ("refs", "spans", "count", "dtype", "fb")

    def __init__(self, params, spans, t):
        self.refs = tuple(weakref.ref(p) for p in params)
        self.spans = spans
        self.count, self.dtype = t.numel(), t.dtype
        self.fb = ErrorFeedback()

    def fits(self, params, t):
        return ((t.numel(), t.dtype) == (self.count, self.dtype)
                and all(r() is p for r, p in zip(self.refs, params)))


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


def allreduce_hook(state: HookState,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: a future of the bucket's average over the
    ranks, reduced by ``state.qc`` (quantized where its policy says)."""
    t = bucket.buffer()
    if t.device.type != "cpu" or t.dtype not in _FLOATS:
        raise TypeError(f"equarx: allreduce_hook takes CPU float gradients, not {t.dtype} on "
                        f"{t.device}")
    qc, size = state.qc, state._size
    fb = state._feedback(bucket, t) if state.feedback else None
    exact = EXACT_DEPTH[0] > 0

    def run():
        with qc.exact() if exact else contextlib.nullcontext():
            qc.Allreduce(MPI.IN_PLACE, array(t), feedback=fb)
        t.div_(size)
    return state._exec.submit(run, t).get_future()
