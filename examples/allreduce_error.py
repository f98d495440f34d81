"""Quantized AllReduce of 16 MiB of float32 per rank next to exact MPI:
the error and the time of each.

    mpirun -n 8 python examples/allreduce_error.py
"""
import time
import zlib

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
n = 4 << 20                                    # 4M float32 = 16 MiB per rank
x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)

exact = np.empty(n, np.float64)
comm.Allreduce(x.astype(np.float64), exact)    # the reference, in float64

with QuantizedComm(comm) as qc:
    out = np.empty_like(x)
    qc.Allreduce(x, out)                       # warm-up (compiles or loads kernels)
    comm.Barrier()
    t0 = time.perf_counter()
    qc.Allreduce(x, out)
    t_q = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

ref = np.empty_like(x)
comm.Barrier()
t0 = time.perf_counter()
comm.Allreduce(x, ref)
t_mpi = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
identical = len(set(comm.allgather(zlib.crc32(out.tobytes())))) == 1
if rank == 0:
    print(f"{size} ranks, {n * 4 >> 20} MiB float32 per rank")
    print(f"int8 ring: relative L2 error {rel:.2%}, max abs error "
          f"{np.abs(out - exact).max():.3g}, identical on all ranks: {identical}")
    print(f"time: int8 ring {t_q * 1e3:.1f} ms, MPI Allreduce {t_mpi * 1e3:.1f} ms "
          f"(one call each; use python -m equarx_mpi.bench for real numbers)")
