"""A real client's own test suite, its communicators wrapped: pylops-mpi.

    mpirun -n 2 python tests/client_suite.py TESTDIR --mode MODE --out DIR [pytest args]

TESTDIR is tests/ of the pylops-mpi sdist of the installed version
(run_tests.sh downloads it); pytest args (module names, -k, --deselect)
narrow the run.  MODE:

  plain      MPI.COMM_WORLD as it is: the baseline;
  defaults   MPI.COMM_WORLD and MPI.COMM_SELF replaced by equarx_mpi.wrap()
             of themselves, the library's defaults;
  quantized  the same with EQUARX_MPI_ALGORITHM=ring and
             EQUARX_MPI_MIN_QUANTIZED_BYTES=0: every float SUM travels int8.

The replacement happens before pylops_mpi loads, so its default arguments
(``base_comm=MPI.COMM_WORLD``) and the tests' own ``MPI.COMM_WORLD`` are the
wrapped communicator, and the communicators pylops-mpi makes from it (Split,
Create_cart) are wrapped too; their calls count in the totals below.  The
client's conftest.py is not loaded: it edits pytest internals (``_nodeid``)
that pytest 8+ no longer has, and only renames the tests.

Each run writes DIR/MODE.json: the tests that failed on any rank and, per
test, the reduction calls that went through the library and how many were
quantized.  What fails the run (exit status 1 on every rank):
  defaults   a failure that DIR/plain.json lacks (or any, without it);
  quantized  a failure outside DIR/plain.json and the expected list
             tests/client_int8.txt (``NODEID  # why``), an entry of that list
             that ran and passed (the list is stale), or no quantized call;
  any mode   no test ran, or (wrapped) no call went through the library.
The last line of rank 0's output is the summary.
"""
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
EXPECTED = HERE / "client_int8.txt"
MODES = ("plain", "defaults", "quantized")


def _args(argv):
    if len(argv) < 2 or "--mode" not in argv or "--out" not in argv:
        sys.exit(__doc__)
    rest, opts = [], {}
    it = iter(argv[1:])
    for a in it:
        if a in ("--mode", "--out"):
            opts[a[2:]] = next(it)
        else:
            rest.append(a)
    if opts["mode"] not in MODES:
        sys.exit(f"--mode must be one of {', '.join(MODES)}, not {opts['mode']!r}")
    return rest[0], opts["mode"], pathlib.Path(opts["out"]), rest[1:]


testdir, mode, out, extra = _args(sys.argv)
if mode == "quantized":
    os.environ["EQUARX_MPI_MIN_QUANTIZED_BYTES"] = "0"
    os.environ["EQUARX_MPI_ALGORITHM"] = "ring"

from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD
made = []           # every QuantizedComm: the wrapped COMM_WORLD's and those of its children

if mode != "plain":
    import equarx_mpi  # noqa: E402
    from equarx_mpi.comm import QuantizedComm  # noqa: E402

    _init = QuantizedComm.__init__

    def _recording_init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        made.append(self)

    QuantizedComm.__init__ = _recording_init
    MPI.COMM_WORLD, MPI.COMM_SELF = equarx_mpi.wrap(world), equarx_mpi.wrap(MPI.COMM_SELF)


def totals():
    """(calls, quantized calls) so far over every communicator (its stats
    stay readable after free)."""
    stats = [qc.stats for qc in made]
    return sum(s.calls for s in stats), sum(s.quantized_calls for s in stats)


class Recorder:
    """pytest plugin: the failed tests and each test's calls."""

    def __init__(self):
        self.failed, self.ran, self.per_test = set(), set(), {}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.add(report.nodeid)
        if report.when == "call":
            self.ran.add(report.nodeid)

    def pytest_runtest_protocol(self, item):
        self._before = totals()

    def pytest_runtest_logfinish(self, nodeid):
        c0, q0 = self._before
        c1, q1 = totals()
        if c1 > c0:
            self.per_test[nodeid] = [c1 - c0, q1 - q0]


def load_expected():
    """nodeid -> why, from tests/client_int8.txt."""
    expected = {}
    for line in EXPECTED.read_text().splitlines():
        nodeid, _, why = line.partition("#")
        if nodeid.strip():
            expected[nodeid.strip()] = why.strip()
    return expected


def judge(failed, ran, calls, quantized):
    """The problems of this run, the same list on every rank."""
    problems = []
    if not ran:
        problems.append("no test ran")
    if mode != "plain" and calls == 0:
        problems.append("no call went through the library")
    if mode == "plain":
        return problems
    plain_file = out / "plain.json"
    plain = set(json.loads(plain_file.read_text())["failed"]) if plain_file.exists() else set()
    new = failed - plain
    if mode == "defaults":
        problems += [f"fails wrapped, passes plain: {t}" for t in sorted(new)]
        return problems
    expected = load_expected()
    problems += [f"fails int8, not in {EXPECTED.name}: {t}" for t in sorted(new - set(expected))]
    problems += [f"stale entry of {EXPECTED.name} (passes int8): {t}"
                 for t in sorted(set(expected) & ran - failed)]
    if world.Get_size() > 1 and quantized == 0:
        problems.append("no call was quantized")
    return problems


def main():
    import pytest

    rec = Recorder()
    args = ["-p", "no:cacheprovider", "--noconftest", "--with-mpi", "-q", "-rf",
            "--rootdir", testdir, "-o", "addopts=", *(extra or [testdir])]
    cwd = os.getcwd()
    os.chdir(testdir)       # its modules import each other by name
    try:
        code = pytest.main(args, plugins=[rec])
    finally:
        os.chdir(cwd)
    # union over ranks (a test may fail on one rank only), on the plain world
    failed = set().union(*world.allgather(rec.failed))
    ran = set().union(*world.allgather(rec.ran))
    calls, quantized = totals()
    problems = judge(failed, ran, calls, quantized)
    if world.Get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{mode}.json").write_text(json.dumps(
            {"failed": sorted(failed), "ran": len(ran), "calls": calls,
             "quantized_calls": quantized, "per_test": rec.per_test}, indent=1))
        for p in problems:
            print(f"FAILED: {p}")
    print(f"client_suite {mode}: {len(ran)} tests ran, {len(failed)} failed "
          f"(pytest exit {int(code)}); rank {world.Get_rank()}: {calls} reduction calls "
          f"through the library, {quantized} quantized; "
          + ("ok" if not problems else f"{len(problems)} problem(s)"), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
