"""``python -m equarx_mpi.bench [COMMAND] [options]``: the benchmarks, one
command each, each with its own options (``... COMMAND --help``).  Without
a command name the arguments go to ``allreduce``, so
``mpirun -n 2 python -m equarx_mpi.bench -b 4K -e 1M -m mpi,int8`` runs the
sweep.  A command's module is imported only when it runs: ``kernels``
never initializes MPI.
"""
import importlib
import sys

PROG = "python -m equarx_mpi.bench"
#: command -> (module under equarx_mpi.bench, one line for --help)
COMMANDS = {
    "allreduce": ("allreduce", "quantized AllReduce against MPI and uncompressed rings, "
                  "under mpirun\n(the default; its options are above)"),
    "shm": ("shm", "the shared-window exact AllReduce against comm.Allreduce on one node,\n"
            "under mpirun; `shm kernels`: its reduction kernels, one process"),
    "tolerance": ("tolerance", "the error-bounded mode (abs_tol) against int8 two-shot at "
                  "the same error,\nunder mpirun"),
    "kernels": ("kernels", "numba's int8 kernels against the C reference in native/, "
                "one process"),
}
DEFAULT = "allreduce"


def listing():
    """The commands, for the default command's --help."""
    lines = ["commands (python -m equarx_mpi.bench COMMAND --help for each one's options):"]
    for name, (_, about) in COMMANDS.items():
        first, *rest = about.split("\n")
        lines += [f"  {name:11s}{first}"] + [f"  {'':11s}{line}" for line in rest]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    name = DEFAULT
    if argv and argv[0] in COMMANDS:
        name, argv = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        raise SystemExit(f"{PROG}: unknown command {argv[0]!r}; choose from "
                         f"{', '.join(COMMANDS)} (or see --help)")
    module = importlib.import_module(f"equarx_mpi.bench.{COMMANDS[name][0]}")
    if name == DEFAULT:
        return module.main(argv, commands=listing())
    return module.main(argv)


if __name__ == "__main__":
    sys.exit(main())
