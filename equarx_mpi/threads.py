"""Threads per rank against the node's cores: one warning when ranks x
threads exceed them.

Why it matters: a quantized AllReduce is CPU work (encode, decode, the
TCP copies) between waits.  When the BLAS of the application keeps more
threads than the node has cores to spare, those threads take the cores
the call needs.  OpenBLAS is the usual culprit: after a multi-threaded
matmul its worker threads busy-wait (2^28 cycles by default, about 0.1 s)
before they sleep, so the AllReduce that follows a matmul runs against
them.  Measured on the emulated cluster (docs/PERFORMANCE.md "BLAS
threads"): the 8 MiB int8 call inside a tensor-parallel prefill took a
median 64-117 ms with OpenBLAS's default of one thread per core, 29-45 ms
with one thread per rank (six runs, loaded machine).

Checked once, when a QuantizedComm is made, from what the process already
knows (no subprocess, no collective; a few ms the first time, when
threadpoolctl is imported, under 1 ms after):

- BLAS threads: threadpoolctl's count if it is installed (it is optional,
  never a dependency), else $OPENBLAS_NUM_THREADS / $OMP_NUM_THREADS,
  else the machine's cores if numpy's BLAS is OpenBLAS (its default);
- numba threads: numba.get_num_threads() only when numba's thread pool has
  been started (asking earlier would start it); the library's own kernels
  run in the caller's thread;
- the library's own kernel threads (QuantizedComm's ``threads`` option);
- threads per rank: the largest of the three (they take turns, not the
  cores at once);
- cores: those this rank may run on (sched_getaffinity).

EQUARX_MPI_THREAD_WARNING=0 silences it.
"""
import os
import sys
import warnings

ENV = "EQUARX_MPI_THREAD_WARNING"
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
_warned = False


def cores():
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return os.cpu_count() or 1


def default_threads(local_ranks):
    """Kernel threads per rank when the option ``threads`` is None: this
    process's cores over the ranks on its node, at least 1 (ranks x threads
    within the cores)."""
    return max(1, cores() // max(1, local_ranks))


def _env_threads(names):
    """(count, name) from the first of ``names`` set to a positive integer,
    else None.  OpenBLAS reads "4" and OpenMP "4,2" (nested): the first."""
    for name in names:
        text = os.environ.get(name, "").split(",")[0].strip()
        if text.isdigit() and int(text) > 0:
            return int(text), f"${name}={text}"
    return None


def _openblas_numpy():
    np = sys.modules.get("numpy")
    if np is None:
        return False
    try:
        name = np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    except (AttributeError, KeyError, TypeError):
        return False
    return "openblas" in str(name).lower()


def blas_threads(ncores):
    """(threads of the process's BLAS, where that number comes from), or
    (1, reason) when nothing says it uses more than one."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        threadpool_info = None
    if threadpool_info is not None:
        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        if pools:
            top = max(pools, key=lambda p: p.get("num_threads") or 1)
            return (top.get("num_threads") or 1,
                    f"threadpoolctl: {top.get('internal_api', 'blas')} "
                    f"{top.get('num_threads')} threads")
    found = _env_threads(_BLAS_ENV)
    if found:
        return found
    if _openblas_numpy():
        return ncores, "OpenBLAS's default, one thread per core"
    return 1, "no threaded BLAS seen"


def numba_threads():
    """(numba's thread count, source) once its pool has been started, else
    (1, reason): calling numba.get_num_threads() would start the pool."""
    numba = sys.modules.get("numba")
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if numba is None or parallel is None or not getattr(parallel, "_is_initialized", False):
        return 1, "numba's thread pool not started"
    n = numba.get_num_threads()
    return n, f"numba {n} threads"


def oversubscribed(ranks, threads, ncores):
    """Whether ``ranks`` ranks of ``threads`` threads each need more than
    ``ncores`` cores *because of the threads*: one thread per rank is the
    least there is, and more ranks than cores is a choice made at mpirun
    (--oversubscribe), not something to warn about in every call."""
    return threads > 1 and ranks * threads > max(ncores, ranks)


def message(ranks, threads, ncores, source):
    return (f"equarx_mpi: {ranks} rank(s) on this node x {threads} threads each ({source}) "
            f"> {ncores} cores: the threads take the cores the AllReduce needs (OpenBLAS's "
            f"idle threads busy-wait after each matmul).  Start the ranks with "
            f"OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 (or the node's cores "
            f"/ ranks) in their environment, or threadpoolctl.threadpool_limits(1) "
            f"in each rank; {ENV}=0 silences this (docs/PERFORMANCE.md)")


def check(ranks, kernel_threads=1):
    """Warn once per process (a RuntimeWarning) if ``ranks`` ranks on this
    node, with this process's threads each (``kernel_threads``: the
    library's own), exceed its cores.  Never raises: a failing probe only
    skips the check."""
    global _warned
    if _warned or os.environ.get(ENV, "1").strip() == "0":
        return False
    try:
        n = cores()
        own = (kernel_threads, f"the library's kernels: threads={kernel_threads}")
        threads, source = max(blas_threads(n), numba_threads(), own)
    except Exception:           # a probe of someone else's library: never fail a comm
        return False
    if not oversubscribed(ranks, threads, n):
        return False
    _warned = True
    warnings.warn(message(ranks, threads, n, source), RuntimeWarning, stacklevel=3)
    return True
