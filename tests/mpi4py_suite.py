"""mpi4py's own test suite, in one process per rank, its communicators wrapped.

    mpirun -n P python tests/mpi4py_suite.py MPI4PY_TEST_DIR [--plain | --quantized]
        [--modules test_a,test_b] [--reducing] [--skip test_c] [--backends numpy]
        [--record FILE] [--baseline FILE] [--times] [-v] [-k PATTERN]

MPI4PY_TEST_DIR is test/ of the mpi4py sdist of the installed version
(run_tests.sh downloads it).  Every test module there (test_*.py) runs,
unchanged, in this one process, except the tests that spawn processes
(EXCLUDED, printed); --modules names some, --reducing takes those that call
a reduction the library takes over (REDUCING), --skip leaves some out, and
--backends keeps only those kinds of buffer in the tests' loops (arrayimpl).
Before they load, MPI.COMM_WORLD and MPI.COMM_SELF are replaced by
equarx_mpi.wrap() of themselves: the tests build their communicators from
those names (``COMM = MPI.COMM_WORLD`` at class level,
``MPI.COMM_WORLD.Dup()`` in setUp, which returns a wrapped communicator
too), so their calls go through the wrapper.  WRAPPED_EXCLUDED (printed)
are the tests no wrapper can pass: they want mpi4py to make an object of
the wrapped class from a handle in its own code.  numba is hidden from the
tests' array backends (as mpi4py's runner, main.py, does without --numba;
its CUDA backend needs a GPU) while the library keeps using it.

--plain runs the same tests on mpi4py's own communicators; --record FILE
writes the ids of the tests that failed (on any rank) and of those that
were skipped, and --baseline FILE (a plain run's record) makes this run
fail on a failure, or a skip, that the baseline lacks, and only on those.
Without --baseline any failure fails the run.

--quantized sets algorithm="ring" and min_quantized_bytes=0 (as
EQUARX_MPI_ALGORITHM and EQUARX_MPI_MIN_QUANTIZED_BYTES, the environment
route; "auto", the default, keeps such small messages exact), so every
float SUM travels as int8.  The tests whose own tolerance int8 cannot meet
would be left out (QUANTIZED_EXCLUDED, printed with the reason each; none
so far: their float sums are of small integers, checked to 7 places).

When test_cco_buf runs wrapped, every rank checks afterwards that calls
went through the library (and, with --quantized at 2+ ranks, that some were
quantized); any failure, on any rank, makes every rank exit non-zero.
"""
import argparse
import fnmatch
import importlib
import json
import os
import pathlib
import re
import sys
import time
import unittest

#: test-id patterns (fnmatch, "module.Class.method") never run, and why
EXCLUDED = {
    "test_spawn.*": "spawns processes (MPI_Comm_spawn)",
    "test_util_pool.TestProcessPool.*": "spawns processes (MPIPoolExecutor)",
}
#: left out of the wrapped runs only: mpi4py makes objects of its own
#: classes from a handle in C, which no Python subclass can change
WRAPPED_EXCLUDED = {
    "test_objmodel.TestObjModel.testCAPI":
        "wants mpi4py's C API (PyMPIComm_New) to make an object of MPI.COMM_SELF's "
        "class from its handle: mpi4py's Intracomm, not the wrapped subclass",
    **{f"test_comm_topo.TestTopo*.test{kind}": "wants MPI.Comm.fromint/f2py of a "
       "Create_cart/_graph/_dist_graph(_adjacent) result to be of its class: "
       "mpi4py's Cartcomm/..., not the wrapped one"
       for kind in ("Cartcomm", "Graphcomm", "Distgraphcomm", "DistgraphcommAdjacent")},
}
#: what a module calls if --reducing keeps it (the calls the library takes over)
REDUCING = re.compile(r"\b(Allreduce|Iallreduce|Allreduce_init|Reduce_scatter_block|allreduce)\(")
#: left out of --quantized only: their own tolerance is tighter than int8's
QUANTIZED_EXCLUDED = {
}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("testdir")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--plain", action="store_true", help="mpi4py's communicators, unwrapped")
    mode.add_argument("--quantized", action="store_true", help="every float SUM as int8")
    p.add_argument("--modules", help="comma-separated module names (default: all; "
                   "with --reducing: those too)")
    p.add_argument("--skip", default="", help="comma-separated module names not to run")
    p.add_argument("--reducing", action="store_true",
                   help="only the modules that call a reduction the library takes over")
    p.add_argument("--backends", help="comma-separated array backends of the tests' buffers "
                   "(default: all; arrayimpl's names: array, numpy, dlpack-numpy, ...)")
    p.add_argument("--record", help="write failed and skipped test ids here (JSON)")
    p.add_argument("--baseline", help="fail only on failures/skips this record lacks")
    p.add_argument("--times", action="store_true", help="print each module's seconds")
    p.add_argument("-v", dest="verbosity", action="store_const", const=2, default=1)
    p.add_argument("-k", dest="patterns", action="append", default=[],
                   help="run only tests whose id contains this (fnmatch if it has *)")
    return p.parse_args()


args = parse()
if args.quantized:
    os.environ["EQUARX_MPI_MIN_QUANTIZED_BYTES"] = "0"
    os.environ["EQUARX_MPI_ALGORITHM"] = "ring"
sys.path.insert(0, args.testdir)

from mpi4py import MPI  # noqa: E402

import equarx_mpi  # noqa: E402

world = MPI.COMM_WORLD
rank = world.Get_rank()
# mpi4py pickles its constants by name, and pickle checks that the name
# leads back to them: with MPI.COMM_WORLD replaced, it finds them here
COMM_WORLD, COMM_SELF = world, MPI.COMM_SELF
if not args.plain:
    MPI.COMM_WORLD, MPI.COMM_SELF = equarx_mpi.wrap(world), equarx_mpi.wrap(MPI.COMM_SELF)
wrapped = MPI.COMM_WORLD

# arrayimpl (every array backend the tests use) must not see numba
import numba  # noqa: E402

sys.modules["numba"] = None
import arrayimpl  # noqa: E402,F401

sys.modules["numba"] = numba
if args.backends:       # the tests loop over these (arrayimpl.loop)
    arrayimpl.ArrayBackends[:] = [b for b in arrayimpl.ArrayBackends
                                  if b.backend in args.backends.split(",")]

excluded = dict(EXCLUDED)
if not args.plain:
    excluded.update(WRAPPED_EXCLUDED)
if args.quantized:
    excluded.update(QUANTIZED_EXCLUDED)


def wanted(test):
    tid = test.id()
    if any(fnmatch.fnmatchcase(tid, pat) for pat in excluded):
        return False
    return not args.patterns or any(
        fnmatch.fnmatchcase(tid, pat if "*" in pat else f"*{pat}*") for pat in args.patterns)


def flat(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flat(t)
        else:
            yield t


names = sorted(f.stem for f in pathlib.Path(args.testdir).glob("test_*.py"))
if args.modules or args.reducing:       # the union of what they name
    names = [n for n in names if n in (args.modules or "").split(",") or args.reducing
             and REDUCING.search((pathlib.Path(args.testdir) / f"{n}.py").read_text("utf-8"))]
names = [n for n in names if n not in args.skip.split(",")]
suite = unittest.TestSuite()
loader = unittest.TestLoader()
for name in names:
    if f"{name}.*" in excluded:       # whole modules are not even imported
        continue
    suite.addTests(t for t in flat(loader.loadTestsFromModule(importlib.import_module(name)))
                   if wanted(t))


class Result(unittest.TextTestResult):
    """Also the seconds each module took."""
    seconds = {}

    def startTest(self, test):
        self._t0 = time.perf_counter()
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        mod = type(test).__module__
        self.seconds[mod] = self.seconds.get(mod, 0.0) + time.perf_counter() - self._t0


if rank == 0:
    label = "plain" if args.plain else "wrapped, every float SUM quantized" if args.quantized \
        else "wrapped"
    print(f"# mpi4py {sys.modules['mpi4py'].__version__}'s test suite, "
          f"{suite.countTestCases()} tests of {len(names)} modules, {label}, "
          f"{world.Get_size()} rank(s); left out:", file=sys.stderr)
    for why in dict.fromkeys(excluded.values()):
        print(f"#   {', '.join(p for p, w in excluded.items() if w == why)}: {why}",
              file=sys.stderr)
    sys.stderr.flush()
runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=args.verbosity, resultclass=Result)
t0 = time.perf_counter()
result = runner.run(suite)
seconds = time.perf_counter() - t0

failed = sorted({t.id() for t, _ in result.failures + result.errors}
                | {t.id() for t in result.unexpectedSuccesses})
skipped = sorted({t.id() for t, _ in result.skipped})
# what any rank saw, on mpi4py's own COMM_WORLD (the wrapped one may be what broke)
failed = sorted(set().union(*world.allgather(failed)))
skipped = sorted(set().union(*world.allgather(skipped)))
problems = [f"{len(failed)} test(s) failed"] if failed else []
if args.baseline:
    base = json.loads(pathlib.Path(args.baseline).read_text())
    new = sorted(set(failed) - set(base["failed"]))
    newly_skipped = sorted(set(skipped) - set(base["skipped"]))
    problems = [f"failed here, not in the baseline: {t}" for t in new]
    problems += [f"skipped here, run in the baseline: {t}" for t in newly_skipped]
if not args.plain and "test_cco_buf" in names:
    s = wrapped.stats
    if s.calls == 0:
        problems.append("no call went through the wrapped COMM_WORLD")
    if args.quantized and world.Get_size() > 1 and s.quantized_calls == 0:
        problems.append("--quantized, yet no call was quantized")
if rank == 0:
    if args.record:
        pathlib.Path(args.record).write_text(json.dumps({"failed": failed, "skipped": skipped}))
    if args.times:
        for mod, sec in sorted(Result.seconds.items(), key=lambda kv: -kv[1]):
            print(f"# {sec:8.2f} s  {mod}", file=sys.stderr)
    for p in problems:
        print(f"# FAILED: {p}", file=sys.stderr)
calls = "" if args.plain else (f"; {wrapped.stats.calls} reduction calls through the wrapped "
                               f"COMM_WORLD, {wrapped.stats.quantized_calls} quantized")
print(f"[{rank}] {result.testsRun} tests in {seconds:.0f} s, {len(failed)} failed on some rank, "
      f"{len(skipped)} skipped{calls}" + ("; FAILED" if problems else "; OK"), flush=True)
sys.exit(1 if world.allreduce(int(bool(problems))) else 0)
