"""``python -m equarx_mpi.bench [COMMAND] [options]``: the benchmarks, one
command each, each with its own options (``... COMMAND --help``).  Without
a command name the arguments go to ``allreduce``, so
``mpirun -n 2 python -m equarx_mpi.bench -b 4K -e 1M -m mpi,int8`` runs the
sweep.  A command's module is imported only when it runs: ``kernels``
never initializes MPI.
"""
import os
import sys

# The commands but app (which studies BLAS threads beside the call) do no
# matmul: one BLAS thread per rank, set before numpy loads its BLAS, rather
# than the library's warning that ranks x BLAS threads oversubscribe the
# node's cores (a warning about the benchmark's own threads, not the user's).
if sys.argv[1:2] != ["app"]:
    for _name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

from equarx_mpi.bench.common import run_command  # noqa: E402 (after the BLAS limit)

PROG = "python -m equarx_mpi.bench"
#: command -> (module, its function, one line for --help)
COMMANDS = {
    "allreduce": ("equarx_mpi.bench.allreduce", "main",
                  "quantized AllReduce against MPI and uncompressed rings, under mpirun\n"
                  "(the default; its options are above)"),
    "shm": ("equarx_mpi.bench.shm", "main",
            "the shared-window exact AllReduce against comm.Allreduce on one node,\n"
            "under mpirun; `shm kernels`: its reduction kernels, one process"),
    "tolerance": ("equarx_mpi.bench.tolerance", "main",
                  "the error-bounded mode (abs_tol) against int8 two-shot at the same\n"
                  "error, on smooth 2-D and 3-D fields, pressure and Gaussian data, with\n"
                  "bytes per value, under mpirun"),
    "calls": ("equarx_mpi.bench.calls", "main",
              "per-call cost of small Allreduces through wrap() and QuantizedComm\n"
              "against mpi4py's own, under mpirun (issue 20's targets, PASS/MISS)"),
    "torch": ("equarx_mpi.bench.torchdist", "main",
              "torch.distributed's all_reduce through the \"equarx\" backend against\n"
              "gloo and gloo on a bf16 copy, under mpirun (needs torch)"),
    "app": ("equarx_mpi.bench.app", "main",
            "the AllReduce right after a BLAS matmul, as an application calls it,\n"
            "against the same call on idle cores, under mpirun"),
    "kernels": ("equarx_mpi.bench.kernels", "main",
                "numba's int8 kernels against the C reference in native/, one process"),
    "quality": ("equarx_mpi.bench.quality", "main",
                "error against bytes per value of every block wire, with and without\n"
                "a Hadamard rotation, on Gaussian, heavy-tailed and MiniLM data, one process"),
    "coldstart": ("equarx_mpi.bench.coldstart", "main",
                  "with numba's cache empty: the first quantized call at 2 ranks (it\n"
                  "launches mpirun) and python -m equarx_mpi.warmup, against the targets"),
}


def main(argv=None):
    return run_command(PROG, COMMANDS, "allreduce", argv)


if __name__ == "__main__":
    sys.exit(main())
