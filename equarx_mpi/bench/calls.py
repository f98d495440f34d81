"""``python -m equarx_mpi.bench calls``: what one small Allreduce costs
through the library, against mpi4py's own call, under mpirun.

    mpirun -n 2 python -m equarx_mpi.bench calls                 # 8 B .. 64 MiB
    mpirun -n 8 --oversubscribe python -m equarx_mpi.bench calls -s 4K,64K,1M
    mpirun -n 2 python -m equarx_mpi.bench calls -s 8,64 -d float32 --json calls.json

Per size, three ways of making the same out-of-place SUM Allreduce of the
same data, with the library's defaults:
  mpi            mpi4py's comm.Allreduce(x, y)
  wrap           equarx_mpi.wrap(comm).Allreduce(x, y)      (the drop-in)
  QuantizedComm  equarx_mpi.QuantizedComm(comm).Allreduce(x, y)
Timed as timeit does: a batch of N calls back to back (N chosen so that
mpi's batch lasts about --min-time, the same N for all three), repeated
R times with the three interleaved batch by batch (the order rotating), so
machine noise hits them alike.  Each rank keeps the best and the median of
its R per-call times; the table gives the slowest rank's.  x_best, x_med:
the method's time over mpi's.  The targets of issue 20 are judged on
x_best, the statistic the issue measured with.  own(us): what the library
adds to a call, timed inside the same calls (the batch's time less the
time the library recorded inside its collective, last_call.seconds
summed): at large sizes two MPI calls differ by more than the whole
difference of the x columns, so issue 29's bound (about 1 us on MPI's
path, at any size) is judged on it.
"""
import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm, wrap
from equarx_mpi.bench import common
from equarx_mpi.bench.common import arg_type, comma_list, human, parse_size

PROG = "python -m equarx_mpi.bench calls"
SIZES = "8,64,4K,64K,1M,16M,64M"
DTYPES = {"float64": np.float64, "float32": np.float32}
METHODS = ("mpi", "wrap", "QuantizedComm")
#: issue 20's per-call targets: (ranks, from bytes, to bytes, at most this x mpi4py)
TARGETS = ((2, 8, 4 << 10, 2.0), (8, 4 << 10, 1 << 20, 1.3))
#: issue 29's bound on own(us) for a call on MPI's own path, at any size
OWN_US = 1.0
MAX_NUMBER = 1 << 16

COLUMNS = (("size(B)", 9), ("count", 7), ("type", 7), ("method", 13), ("N", 7),
           ("best(us)", 10), ("med(us)", 10), ("x_best", 7), ("x_med", 7), ("own(us)", 8),
           ("path", 13),
           ("exact", 5), ("bits", 6), ("rel_err", 8), ("target", 6), ("status", 6))

LEGEND = """\
# columns (one row per size and method):
#   size(B), count, type   message per rank
#   N         calls per timed batch (the same for the three methods of a size)
#   best(us), med(us)   time per call: each rank's best and median over the R batches,
#             then the largest over ranks
#   x_best, x_med   the method's best (median) time / mpi's: 1.00 = as cheap as mpi4py
#   own(us)  median time per call spent in the library outside its collective (the
#             call's time less last_call.seconds), largest over ranks
#   path      last_call of the library's object: "mpi" = MPI's own collective, "shm" =
#             the exact shared window, else algorithm/wire; mpi4py's own row: "-"
#   exact     yes when no wire format was used (last_call.wire is None)
#   bits      "=mpi" when the result has mpi4py's bits on every rank, else "differ"
#   rel_err   ||out - mpi's|| / ||mpi's|| (L2), rank 0
#   target, status   issue 20's bound on x_best (8 B-4 KiB at 2 ranks, 4 KiB-1 MiB at 8),
#             else issue 29's on own(us) on MPI's path ("1us"); PASS or MISS"""


def target(ranks, nbytes):
    """Issue 20's bound on (library time / mpi4py's) at this size, or None."""
    for p, lo, hi, limit in TARGETS:
        if ranks == p and lo <= nbytes <= hi:
            return limit
    return None


def targets_text():
    return "; ".join(f"at most {limit:g}x mpi4py from {human(lo)} to {human(hi)} at {p} ranks"
                     for p, lo, hi, limit in TARGETS)


def build_parser():
    size = arg_type(comma_list(parse_size))
    p = argparse.ArgumentParser(
        prog=PROG, usage=f"mpirun -n P {PROG} [options]",
        description=__doc__.split("\n\n", 1)[1],
        epilog=f"targets (issue 20, wrap and QuantizedComm, x_best): {targets_text()}.\n"
               "sizes: bytes per rank, K/M = 1024, 1024**2",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-s", "--sizes", type=size, default=comma_list(parse_size)(SIZES),
                   metavar="SIZE,...", help=f"message sizes per rank (default {SIZES})")
    p.add_argument("-d", "--dtype", choices=list(DTYPES), default="float64",
                   help="value type (default float64)")
    p.add_argument("-r", "--repeat", type=int, default=5, metavar="R",
                   help="timed batches per method and size (default 5)")
    p.add_argument("-n", "--number", type=int, default=0, metavar="N",
                   help="calls per batch; 0 (default): doubling from a power of 2 near "
                   "1 MiB / size in [16, 1024] until N times mpi's per-call time (slowest "
                   "rank) reaches --min-time")
    p.add_argument("--min-time", type=float, default=0.02, metavar="SEC",
                   help="with -n 0: mpi's batch at least this long (default 0.02)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON (rank 0)")
    return p


def _arg_error(a):
    """Why these arguments cannot run, or None: the same on every rank
    (argv alone decides), so every rank stops alike before any call."""
    item = np.dtype(DTYPES[a.dtype]).itemsize
    bad = [s for s in a.sizes if s < item or s % item]
    if bad:
        return f"--sizes {bad}: each must be a positive multiple of {item} B ({a.dtype})"
    if a.repeat < 1 or a.number < 0 or a.number > MAX_NUMBER:
        return (f"need --repeat >= 1 and 0 <= --number <= {MAX_NUMBER}, "
                f"got -r {a.repeat} -n {a.number}")
    if not 0 < a.min_time <= 10:
        return f"--min-time must be in (0, 10] seconds, got {a.min_time}"
    return None


def _json_error(a):
    """Rank 0's check (it alone writes), made before any timing."""
    folder = os.path.dirname(os.path.abspath(a.json)) if a.json else None
    if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        return f"--json {a.json}: cannot write into {folder}"
    return None


def _batch(comm, call, x, y, n, spent=None):
    """Seconds per call of ``n`` calls back to back, after a Barrier; with
    ``spent`` (the library's recorded seconds so far), also the seconds per
    call outside what it recorded."""
    comm.Barrier()
    s0 = spent() if spent else 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        call(x, y)
    t = (time.perf_counter() - t0) / n
    return t if spent is None else (t, t - (spent() - s0) / n)


def _number(comm, call, x, y, min_time):
    """Calls per batch: doubling from ``_floor`` until that many calls last
    ``min_time`` at the best per-call time seen so far on the slowest rank.
    The floor and the best keep a batch that the scheduler preempts (ranks
    > cores) from stopping the doubling early.  The same number on every
    rank (each batch's time is agreed by MAX)."""
    n, best = _floor(x.nbytes), float("inf")
    while n < MAX_NUMBER:
        best = min(best, comm.allreduce(_batch(comm, call, x, y, n), op=MPI.MAX))
        if n * best >= min_time:
            break
        n *= 2
    return n


def _floor(nbytes):
    """The least calls per batch: a power of 2 near 1 MiB / nbytes, in [16, 1024]."""
    n = 16
    while n < 1024 and n * nbytes < 1 << 20:
        n *= 2
    return n


def _one_size(comm, calls, last, spent, nbytes, dtype, a):
    P, rank = comm.Get_size(), comm.Get_rank()
    count = nbytes // dtype.itemsize
    x = np.random.default_rng(1000 + rank).standard_normal(count).astype(dtype)
    outs = {m: np.empty_like(x) for m in METHODS}
    for m in METHODS:    # warm-up: first touches, and the library plans a new signature
        _batch(comm, calls[m], x, outs[m], 3)
    n = a.number or _number(comm, calls["mpi"], x, outs["mpi"], a.min_time)
    times = {m: [] for m in METHODS}
    owns = {m: [] for m in METHODS}
    for r in range(a.repeat):
        for k in range(len(METHODS)):
            m = METHODS[(r + k) % len(METHODS)]
            got = _batch(comm, calls[m], x, outs[m], n, spent[m])
            t, own = got if spent[m] else (got, 0.0)
            times[m].append(t)
            owns[m].append(own)
    mine = {m: (min(t), float(np.median(t)), float(np.median(owns[m])))
            for m, t in times.items()}
    same = {m: bool(np.array_equal(outs[m], outs["mpi"])) for m in METHODS}
    everyone = comm.gather((mine, same))
    if rank != 0:
        return []
    ref = outs["mpi"].astype(np.float64)
    norm = float(np.linalg.norm(ref))
    rows = []
    for m in METHODS:
        best = max(e[0][m][0] for e in everyone)
        med = max(e[0][m][1] for e in everyone)
        own = max(e[0][m][2] for e in everyone) if spent[m] else None
        info = last[m]()
        e = float(np.linalg.norm(outs[m].astype(np.float64) - ref))
        rows.append(dict(bytes=nbytes, count=count, dtype=dtype.name, method=m, number=n,
                         repeat=a.repeat, best_us=best * 1e6, median_us=med * 1e6,
                         own_us=None if own is None else own * 1e6,
                         path="-" if info is None else
                         (f"{info.method}/{info.wire}" if info.wire else info.method),
                         exact=info is None or info.wire is None,
                         same_bits=all(e[1][m] for e in everyone),
                         rel_err=e / norm if norm > 0 else e))
    base = rows[0]
    limit = target(P, nbytes)
    for r in rows:
        r["x_best"] = r["best_us"] / base["best_us"]
        r["x_median"] = r["median_us"] / base["median_us"]
        r["target"] = r["status"] = None
        if r["method"] == "mpi":
            continue
        if limit is not None:
            r["target"] = f"{limit:g}x"
            r["status"] = "PASS" if r["x_best"] <= limit else "MISS"
        elif r["path"] == "mpi":
            r["target"] = f"{OWN_US:g}us"
            r["status"] = "PASS" if r["own_us"] <= OWN_US else "MISS"
    return rows


def format_row(r):
    cells = (r["bytes"], r["count"], r["dtype"], r["method"], r["number"],
             f"{r['best_us']:.2f}", f"{r['median_us']:.2f}", f"{r['x_best']:.2f}",
             f"{r['x_median']:.2f}", "-" if r["own_us"] is None else f"{r['own_us']:.2f}",
             r["path"], "yes" if r["exact"] else "no",
             "=mpi" if r["same_bits"] else "differ", f"{r['rel_err']:.1e}",
             r["target"] or "-", r["status"] or "-")
    return " " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS))[1:]


def footer(rows, P, say):
    judged = [r for r in rows if r["status"]]
    if not judged:
        say(f"# targets: none at {P} ranks ({targets_text()})")
        return
    for m in METHODS[1:]:
        mine = [r for r in judged if r["method"] == m]
        miss = [f"{human(r['bytes'])} " + (f"{r['x_best']:.2f}x" if r["target"].endswith("x")
                                            else f"{r['own_us']:.2f} us")
                for r in mine if r["status"] == "MISS"]
        say(f"# targets, {m}: {len(mine) - len(miss)} of {len(mine)} PASS"
            + (f"; MISS at {', '.join(miss)}" if miss else ""))


def run(a, comm=MPI.COMM_WORLD):
    P, rank = comm.Get_size(), comm.Get_rank()
    dtype = np.dtype(DTYPES[a.dtype])
    os.environ.setdefault("EQUARX_MPI_LOG", "0")     # the path column says what ran
    w = wrap(comm)
    qc = QuantizedComm(comm)
    calls = {"mpi": comm.Allreduce, "wrap": w.Allreduce, "QuantizedComm": qc.Allreduce}
    last = {"mpi": lambda: None, "wrap": lambda: w.last_call,
            "QuantizedComm": lambda: qc.last_call}
    spent = {"mpi": None, "wrap": lambda: w.stats.seconds,
             "QuantizedComm": lambda: qc.stats.seconds}
    say, cores = common.announce(comm, "per-call benchmark")
    say(f"# Allreduce SUM, {dtype.name}, out of place, library defaults; per size and "
        f"method {a.repeat} batches of N calls, interleaved batch by batch")
    say(f"# targets (issue 20, on x_best): {targets_text()}; issue 29: own(us) <= "
        f"{OWN_US:g} on MPI's path elsewhere")
    rows = common.table(say, LEGEND, COLUMNS, a.sizes,
                        lambda nbytes: _one_size(comm, calls, last, spent, nbytes, dtype, a),
                        format_row)
    w.free()
    qc.free()
    if rank == 0:
        footer(rows, P, say)
        if a.json:
            common.save_rows(a.json, P, cores, rows, dtype=dtype.name)
    return rows


def main(argv=None):
    p = build_parser()
    a = common.parse_checked(p, argv, _arg_error)
    comm = MPI.COMM_WORLD
    err = comm.bcast(_json_error(a) if comm.Get_rank() == 0 else None)
    if err:             # on every rank alike: none waits in a collective
        p.error(err)
    run(a, comm)
    return 0
