"""Benchmarks.  Run under mpirun; only rank 0 prints and writes files.

    mpirun -n 8 python -m equarx_mpi.bench                 # allreduce sweep
    mpirun -n 8 python -m equarx_mpi.bench -b 1M -e 64M --data offset --json out.json
    python -m equarx_mpi.bench kernels                     # kernel GB/s vs C

allreduce (the default command): every method runs on the same data in the
same run, interleaved call by call so machine noise hits them alike.  Per
rank the median time of the timed calls is kept; the columns give its
average, min and max over ranks.  Bandwidths use the *uncompressed* bytes,
like nccl-tests.  Errors are measured against an exact float64 sum of the
inputs.  The output header explains every column.
"""
import argparse
import json
import os
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from equarx_mpi.bench.report import COLUMNS, LEGEND, footer, format_row, human
from equarx_mpi.comm import QuantizedComm
from equarx_mpi.names import BFLOAT16

#: name -> (description, QuantizedComm options or None for mpi4py's exact
#: comm.Allreduce).  A QuantizedComm is built only for the methods a run
#: asks for, so a line may name options this version does not have yet.
METHODS = {
    "mpi": ("mpi4py comm.Allreduce (exact)", None),
    "mpi-lib": ("algorithm='mpi': MPI's Allreduce through the library (its checks and "
                "error bound)", dict(algorithm="mpi")),
    "bf16": ("pipelined ring, bfloat16 on the wire",
             dict(wire="bf16", algorithm="ring", min_quantized_bytes=0)),
    "fp32": ("pipelined ring, float32 on the wire",
             dict(wire="fp32", algorithm="ring", min_quantized_bytes=0)),
    "int8": ("EQuARX int8 ring, exact MPI below the cost model's crossover",
             dict(wire="int8", algorithm="ring")),
    "int8-c1": ("EQuARX int8 ring, chunks=1 (no pipelining), every size",
                dict(wire="int8", algorithm="ring", chunks=1, min_quantized_bytes=0)),
    "int8-raw": ("EQuARX int8 ring at every size (never exact MPI)",
                 dict(wire="int8", algorithm="ring", min_quantized_bytes=0)),
    "int8-2shot": ("EQuARX int8 two-shot (owner reduces at full precision) at every size",
                   dict(wire="int8", algorithm="two_shot", min_quantized_bytes=0)),
    "int8-hier": ("EQuARX int8 hierarchical (exact in each node, two-shot between nodes) "
                  "at every size", dict(wire="int8", algorithm="hierarchical",
                                        min_quantized_bytes=0)),
    "shm": ("exact AllReduce through a shared window (one node; else MPI's)",
            dict(algorithm="shm")),
    "int8-nocheck": ("EQuARX int8 ring as 'int8', without the per-call argument agreement",
                     dict(wire="int8", algorithm="ring", check=False)),
    "int4": ("int4 ring (block 64, its default) at every size",
             dict(wire="int4", algorithm="ring", block_size=64, min_quantized_bytes=0)),
    "fp8": ("fp8 (e4m3) ring at every size",
            dict(wire="fp8", algorithm="ring", min_quantized_bytes=0)),
    "int8-aff": ("int8-affine ring (levels between block min and max) at every size",
                 dict(wire="int8-affine", algorithm="ring", min_quantized_bytes=0)),
    "int4-aff": ("int4-affine ring (block 128, its default) at every size",
                 dict(wire="int4-affine", algorithm="ring", block_size=128,
                      min_quantized_bytes=0)),
    "auto": ("algorithm='auto' (the library default): the cost model's pick per call",
             dict(algorithm="auto")),
    "auto-exact": ("algorithm='auto', accuracy='exact': the faster of MPI and shm",
                   dict(algorithm="auto", accuracy="exact")),
}
DEFAULT_METHODS = "mpi,bf16,fp32,int8,int8-c1"
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "bfloat16": BFLOAT16}


def _smooth(rng, n):
    """Three sines on a sqrt(n) x sqrt(n) grid, phases per rank, plus noise."""
    side = int(np.ceil(np.sqrt(n)))
    u, v = np.divmod(np.arange(n, dtype=np.float64), side)
    u, v = u / side, v / side
    ph = 2 * np.pi * rng.random(3)
    return (np.sin(2 * np.pi * u + ph[0]) + 0.5 * np.sin(6 * np.pi * v + ph[1])
            + 0.25 * np.sin(10 * np.pi * (u + v) + ph[2]) + 0.01 * rng.standard_normal(n))


#: name -> (description, generator(rng, n) -> float64 values).  Each rank
#: seeds its generator with its rank; values are rounded to --dtype after.
DATA = {
    "normal": ("standard normal N(0,1)", lambda rng, n: rng.standard_normal(n)),
    "offset": ("101325 + 100*N(0,1): pressure in Pa, a large offset plus a small signal\n"
               "           (inputs round to 1/128 Pa in float32, 512 Pa in bfloat16)",
               lambda rng, n: 101325.0 + 100.0 * rng.standard_normal(n)),
    "uniform": ("uniform on [-1, 1)", lambda rng, n: rng.uniform(-1.0, 1.0, n)),
    "mask": ("0 or 1, each with probability 1/2", lambda rng, n: rng.integers(0, 2, n) * 1.0),
    "smooth": ("smooth 2-D field: three sines on a sqrt(n) x sqrt(n) grid + 0.01*N(0,1)",
               _smooth),
}

def parse_size(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    try:
        return int(float(t[:len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 16M, 1G)")


def sizes(begin, end, factor):
    """begin, begin*factor, ... up to end (begin >= 1, factor >= 2)."""
    out, s = [], begin
    while s <= end:
        out.append(s)
        s *= factor
    return out


def mpi_library():
    """First line of MPI's library version, without the C string's NUL."""
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m equarx_mpi.bench",
        usage="mpirun -n P python -m equarx_mpi.bench [allreduce] [options]\n"
              "       python -m equarx_mpi.bench kernels [options]",
        description=__doc__.split("\n\n")[2],
        epilog="commands:\n"
               "  allreduce  quantized AllReduce against MPI and uncompressed rings\n"
               "             (the default; its options are above)\n"
               "  kernels    numba kernels against the C reference, one process\n"
               "             (python -m equarx_mpi.bench kernels -h)\n\nmethods:\n"
               + "".join(f"  {m:13s}{d}\n" for m, (d, _) in METHODS.items())
               + "\ndata:\n" + "".join(f"  {k:9s}{d}\n" for k, (d, _) in DATA.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, metavar="SIZE", default=parse_size("4K"),
                   help="smallest message per rank (default 4K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, metavar="SIZE", default=parse_size("64M"),
                   help="largest message per rank (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, metavar="F",
                   help="size multiplier, at least 2 (default 4)")
    p.add_argument("-w", "--warmup", type=int, default=2, metavar="N",
                   help="untimed calls per size and method (default 2)")
    p.add_argument("-n", "--iters", type=int, default=5, metavar="N",
                   help="timed calls per size and method (default 5)")
    p.add_argument("-d", "--dtype", choices=list(DTYPES), default="float32", metavar="TYPE",
                   help=f"value type: {', '.join(DTYPES)} (default float32)")
    p.add_argument("--data", choices=list(DATA), default="normal", metavar="KIND",
                   help=f"values each rank sends: {', '.join(DATA)} (default normal; "
                   "see below)")
    p.add_argument("-m", "--methods", default=DEFAULT_METHODS, metavar="M,M,...",
                   help=f"comma-separated, from the list below (default {DEFAULT_METHODS})")
    p.add_argument("--block", type=int, default=256, metavar="B",
                   help="values per int8 block (default 256)")
    p.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="times, speedup and error against size "
                   "(needs matplotlib: pip install equarx_mpi[plot])")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--overlap", action="store_true",
                   help="time a nonblocking AllReduce against a compute loop of about its "
                   "length, alone and together (benchoverlap.py)")
    return p


def _arg_error(args, methods):
    """Why these arguments cannot run (the same answer on every rank), or None."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        return f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}"
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        return (f"sizes: need 1 <= --minbytes <= --maxbytes, got -b {args.minbytes} "
                f"-e {args.maxbytes}")
    if args.stepfactor < 2:
        return f"--stepfactor must be at least 2, got {args.stepfactor}"
    if args.iters < 1 or args.warmup < 0:
        return f"need --iters >= 1 and --warmup >= 0, got -n {args.iters} -w {args.warmup}"
    if args.overlap and args.plot:
        return "--plot does not draw --overlap runs; use --json"
    if args.data == "offset" and args.dtype == "float16":
        return "--data offset does not fit float16 (101325 > 65504): use float32 or float64"
    return None


def _rank0_error(args):
    """Checks only rank 0 needs (it alone writes files), made before the sweep."""
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            return f"{opt} {path}: cannot write into {folder}"
    if args.plot:
        from equarx_mpi.bench import plot as benchplot
        return benchplot.missing()
    return None


def _agree(comm, err):
    """Exit on every rank, with the first rank's message, if any rank has one."""
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        raise SystemExit(f"equarx_mpi.bench: {errs[0]}")


def _make_comms(comm, methods, block):
    """name -> QuantizedComm for the requested library methods.  Collective."""
    qcs = {}
    for m in methods:
        opts = METHODS[m][1]
        if opts is None:
            continue
        try:
            qcs[m] = QuantizedComm(comm, **{"block_size": block, **opts})
        except (TypeError, ValueError) as e:   # agreed: raised alike on every rank
            for qc in qcs.values():
                qc.free()
            raise SystemExit(f"equarx_mpi.bench: method {m!r} "
                             f"(QuantizedComm options {opts}, block {block}): {e}")
    return qcs


def _path(qc):
    """'exact' when the exact MPI collective ran, 'shm' for the exact shared
    window, else 'algorithm/wire'."""
    last = None if qc is None else qc.last_call
    if last is None or last.wire is None:
        return "shm" if last is not None and last.method == "shm" else "exact"
    return f"{last.method}/{last.wire}"


def run_allreduce(args, comm=MPI.COMM_WORLD):
    P, rank = comm.Get_size(), comm.Get_rank()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    err = _arg_error(args, methods)
    _agree(comm, err or (_rank0_error(args) if rank == 0 else None))
    dtype = np.dtype(DTYPES[args.dtype])
    qcs = _make_comms(comm, methods, args.block)
    # Flushed line by line, so progress on stderr never lands inside the table.
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"# equarx_mpi allreduce benchmark: {P} rank{'s' * (P != 1)}, {mpi_library()}")
    say(f"# dtype {dtype.name}, data {args.data}: {' '.join(DATA[args.data][0].split())}")
    say(f"# block {args.block}; per size and method {args.warmup} warm-up + {args.iters} "
        f"timed calls, methods interleaved call by call")
    if P == 1:
        say("# 1 rank: every method returns its input; run under mpirun -n P (P >= 2)")
    say("# methods:")
    for m in methods:
        say(f"#   {m:12s} {METHODS[m][0]}")
    rows = []
    todo = sorted({max(1, b // dtype.itemsize)
                   for b in sizes(args.minbytes, args.maxbytes, args.stepfactor)})
    if args.overlap:
        from equarx_mpi.bench import overlap as benchoverlap
        rows = benchoverlap.run(args, comm, qcs, methods, dtype, todo, say, _path)
        for qc in qcs.values():
            qc.free()
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": P, "dtype": dtype.name, "mpi": mpi_library(),
                           "argv": sys.argv[1:], "overlap": rows}, f, indent=1)
        return rows
    say(LEGEND)
    say("#" + " ".join(f"{name:>{w}}" for name, w in COLUMNS)[1:])
    for i, count in enumerate(todo):
        if rank == 0 and not args.quiet:
            sys.stderr.write(f"# [{i + 1}/{len(todo)}] {human(count * dtype.itemsize)}\n")
            sys.stderr.flush()
        rows += _one_size(comm, qcs, methods, count, dtype, args, say)
    for qc in qcs.values():
        qc.free()
    if rank == 0:
        footer(rows, methods, say)
        _write_files(args, rows, methods, P, dtype)
    return rows


def _inputs(rank, count, dtype, data):
    x = DATA[data][1](np.random.default_rng(1000 + rank), count)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _one_size(comm, qcs, methods, count, dtype, args, say):
    P, rank = comm.Get_size(), comm.Get_rank()
    x = _inputs(rank, count, dtype, args.data)
    exact = np.empty(count, np.float64)
    comm.Allreduce(x.astype(np.float64), exact)
    # MPI has no 16-bit float types: its baseline reduces float32 copies.
    mpi_x = x.astype(np.float32) if dtype.itemsize == 2 else x
    outs = {m: np.empty_like(mpi_x if m == "mpi" else x) for m in methods}
    calls = {m: (lambda o=outs[m]: comm.Allreduce(mpi_x, o)) if qcs.get(m) is None else
             (lambda q=qcs[m], o=outs[m]: q.Allreduce(x, o)) for m in methods}
    times = {m: [] for m in methods}
    for it in range(args.warmup + args.iters):
        for m in methods:          # interleaved: noise hits every method alike
            comm.Barrier()
            t0 = time.perf_counter()
            calls[m]()
            dt = time.perf_counter() - t0
            if it >= args.warmup:
                times[m].append(dt)
    nbytes = count * dtype.itemsize
    t_all = comm.gather([float(np.median(times[m])) for m in methods])
    crcs = comm.gather([zlib.crc32(outs[m].tobytes()) for m in methods])
    if rank != 0:
        return []
    norm = np.linalg.norm(exact)
    anom = np.linalg.norm(exact - exact.mean())
    rows = []
    for j, m in enumerate(methods):
        t = [ts[j] for ts in t_all]
        diff = outs[m].astype(np.float64) - exact
        e = float(np.linalg.norm(diff))
        avg = float(np.mean(t))
        algbw = nbytes / avg / 1e9
        rows.append(dict(bytes=nbytes, count=count, dtype=dtype.name, method=m,
                         path=_path(qcs.get(m)),
                         time_us=dict(avg=avg * 1e6, min=min(t) * 1e6, max=max(t) * 1e6),
                         algbw_GBps=algbw, busbw_GBps=algbw * 2 * (P - 1) / P,
                         rel_err=e / norm if norm > 0 else (0.0 if e == 0 else None),
                         anom_err=e / anom if anom > 0 else (0.0 if e == 0 else None),
                         max_err=float(np.abs(diff).max()),
                         wrong=sum(c[j] != crcs[0][j] for c in crcs)))
    base = next((r for r in rows if r["method"] == "mpi"), None)
    for r in rows:
        r["speedup_vs_mpi"] = base["time_us"]["avg"] / r["time_us"]["avg"] if base else None
        say(format_row(r))
    return rows


def _write_files(args, rows, methods, P, dtype):
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": P, "dtype": dtype.name, "data": args.data,
                       "block": args.block, "mpi": mpi_library(),
                       "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    if args.plot:
        from equarx_mpi.bench import plot as benchplot
        benchplot.plot(rows, methods, [m for m in methods if METHODS[m][1] is not None],
                       args.plot,
                       f"AllReduce, {P} ranks, {dtype.name}, data {args.data}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "kernels":
        from equarx_mpi.bench import kernels as kernelbench
        return kernelbench.main(argv[1:])
    if argv and argv[0] == "allreduce":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        raise SystemExit(f"equarx_mpi.bench: unknown command {argv[0]!r}; "
                         f"choose from allreduce, kernels (or see --help)")
    run_allreduce(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
