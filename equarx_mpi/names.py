"""Names and tables that every layer shares: the leaf of the import graph.

It imports no module of the package, so a kernel, a wire format, a
schedule and the policy can all take their constants from here without
reaching up into a higher layer.
"""
from typing import NamedTuple

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: Float dtypes that may travel quantized; anything else takes exact MPI.
QUANTIZED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BFLOAT16)
#: The kernels see 16-bit floats as their bits (numba has no float16 or
#: bfloat16 arithmetic): value dtype -> the kernels' element type.
KERNEL_DTYPE: "dict[np.dtype, np.dtype]" = {np.dtype(np.float32): np.dtype(np.float32),
                np.dtype(np.float64): np.dtype(np.float64),
                np.dtype(np.float16): np.dtype(np.int16),
                BFLOAT16: np.dtype(np.uint16)}
#: ... and back: the kernels' element type -> value dtype.
VALUE_DTYPE = {kd: d for d, kd in KERNEL_DTYPE.items()}

#: Reduction codes the kernels dispatch on.
OP_SUM, OP_MAX, OP_MIN = 0, 1, 2
#: Rounding of values to codes: nearest (ties to even), or directed so that
#: a decoded value is never below (UP) or above (DOWN) the value encoded,
#: or STOCHASTIC: up or down at random, unbiased (kernels.stochastic).
ROUND_NEAREST, ROUND_UP, ROUND_DOWN, ROUND_STOCHASTIC = 0, 1, 2, 3
#: the ops the library can quantize, by name, and their kernel codes
KERNEL_OP = {"sum": OP_SUM, "max": OP_MAX, "min": OP_MIN}
#: how each op's codes round by default: MAX up and MIN down always, so
#: MAX is never below and MIN never above the true result
ROUNDING = {"sum": ROUND_NEAREST, "max": ROUND_UP, "min": ROUND_DOWN}

#: the methods that are exact; every other method is a quantized schedule
EXACT = ("copy", "mpi", "shm")


class Layout(NamedTuple):
    """Where the ranks are: the same on every rank."""
    nodes: int                #: how many nodes (EQUARX_MPI_FAKE_NODES can fake them)
    ranks_per_node: int       #: ranks on this rank's node
    uniform: bool             #: every node holds the same number of ranks

    @property
    def one_node(self):
        return self.nodes == 1


def kernel_dtype(dtype):
    """The kernels' element type for a value dtype."""
    dtype = np.dtype(dtype)
    return KERNEL_DTYPE.get(dtype, dtype)


def kernel_view(a, writable):
    """1-D view of a C-contiguous array in the kernels' element type."""
    v = a.reshape(-1)
    v = v.view(KERNEL_DTYPE.get(v.dtype, v.dtype))
    if not writable:
        v.flags.writeable = False
    return v


def acc_dtype(kdtype):
    """The kernels' accumulation type for a kernel element type: float64
    for float64, float32 for the rest."""
    return np.dtype(np.float64) if kdtype == np.float64 else np.dtype(np.float32)


def workspace(kept, key, n, dtype):
    """n values of dtype from the dict ``kept`` under ``key``, grown when
    too short and kept for the next call (the library's own memory, never
    a caller's)."""
    buf = kept.get(key)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = kept[key] = np.empty(n, dtype)
    return buf[:n]


def dtype_name(dtype):
    """numpy's name, "bfloat16" for ml_dtypes' type (whose numpy name is
    not stable across versions)."""
    d = np.dtype(dtype)
    return "bfloat16" if d == BFLOAT16 else d.name


def rounding(opname, mode):
    """How op ``opname``'s codes round: MAX up and MIN down always; SUM to
    nearest, or stochastically with the option ``rounding="stochastic"``."""
    if opname == "sum" and mode == "stochastic":
        return ROUND_STOCHASTIC
    return ROUNDING[opname]


def between_nodes(wire):
    """The quantized schedule between nodes (hierarchical's inner step, and
    what the cost model predicts for it): two-shot on every wire (its error
    is flat in the node count; the ring's grows)."""
    return "two_shot"
