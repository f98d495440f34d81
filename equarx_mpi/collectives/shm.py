"""Exact AllReduce for ranks that share one node, through an MPI-3 shared window.

    sh = ShmAllreduce(comm)          # collective; every rank of comm on one node
    sh.allreduce(send, recv, MPI.SUM)
    x = sh.empty(shape, dtype)       # a buffer in the window: no copy in
    sh.allreduce(MPI.IN_PLACE, x)
    sh.free()                        # collective

The result is the reduction of the ranks' values in the fixed order rank 0,
1, ..., P-1 (kernels/shm.py), accumulated in float32 for float16
and bfloat16 and rounded once: bitwise the same on every rank and every call.

Window layout: one allocation by node rank 0 (so the layout is ours, not the
MPI library's), cut into P slots of ``stride`` bytes, slot k for rank k:

    [ data: cap bytes | result: rcap bytes | one-shot area 0 | one-shot area 1 | control ]

Two-phase schedule (messages above ONESHOT_BYTES):
  reduce_scatter: rank k copies its input, all but its own slice, into its
      data slot, after its empty() buffer if it lent one (no copy when the
      input is that buffer), and writes where its data starts into its
      control line; sync; rank i reduces slice i of every data slot, each
      read where its rank said (its own from its input), into its result
      region (and into its own recv).
  allgather: sync; every rank copies slice j from rank j's result region.
So whether its input is its empty() buffer is each rank's own business.
Nothing else needs a barrier: data slots and data starts are written before
the first sync of a call and read only between its two syncs, and result
regions are written only after the first sync of the next call, which no
rank passes before every rank has finished copying out.  A SUM's kernels
also find the largest finite input magnitude of their slice (the exact
sum's error bound needs it); each rank writes its slice's into its control
line with its result, and reads every rank's after the second sync, so
allreduce returns the largest over all inputs with no extra pass or
message.  The one-shot schedule reads every input and finds it alone.
Slices are whole 64-byte lines, so no two ranks write one line.

One-shot schedule (small messages, latency-bound): copy in to one-shot area
(call count mod 2); sync; every rank reduces the whole message itself.  One
barrier per call: an area is written again only two one-shot calls later,
and every rank has passed the intervening call's sync by then, so all reads
of it have finished.

Hierarchical use (a step between the halves, e.g. across nodes):

    mine = sh.reduce_scatter(send, op, keep_acc=True)   # slice bounds: sh.bounds(n, dtype)
    cross.Allreduce(MPI.IN_PLACE, mine, op)             # rank i rewrites its own slice
    sh.allgather(recv)

``mine`` is this rank's reduced slice, in the window, float32 for 16-bit
inputs when keep_acc (so the value is rounded once, in allgather).  Only its
owner may write it, and only until allgather is called: allgather's sync
publishes it, then every rank reads it.  Slices depend only on (n, dtype, P),
so ranks with the same node rank on equally sized nodes hold the same slice.
"""
import math

import numpy as np
from mpi4py import MPI

from equarx_mpi import kernels as K
from equarx_mpi.collectives.nodes import in_turn, split_nodes
from equarx_mpi.collectives.terms import ONESHOT_BYTES  # messages up to it: one-shot
from equarx_mpi.kernels import shm as SK
from equarx_mpi.names import KERNEL_DTYPE, acc_dtype

#: dtype -> (element type the kernels see, accumulation type)
_TYPES = {d: (kd, acc_dtype(kd)) for d, kd in KERNEL_DTYPE.items()}
_OPS = ((MPI.SUM, K.OP_SUM), (MPI.MAX, K.OP_MAX), (MPI.MIN, K.OP_MIN))
_ACC_OF_KERNEL = {kd: acc for kd, acc in _TYPES.values()}
#: Cache line: slices and regions start on multiples of it.
LINE = 64


def _round_up(x, a):
    return -(-x // a) * a


def slice_bounds(n, itemsize, P, k):
    """[lo, hi) of slice k of n values: whole 64-byte lines, sizes within one
    line of each other (empty slices when n is small)."""
    per = LINE // itemsize
    lines = -(-n // per)
    return (min(n, lines * k // P * per), min(n, lines * (k + 1) // P * per))


class ShmAllreduce:
    """Exact AllReduce (SUM, MAX, MIN; float32, float64, float16, bfloat16)
    through a shared window.  A building block: every rank must pass the
    same sizes, dtypes and op (QuantizedComm agrees on them first); argument
    errors are raised locally before any communication."""

    def __init__(self, comm, nodes=None, oneshot_bytes=None):
        node = split_nodes(comm, nodes)
        if node.Get_size() != comm.Get_size():
            n = node.Get_size()
            node.Free()
            raise ValueError(f"ShmAllreduce needs all {comm.Get_size()} ranks on one node; "
                             f"this rank's node holds {n} of them")
        self.comm = node
        #: messages up to this many bytes per rank take the one-shot schedule
        self.oneshot_bytes = ONESHOT_BYTES if oneshot_bytes is None else int(oneshot_bytes)
        self.P, self.rank = node.Get_size(), node.Get_rank()
        self._win = self._mem = None    # the current window and its bytes
        self._most = self._at = None    # control words (see reserve)
        self._retired = []      # older windows that empty() buffers still point into
        self._lent = False      # whether empty() handed out part of the current one
        self._lent_bytes = 0    # its size; other inputs are copied in after it
        self.cap = self._rcap = self._stride = 0
        self._views = {}        # dtype -> flat array over the window
        self._places = {}       # message shape -> views (see _place)
        self._acc = {d: np.empty(SK.TILE, d) for d in (np.dtype(np.float32), np.dtype(np.float64))}
        # data starts at 0 (the one-shot areas), strided like the control
        # words, so that the kernel is compiled once for both
        self._at_zero = np.zeros((self.P, 2), np.int64)[:, 0]
        self._oneshots = 0
        self._pending = None    # (n, kernel dtype, result dtype, base) between the halves
        self._warmed = set()

    # --- lifetime -------------------------------------------------------------
    def free(self):
        """Collective: release the windows (empty() buffers die with them)."""
        if self.comm is None:
            return
        for win in self._retired + ([self._win] if self._win else []):
            win.Unlock_all()
            win.Free()
        self._retired, self._win, self._mem, self._views, self._places = [], None, None, {}, {}
        self.comm.Free()
        self.comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def reserve(self, nbytes):
        """Collective: make room for messages of nbytes per rank (every rank
        passes the same value).  Growing allocates a new window; the old one
        is freed, or kept until free() if empty() buffers point into it."""
        if nbytes <= self.cap:
            return
        cap = _round_up(nbytes, 4096)
        # Result regions hold one slice in the accumulation type: at most
        # twice the bytes of a slice (16-bit input, float32 results).
        rcap = 2 * LINE * -(-(cap // LINE) // self.P)
        stride = cap + rcap + 2 * _round_up(self.oneshot_bytes, LINE) + LINE
        win = MPI.Win.Allocate_shared(self.P * stride + LINE if self.rank == 0 else 0, 1,
                                      comm=self.comm)
        mem, _ = win.Shared_query(0)
        raw = np.frombuffer(mem, np.uint8)
        pad = self.comm.bcast(-raw.ctypes.data % LINE)   # the same offset on every rank
        # A passive-target epoch on all ranks for the window's whole life:
        # Win.Sync (a memory barrier) is only defined inside one.
        win.Lock_all(MPI.MODE_NOCHECK)
        if self._win is not None:
            if self._lent:
                self._retired.append(self._win)
            else:
                self._win.Unlock_all()
                self._win.Free()
        self._win, self._lent, self._lent_bytes = win, False, 0
        self._mem = raw[pad:pad + self.P * stride]
        self.cap, self._rcap, self._stride = cap, rcap, stride
        self._views, self._places = {}, {}
        # one value per slot from its control line: its largest magnitude,
        # and where its data starts (in values of the call's type)
        first, step = (stride - LINE) // 8, stride // 8
        self._most = self._mem.view(np.float64)[first::step]
        self._at = self._mem.view(np.int64)[first + 1::step]

    def _view(self, dtype):
        v = self._views.get(dtype)
        if v is None:
            v = self._views[dtype] = self._mem.view(dtype)
        return v

    def _sync(self):
        # MPI-3 unified memory model (the shared-memory pattern of the
        # standard's examples): Win.Sync completes this rank's stores to the
        # window (a memory barrier), the Barrier orders every rank's stores
        # before every rank's later loads, and the second Win.Sync keeps this
        # rank's loads from being satisfied before the barrier.
        self._win.Sync()
        self.comm.Barrier()
        self._win.Sync()

    def empty(self, shape, dtype):
        """Collective (every rank passes the same shape and dtype): an
        uninitialised array in this rank's data slot.  As sendbuf (or recvbuf
        in place) of allreduce/reduce_scatter it saves the copy in, whatever
        the other ranks pass; other inputs are then copied in after it, so
        it keeps its values.  Every call returns the same memory (one such
        buffer at a time).  It stays valid until free(), also after the
        window grows, but then it is no longer the slot and is copied like
        any other array."""
        dtype = np.dtype(dtype)
        if dtype not in _TYPES:
            raise TypeError(f"ShmAllreduce.empty: unsupported dtype {dtype}")
        shape = tuple(shape) if np.iterable(shape) else (int(shape),)
        n = math.prod(shape)
        lent = _round_up(max(n * dtype.itemsize, 1), LINE)
        self.reserve(2 * lent)          # room for another input of its size after it
        self._lent, self._lent_bytes = True, lent
        start = self.rank * self._stride
        return self._mem[start:start + n * dtype.itemsize].view(dtype).reshape(shape)

    def is_window_buffer(self, a):
        """Whether array a starts at this rank's data slot (an empty() buffer)."""
        return (self._lent and isinstance(a, np.ndarray)
                and _address(a) == _address(self._mem[self.rank * self._stride:]))

    # --- the collective -------------------------------------------------------
    def bounds(self, n, dtype, k=None):
        """[lo, hi) of the slice that rank k (default: this rank) reduces."""
        return slice_bounds(n, np.dtype(dtype).itemsize, self.P, self.rank if k is None else k)

    def allreduce(self, send, recv, op=MPI.SUM):
        """recv = reduction of every rank's send (send None or MPI.IN_PLACE:
        recv's values, overwritten).  Returns, for SUM, the largest finite
        magnitude among every rank's input (0.0 for MAX and MIN)."""
        src, out, kop = self._check("allreduce", send, recv, op)
        n = out.size
        if n == 0:
            return 0.0
        if out.nbytes <= self.oneshot_bytes:
            return self._oneshot(src, out, kop)
        self._reduce_scatter(src, kop, False, out)
        return self._allgather(out, skip_own=True)

    def reduce_scatter(self, send, op=MPI.SUM, keep_acc=False):
        """First half: returns this rank's reduced slice (bounds(n, dtype)),
        a view into the window; float32 for 16-bit input when keep_acc.
        send is the whole message (n values)."""
        if not isinstance(send, np.ndarray):
            raise TypeError(f"ShmAllreduce.reduce_scatter: sendbuf must be a numpy array, "
                            f"not {type(send).__name__}")
        src, _, kop = self._check("reduce_scatter", None, send, op)
        res = self._reduce_scatter(src, kop, keep_acc, None)
        d = send.dtype
        return res if res.dtype != _TYPES[d][0] else res.view(d)

    def allgather(self, recv):
        """Second half: recv (n values) = every rank's slice, as they are in
        the window now."""
        if self._pending is None:
            raise RuntimeError("ShmAllreduce.allgather: no reduce_scatter before it")
        _, out, _ = self._check("allgather", None, recv, MPI.SUM)
        n, kd = self._pending[:2]
        if (out.size, out.dtype) != (n, kd):
            raise ValueError(f"ShmAllreduce.allgather: recvbuf ({recv.size} x {recv.dtype}) "
                             f"does not match the reduce_scatter's message ({n} values)")
        self._allgather(out, skip_own=False)

    def _check(self, what, send, recv, op):
        """(input as kernel view, recv as kernel view, kernel op)."""
        if self.comm is None:
            raise RuntimeError(f"ShmAllreduce.{what}: used after free()")
        kop = next((code for known, code in _OPS if op == known), None) \
            if isinstance(op, MPI.Op) else None
        if kop is None:
            raise TypeError(f"ShmAllreduce.{what}: op must be MPI.SUM, MPI.MAX or MPI.MIN, "
                            f"not {op!r}")
        if send is MPI.IN_PLACE:
            send = None
        for name, a in (("recvbuf", recv), ("sendbuf", send)):
            if a is None:
                continue
            if not isinstance(a, np.ndarray):
                raise TypeError(f"ShmAllreduce.{what}: {name} must be a numpy array, "
                                f"not {type(a).__name__}")
            if a.dtype not in _TYPES:
                raise TypeError(f"ShmAllreduce.{what}: unsupported dtype {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"ShmAllreduce.{what}: {name} must be C-contiguous")
        if what != "reduce_scatter" and not recv.flags.writeable:
            raise ValueError(f"ShmAllreduce.{what}: recvbuf is read-only")
        if send is not None and send.dtype != recv.dtype:
            raise TypeError(f"ShmAllreduce.{what}: sendbuf dtype {send.dtype} differs from "
                            f"recvbuf dtype {recv.dtype}")
        if send is not None and send.size != recv.size:
            raise ValueError(f"ShmAllreduce.{what}: sendbuf has {send.size} values, "
                             f"recvbuf {recv.size}")
        kd = _TYPES[recv.dtype][0]
        out = recv.reshape(-1).view(kd)
        return SK.readonly(out if send is None else send.reshape(-1).view(kd)), out, kop

    def _warm(self, kd):
        if kd in self._warmed:
            return
        in_turn(self.rank == 0, self.comm, lambda: SK.warm(kd, _ACC_OF_KERNEL[kd], self._at_zero))
        self._warmed.add(kd)

    def _reduce(self, win, stride, at, own, lo, hi, kop, out, out2):
        """Slice [lo, hi) of every slot, slot k's data starting at[k] values
        into it (None: at 0), this rank's read from own; returns the largest
        finite magnitude read (SUM)."""
        if self.P == 2:
            b = lo if at is None else lo + at.item(1 - self.rank)
            x0, b0, x1, b1 = (own, lo, win, stride + b) if self.rank == 0 else (win, b, own, lo)
            return SK.reduce_pair(x0, b0, x1, b1, hi - lo, kop, out, out2)
        acc = self._acc[_ACC_OF_KERNEL[win.dtype]]
        return SK.reduce_slots(win, stride, self._at_zero if at is None else at, self.P,
                               self.rank, own, lo, hi, kop, acc, out, out2)

    def _place(self, n, kd, rd, base):
        """Views of the two-phase schedule for n values of kernel type kd
        with results of type rd, this rank's data starting ``base`` bytes
        into its slot, built once per window and message shape: (window,
        slot stride, own data slot and its address, every rank's (lo, hi,
        result region))."""
        key = (n, kd, rd, base)
        place = self._places.get(key)
        if place is None:
            s = kd.itemsize
            win, stride = self._view(kd), self._stride // s
            first = self.rank * stride + base // s
            slot = win[first:first + n]
            parts = []
            for k in range(self.P):
                lo, hi = slice_bounds(n, s, self.P, k)
                off = (k * self._stride + self.cap) // rd.itemsize
                parts.append((lo, hi, self._view(rd)[off:off + hi - lo]))
            place = self._places[key] = (win, stride, slot, _address(slot), parts)
        return place

    def _reduce_scatter(self, src, kop, keep_acc, own_out):
        n, kd = src.size, src.dtype
        # room for the input after a lent empty() buffer, which then keeps
        # its values: the same size on every rank, whatever each passes
        self.reserve(max(self._lent_bytes + n * kd.itemsize, 1))
        base = 0 if self.is_window_buffer(src) else self._lent_bytes
        self._warm(kd)
        rd = _ACC_OF_KERNEL[kd] if keep_acc else kd
        win, stride, slot, addr, parts = self._place(n, kd, rd, base)
        lo, hi, res = parts[self.rank]
        if _address(src) != addr:
            # the others read all but this rank's own slice, which it reads
            # from src itself
            np.copyto(slot[:lo], src[:lo])
            np.copyto(slot[hi:], src[hi:])
        self._at[self.rank] = base // kd.itemsize
        self._sync()
        self._most[self.rank] = self._reduce(
            win, stride, self._at, src, lo, hi, kop, res,
            win[:0] if own_out is None else own_out[lo:hi])
        self._pending = (n, kd, rd, base)
        return res

    def _allgather(self, out, skip_own):
        n, kd, rd, base = self._pending
        self._pending = None
        parts = self._place(n, kd, rd, base)[4]
        self._sync()
        for k, (lo, hi, res) in enumerate(parts):
            if skip_own and k == self.rank:
                continue
            if rd == kd:
                np.copyto(out[lo:hi], res)
            else:
                SK.convert(res, out[lo:hi])
        return float(self._most.max())

    def _oneshot(self, src, out, kop):
        n, kd = src.size, src.dtype
        self.reserve(n * kd.itemsize)
        self._warm(kd)
        key = (n, kd, None)
        place = self._places.get(key)
        if place is None:
            s = kd.itemsize
            stride = self._stride // s
            place = []
            for parity in (0, 1):
                first = (self.cap + self._rcap + parity * _round_up(self.oneshot_bytes, LINE)) // s
                win = self._view(kd)[first:]
                place.append((win, stride, win[self.rank * stride:self.rank * stride + n]))
            self._places[key] = place
        win, stride, area = place[self._oneshots & 1]
        self._oneshots += 1
        np.copyto(area, src)
        self._sync()
        return self._reduce(win, stride, None, src, 0, n, kop, out, win[:0])


def _address(a):
    return a.__array_interface__["data"][0]
