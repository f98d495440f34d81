"""mpi4py's buffer arguments, seen as numpy arrays.

mpi4py takes a buffer argument as any of

    buf                          a numpy array or any buffer-protocol object
                                 (array.array, bytearray, memoryview, ...)
    [buf, MPI.FLOAT]             the datatype given (also as a typecode, "f")
    [buf, count]  [buf, count, MPI.FLOAT]
    [buf, (count, displ), MPI.FLOAT]   [buf, count, displ, MPI.FLOAT]

with the count in datatype entries (per block for the blocked arguments:
Allgather's recvbuf, Reduce_scatter_block's sendbuf, its recvbuf in place)
and the displacement in entries from the start of buf; without a count the
whole buffer (after displ) is the message.  ``message`` turns one such
argument into a 1-D numpy view of the message's values, in memory order,
so C and Fortran layouts, any shape and any buffer type alike reach the
library as the flat run of values that MPI itself would send.

What mpi4py accepts but numpy cannot look into (device memory through
__cuda_array_interface__ or DLPack, derived datatypes, MPI.BOTTOM) comes
back as OPAQUE: a wrapped communicator hands such calls to MPI unchanged.
Anything else is a TypeError or ValueError naming what to pass instead.
"""
import numbers

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

#: Stands for a buffer argument that MPI can take but numpy cannot view.
OPAQUE = type("Opaque", (), {"__repr__": lambda self: "OPAQUE"})()

FORMS = ("a numpy array (C or Fortran order), a buffer such as array.array, bytearray or "
         "memoryview, or a list [buf, MPI.FLOAT], [buf, count, MPI.FLOAT], "
         "[buf, (count, displ), MPI.FLOAT]")


def is_in_place(spec):
    """mpi4py's rule for a collective's sendbuf: None means in place too."""
    return spec is None or spec is MPI.IN_PLACE


def _datatype(t, where):
    """numpy dtype for an explicit MPI datatype (or typecode), or OPAQUE."""
    if isinstance(t, str):
        t = MPI._typedict.get(t)
        if t is None:
            raise TypeError(f"{where}: no MPI datatype for typecode; pass an MPI.Datatype")
    if not isinstance(t, MPI.Datatype):
        raise TypeError(f"{where}: expected an MPI.Datatype, not {type(t).__name__}")
    if t == MPI.DATATYPE_NULL:
        raise ValueError(f"{where}: datatype is MPI.DATATYPE_NULL")
    if not t.is_predefined:
        return OPAQUE            # derived datatype: only MPI knows its layout
    try:
        dt = dtlib.to_numpy_dtype(t)
    except (ValueError, KeyError, TypeError):
        return OPAQUE
    return dt if dt.fields is None and dt.subdtype is None else OPAQUE


def _memory(buf, where):
    """(flat numpy view of buf's memory in its own dtype) or OPAQUE."""
    if buf is MPI.BOTTOM:
        return OPAQUE
    if isinstance(buf, np.ndarray):
        a = buf.view(np.ndarray)     # np.matrix, masked arrays: the data they hold
        if not (a.flags.c_contiguous or a.flags.f_contiguous):
            raise ValueError(f"{where}: a numpy array must be C-contiguous or Fortran-contiguous "
                             f"(shape {a.shape}, strides {a.strides}); pass "
                             f"np.ascontiguousarray(x) and copy the result back")
        return a.reshape(-1, order="A")   # a view, in memory order
    try:
        mem = memoryview(buf)
    except TypeError:
        if hasattr(buf, "__cuda_array_interface__") or hasattr(buf, "__dlpack__"):
            return OPAQUE
        raise TypeError(f"{where}: {type(buf).__name__} is not a buffer; pass {FORMS}") from None
    if not mem.contiguous:
        raise ValueError(f"{where}: the buffer is not contiguous; pass a contiguous copy")
    try:
        return np.asarray(mem).reshape(-1, order="A")
    except (TypeError, ValueError):  # a format numpy does not know: its bytes
        return np.frombuffer(mem.cast("B") if mem.c_contiguous else mem.tobytes(), np.uint8)


def _index(v, what, where):
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise TypeError(f"{where}: {what} must be an integer, not {v!r}")
    if v < 0:
        raise ValueError(f"{where}: negative {what} {v}")
    return int(v)


def message(spec, where="recvbuf", blocks=1):
    """The values of buffer argument ``spec`` as a 1-D numpy view (read-only
    if the memory is), or OPAQUE.  blocks: the count is per block of that many."""
    if type(spec) is np.ndarray and spec.flags.c_contiguous and spec.size % blocks == 0:
        return spec.reshape(-1)         # the common case, quickly
    count = displ = dtype = None
    if isinstance(spec, (list, tuple)):
        items = list(spec)
        if len(items) == 2:
            buf, second = items
            if isinstance(second, (MPI.Datatype, str)):
                dtype = second
            elif isinstance(second, (list, tuple)):
                count, displ = second
            else:
                count = second
        elif len(items) == 3:
            buf, count, dtype = items
            if isinstance(count, (list, tuple)):
                count, displ = count
        elif len(items) == 4:
            buf, count, displ, dtype = items
        else:
            raise TypeError(f"{where}: a list/tuple of {len(items)} items is not a buffer "
                            f"(a buffer list has 2 to 4 items); pass {FORMS}")
    elif spec is None:
        raise TypeError(f"{where}: None is not a buffer; pass {FORMS}")
    else:
        buf = spec
    mem = _memory(buf, where)
    if dtype is not None:
        dtype = _datatype(dtype, where)
    if mem is OPAQUE or dtype is OPAQUE:
        return OPAQUE
    if dtype is None or dtype == mem.dtype:
        vals = mem
    else:                                # MPI reads the bytes as the datatype says
        raw = mem.view(np.uint8)
        if raw.size % dtype.itemsize and count is None:
            raise ValueError(f"{where}: {raw.size} bytes is not a whole number of "
                             f"{dtype.itemsize}-byte values")
        vals = raw[:raw.size - raw.size % dtype.itemsize].view(dtype)
    start = 0 if displ is None else _index(displ, "displacement", where)
    if start > vals.size:
        raise ValueError(f"{where}: displacement {start} is past the buffer's "
                         f"{vals.size} values")
    if count is None:
        n = vals.size - start
        if n % blocks:
            raise ValueError(f"{where}: {n} values do not split into {blocks} equal blocks")
    else:
        n = _index(count, "count", where) * blocks
        if start + n > vals.size:
            raise ValueError(f"{where}: count {n} from displacement {start} needs "
                             f"{start + n} values; the buffer holds {vals.size}")
    return vals[start:start + n]
