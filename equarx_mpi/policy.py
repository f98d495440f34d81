"""The choice of method for each call, in one place: exact MPI or a
quantized schedule, how a shard is cut into pieces, and how values round.

Lossy only where the caller asked for it: SUM is quantized by default;
MAX and MIN only when ``lossy_ops`` names them (then rounded so MAX is
never below and MIN never above the true result); every other op and
every non-float dtype is exact.  Small messages take exact MPI too, below
the measured crossover where quantizing stops paying."""
from typing import NamedTuple

import numpy as np

from . import formats
from . import kernels as K
from .options import disabled
from .validate import QUANTIZED_DTYPES

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

KERNEL_OP = {"sum": K.OP_SUM, "max": K.OP_MAX, "min": K.OP_MIN}
ROUNDING = {"sum": K.ROUND_NEAREST, "max": K.ROUND_UP, "min": K.ROUND_DOWN}


def rounding(opts, opname):
    """How op ``opname``'s codes round: MAX up and MIN down always; SUM to
    nearest, or stochastically with ``rounding="stochastic"``."""
    if opname == "sum" and opts["rounding"] == "stochastic":
        return K.ROUND_STOCHASTIC
    return ROUNDING[opname]


def min_quantized_bytes(opts, one_node):
    q = opts["min_quantized_bytes"]
    return DEFAULT_MIN_QUANTIZED_BYTES["one_node" if one_node else "network"] if q is None else q


class Layout(NamedTuple):
    """Where the ranks are: the same on every rank."""
    nodes: int                #: how many nodes (EQUARX_MPI_FAKE_NODES can fake them)
    ranks_per_node: int       #: ranks on this rank's node
    uniform: bool             #: every node holds the same number of ranks

    @property
    def one_node(self):
        return self.nodes == 1


#: the methods that are exact
EXACT = ("copy", "mpi", "shm")


def choose(opts, what, opname, dtype, nbytes, P, layout):
    """(method, reason): how this call runs, and why, in words for
    ``last_call``.  Methods: "copy" (one rank), "mpi" (MPI's own
    collective), "shm" (exact, through a shared window on one node), or a
    quantized schedule: "ring", "two_shot", "hierarchical"."""
    if P == 1:
        return "copy", "one rank: a copy"
    if disabled():
        return "mpi", "EQUARX_MPI_DISABLE is set"
    alg = opts["algorithm"]
    if alg == "mpi":
        return "mpi", "algorithm='mpi'"
    if dtype not in QUANTIZED_DTYPES:
        return "mpi", f"dtype {np.dtype(dtype).name} is always exact"
    if what != "Allgather" and opname not in KERNEL_OP:
        return "mpi", f"op {opname} is always exact"
    # exact from here on: through the window where asked for and possible
    window = (alg == "shm" and layout.one_node and what == "Allreduce")
    exact = "shm" if window else "mpi"
    if alg == "shm":
        return exact, ("algorithm='shm': exact, through a shared window" if window else
                       "algorithm='shm' reduces only Allreduce on one node: MPI")
    if what != "Allgather":
        if opname not in opts["lossy_ops"]:
            return exact, (f"op {opname.upper()} is exact unless lossy_ops "
                           f"includes {opname!r}")
        if opname != "sum" and opts["wire"] not in formats.DIRECTED_WIRES:
            return exact, (f"{opname.upper()} travels quantized only on wires that round "
                           f"up and down: {', '.join(formats.DIRECTED_WIRES)}")
    least = min_quantized_bytes(opts, layout.one_node)
    if nbytes < least:
        return exact, f"{nbytes} bytes is below min_quantized_bytes={least}"
    if alg == "hierarchical":
        if what == "Allreduce" and layout.uniform and not layout.one_node:
            return "hierarchical", "quantized between nodes, exact inside them"
        return "ring", ("hierarchical covers Allreduce across nodes of equal size; "
                        "this call: the ring")
    return alg, "quantized"


def chunks(opts, one_node, biggest_shard_bytes):
    """Pieces per shard."""
    if opts["chunks"] is not None:
        return opts["chunks"]
    if one_node:
        return 1
    return max(1, min(MAX_AUTO_CHUNKS, biggest_shard_bytes // PIECE_TARGET_BYTES))
