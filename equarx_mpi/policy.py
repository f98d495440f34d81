"""The choice of method for each call, in one place: exact MPI or a
quantized schedule, how a shard is cut into pieces, and how values round.

Lossy only where the caller asked for it: SUM is quantized by default;
MAX and MIN only when ``lossy_ops`` names them (then rounded so MAX is
never below and MIN never above the true result); every other op and
every non-float dtype is exact.  Small messages take exact MPI too, below
the measured crossover where quantizing stops paying."""
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


def min_quantized_bytes(opts, one_node):
    q = opts["min_quantized_bytes"]
    return DEFAULT_MIN_QUANTIZED_BYTES["one_node" if one_node else "network"] if q is None else q


def choose(opts, what, opname, dtype, nbytes, P, one_node):
    """(quantize, reason): whether this call travels quantized, and why
    (or why not), in words for ``last_call``."""
    if P == 1:
        return False, "one rank: a copy"
    if disabled():
        return False, "EQUARX_MPI_DISABLE is set"
    if dtype not in QUANTIZED_DTYPES:
        return False, f"dtype {np.dtype(dtype).name} is always exact"
    if what != "Allgather":
        if opname not in KERNEL_OP:
            return False, f"op {opname} is always exact"
        if opname not in opts["lossy_ops"]:
            return False, (f"op {opname.upper()} is exact unless lossy_ops "
                           f"includes {opname!r}")
        if opname != "sum" and opts["wire"] not in formats.DIRECTED_WIRES:
            return False, (f"{opname.upper()} travels quantized only on the wires that round "
                           f"up and down: {', '.join(formats.DIRECTED_WIRES)}")
    least = min_quantized_bytes(opts, one_node)
    if nbytes < least:
        return False, f"{nbytes} bytes is below min_quantized_bytes={least}"
    return True, "quantized"


def chunks(opts, one_node, biggest_shard_bytes):
    """Pieces per shard."""
    if opts["chunks"] is not None:
        return opts["chunks"]
    if one_node:
        return 1
    return max(1, min(MAX_AUTO_CHUNKS, biggest_shard_bytes // PIECE_TARGET_BYTES))
