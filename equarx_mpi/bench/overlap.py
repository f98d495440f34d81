"""``python -m equarx_mpi.bench allreduce --overlap``: how much of a
nonblocking AllReduce hides behind computation.

Per message size and method, three things are timed, interleaved call by
call (a Barrier before each):
    allreduce  Iallreduce, then Wait at once
    compute    a loop of 64x64 float64 matmuls (numpy; one BLAS thread at
               that size), as many as take about as long as the allreduce
               (calibrated per size and method, the same count on every rank)
    both       Iallreduce, the compute loop, Wait
hidden = allreduce + compute - both: the time saved against running them one
after the other; "hidden%" is that as a share of the shorter of the two
(100% = the shorter one is entirely hidden).  The library's requests
progress in its own thread; MPI's own Iallreduce (method "mpi") moves only
while some MPI call runs, so the compute loop, which makes none, stalls it.
"""
import time

import numpy as np
from mpi4py import MPI

MM = 64        # at this size OpenBLAS multiplies in one thread (m*n*k <= 4*65536)

LEGEND = """\
# columns (one row per message size and method; times: each rank's median over
# the timed rounds, averaged over ranks):
#   size(B), count, type   message per rank
#   path      what the AllReduce ran: "exact" or algorithm/wire
#   allreduce(us)  Iallreduce + Wait, alone
#   cpu(us)        CPU time the process used meanwhile (all its threads, user + system):
#                  what the AllReduce takes from the cores, which no overlap can hide
#                  when the computation needs every core
#   compute(us)    the matmul loop alone (reps: 64x64 float64 matmuls)
#   both(us)       Iallreduce, the matmul loop, Wait
#   hidden(us)     allreduce + compute - both
#   hidden%        hidden / min(allreduce, compute): 100 = the shorter fully hidden"""

COLUMNS = (("size(B)", 12), ("count", 11), ("type", 8), ("method", 12), ("path", 13),
           ("reps", 7), ("allreduce(us)", 13), ("cpu(us)", 10), ("compute(us)", 12),
           ("both(us)", 11),
           ("hidden(us)", 11), ("hidden%", 8))


def _matmuls():
    rng = np.random.default_rng(0)
    a, b = rng.random((MM, MM)), rng.random((MM, MM))
    c = np.empty_like(a)

    def compute(reps):
        for _ in range(reps):
            np.matmul(a, b, out=c)
    return compute


def _timed(comm, fn, cpu=None):
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def one(comm, start, count, dtype, compute, args):
    """Rows' numbers for one method at one size: per rank medians (seconds)
    of allreduce, compute and both, the path, and the matmul count."""
    rng = np.random.default_rng(1000 + comm.Get_rank())
    x = rng.standard_normal(count).astype(dtype)
    out = np.empty_like(x)

    def allreduce():
        start(x, out).Wait()
    for _ in range(args.warmup):
        allreduce()
    t_ar = comm.allreduce(float(np.median([_timed(comm, allreduce)
                                            for _ in range(args.iters)])), MPI.MAX)
    # a first guess from a short burst, then scaled by a loop of that length
    # (a long loop runs slower: the ranks share the cores)
    reps = 20
    for _ in range(2):
        t = float(np.median([_timed(comm, lambda: compute(reps)) for _ in range(3)]))
        reps = max(1, int(round(reps * t_ar / comm.allreduce(t, MPI.MAX))))

    def both():
        req = start(x, out)
        compute(reps)
        req.Wait()
    times = {"allreduce": [], "compute": [], "both": []}
    fns = {"allreduce": allreduce, "compute": lambda: compute(reps), "both": both}
    cpu = []
    for _ in range(args.warmup):
        both()
    for _ in range(args.iters):
        for k in times:                         # interleaved: noise hits all alike
            times[k].append(_timed(comm, fns[k], cpu if k == "allreduce" else None))
    out = {k: float(np.median(v)) for k, v in times.items()}
    out["cpu"] = float(np.median(cpu))
    return out, reps


def run(args, comm, qcs, methods, dtype, todo, say, path_of):
    """The --overlap sweep (allreduce.run_allreduce hands over its parsed
    arguments, communicators and sizes); returns the rows on rank 0."""
    P, rank = comm.Get_size(), comm.Get_rank()
    say(f"# overlap: nonblocking AllReduce against a compute loop ({P} ranks); "
        f"MPI_THREAD_MULTIPLE: {MPI.Query_thread() == MPI.THREAD_MULTIPLE}")
    say(LEGEND)
    say("#" + " ".join(f"{name:>{w}}" for name, w in COLUMNS)[1:])
    compute = _matmuls()
    rows = []
    for count in todo:
        for m in methods:
            qc = qcs.get(m)
            start = ((lambda x, o: comm.Iallreduce(x, o)) if qc is None else
                     (lambda x, o, q=qc: q.Iallreduce(x, o)))
            t, reps = one(comm, start, count, dtype, compute, args)
            avg = {k: float(np.mean(v)) for k, v in
                   zip(t, zip(*comm.allgather([t[k] for k in t])))}
            if rank != 0:
                continue
            hidden = avg["allreduce"] + avg["compute"] - avg["both"]
            shorter = min(avg["allreduce"], avg["compute"])
            row = dict(bytes=count * dtype.itemsize, count=count, dtype=dtype.name, method=m,
                       path=path_of(qc), reps=reps,
                       time_us={k: v * 1e6 for k, v in avg.items()},
                       hidden_us=hidden * 1e6, hidden_share=hidden / shorter)
            rows.append(row)
            cells = (row["bytes"], count, dtype.name, m, row["path"], reps,
                     *(f"{row['time_us'][k]:.1f}"
                       for k in ("allreduce", "cpu", "compute", "both")),
                     f"{hidden * 1e6:.1f}", f"{100 * hidden / shorter:.0f}")
            say(" " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS))[1:])
    if rank == 0 and rows:
        for m in methods:
            shares = [r["hidden_share"] for r in rows if r["method"] == m]
            say(f"# {m:12s} hidden: median {100 * float(np.median(shares)):.0f}% of the "
                f"shorter (target: at least 50%)")
    return rows
