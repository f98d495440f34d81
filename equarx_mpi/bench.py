"""Benchmarks.  Run under mpirun; only rank 0 prints and writes files.

    mpirun -n 8 python -m equarx_mpi.bench                 # allreduce sweep
    mpirun -n 8 python -m equarx_mpi.bench allreduce -b 1M -e 64M --json out.json
    python -m equarx_mpi.bench kernels                     # kernel GB/s vs C

allreduce: every method runs on the same data in the same run, interleaved
call by call so machine noise hits them alike.  Per rank the median time of
the timed calls is kept; the columns give its average, min and max over
ranks.  Bandwidths use the *uncompressed* bytes, like nccl-tests:
algbw = size / time, busbw = algbw * 2(P-1)/P.  Errors are measured against
an exact float64 sum; #wrong counts ranks whose result differs from rank 0's.
"""
import argparse
import json
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from .comm import BFLOAT16, QuantizedComm

#: name -> (description, QuantizedComm options or None for comm.Allreduce)
METHODS = {
    "mpi": ("mpi4py comm.Allreduce (exact)", None),
    "bf16": ("pipelined ring, bfloat16 on the wire", dict(bits=16, min_quantized_bytes=0)),
    "fp32": ("pipelined ring, float32 on the wire", dict(bits=32, min_quantized_bytes=0)),
    "int8": ("EQuARX int8 ring, library defaults", dict(bits=8)),
    "int8-c1": ("EQuARX int8 ring, chunks=1 (no pipelining)",
                dict(bits=8, chunks=1, min_quantized_bytes=0)),
    "int8-raw": ("EQuARX int8 ring, never falls back to MPI", dict(bits=8, min_quantized_bytes=0)),
    "int8-nocheck": ("EQuARX int8 ring without the argument agreement",
                     dict(bits=8, check=False)),
}
DEFAULT_METHODS = "mpi,bf16,fp32,int8,int8-c1"
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "bfloat16": BFLOAT16}


def parse_size(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    try:
        return int(float(t[:len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 16M, 1G)")


def human(nbytes):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= k:
            return f"{nbytes / k:g} {unit}"
    return f"{nbytes} B"


def sizes(begin, end, factor):
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = s * factor if factor > 1 else s + 1
    return out


def allreduce_parser(p):
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"),
                   help="smallest message per rank (default 4K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest message per rank (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier (default 4)")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls per size and method")
    p.add_argument("-n", "--iters", type=int, default=5, help="timed calls per size and method")
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("-m", "--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated, from {', '.join(METHODS)} (default {DEFAULT_METHODS})")
    p.add_argument("--block", type=int, default=256, help="int8 block size")
    p.add_argument("--json", metavar="FILE", help="write all rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="speedup and error against size "
                   "(needs matplotlib: pip install equarx_mpi[plot])")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run_allreduce(args, comm=MPI.COMM_WORLD):
    P, rank = comm.Get_size(), comm.Get_rank()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if args.plot and rank == 0:
        import matplotlib  # noqa: F401  (fail before the sweep, not after it)
    dtype = np.dtype(DTYPES[args.dtype])
    qcs = {m: QuantizedComm(comm, block_size=args.block, **METHODS[m][1])
           for m in methods if METHODS[m][1] is not None}
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"# equarx_mpi allreduce benchmark: {P} ranks, {MPI.Get_library_version().splitlines()[0]}")
    say(f"# dtype {dtype.name}, block {args.block}, warm-up {args.warmup}, timed {args.iters}, "
        f"time = per-rank median, avg/min/max over ranks")
    for m in methods:
        say(f"#   {m:12s} {METHODS[m][0]}")
    hdr = (f"#{'size(B)':>12} {'count':>11} {'type':>8} {'method':>12} {'avg(us)':>11} "
           f"{'min(us)':>11} {'max(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} "
           f"{'speedup':>8} {'rel_err':>9} {'max_err':>9} {'#wrong':>6}")
    say(hdr)
    rows = []
    todo = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    for i, nbytes in enumerate(todo):
        count = max(1, nbytes // dtype.itemsize)
        if rank == 0 and not args.quiet:
            sys.stderr.write(f"# [{i + 1}/{len(todo)}] {human(count * dtype.itemsize)}\n")
        rows += _one_size(comm, qcs, methods, count, dtype, args, say)
    by_method = {m: [r for r in rows if r["method"] == m] for m in methods}
    for m in methods:
        say(f"# avg busbw {m:12s} {np.mean([r['busbw_GBps'] for r in by_method[m]]):.3f} GB/s")
    last = max(r["bytes"] for r in rows)
    at_last = {r["method"]: r for r in rows if r["bytes"] == last}
    for base in ("mpi", "bf16"):
        if "int8" in at_last and base in at_last:
            say(f"# int8 vs {base} at {human(last)}: {at_last[base]['time_us']['avg'] / at_last['int8']['time_us']['avg']:.2f}x")
    wrong = sum(r["wrong"] for r in rows)
    say(f"# wrong results: {wrong}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": P, "dtype": dtype.name, "block": args.block,
                       "mpi": MPI.Get_library_version().splitlines()[0], "rows": rows}, f, indent=1)
    if rank == 0 and args.plot:
        plot(rows, methods, args.plot, P)
    for qc in qcs.values():
        qc.free()
    return rows


def _one_size(comm, qcs, methods, count, dtype, args, say):
    P, rank = comm.Get_size(), comm.Get_rank()
    x = np.random.default_rng(1000 + rank).standard_normal(count).astype(dtype)
    exact = np.empty(count, np.float64)
    comm.Allreduce(x.astype(np.float64), exact)
    # MPI has no 16-bit float types: its baseline reduces float32 copies.
    mpi_x = x.astype(np.float32) if dtype.itemsize == 2 else x
    outs = {m: np.empty_like(mpi_x if m == "mpi" else x) for m in methods}
    calls = {m: (lambda o=outs[m]: comm.Allreduce(mpi_x, o)) if m == "mpi" else
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
    rows = []
    nbytes = count * dtype.itemsize
    norm = np.linalg.norm(exact)
    for m in methods:
        med = float(np.median(times[m]))
        t_all = comm.gather(med)
        out = outs[m].astype(np.float64)
        crc = zlib.crc32(outs[m].tobytes())
        crcs = comm.gather(crc)
        if rank != 0:
            continue
        rel = float(np.linalg.norm(out - exact) / norm) if norm > 0 else 0.0
        maxerr = float(np.abs(out - exact).max())
        avg = float(np.mean(t_all))
        algbw = nbytes / avg / 1e9
        rows.append(dict(bytes=nbytes, count=count, dtype=dtype.name, method=m,
                         time_us=dict(avg=avg * 1e6, min=min(t_all) * 1e6, max=max(t_all) * 1e6),
                         algbw_GBps=algbw, busbw_GBps=algbw * 2 * (P - 1) / P,
                         rel_err=rel, max_err=maxerr,
                         wrong=sum(c != crcs[0] for c in crcs)))
    if rank == 0:
        base = next((r for r in rows if r["method"] == "mpi"), None)
        for r in rows:
            r["speedup_vs_mpi"] = base["time_us"]["avg"] / r["time_us"]["avg"] if base else None
            sp = f"{r['speedup_vs_mpi']:8.2f}" if base else f"{'-':>8}"
            say(f" {r['bytes']:>12} {r['count']:>11} {r['dtype']:>8} {r['method']:>12} "
                f"{r['time_us']['avg']:11.1f} {r['time_us']['min']:11.1f} {r['time_us']['max']:11.1f} "
                f"{r['algbw_GBps']:11.3f} {r['busbw_GBps']:11.3f} {sp} {r['rel_err']:9.2e} "
                f"{r['max_err']:9.2e} {r['wrong']:>6}")
    return comm.bcast(rows)


def plot(rows, methods, path, P):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["bytes"])
        b = [r["bytes"] for r in rs]
        if m != "mpi":
            a1.plot(b, [r["speedup_vs_mpi"] for r in rs], marker="o", label=m)
            a2.plot(b, [max(r["rel_err"], 1e-9) for r in rs], marker="o", label=m)
    for a, title in ((a1, f"speedup vs MPI Allreduce ({P} ranks)"),
                     (a2, "relative L2 error vs exact sum")):
        a.set_xscale("log", base=2)
        a.set_xlabel("message per rank [bytes]")
        a.set_title(title)
        a.grid(True, alpha=0.3)
        a.legend()
    a1.axhline(1.0, color="k", lw=0.8)
    a2.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"allreduce": "quantized AllReduce against MPI and uncompressed rings (default)",
                "kernels": "numba kernel throughput against the C reference (one process)"}
    if argv and argv[0] in ("-h", "--help") or not argv or argv[0].startswith("-"):
        if argv and argv[0] in ("-h", "--help"):
            print("usage: python -m equarx_mpi.bench [command] [options]\ncommands:")
            for c, d in commands.items():
                print(f"  {c:10s} {d}")
            print("python -m equarx_mpi.bench COMMAND -h for its options")
            return 0
        argv = ["allreduce"] + argv
    cmd, rest = argv[0], argv[1:]
    if cmd == "kernels":
        from . import kernelbench
        return kernelbench.main(rest)
    if cmd != "allreduce":
        raise SystemExit(f"unknown command {cmd!r}; choose from {list(commands)}")
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.bench allreduce",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    allreduce_parser(p)
    run_allreduce(p.parse_args(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
