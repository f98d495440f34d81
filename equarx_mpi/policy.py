"""The choice of method for each call, in one place: exact MPI or a
quantized schedule, how a shard is cut into pieces, and how values round.

Lossy only where the caller asked for it: SUM is quantized by default;
MAX and MIN only when ``lossy_ops`` names them (then rounded so MAX is
never below and MIN never above the true result); every other op and
every non-float dtype is exact.  Small messages take exact MPI too, below
the crossover where quantizing stops paying: where the cost model
(costmodel.py, a profile measured by ``python -m equarx_mpi.tune``)
predicts the quantized method at least LOSSY_MARGIN faster than the exact
one, or from ``min_quantized_bytes`` when that is given.

algorithm="auto" picks, per call, the fastest predicted method among those
allowed: the exact ones (MPI; the shared window on one node) and the
quantized ones (ring; two-shot; hierarchical on several nodes of equal
size) whose error on standard-normal data (costmodel.error) is within
``accuracy``.  A quantized method must beat the best exact one by
LOSSY_MARGIN: exactness wins near-ties."""
from typing import NamedTuple

import numpy as np

from . import formats
from . import kernels as K
from .options import disabled
from .validate import QUANTIZED_DTYPES

#: A quantized method runs only where predicted this much faster than the
#: exact one (1.05: at most 5% slower than the best, by the model).
LOSSY_MARGIN = 1.05
#: Automatic pipelining across nodes: about this many input bytes per piece,
#: at most MAX_AUTO_CHUNKS pieces per shard.  On one node a shard goes as one
#: piece: the "transfer" is a memory copy by the same cores, nothing to hide
#: the kernels behind.  Measured, see README "Defaults".
PIECE_TARGET_BYTES = 256 << 10
MAX_AUTO_CHUNKS = 8

KERNEL_OP = {"sum": K.OP_SUM, "max": K.OP_MAX, "min": K.OP_MIN}
ROUNDING = {"sum": K.ROUND_NEAREST, "max": K.ROUND_UP, "min": K.ROUND_DOWN}


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


def choose(opts, what, opname, dtype, nbytes, P, layout, model):
    """(method, reason): how this call runs, and why, in words for
    ``last_call``.  Methods: "copy" (one rank), "mpi" (MPI's own
    collective), "shm" (exact, through a shared window on one node), or a
    quantized schedule: "ring", "two_shot", "hierarchical".  ``model``: the
    communicator's costmodel.Model."""
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
    window = layout.one_node and what == "Allreduce"
    if alg == "shm":
        return ("shm", "algorithm='shm': exact, through a shared window") if window else (
            "mpi", "algorithm='shm' reduces only Allreduce on one node: MPI")
    # exact from here on: through the window where auto may pick it and it pays
    exact = ["mpi", "shm"] if alg == "auto" and window else ["mpi"]
    times = {}

    def t(m):
        if m not in times:
            times[m] = model.time(m, nbytes, np.dtype(dtype).itemsize, _dtype_name(dtype))
        return times[m]

    best_exact = min(exact, key=t) if len(exact) > 1 else "mpi"
    if what != "Allgather":
        if opname not in opts["lossy_ops"]:
            return best_exact, (f"op {opname.upper()} is exact unless lossy_ops "
                                f"includes {opname!r}")
        if opname != "sum" and opts["wire"] not in formats.DIRECTED_WIRES:
            return best_exact, (f"{opname.upper()} travels quantized only on wires that "
                                f"round up and down: {', '.join(formats.DIRECTED_WIRES)}")
    lossy, why = _lossy_candidates(opts, what, layout, model)
    if not lossy:
        return best_exact, why
    least = opts["min_quantized_bytes"]
    if least is not None and nbytes < least:
        return best_exact, f"{nbytes} bytes is below min_quantized_bytes={least}"
    best = min(lossy, key=t)
    if least is None and t(best) * LOSSY_MARGIN > t(best_exact):
        return best_exact, (f"exact is predicted faster: {_predicted(times, best_exact)}, "
                            f"{_predicted(times, best)}")
    if alg != "auto":
        return best, why
    return best, (f"auto: {_predicted(times, best)}, error {model.error(best):.2%}; "
                  f"{_predicted(times, best_exact)}")


def _dtype_name(dtype):
    d = np.dtype(dtype)
    return "bfloat16" if d.itemsize == 2 and d != np.float16 else d.name


def _predicted(times, m):
    return f"{m} predicted {times[m] * 1e3:.3g} ms"


def _lossy_candidates(opts, what, layout, model):
    """(quantized methods this call may take, and why, in words): the
    algorithm asked for, or under auto every one that fits the call, the
    wire and ``accuracy``."""
    alg, wire, acc = opts["algorithm"], opts["wire"], opts["accuracy"]
    if acc == "exact":
        return [], "accuracy='exact'"
    if alg == "auto":
        cands = ["ring"]
        if wire in formats.MANY_INPUT_WIRES and what != "Allgather":
            cands.append("two_shot")
        if what == "Allreduce" and layout.uniform and not layout.one_node:
            cands.append("hierarchical")
        why = "auto"
    elif alg == "hierarchical" and not (what == "Allreduce" and layout.uniform
                                        and not layout.one_node):
        cands, why = ["ring"], ("hierarchical covers Allreduce across nodes of equal size; "
                                "this call: the ring")
    else:
        cands, why = [alg], "quantized"
    if acc is None:
        return cands, why
    fits = [m for m in cands if model.error(m) <= acc]
    if not fits:
        errs = ", ".join(f"{m} {model.error(m):.2%}" for m in cands)
        return [], f"accuracy={acc:g}: no quantized method is that accurate ({errs})"
    return fits, why


def chunks(opts, one_node, biggest_shard_bytes):
    """Pieces per shard."""
    if opts["chunks"] is not None:
        return opts["chunks"]
    if one_node:
        return 1
    return max(1, min(MAX_AUTO_CHUNKS, biggest_shard_bytes // PIECE_TARGET_BYTES))
