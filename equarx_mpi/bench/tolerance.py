"""``python -m equarx_mpi.bench tolerance``: the error-bounded mode
(abs_tol) against fixed int8 two-shot, at the same error.

    mpirun -n P python -m equarx_mpi.bench tolerance [--values N] [--repeats R]
                                                     [--kinds gaussian,field]

For each data kind of --kinds (Gaussian data; a smooth 2-D field, a
temperature-like field with an offset, different on every rank: the kind
science codes reduce), float32:

1. int8 (two-shot, the same schedule) runs; its achieved error (largest
   |result - exact|, exact = the float64 sum of the gathered inputs,
   itself within 2^-53 relative of the true sum) and its certified bound
   (last_error_bound) are measured;
2. the error-bounded mode runs with abs_tol = int8's achieved error
   ("same achieved error": it guarantees what int8 happened to reach), and
   with abs_tol = int8's certified bound ("same guarantee").

Rows: bytes this rank sent (largest over ranks), the bytes relative to
int8, the achieved error, the certified bound, and the median time over
interleaved calls (every configuration once per round, each call timed
as the slowest rank's), relative to int8.  Speed on a shared machine is
noisy: compare the ratios of one run, not absolute times across runs.
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi.comm import QuantizedComm

PROG = "python -m equarx_mpi.bench tolerance"
#: --kinds: name -> what it is
KINDS = {"gaussian": "standard normal values, seeded by rank",
         "field": "a smooth 2-D field of 1024 columns: 280 (K) plus waves whose\n"
                  "phases differ by rank, and a slow gradient"}


def data(kind, n, rank):
    """This rank's float32 input: ``n`` values of ``kind`` (a key of KINDS)."""
    if kind == "gaussian":
        return np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    if kind != "field":
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    # a smooth field on a grid of rows x cols with an offset: 280 K plus a
    # few waves whose phases differ by rank, and a slow gradient
    cols = 1024
    rows = -(-n // cols)
    y, x = np.mgrid[0:rows, 0:cols].astype(np.float64)
    y /= rows
    x /= cols
    f = (280.0 + 12.0 * np.sin(2 * np.pi * (2 * x + 0.1 * rank)) * np.cos(2 * np.pi * 3 * y)
         + 3.0 * np.sin(2 * np.pi * (5 * x * y + 0.3 * rank)) + 4.0 * x)
    return f.ravel()[:n].astype(np.float32)


def _timed(qc, x, out, comm):
    comm.Barrier()
    t0 = time.perf_counter()
    qc.Allreduce(x, out)
    return comm.allreduce(time.perf_counter() - t0, MPI.MAX)


def _error(out, exact):
    return float(np.max(np.abs(out.astype(np.float64) - exact)))


def run(comm, kind, n, repeats, block):
    r = comm.Get_rank()
    x = data(kind, n, r)
    exact = np.sum(np.array(comm.allgather(x), np.float64), axis=0)
    common = dict(min_quantized_bytes=0, block_size=block)
    base = QuantizedComm(comm, wire="int8", algorithm="two_shot", **common)
    out = np.empty_like(x)
    base.Allreduce(x, out)
    achieved = comm.allreduce(_error(out, exact), MPI.MAX)
    certified = base.last_error_bound
    configs = [("int8 two-shot", base),
               ("mixed, same error", QuantizedComm(comm, abs_tol=achieved, **common)),
               ("mixed, same bound", QuantizedComm(comm, abs_tol=certified, **common))]
    times = {name: [] for name, _ in configs}
    rows = {}
    for name, qc in configs:            # warm: compiles, plans, workspace
        qc.Allreduce(x, out)
        rows[name] = (comm.allreduce(qc.last_call.bytes_sent, MPI.MAX),
                      comm.allreduce(_error(out, exact), MPI.MAX), qc.last_error_bound,
                      qc.options["abs_tol"])
    for _ in range(repeats):
        for name, qc in configs:
            times[name].append(_timed(qc, x, out, comm))
    for _, qc in configs:
        qc.free()
    return rows, {name: statistics.median(t) for name, t in times.items()}


def build_parser():
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n", 1)[1],
        epilog="kinds (--kinds):\n" + "".join(
            f"  {k:10s}" + d.replace("\n", "\n" + " " * 12) + "\n" for k, d in KINDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=1 << 20, metavar="N",
                   help="float32 values per rank (default 1048576: 4 MiB)")
    p.add_argument("--repeats", type=int, default=15, metavar="R",
                   help="interleaved timed rounds (default 15)")
    p.add_argument("--block", type=int, default=256, metavar="B",
                   help="values per block (default 256)")
    p.add_argument("--kinds", default="gaussian,field", metavar="K,K",
                   help=f"comma-separated data kinds, from {', '.join(KINDS)} (see below; "
                   "default gaussian,field)")
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    # the same arguments on every rank: every rank stops alike, before any call
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds {a.kinds!r}: choose from {', '.join(KINDS)}")
    if a.values < 1 or a.repeats < 1:
        p.error(f"need --values >= 1 and --repeats >= 1, got {a.values}, {a.repeats}")
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    for kind in kinds:
        rows, med = run(comm, kind, a.values, a.repeats, a.block)
        if comm.Get_rank():
            continue
        print(f"# {kind}: P={P}, {a.values} float32 values ({a.values * 4 / 2 ** 20:.1f} MiB) "
              f"per rank, block {a.block}, {a.repeats} interleaved rounds")
        print(f"{'configuration':<20} {'abs_tol':>10} {'bytes sent':>11} {'vs int8':>8} "
              f"{'achieved err':>13} {'bound':>10} {'median ms':>10} {'vs int8':>8}")
        b0, t0 = rows["int8 two-shot"][0], med["int8 two-shot"]
        for name, (sent, err, bnd, tol) in rows.items():
            tol_s = "-" if tol is None else f"{tol:.3g}"
            print(f"{name:<20} {tol_s:>10} {sent:>11} {sent / b0:>8.3f} {err:>13.4g} "
                  f"{bnd:>10.4g} {med[name] * 1e3:>10.3f} {med[name] / t0:>8.3f}")
        print(flush=True)
    return 0
