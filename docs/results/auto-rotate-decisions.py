"""rotate="auto" against rotate=False and True through a call
(docs/results/auto-rotate-decisions.txt): two-shot, 2^20 float32 a rank,
standard normal with every k-th value times m."""
import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm

world = MPI.COMM_WORLD
rank = world.Get_rank()
N = 1 << 20
for every, mult in [(61, 300), (61, 30), (64, 100), (256, 100), (7, 20), (97, 40), (1, 1)]:
    rng = np.random.default_rng(3 + rank)
    x = rng.standard_normal(N).astype(np.float32)
    x[::every] *= mult
    ex = np.array(world.allgather(x.astype(np.float64))).sum(0)
    for wire in ["int8", "int4", "int3", "int2"]:
        rels = {}
        for rot in [False, True, "auto"]:
            with QuantizedComm(world, wire=wire, rotate=rot, algorithm="two_shot",
                               min_quantized_bytes=0) as qc:
                r = np.empty_like(x)
                qc.Allreduce(x, r)
                if rot == "auto":
                    chose = qc.last_call.rotation
            rels[rot] = np.linalg.norm(r - ex) / np.linalg.norm(ex)
        if rank == 0:
            print(f"every {every:3d} x{mult:3d} {wire}: unrot {rels[False]:.3e} "
                  f"rot {rels[True]:.3e} gain {rels[False]/rels[True]:5.2f}  "
                  f"auto rotated={bool(chose)} auto err {rels['auto']:.3e}")
