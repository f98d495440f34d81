"""Shared-window exact AllReduce against comm.Allreduce, one node.

    mpirun -n 2 python -m equarx_mpi.shmbench                  # 4K .. 256M
    mpirun -n 8 --oversubscribe python -m equarx_mpi.shmbench -e 64M -n 5

Methods, interleaved call by call on the same data:
  mpi      comm.Allreduce(x, y)                       (out of place)
  shm      ShmAllreduce.allreduce(x, y)               (out of place, copy in)
  shm-win  ShmAllreduce.allreduce(IN_PLACE, w), w from ShmAllreduce.empty()
A call's time is the slowest rank's (each call starts after a Barrier); the
table gives the median over the timed calls and ratio = mpi / method.

Memory-traffic model, bytes each rank moves for n bytes (reads + writes):
  shm      copy in 2n, reduce n + n/P (+ n/P into the own recv), copy out
           2n(P-1)/P: 5n in all;  shm-win: 3n (no copy in).
  The least any AllReduce moves is about 2n (read the input, write the
  result); the model time is P * traffic / (the copy rate of all P ranks
  copying at once, bytes read + written per second), printed as model(us).
"""
import argparse
import statistics
import subprocess
import time

import numpy as np
from mpi4py import MPI

from .bench import human, parse_size, sizes
from .shm import ShmAllreduce

TRAFFIC = {"shm": 5, "shm-win": 3}


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


def run(args):
    comm = MPI.COMM_WORLD
    P, r = comm.Get_size(), comm.Get_rank()
    sh = ShmAllreduce(comm, oneshot_bytes=args.oneshot)
    sh.reserve(args.maxbytes)     # empty() below then never grows the window
    alone, together = copy_rate(comm)
    if r == 0:
        cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                             text=True).stdout.split(":")[-1].strip()
        print(f"# shmbench: {P} ranks, float32, {args.warmup} warm-up + {args.iters} timed "
              f"calls per size and method, interleaved; CPU {cpu}")
        print(f"# copy rate (64 MiB numpy copy, read+write bytes): one rank alone "
              f"{alone / 1e9:.1f} GB/s; all {P} ranks at once {together / 1e9:.1f} GB/s in all")
        print(f"# {'size(B)':>10} {'size':>8} {'mpi(us)':>10} {'shm(us)':>10} {'win(us)':>10} "
              f"{'mpi/shm':>8} {'mpi/win':>8} {'model-shm':>10} {'model-win':>10}")
    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        n = nbytes // 4
        x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
        y = np.empty_like(x)
        w = sh.empty(n, np.float32)
        calls = {"mpi": lambda: comm.Allreduce(x, y, MPI.SUM),
                 "shm": lambda: sh.allreduce(x, y, MPI.SUM),
                 "shm-win": lambda: sh.allreduce(MPI.IN_PLACE, w, MPI.SUM)}
        times = {k: [] for k in calls}
        for i in range(args.warmup + args.iters):
            for name, call in calls.items():
                if name == "shm-win":
                    np.copyto(w, x)
                comm.Barrier()
                t = time.perf_counter()
                call()
                t = comm.allreduce(time.perf_counter() - t, MPI.MAX)
                if i >= args.warmup:
                    times[name].append(t)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        model = {k: P * f * nbytes / together * 1e6 for k, f in TRAFFIC.items()}
        if r == 0:
            print(f"  {nbytes:>10} {human(nbytes):>8} {med['mpi']:>10.1f} {med['shm']:>10.1f} "
                  f"{med['shm-win']:>10.1f} {med['mpi'] / med['shm']:>8.2f} "
                  f"{med['mpi'] / med['shm-win']:>8.2f} {model['shm']:>10.1f} "
                  f"{model['shm-win']:>10.1f}", flush=True)
        del w
    sh.free()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.shmbench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-w", "--warmup", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=7)
    p.add_argument("--oneshot", type=parse_size, default=None,
                   help="one-shot schedule up to this many bytes (default: the library's)")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
