"""``python -m equarx_mpi.tune [COMMAND] [options]``: the cost model's
profiles (docs/TUNING.md), one command each, each with its own options
(``... COMMAND --help``).  Without a command name the arguments go to
``measure`` (under mpirun).  A command's module is imported only when it
runs: predict, check and builtin never initialize MPI.
"""
import sys

from equarx_mpi.bench.common import run_command

PROG = "python -m equarx_mpi.tune"
#: command -> (module, its function, one line for --help)
COMMANDS = {
    "measure": ("equarx_mpi.tune.measure", "main",
                "measure this machine's profile, under mpirun (the default; its\n"
                "options are above)"),
    "predict": ("equarx_mpi.tune.predict", "predict",
                "the model's times for clusters that were not measured; serial"),
    "check": ("equarx_mpi.tune.predict", "check",
              "the model's predictions against a benchmark's JSON; serial"),
    "builtin": ("equarx_mpi.tune.builtin", "main",
                "for maintainers: the built-in profile (model/builtin.py) from\n"
                "measured ones; serial"),
}


def main(argv=None):
    return run_command(PROG, COMMANDS, "measure", argv)


if __name__ == "__main__":
    sys.exit(main())
