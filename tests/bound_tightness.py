"""How tight the certified error bound is (docs/ERROR.md): on normal data,
last_error_bound / the largest observed |result - exact| per wire and
algorithm.

    mpirun -n 4 python tests/bound_tightness.py [values] [repeats]
"""
import sys

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import formats

WORLD = MPI.COMM_WORLD
P, R = WORLD.Get_size(), WORLD.Get_rank()
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 18
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 15


def inputs(dtype):
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(N).astype(dtype) for _ in range(P)]
    # float32 normals: float64 adds them exactly (24-bit values, P <= 8)
    return xs, np.sum([x.astype(np.float64) for x in xs], axis=0)


def tightness():
    xs, exact = inputs(np.float32)
    rows = [("ring", w) for w in formats.WIRES] + \
           [("two_shot", w) for w in formats.WIRES]
    for alg, wire in rows:
        with QuantizedComm(WORLD, wire=wire, algorithm=alg, min_quantized_bytes=0) as qc:
            out = qc.allreduce(xs[R])
            worst = float(np.abs(out.astype(np.float64) - exact).max())
            b = qc.last_error_bound
            blocks = qc.block_bounds()
        if R == 0:
            print(f"P={P} float32 n={N} {alg:8s} {wire:11s} bound {b:.3e}  max error "
                  f"{worst:.3e}  ratio {b / worst:6.2f}  median block bound "
                  f"{np.median(blocks):.3e}", flush=True)


if __name__ == "__main__":
    tightness()
