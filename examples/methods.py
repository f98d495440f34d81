"""The AllReduce methods the examples compare, in one table.

Each name maps to QuantizedComm options, or None for mpi4py's exact
``comm.Allreduce``.  ``make_reducers(comm, names)`` returns, per name, a
function ``reduce(buf)`` that sums ``buf`` over the ranks in place.
New library methods (algorithms, wire formats) are one line here.
"""
import os

from mpi4py import MPI

from equarx_mpi import QuantizedComm

#: a schedule by name at every size (the library's default, "auto", picks per call)
RING = dict(algorithm="ring", min_quantized_bytes=0)
METHODS = {
    "mpi": None,                                         # exact, what MPI codes use today
    "bf16": dict(RING, wire="bf16"),                     # uncompressed 16-bit ring
    "int8": dict(RING, wire="int8"),                     # EQuARX int8 ring, every size
    "int8-2shot": dict(wire="int8", algorithm="two_shot", min_quantized_bytes=0),
    "fp8": dict(RING, wire="fp8"),                       # e4m3 codes, ring
    "int4": dict(RING, wire="int4"),                     # half int8's bytes, ring
}


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
            else:
                qc = QuantizedComm(comm, **opts)
                self._qcs.append(qc)
                self._by_name[name] = qc
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


def parse_methods(parser, text):
    """The method names in a comma-separated ``text``; an argparse error
    (on every rank alike) for an unknown one."""
    names = [m for m in text.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    return names


def limit_blas_threads(comm):
    """Give each rank its share of the node's cores, so that P ranks times
    BLAS threads do not oversubscribe them (each rank plays one chip).
    Returns the active limiter (keep it alive), or None where
    OMP_NUM_THREADS or OPENBLAS_NUM_THREADS already decides."""
    from threadpoolctl import threadpool_limits
    if {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"} & set(os.environ):
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = node.Get_size()
    node.Free()
    return threadpool_limits(max(1, (os.cpu_count() or 1) // ranks))
