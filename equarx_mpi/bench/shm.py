"""``python -m equarx_mpi.bench shm``: the shared-window exact AllReduce
against comm.Allreduce, one node.

    mpirun -n 2 python -m equarx_mpi.bench shm                       # 4K .. 256M
    mpirun -n 8 --oversubscribe python -m equarx_mpi.bench shm -e 64M
    python -m equarx_mpi.bench shm kernels                           # one process

allreduce (default): methods interleaved call by call on the same data:
  mpi      comm.Allreduce(x, y)                          (out of place)
  shm      ShmAllreduce.allreduce(x, y)                  (out of place)
  2phase   the same with oneshot_bytes=0                 (never one-shot)
  win      ShmAllreduce.allreduce(IN_PLACE, w), w from ShmAllreduce.empty()
A call's time is the slowest rank's (each call starts after a Barrier); the
table gives the median over the timed calls (at least -n; more for small
sizes, about --budget seconds per method, at most --max-iters) and
ratio = mpi / method.

Memory-traffic model, bytes each rank reads + writes for n bytes of input:
  shm      copy in all but the own slice 2n(P-1)/P; reduce: read n, write
           the slice to the window and to recv 2n/P; copy out the other
           slices 2n(P-1)/P: 5n - 2n/P in all (4n at P=2);
  win      no copy in: 3n.
  The least any AllReduce moves is about 2n (read the input, write the
  result).  Model time = P * traffic / (the copy rate of all P ranks copying
  at once, bytes read + written per second); it ignores write-allocate
  reads and the barriers, so it is a floor.

kernels: GB/s of the reduction kernels against numpy, one process.
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi.bench.common import arg_type, human, parse_size, sizes
from equarx_mpi.collectives.shm import ShmAllreduce
from equarx_mpi.kernels import shm as SK
from equarx_mpi.model.profiles import cpu_model

PROG = "python -m equarx_mpi.bench shm"


def copy_rate(comm, nbytes=64 << 20, reps=5):
    """(bytes moved per second by one rank copying alone, by all ranks
    copying at once); a copy of n bytes moves 2n."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    alone, together = [], []
    for _ in range(reps):
        comm.Barrier()
        if comm.Get_rank() == 0:
            t = time.perf_counter()
            np.copyto(b, a)
            alone.append(time.perf_counter() - t)
        comm.Barrier()
        t = time.perf_counter()
        np.copyto(b, a)
        together.append(comm.allreduce(time.perf_counter() - t, MPI.MAX))
    P = comm.Get_size()
    return (2 * nbytes / min(alone) if alone else 0.0,
            P * 2 * nbytes / statistics.median(together))


def timed(comm, call, before=None):
    if before is not None:
        before()
    comm.Barrier()
    t = time.perf_counter()
    call()
    return comm.allreduce(time.perf_counter() - t, MPI.MAX)


def run_allreduce(args):
    comm = MPI.COMM_WORLD
    P, r = comm.Get_size(), comm.Get_rank()
    sh = ShmAllreduce(comm)
    sh2 = ShmAllreduce(comm, oneshot_bytes=0)
    sh.reserve(args.maxbytes)     # empty() below then never grows the window
    alone, together = copy_rate(comm)
    traffic = {"shm": 5 - 2 / P, "win": 3}
    if r == 0:
        print(f"# bench shm allreduce: {P} ranks, float32, SUM; {args.warmup} warm-up calls, "
              f"median of >= {args.iters} timed calls per size and method, interleaved")
        print(f"# CPU: {cpu_model()}; load average {open('/proc/loadavg').read().split()[0]}")
        print(f"# copy rate (64 MiB numpy copy, read+write bytes): one rank alone "
              f"{alone / 1e9:.1f} GB/s; all {P} ranks at once {together / 1e9:.1f} GB/s in all")
        print(f"# {'size(B)':>10} {'size':>8} {'mpi(us)':>9} {'shm(us)':>9} {'2phase':>9} "
              f"{'win(us)':>9} {'mpi/shm':>8} {'mpi/2ph':>8} {'mpi/win':>8} "
              f"{'model-shm':>10} {'model-win':>10}")
    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        n = nbytes // 4
        x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
        y = np.empty_like(x)
        w = sh.empty(n, np.float32)
        methods = {"mpi": (lambda: comm.Allreduce(x, y, MPI.SUM), None),
                   "shm": (lambda: sh.allreduce(x, y, MPI.SUM), None),
                   "2phase": (lambda: sh2.allreduce(x, y, MPI.SUM), None),
                   "win": (lambda: sh.allreduce(MPI.IN_PLACE, w, MPI.SUM),
                           lambda: np.copyto(w, x))}
        warm = max(max(timed(comm, *m) for m in methods.values()) for _ in range(args.warmup))
        iters = max(args.iters, min(args.max_iters, int(args.budget / max(warm, 1e-9))))
        times = {k: [] for k in methods}
        for _ in range(iters):
            for name, m in methods.items():
                times[name].append(timed(comm, *m))
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        model = {k: P * f * nbytes / together * 1e6 for k, f in traffic.items()}
        if r == 0:
            print(f"  {nbytes:>10} {human(nbytes):>8} {med['mpi']:>9.1f} {med['shm']:>9.1f} "
                  f"{med['2phase']:>9.1f} {med['win']:>9.1f} "
                  + " ".join(f"{med['mpi'] / med[k]:>8.2f}" for k in ("shm", "2phase", "win"))
                  + f" {model['shm']:>10.1f} {model['win']:>10.1f}", flush=True)
    sh.free()
    sh2.free()


def run_kernels(args):
    """Reduction of one slice out of P slots of n bytes each."""
    print(f"# bench shm kernels: float32 SUM, best of {args.iters}; GB/s of slot bytes read; "
          f"CPU: {cpu_model()}")
    print(f"# {'size':>8} {'P':>2} {'fused':>7} {'+recv':>7} {'numpy':>7}  (P=2: fused = "
          f"reduce_pair, else reduce_slots; +recv also writes the slice to recv; numpy: "
          f"P-1 np.add passes)")

    def best(f):
        f()
        ts = []
        for _ in range(args.iters):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return min(ts)

    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        for P in (2, 8):
            n = nbytes // 4
            stride = n + 16
            win = np.random.default_rng(0).standard_normal(P * stride).astype(np.float32)
            own = win[stride:stride + n].copy()
            m = n // P
            out, recv, acc = np.empty(m, np.float32), np.empty(m, np.float32), \
                np.empty(SK.TILE, np.float32)
            rows = [win[k * stride:k * stride + m] for k in range(P)]

            def fused(out2):
                if P == 2:
                    return lambda: SK.reduce_pair(win, 0, own, 0, m, 0, out, out2)
                # every slot's data at its start, strided as shm's control words
                at = np.zeros((P, 2), np.int64)[:, 0]
                return lambda: SK.reduce_slots(win, stride, at, P, 1, own, 0, m, 0, acc, out, out2)

            def numpy_adds():
                np.add(rows[0], rows[1], out)
                for row in rows[2:]:
                    np.add(out, row, out)
            rate = [P * m * 4 / best(f) / 1e9 for f in (fused(out[:0]), fused(recv), numpy_adds)]
            print(f"  {human(nbytes):>8} {P:>2} " + " ".join(f"{v:>7.1f}" for v in rate),
                  flush=True)


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = arg_type(parse_size)
    p.add_argument("what", nargs="?", choices=("allreduce", "kernels"), default="allreduce",
                   help="allreduce (the default, under mpirun) or kernels (one process)")
    p.add_argument("-b", "--minbytes", type=size, default=None, metavar="SIZE",
                   help="smallest message per rank (allreduce 4K, kernels 1M)")
    p.add_argument("-e", "--maxbytes", type=size, default=None, metavar="SIZE",
                   help="largest message per rank (allreduce 256M, kernels 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, metavar="F",
                   help="size multiplier, at least 2 (default 4)")
    p.add_argument("-w", "--warmup", type=int, default=2, metavar="N",
                   help="allreduce: untimed rounds per size (default 2)")
    p.add_argument("-n", "--iters", type=int, default=7, metavar="N",
                   help="timed calls per size and method, at least (default 7); kernels: "
                   "the best of N")
    p.add_argument("--max-iters", type=int, default=200, metavar="N",
                   help="allreduce: timed calls per size and method, at most (default 200)")
    p.add_argument("--budget", type=float, default=0.2, metavar="SECONDS",
                   help="allreduce: seconds of timed calls per method and size, for small "
                   "sizes (default 0.2)")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    kernels = args.what == "kernels"
    args.minbytes = args.minbytes or parse_size("1M" if kernels else "4K")
    args.maxbytes = args.maxbytes or parse_size("64M" if kernels else "256M")
    # the same arguments on every rank: every rank stops alike, before any call
    if not 4 <= args.minbytes <= args.maxbytes:
        p.error(f"need 4 <= --minbytes <= --maxbytes, got -b {args.minbytes} "
                f"-e {args.maxbytes}")
    if args.stepfactor < 2 or args.iters < 1 or args.warmup < 1:
        p.error(f"need --stepfactor >= 2, --iters >= 1 and --warmup >= 1, got "
                f"-f {args.stepfactor} -n {args.iters} -w {args.warmup}")
    (run_kernels if kernels else run_allreduce)(args)
    return 0
