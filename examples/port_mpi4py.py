"""Porting an mpi4py code to equarx_mpi: one line.

    mpirun -n 4 python examples/port_mpi4py.py [--size 1M] [--steps 30]

``train`` is an existing mpi4py code, unchanged: data-parallel gradient
descent where every rank holds its own data, sums its gradient over the
ranks with ``comm.Allreduce`` (a large float32 array: the traffic), and
also reduces a Python float (the loss) and an integer array (a count of
non-finite values).
It runs twice, on ``MPI.COMM_WORLD`` (before) and on
``equarx_mpi.wrap(MPI.COMM_WORLD)`` (after): only the large float SUM
travels quantized, from the size where algorithm="auto" (the default)
predicts a quantized method at least 5% faster than MPI: with the built-in
profile 96 KiB of float32 at 2 ranks, 1 MiB at 4, 5 MiB at 8 on one node
(docs/PORTING.md), so the default --size 1M (4 MiB per rank) is quantized at
2 and 4 ranks; the loss and the count are mpi4py's and MPI's own, exact.
The last line says how many calls were quantized.

The problem: minimize sum over ranks r of 0.5 * ||a_r * w - b_r||^2 (element
by element, n unknowns); the answer is w* = sum a_r b_r / sum a_r^2.
"""
import argparse

import numpy as np
from mpi4py import MPI

import equarx_mpi


def problem(rank, n, seed=0):
    rng = np.random.default_rng(seed + rank)
    a = rng.uniform(0.5, 1.5, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return a, b


def train(comm, a, b, steps, lr=None):
    """Plain mpi4py data-parallel gradient descent (the code being ported)."""
    P = comm.Get_size()
    lr = 1.0 / (2.25 * P) if lr is None else lr      # 1 / max over w of the curvature
    w = np.zeros_like(a)
    grad = np.empty_like(a)
    for _ in range(steps):
        np.multiply(a, a * w - b, out=grad)
        comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)          # the big one
        w -= lr * grad
    r = a * w - b
    loss = comm.allreduce(0.5 * float(r @ r))                 # a Python float
    bad = np.array([np.count_nonzero(~np.isfinite(w))], np.int64)
    comm.Allreduce(MPI.IN_PLACE, bad)                         # integers
    return w, loss, int(bad[0])


def exact_answer(comm, a, b):
    num, den = (a * b).astype(np.float64), (a * a).astype(np.float64)
    comm.Allreduce(MPI.IN_PLACE, num)
    comm.Allreduce(MPI.IN_PLACE, den)
    return num / den


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1M", help="unknowns per rank, e.g. 1M (default)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    n = int(float(args.size.rstrip("KMkm")) * {"K": 1 << 10, "M": 1 << 20}.get(
        args.size[-1:].upper(), 1))
    world = MPI.COMM_WORLD
    a, b = problem(world.Get_rank(), n)
    best = exact_answer(world, a, b)

    before = train(world, a, b, args.steps)                     # plain mpi4py
    comm = equarx_mpi.wrap(world)                               # the port
    after = train(comm, a, b, args.steps)

    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks, {n} float32 unknowns, {args.steps} steps")
        for name, (w, loss, bad) in (("before (mpi4py)", before), ("after (wrap)", after)):
            err = np.linalg.norm(w - best) / np.linalg.norm(best)
            print(f"{name:16s} loss {loss:.6g}  |w - w*|/|w*| {err:.2e}  "
                  f"non-finite values {bad}")
        s = comm.stats
        print(f"wrapped: {s.calls} reduction calls, {s.quantized_calls} quantized, "
              f"{s.bytes_sent / 1e6:.1f} MB sent for {s.bytes_uncompressed / 1e6:.1f} MB "
              f"uncompressed ({s.bytes_uncompressed / max(s.bytes_sent, 1):.2f}x less)")
    comm.free()


if __name__ == "__main__":
    main()
