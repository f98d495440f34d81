"""``python -m equarx_mpi.bench torch``: torch.distributed's all_reduce
through the "equarx" backend against gloo, under mpirun (needs torch).

    mpirun -n 2 python -m equarx_mpi.bench torch                 # 32 B .. 16 MiB
    python -m equarx_mpi.cluster run --hosts 4 --rate 1gbit -- torch -s 16M

Per size, the same SUM of the same float32 tensors (seeded per rank),
every method on one process group of its own, created in one job:
  gloo          dist.all_reduce on a gloo group (exact, the input's bytes)
  gloo-bf16     the same on a bfloat16 copy, cast back (2x fewer bytes;
                what DDP's bf16_compress_hook does to a bucket)
  equarx        dist.all_reduce on the "equarx" group with its defaults
                (auto: lossy only for float SUM/AVG where predicted 25%
                faster than exact)
  equarx-exact  the same inside equarx_mpi.torch.exact()
Each call first copies the input into the tensor it reduces (the same
copy for every method; gloo-bf16's is its cast).  Timed in batches of N
calls after a barrier (N = 1 from 1 MiB up, more below so that a batch is
not one tiny call), R rounds with the methods interleaved round by round
(the order rotating); each rank keeps its median per-call time, the table
gives the slowest rank's.  x_gloo: gloo's time over the method's (> 1 =
faster than gloo).  rel_err: ||out - exact|| / ||exact||, exact the
float64 sum of the inputs.

Targets (issue 30): at 16 MiB, equarx >= 3.5x gloo and >= 1.8x gloo-bf16
(set for 4 hosts x 1 Gbit/s, the emulated cluster; on one node the
memory-bound sum has nothing to gain from fewer bytes); at 32 B
(8 float32), equarx-exact at most 2x gloo's time (per call, one node).
"""
import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi.bench import common
from equarx_mpi.bench.common import arg_type, comma_list, human, parse_size

PROG = "python -m equarx_mpi.bench torch"
SIZES = "32,4K,1M,16M"
METHODS = ("gloo", "gloo-bf16", "equarx", "equarx-exact")
#: (method, against, bytes per rank, at least this x_gloo-style ratio)
SPEED_TARGETS = (("equarx", "gloo", 16 << 20, 3.5), ("equarx", "gloo-bf16", 16 << 20, 1.8))
#: (method, bytes per rank, at most this x gloo's time)
CALL_TARGETS = (("equarx-exact", 32, 2.0),)
COLUMNS = (("size(B)", 9), ("count", 8), ("method", 12), ("N", 5), ("med(us)", 11),
           ("x_gloo", 7), ("rel_err", 8), ("path", 13))
LEGEND = """\
# columns (one row per size and method):
#   size(B), count   float32 message per rank
#   N         calls per timed batch (the same for every method of a size)
#   med(us)   time per call: each rank's median over the rounds, the largest over ranks
#   x_gloo    gloo's med / this method's: > 1 = faster than gloo's own all_reduce
#   rel_err   ||out - exact|| / ||exact|| (L2, rank 0), exact = float64 sum of the inputs
#   path      equarx's last_call (method/wire, "mpi" = MPI's own exact collective);
#             gloo: "-\""""


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, usage=f"mpirun -n P {PROG} [options]",
                                description=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-s", "--sizes", type=arg_type(comma_list(parse_size)),
                   default=comma_list(parse_size)(SIZES), metavar="SIZE,...",
                   help=f"bytes per rank, multiples of 4 (default {SIZES})")
    p.add_argument("-m", "--methods", default=",".join(METHODS),
                   help=f"comma-separated, from {','.join(METHODS)} (default: all)")
    p.add_argument("-r", "--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON (rank 0)")
    return p


def _arg_error(a):
    bad = [s for s in a.sizes if s < 4 or s % 4]
    if bad:
        return f"--sizes {bad}: each must be a positive multiple of 4 B (float32)"
    unknown = [m for m in a.methods.split(",") if m not in METHODS]
    if unknown or not a.methods:
        return f"--methods {unknown or a.methods!r}: choose from {', '.join(METHODS)}"
    if a.rounds < 1:
        return f"--rounds must be at least 1, got {a.rounds}"
    return None


def _methods(torch, dist, groups, eqt):
    """method name -> call(x, y): y = the sum over ranks of x (float32)."""
    def gloo(x, y):
        y.copy_(x)
        dist.all_reduce(y, group=groups["gloo"])

    def gloo_bf16(x, y):
        b = x.to(torch.bfloat16)
        dist.all_reduce(b, group=groups["gloo"])
        y.copy_(b)

    def equarx(x, y):
        y.copy_(x)
        dist.all_reduce(y, group=groups["equarx"])

    def equarx_exact(x, y):
        with eqt.exact(groups["equarx"]):
            equarx(x, y)
    return {"gloo": gloo, "gloo-bf16": gloo_bf16, "equarx": equarx,
            "equarx-exact": equarx_exact}


def _one_size(comm, torch, calls, methods, qc, nbytes, rounds):
    rank, count = comm.Get_rank(), nbytes // 4
    n = 1 if nbytes >= 1 << 20 else max(1, min(1000, (1 << 20) // nbytes // 16))
    x = torch.from_numpy(np.random.default_rng(100 + rank).standard_normal(count)
                         .astype(np.float32))
    outs = {m: torch.empty_like(x) for m in methods}
    paths = {}
    for m in methods:           # warm-up: first touches, plans, connections
        for _ in range(2):
            calls[m](x, outs[m])
        paths[m] = _path(qc.last_call) if m.startswith("equarx") else "-"
    times = {m: [] for m in methods}
    for r in range(rounds):
        for k in range(len(methods)):
            m = methods[(r + k) % len(methods)]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                calls[m](x, outs[m])
            times[m].append((time.perf_counter() - t0) / n)
    med = {m: comm.allreduce(float(np.median(t)), op=MPI.MAX) for m, t in times.items()}
    exact = np.sum(comm.allgather(x.numpy().astype(np.float64)), axis=0)
    norm = float(np.linalg.norm(exact)) or 1.0
    rows = []
    for m in methods:
        err = float(np.linalg.norm(outs[m].numpy().astype(np.float64) - exact)) / norm
        rows.append(dict(bytes=nbytes, count=count, method=m, number=n, median_us=med[m] * 1e6,
                         x_gloo=med["gloo"] / med[m] if "gloo" in med else None,
                         rel_err=err, path=paths[m]))
    return rows


def _path(info):
    if info is None:
        return "?"
    return f"{info.method}/{info.wire}" if info.wire else info.method


def format_row(r):
    cells = (r["bytes"], r["count"], r["method"], r["number"], f"{r['median_us']:.1f}",
             "-" if r["x_gloo"] is None else f"{r['x_gloo']:.2f}", f"{r['rel_err']:.1e}",
             r["path"])
    return " " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS))[1:]


def verdicts(rows):
    """The targets that these rows can judge, as lines."""
    by = {(r["bytes"], r["method"]): r for r in rows}
    out = []
    for m, other, nbytes, least in SPEED_TARGETS:
        a, b = by.get((nbytes, m)), by.get((nbytes, other))
        if a and b:
            x = b["median_us"] / a["median_us"]
            out.append(f"# target: {m} >= {least:g}x {other} at {human(nbytes)}: {x:.2f}x "
                       f"{'PASS' if x >= least else 'MISS'} (set for 4 hosts x 1 Gbit/s)")
    for m, nbytes, most in CALL_TARGETS:
        a, b = by.get((nbytes, m)), by.get((nbytes, "gloo"))
        if a and b:
            x = a["median_us"] / b["median_us"]
            out.append(f"# target: {m} at most {most:g}x gloo's time at {human(nbytes)}: "
                       f"{x:.2f}x {'PASS' if x <= most else 'MISS'} (one node)")
    return out


def run(a, comm=MPI.COMM_WORLD):
    import torch
    import torch.distributed as dist

    import equarx_mpi.torch as eqt
    P, rank = comm.Get_size(), comm.Get_rank()
    torch.set_num_threads(1)
    os.environ.setdefault("EQUARX_MPI_LOG", "0")     # the path column says what ran
    methods = [m for m in METHODS if m in a.methods.split(",")]
    dist.init_process_group("equarx")
    groups = {"equarx": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    qc = eqt.qcomm()
    calls = _methods(torch, dist, groups, eqt)
    say, cores = common.announce(comm, "torch.distributed benchmark", f"torch {torch.__version__}, ")
    say(f"# all_reduce SUM, float32, {a.rounds} rounds per size, methods interleaved; "
        f"equarx with its defaults (profile: {qc.profile_source})")
    rows = common.table(say, LEGEND, COLUMNS, a.sizes,
                        lambda nbytes: _one_size(comm, torch, calls, methods, qc, nbytes,
                                                 a.rounds), format_row)
    for line in verdicts(rows):
        say(line)
    if rank == 0 and a.json:
        common.save_rows(a.json, P, cores, rows, torch=torch.__version__)
    dist.destroy_process_group()
    return rows


def main(argv=None):
    p = build_parser()
    a = common.parse_checked(p, argv, _arg_error)
    try:
        import torch  # noqa: F401
    except ImportError:
        p.error("needs PyTorch: pip install 'equarx_mpi[torch]' (torch==2.13.0 here)")
    run(a)
    return 0
