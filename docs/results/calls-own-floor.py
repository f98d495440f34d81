"""What runs after a large Allreduce pays cache misses: time per call
spent outside MPI_Allreduce (us, median of 10 batches, rank 0), for
mpi4py's bare call, a bare Python function that times it, the same with
the plan shortcut's checks (call/plans.py still), and QuantizedComm."""
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm
from equarx_mpi.call.plans import signature, still

comm = MPI.COMM_WORLD
qc = QuantizedComm(comm)
pc = time.perf_counter
spent = [0.0]


def bare(x, y):
    t0 = pc()
    comm.Allreduce(x, y)
    spent[0] += pc() - t0


def checked(x, y):
    if still(key, x, y):
        t0 = pc()
        comm.Allreduce(x, y)
        spent[0] += pc() - t0


ways = (("mpi4py, each call timed", comm.Allreduce, None),
        ("a Python function timing it", bare, lambda: spent[0]),
        ("... and the shortcut's checks", checked, lambda: spent[0]),
        ("QuantizedComm", qc.Allreduce, lambda: qc.stats.seconds))
for nbytes in (8, 64 << 10, 1 << 20, 16 << 20):
    x = np.ones(nbytes // 8)
    y = np.empty_like(x)
    key = signature(x, y, MPI.SUM, 0)
    n = max(8, min(4096, (64 << 20) // nbytes))
    for _ in range(3):
        qc.Allreduce(x, y)
    got = {}
    for _ in range(2):
        for name, f, rec in ways:
            for _ in range(5):
                comm.Barrier()
                if rec is None:             # mpi4py: time each call here
                    inside, t0 = 0.0, pc()
                    for _ in range(n):
                        a = pc()
                        f(x, y)
                        inside += pc() - a
                else:
                    s0, t0 = rec(), pc()
                    for _ in range(n):
                        f(x, y)
                    inside = rec() - s0
                got.setdefault(name, []).append(((pc() - t0) - inside) / n * 1e6)
    if comm.rank == 0:
        print(f"{nbytes:>9} B ({qc.last_call.method}): " + ", ".join(
            f"{k} {np.median(v):.2f}" for k, v in got.items()), flush=True)
qc.free()
