"""How tight the certified error bound is (docs/ERROR.md): on normal data,
last_error_bound / the largest observed |result - exact| per wire and
algorithm.

    mpirun -n 4 python tests/bound_tightness.py [values] [repeats]

With ``--measured``: the format's bound and the measured one
(measured_bounds=True) of rotated and unrotated calls, on heavy-tailed
data (Student-t, every 97th value 40x; tests/test_mpi_rotate.py's) and
normal data, each rank its own values.

    mpirun -n 4 python tests/bound_tightness.py --measured [values]
"""
import sys

import numpy as np
from mpi4py import MPI

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import formats

WORLD = MPI.COMM_WORLD
P, R = WORLD.Get_size(), WORLD.Get_rank()
MEASURED = "--measured" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--measured"]
N = int(ARGS[0]) if ARGS else 1 << 16 if MEASURED else 1 << 18
REPEATS = int(ARGS[1]) if len(ARGS) > 1 else 15


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


def own_values(kind, rank):
    rng = np.random.default_rng(100 + rank)
    if kind == "gauss":
        return rng.standard_normal(N).astype(np.float32)
    x = rng.standard_t(3, N)
    x[::97] *= 40
    return x.astype(np.float32)


def measured():
    if R == 0:
        print(f"# {P} ranks, {N} float32 values per rank; ratio = last_error_bound / "
              f"max |result - exact|\n# data   wire  alg       rotate  max error   format's "
              f"(ratio)   measured (ratio)")
    for kind in ("heavy", "gauss"):
        xs = [own_values(kind, k) for k in range(P)]
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        for wire, alg in (("int8", "ring"), ("int8", "two_shot"), ("int4", "ring"),
                          ("int4", "two_shot"), ("int3", "two_shot")):
            for rotate in (False, True):
                b = {}
                for m in (False, True):
                    with QuantizedComm(WORLD, wire=wire, algorithm=alg, rotate=rotate,
                                       measured_bounds=m, min_quantized_bytes=0) as qc:
                        out = qc.allreduce(xs[R])
                        b[m] = qc.last_error_bound
                worst = WORLD.allreduce(float(np.abs(out.astype(np.float64) - exact).max()),
                                        MPI.MAX)
                if R == 0:
                    print(f"  {kind:6} {wire:5} {alg:9} {rotate!s:6} {worst:9.4g} "
                          f"{b[False]:10.4g} ({b[False] / worst:5.1f}) {b[True]:10.4g} "
                          f"({b[True] / worst:5.2f})", flush=True)


if __name__ == "__main__":
    measured() if MEASURED else tightness()
