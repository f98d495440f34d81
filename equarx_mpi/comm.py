"""The public edge: QuantizedComm, argument checks agreed across ranks, the
choice between the quantized ring and exact MPI, and the one-call helper."""
import array
import collections
import functools
import inspect
import math
import os
import sys
import zlib

import ml_dtypes
import numpy as np
from mpi4py import MPI

from . import formats, ring
from . import kernels as K

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: Float dtypes that travel quantized; anything else takes exact MPI.
QUANTIZED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BFLOAT16)
_HALF_DTYPES = (np.dtype(np.float16), BFLOAT16)
#: Reduced in float32 on the exact path: MPI knows no such type.
_UPCAST_DTYPES = (BFLOAT16,) if "e" in MPI._typedict else _HALF_DTYPES
ALGORITHMS = ("ring",)
#: Below this many bytes per rank the exact MPI collective is used, by
#: default: one value when all ranks share a node (shared memory: MPI's copy
#: is cheap, the kernels' passes over memory are not), one across nodes.
#: Measured with ``python -m equarx_mpi.bench``; see README "Defaults".
DEFAULT_MIN_QUANTIZED_BYTES = {"one_node": 4 << 20, "network": 256 << 10}
#: Automatic pipelining across nodes: about this many input bytes per piece,
#: at most MAX_AUTO_CHUNKS pieces per shard.  On one node a shard goes as one
#: piece: the "transfer" is a memory copy by the same cores, nothing to hide
#: the kernels behind.  Measured, see README "Defaults".
PIECE_TARGET_BYTES = 256 << 10
MAX_AUTO_CHUNKS = 8
#: No single message exceeds this (MPI counts are 32-bit in many places);
#: pieces are whole blocks, so it must hold at least one block.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_PLAN_CACHE = 8

_OPS = ((MPI.SUM, K.OP_SUM, "SUM"), (MPI.MAX, K.OP_MAX, "MAX"),
        (MPI.MIN, K.OP_MIN, "MIN"))
_OTHER_OPS = ("PROD", "LAND", "BAND", "LOR", "BOR", "LXOR", "BXOR",
              "MAXLOC", "MINLOC", "REPLACE", "NO_OP")


def _op_code(op):
    """(kernel op, or None for the exact path; name)."""
    for known, code, name in _OPS:
        if op == known:
            return code, name
    for name in _OTHER_OPS:
        if op == getattr(MPI, name, None):
            return None, name
    return None, "user-defined op"


def _kernel_view(a, writable):
    """1-D view of a C-contiguous array in the kernels' element type."""
    v = a.reshape(-1)
    if v.dtype == np.float16:
        v = v.view(np.int16)
    elif v.dtype == BFLOAT16:
        v = v.view(np.uint16)
    else:
        v = v.view()
    if not writable:
        v.flags.writeable = False
    return v


def _acc_dtype(dtype):
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


@functools.lru_cache(maxsize=256)
def _meta_key(name, value):
    """A stable integer for comparing a call's value across ranks."""
    if type(value) is int:
        return value
    if isinstance(value, np.dtype):   # dtype.str alone can't tell bfloat16 apart
        value = value.str + str(value)
    return zlib.crc32(f"{name}={value}".encode())


def _is_power_of_two(x):
    return x > 0 and x & (x - 1) == 0


class QuantizedComm:
    """AllReduce and its halves on ``comm``, sending block-quantized data.

    Collective: every rank of ``comm`` creates it with the same options.
    Traffic goes over a duplicate of ``comm``, so it never matches the
    caller's messages.  ``free()`` (or leaving a ``with`` block) releases it.

    bits: 8 = dynamic block-wise int8 (the product); 16 = bfloat16 and
        32 = float32 on the wire (uncompressed rings, the baselines).
    block_size: values per int8 block (one float32 scale each), a power of
        two from 32 to 4096.
    algorithm: "ring" (pipelined reduce-scatter + all-gather).
    chunks: pieces per shard for pipelining; None: one piece when all ranks
        share a node, else about 256 KiB of input per piece (at most 8).
    min_quantized_bytes: messages smaller than this (bytes per rank; for the
        two halves, the P*m-value buffer) use the exact MPI collective; None
        takes the measured default: 4 MiB on one node, 256 KiB across nodes.
    check: agree on every call's arguments across ranks first (one tiny
        Allreduce), so mismatched or bad calls raise the same error
        everywhere instead of hanging.  Turn off only if the caller
        guarantees consistent calls.
    max_message_bytes: split messages above this size.
    """

    def __init__(self, comm, *, bits=8, block_size=256, algorithm="ring",
                 chunks=None, min_quantized_bytes=None, check=True,
                 max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES):
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py MPI.Comm, not {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        if comm.Is_inter():
            raise TypeError("QuantizedComm needs an intra-communicator; "
                            "got an inter-communicator")
        options = dict(bits=bits, block_size=block_size, algorithm=algorithm,
                       chunks=chunks, min_quantized_bytes=min_quantized_bytes,
                       check=check, max_message_bytes=max_message_bytes)
        err = _option_error(options)
        everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                                   options))
        _raise_agreed("QuantizedComm", everyone)
        self.bits = bits
        self.block_size = block_size
        self.algorithm = algorithm
        self.chunks = chunks
        self.check = check
        self.max_message_bytes = max_message_bytes
        self.format = formats.make_format(bits, block_size)
        if os.environ.get("EQUARX_MPI_ABORT_ON_EXCEPTION", "1") != "0":
            abort_on_exception()
        self._comm = comm.Dup()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._compile_first = local.Get_rank() == 0
        #: all ranks on one node (shared memory); the same answer on every rank
        self.one_node = local.Get_size() == self._comm.Get_size()
        local.Free()
        self.min_quantized_bytes = (
            DEFAULT_MIN_QUANTIZED_BYTES["one_node" if self.one_node else "network"]
            if min_quantized_bytes is None else min_quantized_bytes)
        self._compiled = set()
        self._plans = collections.OrderedDict()
        self._ws = np.empty(0, np.uint8)
        self._scratch = {}

    # --- lifetime -----------------------------------------------------------
    def free(self):
        """Collective: release the duplicate communicator and workspace."""
        if self._comm is not None:
            self._comm.Free()
            self._comm = None
            self._plans.clear()
            self._ws = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def _usable(self):
        if self._comm is None:
            raise ValueError("equarx_mpi: this QuantizedComm has been freed")

    # --- public collectives ---------------------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """recvbuf = op over ranks of sendbuf.  ``MPI.IN_PLACE`` as sendbuf (or
        the same array twice) reduces recvbuf in place.  Returns None."""
        send, recv, kop, quantized = self._begin("Allreduce", sendbuf, recvbuf, op)
        P = self._comm.Get_size()
        if P == 1:
            return
        if not quantized:
            return _exact(self._comm, "Allreduce", send, recv, op)
        own = _kernel_view(recv if send is None else send, writable=False)
        out = _kernel_view(recv, writable=True)
        n, B = out.size, self.block_size
        nb = -(-n // B)
        edges = [min(s * nb // P * B, n) for s in range(P + 1)]
        shards = [(edges[s], edges[s + 1] - edges[s]) for s in range(P)]
        self._run("allreduce", shards, own, out, kop, 0, 0)

    def allreduce(self, x, op=MPI.SUM):
        """A new array with x's shape and dtype holding op over ranks of x."""
        x = np.asarray(x)
        x = np.ascontiguousarray(x).reshape(x.shape)    # keeps 0-d as 0-d
        out = np.empty_like(x)
        self.Allreduce(x, out, op)
        return out

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """recvbuf (m values) = op over ranks of block ``rank`` of sendbuf
        (P*m values).  With ``MPI.IN_PLACE`` the input is recvbuf (P*m values)
        and the result goes to its first m.  The result is not requantized:
        it is the full-precision reduction of the quantized partial sums."""
        send, recv, kop, quantized = self._begin("Reduce_scatter_block", sendbuf, recvbuf, op)
        P, r = self._comm.Get_size(), self._comm.Get_rank()
        if P == 1:
            return
        if not quantized:
            return _exact(self._comm, "Reduce_scatter_block", send, recv, op)
        own = _kernel_view(recv if send is None else send, writable=False)
        m = own.size // P
        out = _kernel_view(recv, writable=True)[:m]
        self._run("reduce_scatter", [(s * m, m) for s in range(P)], own, out, kop, 0, r * m)

    def Allgather(self, sendbuf, recvbuf):
        """recvbuf (P*m values) = the m values of every rank, quantized once
        by their owner; the owner's own block is the dequantized form too, so
        recvbuf is identical on every rank.  ``MPI.IN_PLACE``: rank r's values
        are read from block r of recvbuf."""
        send, recv, _, quantized = self._begin("Allgather", sendbuf, recvbuf, None)
        P, r = self._comm.Get_size(), self._comm.Get_rank()
        if P == 1:
            return
        if not quantized:
            return _exact_gather(self._comm, send, recv)
        m = recv.size // P
        out = _kernel_view(recv, writable=True)
        own = (_kernel_view(recv, writable=False)[r * m:(r + 1) * m] if send is None
               else _kernel_view(send, writable=False))
        self._run("allgather", [(s * m, m) for s in range(P)], own, out, K.OP_MAX, r * m, 0)

    # --- internals --------------------------------------------------------------
    def _begin(self, what, sendbuf, recvbuf, op):
        """What every call starts with: local checks, agreed across ranks, and
        the choice between the quantized ring and exact MPI (Allgather
        reduces nothing and ignores op).  Returns (send or None for in place,
        recv, kernel op, quantized).  On one rank every collective is a copy,
        done here."""
        self._usable()
        send, recv, meta, err = _check_buffers(what, sendbuf, recvbuf, op,
                                               self._comm.Get_size())
        kop = K.OP_MAX if what == "Allgather" else _op_code(op)[0]
        quantized = (err is None and kop is not None and recv.dtype in QUANTIZED_DTYPES
                     and dict(meta)["count"] * recv.dtype.itemsize >= self.min_quantized_bytes)
        guard = self.check and quantized and recv.dtype == np.float64
        exponent = _f64_exponent(self._own_values(what, send, recv)) if guard else NO_EXPONENT
        top = self._agree(what, meta, err, exponent)
        if guard and not -F64_EXPONENT_LIMIT <= top <= F64_EXPONENT_LIMIT:
            quantized = False            # beyond what float32 scales can carry
        if self._comm.Get_size() == 1 and send is not None:
            recv[...] = send.reshape(recv.shape)
        return send, recv, kop, quantized

    def _own_values(self, what, send, recv):
        """This rank's input (in place, for Allgather, only its own block)."""
        if send is not None:
            return send
        if what == "Allgather":
            P, r = self._comm.Get_size(), self._comm.Get_rank()
            m = recv.size // P
            return recv.reshape(-1)[r * m:(r + 1) * m]
        return recv

    def _agree(self, what, meta, err, exponent):
        """Raise the same error on every rank unless all ranks made the same
        call without local errors.  Returns the largest ``exponent``."""
        if not self.check or self._comm.Get_size() == 1:
            if err is not None:
                raise err
            return exponent
        # One tiny MAX-Allreduce of (fields, -fields, error flag, exponent)
        # tells every rank whether all agree; only then are details gathered.
        # (array.array: a numpy array costs more than the message here.)
        fields = [v if type(v) is int else _meta_key(name, v) for name, v in meta]
        a = array.array("q", fields)
        a.extend([-f for f in fields])
        a.extend((err is not None, exponent))
        self._comm.Allreduce(MPI.IN_PLACE, [a, MPI.INT64_T], MPI.MAX)
        k = len(fields)
        if not a[-2] and all(a[i] == -a[k + i] for i in range(k)):
            return a[-1]
        everyone = self._comm.allgather(
            (None if err is None else (type(err).__name__, str(err)),
             {name: str(v) for name, v in meta}))
        _raise_agreed(what, everyone)

    def _ensure_compiled(self, kdtype):
        # One rank per node compiles into numba's on-disk cache first, so
        # ranks never write the same cache entries at once.
        key = kdtype.str
        if key in self._compiled:
            return
        if self._compile_first:
            _warm(self.format, kdtype, self.block_size)
        self._comm.Barrier()
        if not self._compile_first:
            _warm(self.format, kdtype, self.block_size)
        self._compiled.add(key)

    def _workspace(self, nbytes):
        if self._ws.size < nbytes:
            self._plans.clear()
            self._ws = np.empty(nbytes, np.uint8)
        return self._ws

    def _run(self, kind, shards, own, out, kop, own_offset, out_offset):
        self._ensure_compiled(own.dtype)
        P = len(shards)
        item = own.dtype.itemsize
        chunks = self.chunks
        if chunks is None and self.one_node:
            chunks = 1
        elif chunks is None:
            biggest = max(length for _, length in shards) * item
            chunks = max(1, min(MAX_AUTO_CHUNKS, biggest // PIECE_TARGET_BYTES))
        key = (kind, tuple(shards), chunks)
        plan = self._plans.get(key)
        if plan is None:
            plan = ring.Plan(kind, self.format, shards, self._comm.Get_rank(),
                             chunks, self.block_size, self.max_message_bytes,
                             self._workspace)
            self._plans[key] = plan
            while len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        acc = _acc_dtype(own.dtype)
        scratch = self._scratch.get(acc.str)
        if scratch is None:
            scratch = self._scratch[acc.str] = np.empty(self.block_size, acc)
        ring.run(self._comm, plan, self.format, own, out, kop, scratch,
                 own_offset, out_offset)


# --- argument checks --------------------------------------------------------------

def _option_error(o):
    try:
        if o["bits"] not in formats.SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {formats.SUPPORTED_BITS}, not {o['bits']!r}")
        b = o["block_size"]
        if not isinstance(b, (int, np.integer)) or not _is_power_of_two(b) or not 32 <= b <= 4096:
            raise ValueError(f"block_size must be a power of two from 32 to 4096, not {b!r}")
        if o["algorithm"] not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {o['algorithm']!r}")
        c = o["chunks"]
        if c is not None and (not isinstance(c, (int, np.integer)) or c < 1):
            raise ValueError(f"chunks must be None or an integer >= 1, not {c!r}")
        q = o["min_quantized_bytes"]
        if q is not None and (not isinstance(q, (int, np.integer)) or q < 0):
            raise ValueError(f"min_quantized_bytes must be None or an integer >= 0, not {q!r}")
        mm = o["max_message_bytes"]
        one_block = formats.make_format(o["bits"], b).nbytes(b)
        if not isinstance(mm, (int, np.integer)) or not one_block <= mm < 2 ** 31:
            raise ValueError(f"max_message_bytes must be an integer from one block's "
                             f"{one_block} bytes to 2**31 - 1, not {mm!r}")
    except ValueError as e:
        return e
    return None


NO_EXPONENT = -(1 << 20)
#: float64 data whose largest magnitude (over all ranks) is not within
#: 2**+-100 takes exact MPI: float32 block scales cannot carry it faithfully.
F64_EXPONENT_LIMIT = 100


def _f64_exponent(x):
    """Binary exponent e of the largest finite |x| (|x| < 2**e)."""
    hi = max(float(x.max(initial=-np.inf)), -float(x.min(initial=np.inf)))
    if not np.isfinite(hi):
        finite = x[np.isfinite(x)]
        hi = float(np.abs(finite).max(initial=0.0))
    return math.frexp(hi)[1] if hi > 0 else NO_EXPONENT


def _same_memory(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.nbytes == b.nbytes)


def _check_buffers(what, sendbuf, recvbuf, op, P):
    """Local checks before any communication, for ``what`` in Allreduce,
    Reduce_scatter_block (recv = send / P) and Allgather (recv = P x send).

    Returns (send or None when in place, recv, meta, error): meta is a list
    of (name, value) that every rank must share; count is the whole message
    (P*m values for the two halves)."""
    in_place = sendbuf is MPI.IN_PLACE
    reduces = what != "Allgather"
    meta = [("call", what), ("op", _op_code(op)[1] if isinstance(op, MPI.Op) else "none")]
    try:
        if reduces and not isinstance(op, MPI.Op):
            raise TypeError(f"{what}: op must be an MPI.Op such as MPI.SUM, not {op!r}")
        if not isinstance(recvbuf, np.ndarray):
            raise TypeError(f"{what}: recvbuf must be a numpy array, not {type(recvbuf).__name__}")
        if not in_place and not isinstance(sendbuf, np.ndarray):
            raise TypeError(f"{what}: sendbuf must be a numpy array or MPI.IN_PLACE, "
                            f"not {type(sendbuf).__name__}")
        # subclasses (np.matrix, masked arrays) as the plain arrays they hold
        recvbuf = recvbuf.view(np.ndarray)
        send = None if in_place else sendbuf.view(np.ndarray)
        dt = recvbuf.dtype
        if send is not None and send.dtype != dt:
            raise TypeError(f"{what}: sendbuf dtype {send.dtype} differs from recvbuf dtype {dt}")
        if dt not in QUANTIZED_DTYPES and dt.kind not in "biufc":
            raise TypeError(f"{what}: unsupported dtype {dt}")
        if not dt.isnative:
            raise TypeError(f"{what}: dtype {dt.str} is not in the machine's byte order")
        if dt == BFLOAT16 and reduces and _op_code(op)[1] == "user-defined op":
            raise TypeError(f"{what}: a user-defined op cannot reduce bfloat16 "
                            f"(MPI has no bfloat16 type)")
        if not recvbuf.flags.c_contiguous:
            raise ValueError(f"{what}: recvbuf must be C-contiguous (shape {recvbuf.shape}, "
                             f"strides {recvbuf.strides})")
        if not recvbuf.flags.writeable:
            raise ValueError(f"{what}: recvbuf is read-only")
        if send is not None:
            if not send.flags.c_contiguous:
                raise ValueError(f"{what}: sendbuf must be C-contiguous (shape {send.shape}, "
                                 f"strides {send.strides})")
            want = {"Allreduce": send.size, "Allgather": P * send.size,
                    "Reduce_scatter_block": send.size // P}[what]
            if recvbuf.size != want or (what == "Reduce_scatter_block" and send.size % P):
                raise ValueError(f"{what}: sendbuf has {send.size} values and recvbuf "
                                 f"{recvbuf.size}; with {P} ranks recvbuf needs {want}"
                                 + (f" and sendbuf a multiple of {P}"
                                    if what == "Reduce_scatter_block" else ""))
            if np.may_share_memory(send, recvbuf):
                if what != "Allreduce" or not _same_memory(send, recvbuf):
                    raise ValueError(f"{what}: sendbuf and recvbuf overlap; pass "
                                     f"MPI.IN_PLACE to work in place")
                send = None
        elif what != "Allreduce" and recvbuf.size % P:
            raise ValueError(f"{what}: in place, recvbuf's {recvbuf.size} values do not split "
                             f"into {P} equal blocks")
        total = send.size if what == "Reduce_scatter_block" and send is not None else (
            recvbuf.size)
        meta += [("count", int(total)), ("dtype", dt), ("shape", recvbuf.shape)]
        return send, recvbuf, meta, None
    except (TypeError, ValueError) as e:
        meta += [("count", "?"), ("dtype", "?"), ("shape", "?")]
        return None, recvbuf, meta, e


def _raise_agreed(what, everyone):
    """Raise on every rank the same exception, built from every rank's
    (error or None, description) as gathered in rank order."""
    errors = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if errors:
        r, (cls, msg) = errors[0]
        more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
        exc = TypeError if cls == "TypeError" else ValueError
        raise exc(f"equarx_mpi: rank {r}: {msg}{more}")
    descs = [d for _, d in everyone]
    for name in descs[0]:
        values = [d.get(name) for d in descs]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"equarx_mpi: {name} differs between ranks ({shown})")


def _exact(comm, what, send, recv, op):
    """The exact MPI collective on the duplicate; send None means in place."""
    fn = getattr(comm, what)
    if recv.dtype not in _UPCAST_DTYPES:
        return fn(MPI.IN_PLACE if send is None else send, recv, op)
    # MPI has no bfloat16 (and some MPIs no float16): reduce in float32.
    src = (recv if send is None else send).reshape(-1).astype(np.float32)
    if what == "Allreduce":
        fn(MPI.IN_PLACE, src, op)
        res = src
    else:
        res = np.empty(src.size // comm.Get_size(), np.float32)
        fn(src, res, op)
    recv.reshape(-1)[:res.size] = res.astype(recv.dtype)


def _exact_gather(comm, send, recv):
    r = recv.reshape(-1)
    if r.dtype in _HALF_DTYPES:   # move the bits
        r = r.view(np.uint16)
        send = None if send is None else send.reshape(-1).view(np.uint16)
    comm.Allgather(MPI.IN_PLACE if send is None else send, r)


def _warm(fmt, kdtype, block):
    """Compile (or load from cache) every kernel for one element type."""
    acc = _acc_dtype(kdtype)
    scratch = np.empty(block, acc)
    src = np.zeros(2 * block + 3, kdtype)
    src.flags.writeable = False
    out = np.zeros_like(src)
    w = fmt.views(np.zeros(fmt.nbytes(src.size), np.uint8), src.size)
    fmt.encode(src, w, scratch)
    fmt.decode(w, out, scratch)
    fmt.decode_reduce(src, w, out, K.OP_SUM, scratch)
    fmt.decode_reduce_encode(src, w, w, K.OP_SUM, scratch)


def abort_on_exception():
    """Make an uncaught exception on any rank print its traceback and end the
    whole MPI job (``COMM_WORLD.Abort``), as ``python -m mpi4py`` does.

    Without it, the other ranks wait in their next collective forever.
    QuantizedComm installs it; EQUARX_MPI_ABORT_ON_EXCEPTION=0 opts out."""
    if getattr(sys.excepthook, "_equarx_mpi", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.write(f"equarx_mpi: uncaught exception on rank "
                         f"{MPI.COMM_WORLD.Get_rank()}, aborting the MPI job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    hook._equarx_mpi = True
    sys.excepthook = hook


# --- one call for scripts ----------------------------------------------------------

_keyval = None
_SIGNATURE = inspect.signature(QuantizedComm.__init__)


def _drop_cached(comm, keyval, cached):
    for qc in cached.values():
        qc.free()


def allreduce(x, comm=None, op=MPI.SUM, **options):
    """op over the ranks of ``comm`` (default COMM_WORLD) of array x, as a new
    array.  The QuantizedComm for (comm, options) is created on first use and
    cached on ``comm`` itself (an MPI attribute), freed with ``comm``."""
    global _keyval
    comm = MPI.COMM_WORLD if comm is None else comm
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_drop_cached)
    cached = comm.Get_attr(_keyval)
    if cached is None:
        cached = {}
        comm.Set_attr(_keyval, cached)
    # the same options however spelled, or ranks would pick different entries
    bound = _SIGNATURE.bind(None, comm, **options)
    bound.apply_defaults()
    key = tuple(sorted((k, v) for k, v in bound.arguments.items() if k not in ("self", "comm")))
    qc = cached.get(key)
    if qc is None:
        qc = cached[key] = QuantizedComm(comm, **options)
    return qc.allreduce(x, op)
