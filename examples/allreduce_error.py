"""The error of the quantized AllReduce on standard-normal float32 data,
against an exact float64 sum: relative L2 error per call (mean, min and
max over seeds) and the worst single block, identical on every rank.

    mpirun -n 8 python examples/allreduce_error.py
    mpirun -n 4 python examples/allreduce_error.py --seeds 10 --wire int8

Relative L2 of a call is ||out - exact|| / ||exact|| over the whole array;
that of a block the same over its 256 values (the worst block is far
above the mean: a block's error depends on its largest value).
"""
import argparse
import zlib

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="calls with different data (default 5)")
    ap.add_argument("--mib", type=float, default=4, help="MiB of float32 per rank (default 4)")
    ap.add_argument("--wire", default="int8")
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--block", type=int, default=256)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = int(args.mib * (1 << 20)) // 4
    B = args.block
    rel, worst, identical = [], 0.0, True
    with QuantizedComm(comm, wire=args.wire, algorithm=args.algorithm, block_size=B,
                       min_quantized_bytes=0) as qc:
        for seed in range(args.seeds):
            x = np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)
            exact = np.empty(n, np.float64)
            comm.Allreduce(x.astype(np.float64), exact)
            out = qc.allreduce(x)
            err = (out - exact).astype(np.float64)
            rel.append(np.linalg.norm(err) / np.linalg.norm(exact))
            m = n // B * B
            per_block = (np.linalg.norm(err[:m].reshape(-1, B), axis=1)
                         / np.linalg.norm(exact[:m].reshape(-1, B), axis=1))
            worst = max(worst, float(per_block.max()))
            identical &= len(set(comm.allgather(zlib.crc32(out.tobytes())))) == 1
    if rank == 0:
        r = np.array(rel)
        print(f"{size} ranks, {args.wire} {args.algorithm}, block {B}, {n * 4 / 2**20:g} MiB "
              f"float32 per rank, {args.seeds} seeds")
        print(f"relative L2 error per call: mean {r.mean():.4%}, min {r.min():.4%}, "
              f"max {r.max():.4%}; worst single block {worst:.3%}; "
              f"identical on all ranks: {identical}")


if __name__ == "__main__":
    main()
