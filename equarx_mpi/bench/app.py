"""``python -m equarx_mpi.bench app``: the AllReduce as an application
calls it, right after BLAS compute, against the same call on idle cores.

    mpirun -n P python -m equarx_mpi.bench app [-s 8M] [--matmul 1024] [-m mpi,bf16,int8-raw]

An application (a tensor-parallel forward, a training step) calls the
AllReduce right after a matmul; the plain benchmark calls it on idle cores.
Per round and method (methods interleaved, so noise hits them alike):
    alone  --gap seconds of sleep, a Barrier, the timed call
    after  a float32 matmul (N x N by N x N), a Barrier, the timed call
Each call is timed on every rank and kept as the slowest rank's; the
columns give the medians over rounds and after/alone.  The Barrier keeps
the ranks' drift in the matmul out of the call's time.  A ratio well above
1 means the compute's threads take the cores the call needs: OpenBLAS's
worker threads busy-wait for a while (2^28 cycles by default, about 0.1 s)
after each multi-threaded matmul; the gap before "alone" (0.15 s) is
longer than that, and shorter than the 200 ms after which Linux restarts
TCP's slow start on an idle connection (tcp_slow_start_after_idle), which
would slow "alone" for a reason an application does not see.  The header says how many threads the BLAS has (threadpoolctl if it
is installed, else the environment) and whether equarx_mpi.threads thinks
ranks x threads oversubscribe the node.  Try it with OPENBLAS_NUM_THREADS=1
in the ranks' environment, or --blas-threads 1 (threadpoolctl's limit,
set after numpy has loaded), to see which cures it.
"""
import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi import threads
from equarx_mpi.bench.common import arg_type, human, mpi_library, parse_size
from equarx_mpi.bench.methods import METHODS, parse_methods

PROG = "python -m equarx_mpi.bench app"
DEFAULT_METHODS = "mpi,bf16,int8-raw"
COLUMNS = (("method", 12), ("path", 14), ("alone(ms)", 10), ("after(ms)", 10),
           ("after/alone", 12), ("matmul(ms)", 11))
LEGEND = """\
# columns (medians over the rounds; each call timed as the slowest rank's):
#   method, path   what ran ("exact": MPI's own Allreduce)
#   alone(ms)      the call after --gap seconds of sleep and a Barrier
#   after(ms)      the call right after the matmul and a Barrier, as in an application
#   after/alone    median over rounds of the ratio within a round
#   matmul(ms)     the matmul before "after" (slowest rank)"""


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-s", "--size", type=arg_type(parse_size), default=parse_size("8M"),
                   metavar="SIZE", help="float32 message per rank, K/M/G = 1024... (default 8M)")
    p.add_argument("--matmul", type=int, default=1024, metavar="N",
                   help="side of the square float32 matmul before each 'after' call "
                        "(default 1024)")
    p.add_argument("-m", "--methods", default=DEFAULT_METHODS, metavar="M,M,...",
                   help=f"from python -m equarx_mpi.bench --help (default {DEFAULT_METHODS})")
    p.add_argument("-w", "--warmup", type=int, default=2, metavar="N",
                   help="untimed rounds (default 2)")
    p.add_argument("-n", "--iters", type=int, default=9, metavar="N",
                   help="timed rounds (default 9)")
    p.add_argument("--gap", type=float, default=0.15, metavar="S",
                   help="seconds of sleep before each 'alone' call (default 0.15)")
    p.add_argument("--blas-threads", type=int, default=None, metavar="T",
                   help="limit the BLAS to T threads with threadpoolctl after numpy has "
                        "loaded (needs threadpoolctl; default: leave it)")
    return p


def _error(a):
    try:
        parse_methods(a.methods)
    except ValueError as e:
        return str(e)
    if a.size < 4 or a.matmul < 1 or a.iters < 1 or a.warmup < 0 or a.gap < 0:
        return (f"need --size >= 4 bytes, --matmul >= 1, -n >= 1, -w >= 0, --gap >= 0; got "
                f"-s {a.size} --matmul {a.matmul} -n {a.iters} -w {a.warmup} --gap {a.gap}")
    if a.blas_threads is not None:
        if a.blas_threads < 1:
            return f"--blas-threads must be at least 1, got {a.blas_threads}"
        try:
            import threadpoolctl  # noqa: F401
        except ImportError:
            return "--blas-threads needs threadpoolctl (pip install threadpoolctl)"
    return None


def _path(qc):
    last = None if qc is None else qc.last_call
    if last is None or last.wire is None:
        return "exact"
    return f"{last.method}/{last.wire}"


def _slowest(comm, seconds):
    return comm.allreduce(seconds, MPI.MAX)


def run(a, comm=MPI.COMM_WORLD):
    """Rows (rank 0; empty lists elsewhere)."""
    rank, P = comm.Get_rank(), comm.Get_size()
    errs = [e for e in comm.allgather(_error(a)) if e]
    if errs:
        raise SystemExit(f"{PROG}: {errs[0]}")
    limiter = None
    if a.blas_threads is not None:
        from threadpoolctl import threadpool_limits
        limiter = threadpool_limits(a.blas_threads, user_api="blas")  # noqa: F841
    os.environ.setdefault("EQUARX_MPI_LOG", "0")
    methods = parse_methods(a.methods)
    say = (lambda *x: print(*x, flush=True)) if rank == 0 else (lambda *x: None)
    qcs = {}
    from equarx_mpi import QuantizedComm, wrap
    for m in methods:
        opts = METHODS[m].options
        if opts is not None:
            qcs[m] = (wrap if METHODS[m].wrapped else QuantizedComm)(comm, **opts)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = node.Get_size()
    node.Free()
    ncores = threads.cores()
    blas, source = threads.blas_threads(ncores)
    infos = comm.allgather((blas, source, ncores, per_node))
    count = a.size // 4
    rng = np.random.default_rng(rank)
    x = rng.standard_normal(count).astype(np.float32)
    buf = np.empty_like(x)
    A = rng.standard_normal((a.matmul, a.matmul)).astype(np.float32)
    B = rng.standard_normal((a.matmul, a.matmul)).astype(np.float32)
    C = np.empty_like(A)
    say(f"# equarx_mpi app benchmark: {P} ranks, {mpi_library()}")
    say(f"# AllReduce of {human(a.size)} float32 per rank (in place); matmul {a.matmul}^3 "
        f"float32 = {2 * a.matmul ** 3 / 1e9:.3g} GFLOP before each 'after' call; "
        f"{a.warmup} warm-up + {a.iters} timed rounds, methods interleaved")
    for r, (t, s, c, n) in enumerate(infos):
        if r == 0 or infos[r] != infos[0]:
            over = threads.oversubscribed(n, t, c)
            say(f"# rank {r}: BLAS {t} threads ({s}); {n} rank(s) on its node, {c} cores: "
                f"{'oversubscribed' if over else 'within the cores'}")
    env = {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                       "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                                       "OPENBLAS_THREAD_TIMEOUT") if k in os.environ}
    say(f"# environment: {' '.join(f'{k}={v}' for k, v in env.items()) or 'no thread settings'}"
        f"; load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    say(LEGEND)
    say("#" + " ".join(f"{name:>{w}}" for name, w in COLUMNS)[1:])

    def call(m):
        buf[...] = x
        if m in qcs:
            qcs[m].Allreduce(MPI.IN_PLACE, buf)
        else:
            comm.Allreduce(MPI.IN_PLACE, buf)

    def alone(m):
        time.sleep(a.gap)
        comm.Barrier()
        t0 = time.perf_counter()
        call(m)
        return time.perf_counter() - t0, 0.0

    def after(m):
        t0 = time.perf_counter()
        np.matmul(A, B, out=C)
        mm = time.perf_counter() - t0
        comm.Barrier()
        t0 = time.perf_counter()
        call(m)
        return time.perf_counter() - t0, mm

    times = {m: {"alone": [], "after": [], "matmul": []} for m in methods}
    for i in range(a.warmup + a.iters):
        for m in methods:
            t_alone, _ = alone(m)
            t_after, t_mm = after(m)
            if i >= a.warmup:
                got = times[m]
                got["alone"].append(_slowest(comm, t_alone))
                got["after"].append(_slowest(comm, t_after))
                got["matmul"].append(_slowest(comm, t_mm))
    rows = []
    for m in methods:
        t = times[m]
        ratio = statistics.median(b / c for b, c in zip(t["after"], t["alone"]))
        row = dict(method=m, path=_path(qcs.get(m)), ratio=ratio,
                   **{k + "_ms": 1e3 * statistics.median(v) for k, v in t.items()})
        rows.append(row)
        cells = (m, row["path"], f"{row['alone_ms']:.2f}", f"{row['after_ms']:.2f}",
                 f"{ratio:.2f}", f"{row['matmul_ms']:.1f}")
        say(" " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS))[1:])
    for qc in qcs.values():
        qc.free()
    del limiter
    return rows if rank == 0 else []


def main(argv=None):
    run(build_parser().parse_args(argv))
    return 0
