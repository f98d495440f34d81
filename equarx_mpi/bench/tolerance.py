"""``python -m equarx_mpi.bench tolerance``: the error-bounded mode
(abs_tol) against fixed int8 two-shot and MPI, on the data science codes
reduce.

    mpirun -n P python -m equarx_mpi.bench tolerance [--values N] [--repeats R]
        [--kinds gaussian,field,field3d,pressure] [--dtype float32|float64]
        [--abs-tol T,T,...] [--ablate] [--same] [--write PREFIX]

For each data kind of --kinds (see below; every rank its own data, or with
--same every rank rank 0's, as ZCCL's benchmark gives):

1. MPI's Allreduce and int8 (two-shot, the same schedule) run; int8's
   achieved error (largest |result - exact|, exact = the float64 sum of
   the gathered inputs, itself within 2^-53 relative of the true sum) and
   its certified bound (last_error_bound) are measured;
2. the error-bounded mode runs with abs_tol = each --abs-tol given, or by
   default with abs_tol = int8's achieved error ("same error": it
   guarantees what int8 happened to reach) and int8's certified bound
   ("same bound").  Prediction (DELTA blocks) is on across nodes only
   (wire/mixed.PREDICT); --ablate forces it on, and adds each tolerance
   without it (the mode as it was before it).

Rows: bytes this rank sent (largest over ranks); B/value, those bytes per
value this rank sends (two-shot sends 2(P-1)/P of its values: the scatter
and the all-gather; 4 for float32 sent raw); the achieved error, the
certified bound, and the median time over interleaved calls (every
configuration once per round, each call timed as the slowest rank's),
relative to int8.  Speed on a shared machine is noisy: compare the ratios
of one run, not absolute times across runs.  --write PREFIX: rank 0 writes
its input of the first kind as raw float32 to PREFIX00.dat (the file name
ZCCL's examples/compression_allreduce reads with -f PREFIX).
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import mixed

PROG = "python -m equarx_mpi.bench tolerance"
#: --kinds: name -> what it is
KINDS = {"gaussian": "standard normal values, seeded by rank",
         "field": "a smooth 2-D field of 1024 columns: 280 (K) plus waves whose\n"
                  "phases differ by rank, and a slow gradient (267-298)",
         "field3d": "a smooth 3-D field of 64 x 64 columns per level: 250 (K) plus\n"
                    "waves along all three axes, phases by rank",
         "pressure": "the 2-D field's shape around 1e5 (Pa), amplitude 2000"}


def _field(n, rank):
    # a smooth field on a grid of rows x cols with an offset: 280 K plus a
    # few waves whose phases differ by rank, and a slow gradient
    cols = 1024
    rows = -(-n // cols)
    y, x = np.mgrid[0:rows, 0:cols].astype(np.float64)
    y /= rows
    x /= cols
    f = (280.0 + 12.0 * np.sin(2 * np.pi * (2 * x + 0.1 * rank)) * np.cos(2 * np.pi * 3 * y)
         + 3.0 * np.sin(2 * np.pi * (5 * x * y + 0.3 * rank)) + 4.0 * x)
    return f.ravel()[:n]


def _field3d(n, rank):
    side = 64
    levels = -(-n // (side * side))
    z, y, x = np.mgrid[0:levels, 0:side, 0:side].astype(np.float64)
    z /= max(levels, 1)
    y /= side
    x /= side
    f = (250.0 + 10.0 * np.sin(2 * np.pi * (x + 0.1 * rank)) * np.cos(2 * np.pi * y)
         + 5.0 * np.cos(2 * np.pi * (2 * z + 0.2 * rank)) + 2.0 * np.sin(2 * np.pi * (x + y + z)))
    return f.ravel()[:n]


def data(kind, n, rank, dtype=np.float32):
    """This rank's input: ``n`` values of ``kind`` (a key of KINDS)."""
    if kind == "gaussian":
        return np.random.default_rng(rank).standard_normal(n).astype(dtype)
    if kind == "field":
        return _field(n, rank).astype(dtype)
    if kind == "field3d":
        return _field3d(n, rank).astype(dtype)
    if kind == "pressure":
        return (1e5 + (_field(n, rank) - 280.0) * (2000.0 / 19.0)).astype(dtype)
    raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")


def _timed(fn, comm):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, MPI.MAX)


def _error(out, exact):
    return float(np.max(np.abs(out.astype(np.float64) - exact)))


def run(comm, kind, n, repeats, block, dtype=np.float32, tols=None, same=False, write=None,
        ablate=False):
    """Rows {name: (bytes sent, achieved error, bound, abs_tol)} and medians
    {name: seconds} of one kind."""
    r = comm.Get_rank()
    x = data(kind, n, 0 if same else r, dtype)
    if write and r == 0:
        x.astype(np.float32).tofile(f"{write}00.dat")
    exact = np.sum(np.array(comm.allgather(x), np.float64), axis=0)
    common = dict(min_quantized_bytes=0, block_size=block)
    base = QuantizedComm(comm, wire="int8", algorithm="two_shot", **common)
    out = np.empty_like(x)
    base.Allreduce(x, out)
    if tols is None:
        achieved = comm.allreduce(_error(out, exact), MPI.MAX)
        tols = [("mixed, same error", achieved), ("mixed, same bound", base.last_error_bound)]
    else:
        tols = [(f"mixed, abs_tol {t:g}", t) for t in tols]
    configs = [("mpi", None), ("int8 two-shot", base)]
    for name, t in tols:
        configs.append((name, QuantizedComm(comm, abs_tol=t, **common)))
        if ablate:
            configs.append((name.replace("mixed", "no prediction"),
                            QuantizedComm(comm, abs_tol=t, **common)))
    times = {name: [] for name, _ in configs}
    rows = {}                           # or a refused tolerance's "need abs_tol >= ..."
    for name, qc in configs:            # warm: compiles, plans, workspace
        if qc is None:
            comm.Allreduce(x, out)
            rows[name] = (0, _error(out, exact), 0.0, None)
            continue
        # its format is made at its first call, and reads PREDICT then:
        # --ablate forces prediction on and off, else the default (across
        # nodes only)
        mixed.PREDICT = (not name.startswith("no prediction")) if ablate else None
        try:
            qc.Allreduce(x, out)
        except ValueError as e:         # too fine for this data: every rank alike
            rows[name] = str(e).rsplit(": ", 1)[-1]
            continue
        finally:
            mixed.PREDICT = None
        rows[name] = (comm.allreduce(qc.last_call.bytes_sent, MPI.MAX),
                      comm.allreduce(_error(out, exact), MPI.MAX), qc.last_error_bound,
                      qc.options["abs_tol"])
    rows["mpi"] = (rows["mpi"][0], comm.allreduce(rows["mpi"][1], MPI.MAX), 0.0, None)
    everyone = configs
    configs = [(name, qc) for name, qc in configs if not isinstance(rows[name], str)]
    for _ in range(repeats):
        for name, qc in configs:
            fn = (lambda: comm.Allreduce(x, out)) if qc is None else (lambda q=qc: q.Allreduce(x, out))
            times[name].append(_timed(fn, comm))
    for _, qc in everyone:
        if qc is not None:
            qc.free()
    return rows, {name: statistics.median(t) for name, t in times.items() if t}


def _floats(text):
    try:
        v = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of numbers") from None
    if not v or not all(0 < t < float("inf") for t in v):
        raise argparse.ArgumentTypeError(f"{text!r}: tolerances must be finite and > 0")
    return v


def build_parser():
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n", 1)[1],
        epilog="kinds (--kinds):\n" + "".join(
            f"  {k:10s}" + d.replace("\n", "\n" + " " * 12) + "\n" for k, d in KINDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=1 << 20, metavar="N",
                   help="values per rank (default 1048576: 4 MiB of float32)")
    p.add_argument("--repeats", type=int, default=15, metavar="R",
                   help="interleaved timed rounds (default 15)")
    p.add_argument("--block", type=int, default=256, metavar="B",
                   help="values per block (default 256)")
    p.add_argument("--kinds", default="gaussian,field", metavar="K,K",
                   help=f"comma-separated data kinds, from {', '.join(KINDS)} (see below; "
                   "default gaussian,field)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                   help="the inputs' type (default float32)")
    p.add_argument("--abs-tol", type=_floats, default=None, metavar="T,T",
                   help="run the mode at these tolerances (default: int8's achieved error "
                   "and its certified bound)")
    p.add_argument("--ablate", action="store_true",
                   help="prediction forced on, and each tolerance also without it")
    p.add_argument("--same", action="store_true",
                   help="every rank rank 0's data (as ZCCL's benchmark gives)")
    p.add_argument("--write", metavar="PREFIX", default=None,
                   help="rank 0 writes its first kind's input as float32 to PREFIX00.dat")
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
    dtype = np.dtype(a.dtype)
    for i, kind in enumerate(kinds):
        rows, med = run(comm, kind, a.values, a.repeats, a.block, dtype, a.abs_tol, a.same,
                        a.write if i == 0 else None, a.ablate)
        if comm.Get_rank():
            continue
        print(f"# {kind}: P={P}, {a.values} {dtype.name} values "
              f"({a.values * dtype.itemsize / 2 ** 20:.1f} MiB) per rank"
              f"{', the same on every rank' if a.same else ''}, block {a.block}, "
              f"{a.repeats} interleaved rounds")
        print(f"{'configuration':<28} {'abs_tol':>10} {'bytes sent':>11} {'B/value':>8} "
              f"{'achieved err':>13} {'bound':>10} {'median ms':>10} {'vs int8':>8}")
        t0 = med["int8 two-shot"]
        sent_values = 2 * (P - 1) / P * a.values
        for name, row in rows.items():
            if isinstance(row, str):
                print(f"{name:<28} refused: {row}")
                continue
            sent, err, bnd, tol = row
            tol_s = "-" if tol is None else f"{tol:.3g}"
            bpv = f"{sent / sent_values:.3f}" if sent and sent_values else "-"
            if name == "mpi":
                bpv = f"{dtype.itemsize:.3f}"
            print(f"{name:<28} {tol_s:>10} {sent:>11} {bpv:>8} {err:>13.4g} "
                  f"{bnd:>10.4g} {med[name] * 1e3:>10.3f} {med[name] / t0:>8.3f}")
        print(flush=True)
    return 0
