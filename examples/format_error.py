"""Error and size of the wire formats through the library's ring, against an
exact float64 sum: one row per wire and block size.

    mpirun -n 4 python examples/format_error.py --wires int8,int4 --blocks 32,64,128,256
    mpirun -n 2 python examples/format_error.py --data offset --anomaly 101325
    mpirun -n 2 python examples/format_error.py --data heavy

Columns: bytes per value on the wire (headers included, for the whole
message), relative L2 error ||out - exact|| / ||exact|| and the error
against the signal ||out - exact|| / ||exact - mean(exact)|| (mean, min and
max over seeds), whether every rank got identical bytes.  --anomaly REF
adds a row per wire that reduces anomalies: each rank subtracts REF before
the call and the caller adds P * REF back after (float64 arithmetic, then
rounded to the input type).
"""
import argparse
import zlib

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import formats

DATA = {"normal": lambda rng, n: rng.standard_normal(n),
        "offset": lambda rng, n: 101325.0 + 100.0 * rng.standard_normal(n),
        # heavy tails: N(0,1) times a log-normal scale, so most blocks hold a
        # few values far larger than the rest (a relative format's case)
        "heavy": lambda rng, n: rng.standard_normal(n) * np.exp(2.0 * rng.standard_normal(n))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wires", default="int8,int4,fp8,int8-affine,int4-affine")
    ap.add_argument("--blocks", default="default",
                    help="comma-separated block sizes, or 'default' (each wire's own)")
    ap.add_argument("--data", choices=list(DATA), default="normal")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--anomaly", type=float, default=None, metavar="REF")
    ap.add_argument("--seeds", type=int, default=3, help="calls with different data (default 3)")
    ap.add_argument("--mib", type=float, default=4, help="MiB of input per rank (default 4)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    n = int(args.mib * (1 << 20)) // dtype.itemsize
    rows = []
    for wire in args.wires.split(","):
        blocks = ([formats.default_block(wire)] if args.blocks == "default"
                  else [int(b) for b in args.blocks.split(",")])
        for B in blocks:
            for anomaly in ([None] if args.anomaly is None else [None, args.anomaly]):
                rows.append(measure(comm, wire, B, anomaly, args, dtype, n))
    if rank == 0:
        mib = n * dtype.itemsize / 2**20
        print(f"# {size} ranks, ring, data {args.data}, {args.dtype}, {mib:g} MiB per rank"
              f", {args.seeds} seeds; errors: mean (min-max) over seeds")
        print(f"# {'wire':12s} {'block':>5s} {'anomaly':>8s} {'bytes/value':>11s} "
              f"{'rel_err %':>24s} {'anom_err %':>24s} identical")
        for r in rows:
            print(r)


def measure(comm, wire, B, anomaly, args, dtype, n):
    rank, size = comm.Get_rank(), comm.Get_size()
    rel, anom, identical = [], [], True
    with QuantizedComm(comm, wire=wire, algorithm="ring", block_size=B,
                       min_quantized_bytes=0) as qc:
        for seed in range(args.seeds):
            x = DATA[args.data](np.random.default_rng([seed, rank]), n).astype(dtype)
            exact = np.empty(n, np.float64)
            comm.Allreduce(x.astype(np.float64), exact)
            if anomaly is None:
                out = qc.allreduce(x)
            else:
                out = (qc.allreduce((x - anomaly).astype(dtype)).astype(np.float64)
                       + size * anomaly).astype(dtype)
            e = np.linalg.norm(out.astype(np.float64) - exact)
            rel.append(e / np.linalg.norm(exact))
            anom.append(e / np.linalg.norm(exact - exact.mean()))
            identical &= len(set(comm.allgather(zlib.crc32(out.tobytes())))) == 1
    bpv = formats.make_format(wire, B, dtype).nbytes(n) / n

    def stat(v):
        v = 100 * np.array(v)
        return f"{v.mean():.4f} ({v.min():.4f}-{v.max():.4f})"
    return (f"  {wire:12s} {B:5d} {'-' if anomaly is None else f'{anomaly:g}':>8s} {bpv:11.4f} "
            f"{stat(rel):>24s} {stat(anom):>24s} {identical}")


if __name__ == "__main__":
    main()
