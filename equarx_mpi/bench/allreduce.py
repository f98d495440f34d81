"""``python -m equarx_mpi.bench [allreduce]``: every AllReduce method on
the same data, under mpirun; only rank 0 prints and writes files.

    mpirun -n 8 python -m equarx_mpi.bench                 # 4K .. 64M, the default methods
    mpirun -n 8 python -m equarx_mpi.bench -b 1M -e 64M --data offset --json out.json
    mpirun -n 2 python -m equarx_mpi.bench -m mpi,int8-raw --overlap   # bench/overlap.py

allreduce (the default command): every method runs on the same data in the
same run, interleaved call by call so machine noise hits them alike.  Per
rank the median time of the timed calls is kept; the columns give its
average, min and max over ranks.  Bandwidths use the *uncompressed* bytes,
like nccl-tests.  Errors are measured against a float64 sum of the inputs.
The largest size runs first: a summary of it (the int8 ring against the
bf16 ring and MPI, and what one machine can show) heads the output, above
the table.  The output header explains every column.  The library's log of
lossy calls (EQUARX_MPI_LOG) is off unless set: the path column says it.
"""
import argparse
import json
import os
import sys
import textwrap
import time
import zlib

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm, wrap
from equarx_mpi.bench.common import arg_type, human, mpi_library, node_cores, parse_size, sizes
from equarx_mpi.bench.methods import DEFAULT_METHODS, METHODS, PIECES, parse_methods
from equarx_mpi.bench.report import COLUMNS, LEGEND, footer, format_row, summary
from equarx_mpi.names import BFLOAT16

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

def _entries(table):
    """``name  words`` lines of a --help table, the words wrapped under themselves."""
    table = list(table)
    width = 4 + max(len(name) for name, _ in table)
    out = []
    for name, words in table:
        out.append(textwrap.fill(" ".join(words.split()), 90,
                                 initial_indent=f"  {name:{width - 2}s}",
                                 subsequent_indent=" " * width))
    return "\n".join(out) + "\n"


def build_parser(commands=""):
    """The allreduce command's options; ``commands``: the list of all the
    bench's commands, shown in --help (python -m equarx_mpi.bench passes it)."""
    size = arg_type(parse_size)
    p = argparse.ArgumentParser(
        prog="python -m equarx_mpi.bench",
        usage="mpirun -n P python -m equarx_mpi.bench [allreduce] [options]\n"
              "       python -m equarx_mpi.bench COMMAND [options]",
        description=__doc__.split("\n\n")[2],
        epilog=(commands + "\n\n" if commands else "")
        + "methods (-m):\n" + _entries((m, d.about) for m, d in METHODS.items())
        + textwrap.fill(PIECES, 90, initial_indent="  ", subsequent_indent="  ")
        + "\n\ndata (--data):\n" + _entries((k, d) for k, (d, _) in DATA.items())
        + "\nsizes (-b, -e): bytes per rank, K/M/G = 1024, 1024**2, 1024**3 (4K, 1.5M, 64KiB)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=size, metavar="SIZE", default=parse_size("4K"),
                   help="smallest message per rank (default 4K)")
    p.add_argument("-e", "--maxbytes", type=size, metavar="SIZE", default=parse_size("64M"),
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
                   help="values per block of the library's methods (default 256); int4 and "
                   "int4-aff keep their own (64, 128)")
    p.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="times, speedup and error against size "
                   "(needs matplotlib: pip install equarx_mpi[plot])")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.add_argument("--overlap", action="store_true",
                   help="instead of the table: a nonblocking AllReduce against a compute "
                   "loop of about its length, alone and together (equarx_mpi/bench/overlap.py)")
    return p


def _arg_error(args):
    """Why these arguments cannot run (the same answer on every rank), or None."""
    try:
        parse_methods(args.methods)
    except ValueError as e:
        return str(e)
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
        from equarx_mpi.bench import plot
        return plot.missing()
    return None


def _agree(comm, err):
    """Exit on every rank, with the first rank's message, if any rank has one."""
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        raise SystemExit(f"equarx_mpi.bench: {errs[0]}")


def _make_comms(comm, methods, block):
    """name -> QuantizedComm (or wrapped communicator) for the requested
    library methods.  Collective."""
    qcs = {}
    for m in methods:
        opts = METHODS[m].options
        if opts is None:
            continue
        try:
            make = wrap if METHODS[m].wrapped else QuantizedComm
            qcs[m] = make(comm, **{"block_size": block, **opts})
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
    err = _arg_error(args)
    _agree(comm, err or (_rank0_error(args) if rank == 0 else None))
    methods = parse_methods(args.methods)
    dtype = np.dtype(DTYPES[args.dtype])
    # The path column says what travelled lossy: the library's log of it on
    # stderr (on by default) would bury the progress lines, unless asked for.
    os.environ.setdefault("EQUARX_MPI_LOG", "0")
    qcs = _make_comms(comm, methods, args.block)
    # flushed line by line: a newcomer sees each line as it is made
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"# equarx_mpi allreduce benchmark: {P} rank{'s' * (P != 1)}, {mpi_library()}")
    say(f"# dtype {dtype.name}, data {args.data}: {' '.join(DATA[args.data][0].split())}")
    say(f"# block {args.block}; per size and method {args.warmup} warm-up + {args.iters} "
        f"timed calls, methods interleaved call by call")
    if P == 1:
        say("# 1 rank: every method returns its input; run under mpirun -n P (P >= 2)")
    todo = sorted({max(1, b // dtype.itemsize)
                   for b in sizes(args.minbytes, args.maxbytes, args.stepfactor)})
    if args.overlap:
        _say_methods(methods, say)
        from equarx_mpi.bench import overlap
        rows = overlap.run(args, comm, qcs, methods, dtype, todo, say, _path)
        for qc in qcs.values():
            qc.free()
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": P, "dtype": dtype.name, "mpi": mpi_library(),
                           "argv": sys.argv[1:], "overlap": rows}, f, indent=1)
        return rows
    # The largest size runs first: the summary above the table is made of it,
    # and a newcomer reads it while the other sizes run.
    one_node, cores = node_cores(comm)
    order = todo[-1:] + todo[:-1]
    by_count = {}
    for i, count in enumerate(order):
        # One progress line, before the first (largest, slowest) size: after
        # it each size's rows show the progress.  On stdout, in order: mpirun
        # forwards stderr apart, which put progress lines inside the legend.
        if i == 0 and not args.quiet:
            more = (" (first: the summary; then the table, a size at a time)"
                    if len(order) > 1 else "")
            say(f"# [1/{len(order)}] {human(count * dtype.itemsize)}{more}")
        by_count[count] = got = _one_size(comm, qcs, methods, count, dtype, args)
        if i == 0:
            if rank == 0:
                summary(got, P, cores, one_node, say)
            _say_methods(methods, say)
            say(LEGEND)
            say("#" + " ".join(f"{name:>{w}}" for name, w in COLUMNS)[1:])
        else:
            for r in got:
                say(format_row(r))
    for r in by_count[order[0]]:        # the largest size, in its place: last
        say(format_row(r))
    rows = [r for count in todo for r in by_count[count]]
    for qc in qcs.values():
        qc.free()
    if rank == 0:
        footer(rows, methods, say)
        _write_files(args, rows, methods, P, dtype)
    return rows


def _say_methods(methods, say):
    say("# methods:")
    for m in methods:
        say(f"#   {m:12s} {METHODS[m].about}")


def _inputs(rank, count, dtype, data):
    x = DATA[data][1](np.random.default_rng(1000 + rank), count)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _one_size(comm, qcs, methods, count, dtype, args):
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
    return rows


def _write_files(args, rows, methods, P, dtype):
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": P, "dtype": dtype.name, "data": args.data,
                       "block": args.block, "mpi": mpi_library(),
                       "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    if args.plot:
        from equarx_mpi.bench import plot
        plot.plot(rows, methods, [m for m in methods if METHODS[m].options is not None],
                  args.plot, f"AllReduce, {P} ranks, {dtype.name}, data {args.data}")


def main(argv=None, commands=""):
    """``python -m equarx_mpi.bench [allreduce] ARGS`` (bench/__main__.py)."""
    run_allreduce(build_parser(commands).parse_args(argv))
    return 0
