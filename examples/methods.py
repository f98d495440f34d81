"""The AllReduce methods the examples compare, in one table.

Each name maps to QuantizedComm options, or None for mpi4py's exact
``comm.Allreduce``; ``feedback=True`` among them gives each buffer shape
its own equarx_mpi.ErrorFeedback (the residual of one call joins the next
on the same shape: for gradients).  ``Reducers(comm, names)`` holds, per
name, a function ``reduce(buf)`` that sums ``buf`` over the ranks in place.

The options come from the benchmark's table (equarx_mpi/bench/methods.py,
the one home of the method names: ``python -m equarx_mpi.bench --help``
describes each); BENCH_NAME says which of its methods each example name
runs.  They are the same names but one: the examples' "int8" is the
bench's "int8-raw", the int8 ring at every size.  The bench's "int8" is
what algorithm="ring" does by default, exact MPI below 4 MiB per rank on
one node, and would leave the examples' small messages exact.  New library
methods (algorithms, wire formats) are one line in the bench's table and
one here.
"""
import os

from mpi4py import MPI

from equarx_mpi import ErrorFeedback, QuantizedComm
from equarx_mpi.bench.methods import METHODS as BENCH

#: example name -> (the bench's method it runs, with error feedback)
BENCH_NAME = {
    "mpi": ("mpi", False),                   # exact, what MPI codes use today
    "bf16": ("bf16", False),                 # uncompressed 16-bit ring
    "int8": ("int8-raw", False),             # EQuARX int8 ring, every size
    "int8-2shot": ("int8-2shot", False),
    "fp8": ("fp8", False),                   # e4m3 codes, ring
    "int4": ("int4", False),                 # half int8's bytes, ring
    "int4+ef": ("int4", True),               # + error feedback
    "int8-rot": ("int8-rot", False),         # rotated before quantizing (rotate=True)
    "int4-rot": ("int4-rot", False),
    "int4-rot+ef": ("int4-rot", True),
    "int4-rot-2s": ("int4-rot-2s", False),   # two-shot, as the torch examples run it
    "int5-rot": ("int5-rot", False),         # 5 and 6 bits, two-shot
    "int6-rot": ("int6-rot", False),
    "int3": ("int3", False),                 # 3 and 2 bits, two-shot: for gradients,
    "int3+ef": ("int3", True),               # with error feedback
    "int2": ("int2", False),
    "int2+ef": ("int2", True),
    "fp8+ef": ("fp8", True),
}
METHODS = {name: None if BENCH[bench].options is None else
           dict(BENCH[bench].options, **({"feedback": True} if feedback else {}))
           for name, (bench, feedback) in BENCH_NAME.items()}
#: the methods without state between calls: the default where one buffer
#: shape holds different quantities from call to call (activations of each
#: layer, an ensemble's sum and sum of squares), which error feedback would
#: mix; dp_digits (one gradient buffer) takes every method
STATELESS = [name for name, opts in METHODS.items() if not (opts or {}).get("feedback")]


class Reducers(dict):
    """name -> reduce(buf) (in-place SUM over ``comm``); ``free()`` releases
    the library's communicators.  Collective: every rank passes the same names."""

    def __init__(self, comm, names):
        super().__init__()
        self._qcs = []
        self._by_name = {}
        for name in names:
            opts = METHODS[name]
            if opts is None:
                self[name] = lambda buf, c=comm: c.Allreduce(MPI.IN_PLACE, buf)
                continue
            opts = dict(opts)
            feedback = opts.pop("feedback", False)
            qc = QuantizedComm(comm, **opts)
            self._qcs.append(qc)
            self._by_name[name] = qc
            if feedback:
                self[name] = _with_feedback(qc)
            else:
                self[name] = lambda buf, q=qc: q.Allreduce(MPI.IN_PLACE, buf)

    def qc(self, name):
        """The QuantizedComm behind ``name`` (None for exact MPI), to read
        what the library reports about its last call."""
        return self._by_name.get(name)

    def free(self):
        for qc in self._qcs:
            qc.free()
        self._qcs = []
        self._by_name = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


def _with_feedback(qc):
    """reduce(buf) on qc with one ErrorFeedback per buffer shape and dtype."""
    residuals = {}

    def reduce(buf):
        ef = residuals.setdefault((buf.shape, buf.dtype.str), ErrorFeedback())
        qc.Allreduce(MPI.IN_PLACE, buf, feedback=ef)
    return reduce


def parse_methods(parser, text):
    """The method names in a comma-separated ``text``; an argparse error
    (on every rank alike) for an unknown one."""
    names = [m for m in text.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    return names


def limit_blas_threads(comm=None):
    """Hold the BLAS at $OPENBLAS_NUM_THREADS threads per rank (1 unless
    set; each example sets it before numpy loads, which is what works for
    numba too).  Needed only where numpy loaded its BLAS before the example
    set the environment (the example imported into a test or a notebook).
    Returns the active limiter (keep it alive; its restore_original_limits()
    undoes it).  ``comm`` is unused, kept for callers.

    Not the node's cores divided by the ranks on the node: on the emulated
    cluster every rank is alone on its "node" and would keep a thread per
    core, which is what made the AllReduce inside tp_prefill 2-3x slower
    there (docs/PERFORMANCE.md "BLAS threads")."""
    from threadpoolctl import threadpool_limits
    text = os.environ.get("OPENBLAS_NUM_THREADS", "1")
    return threadpool_limits(int(text) if text.isdigit() and int(text) > 0 else 1,
                             user_api="blas")
