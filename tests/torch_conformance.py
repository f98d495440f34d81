"""torch's own distributed tests through the "equarx" backend, under mpirun.

    mpirun -n 2 python tests/torch_conformance.py --backend equarx
        [--record FILE | --baseline FILE] [-k PATTERN]... [--list] [--timeout S]
        [--accepted FILE]

The tests are those of the installed torch wheel,
``torch/testing/_internal/distributed/distributed_test.py``: the class
``DistributedTest._DistTestBase`` that torch's ``test_distributed_spawn.py``
drives with the environment variable BACKEND.  That driver accepts only
gloo, nccl and ucc, and its children (multiprocessing spawn) are no MPI
job.  Here each MPI rank is one of its test processes instead: BACKEND,
WORLD_SIZE (MPI's) and TEMP_DIR, the variables that driver requires, and
INIT_METHOD (file://) are set before the module loads (the module reads
BACKEND and INIT_METHOD then, its decorators WORLD_SIZE); every selected
test method runs,
in the same order on every rank, in a ``unittest`` case made of
``_DistTestBase`` and torch's ``TestCase`` (what ``TestDistBackend``
gives it: ``rank``, ``world_size``, ``file_name``, ``init_method``) with
its own ``dist.init_process_group(backend, init_method="file://...",
rank, world_size, timeout)`` (torch's per-test timeouts,
``CUSTOM_PG_TIMEOUT``) and ``destroy_process_group()`` after it.  Rank 0
makes a directory for the run and broadcasts its path; each test gets its
own directory in it (TEMP_DIR: the ``barrier``, ``test_dir`` and
``init_dir`` the tests' ``_barrier`` and file checks use; a fresh store
file).  Skips are honoured: the decorators' (``unittest`` attributes),
``SkipTest``, and torch's skip exit codes (``skip_if_lt_x_gpu`` and
friends call ``sys.exit(TEST_SKIPS[...].exit_code)`` in a test process)
count as skipped.  A test fails if it fails on any rank (the first lines
of each rank's error are printed); it is skipped if it passed on some
ranks and was skipped on others.  The ranks exchange their results after
each test over MPI (which keeps them in step), then destroy the test's
groups.  What a test sets in os.environ is undone after it (each test had
a process of its own: ``with_dist_debug_levels`` leaves
TORCH_DISTRIBUTED_DEBUG at its last level).  A watchdog thread gives
each test ``--timeout`` seconds (setup, test, teardown, the exchange):
past that it prints which test hung and every thread's stack, and calls
``MPI.COMM_WORLD.Abort``.

Tests skipped only by a backend's name are forced where they apply to a
CPU backend, by two means, both set up before distributed_test loads
(its decorators read them when the class body runs):

* torch's declaration point for backends, ``DistTestCases.backend_feature``:
  the backend under test is added to its "ddp", "subgroup" and "plugin"
  sets (DistributedDataParallel; ``new_group`` subgroups;
  ``require_backend_is_available`` then finds it available) -- not to
  "gpu", "cuda" or any device feature;
* FORCED below: torch's skip reasons that name backends but test a CPU
  feature.  ``skip_but_pass_in_sandcastle_if`` and
  ``skip_but_pass_in_sandcastle`` (which set ``__unittest_skip__`` on the
  test function) are wrapped so that a decorator whose reason matches
  FORCED leaves the function as it is; every other decorator of the same
  test (world size, file:// only, GPU counts) still applies.  The forced
  tests are listed with ``--list``.  They apply to gloo's baseline run too
  where its name is not in the reason (all_to_all: "Only MPI supports").

A test body that branches on BACKEND naming the CPU backends
(``if BACKEND == "mpi" or BACKEND == "gloo"``: build the CPU model) runs
with the module's BACKEND reading "gloo" (CPU_BRANCH_TESTS); the process
group stays the backend under test.

The selection (select()): every test of the class but those named for
CUDA/NCCL/GPUs (GPU_NAMES): collectives, reduce/scatter/gather/
all_to_all/p2p, groups and barriers, objects, DDP on CPU, model
averaging.  ``-k`` narrows it (a substring, or an fnmatch pattern).  At 2
ranks torch itself skips the ``*_group`` tests (a group of ranks 1 and 2;
``skip_if_small_worldsize`` below 8 ranks but for MPI) and most DDP tests
(``skip_if_lt_x_gpu(2)``), for gloo as for any backend.

Accepted exceptions and temporary exclusions: tests/torch_conformance.txt
(or --accepted FILE): ``PATTERN  # reason`` per line, fnmatch patterns of
test names; ``exclude BACKEND PATTERN  # reason``: those tests do not run
at all on that backend (only for tests that hang, each marked TEMPORARY
with its cause, printed at the start of the run).  Judgement:
with ``--baseline FILE`` (a ``--record`` of the gloo run of the same
selection) the run fails on a failure outside the baseline's failures and
the accepted exceptions; without it, on a failure outside the accepted
exceptions.  An accepted entry that matched tests which all ran and
passed is stale and fails the run too; so does a run where no test ran.
``--record FILE`` writes this run's results (JSON) and judges nothing but
"no test ran" (a baseline run).  Exit status 1 on every rank on failure.

The last line of rank 0's output: ``N passed, M failed, K skipped`` where
M counts the failures that fail the run; failures excused by the baseline
or an accepted exception are counted on the line before.
"""
import argparse
import faulthandler
import fnmatch
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import unittest

HERE = pathlib.Path(__file__).resolve().parent
ACCEPTED_FILE = HERE / "torch_conformance.txt"

#: torch's skip reasons that name backends but guard a feature any CPU
#: backend can have, and why each applies (regex over the reason)
FORCED = {
    r"Test requires backend \S+ to be one of \{[^}]*'gloo'[^}]*\}":
        "require_backend_is_available(...) of a set with gloo: CPU tests "
        "(all_reduce_coalesced, objects, DDP, monitored_barrier)",
    r"Only gloo backend supports timeouts": "barrier timeouts of init_process_group/new_group",
    r"GLOO Batch Send Recv CPU": "batch_isend_irecv of CPU tensors",
    r"Only Gloo backend supports sparse all reduce": "all_reduce of a sparse CPU tensor",
    r"get_future is only supported on mpi, nccl and gloo": "Work.get_future(); DDP's no_sync on CPU",
    r"Only Nccl & Gloo backend support DistributedDataParallel": "DistributedDataParallel",
    r"Only MPI supports (CPU )?all_to_all": "all_to_all and all_to_all_single of CPU tensors",
}
#: test names left out: they need CUDA/NCCL/GPUs (their decorators would
#: mostly skip them too)
GPU_NAMES = re.compile(r"cuda|nccl|gpu", re.IGNORECASE)
#: tests whose body picks its CPU model with ``BACKEND == "mpi" or
#: BACKEND == "gloo"`` (_test_accumulate_gradients_no_sync): BACKEND reads
#: "gloo" in the module while they run
CPU_BRANCH_TESTS = {
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", required=True, help="equarx, or gloo for the baseline")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--record", metavar="FILE", help="write this run's results (JSON)")
    g.add_argument("--baseline", metavar="FILE", help="a --record of the gloo run")
    p.add_argument("-k", action="append", default=[], metavar="PATTERN",
                   help="only tests whose name contains PATTERN (or fnmatch it); repeatable")
    p.add_argument("--list", action="store_true", help="print the selection and exit")
    p.add_argument("--timeout", type=float, default=float(os.environ.get(
        "TORCH_CONFORMANCE_TIMEOUT", 90)), help="seconds a test may take (default 90)")
    p.add_argument("--accepted", default=str(ACCEPTED_FILE), metavar="FILE",
                   help="accepted exceptions and exclusions (default tests/torch_conformance.txt)")
    return p.parse_args(argv)


args = parse_args(sys.argv[1:])
# torch.testing's common_utils parses sys.argv when it loads
sys.argv = sys.argv[:1]

from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD
RANK, SIZE = world.Get_rank(), world.Get_size()
BACKEND = args.backend

# the run's directory: made by rank 0, its path broadcast
RUN_DIR = world.bcast(tempfile.mkdtemp(prefix="torch_conformance.") if RANK == 0 else None)

# what test_distributed_spawn.py requires, and the file:// init method
os.environ["BACKEND"] = BACKEND
os.environ["WORLD_SIZE"] = str(SIZE)
os.environ["TEMP_DIR"] = RUN_DIR
os.environ["INIT_METHOD"] = "file://" + os.path.join(RUN_DIR, "shared_init_file")
# no "To execute this test, run ..." after each failure (a python command line
# for test_distributed_spawn.py that does not apply here)
os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")   # as TestDistBackend.setUpClass

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if BACKEND == "equarx":
    import equarx_mpi.torch  # noqa: E402,F401  (registers "equarx")

import torch.testing._internal.common_utils as common_utils  # noqa: E402
from torch.testing._internal.common_distributed import (  # noqa: E402
    TEST_SKIPS,
    DistTestCases,
)

# --- forcing the skips by backend name (module docstring) --------------------
for _feature in ("ddp", "subgroup", "plugin"):
    DistTestCases.backend_feature[_feature].add(BACKEND)
FORCED_RE = [(re.compile(r), why) for r, why in FORCED.items()]
forced = {}                     # test name -> torch's reason, lifted
_skip_if, _skip = common_utils.skip_but_pass_in_sandcastle_if, common_utils.skip_but_pass_in_sandcastle


def _forced(reason):
    return next((why for r, why in FORCED_RE if r.search(str(reason))), None)


def _skip_if_unless_forced(condition, reason):
    decorate = _skip_if(condition, reason)

    def decorator(func):
        if condition and _forced(reason):
            forced[func.__name__] = reason
            return func
        return decorate(func)
    return decorator


def _skip_unless_forced(reason):
    decorate = _skip(reason)

    def decorator(func):
        if _forced(reason):
            forced[func.__name__] = reason
            return func
        return decorate(func)
    return decorator


common_utils.skip_but_pass_in_sandcastle_if = _skip_if_unless_forced
common_utils.skip_but_pass_in_sandcastle = _skip_unless_forced
try:
    import torch.testing._internal.distributed.distributed_test as dt  # noqa: E402
finally:
    common_utils.skip_but_pass_in_sandcastle_if = _skip_if
    common_utils.skip_but_pass_in_sandcastle = _skip

SKIP_CODES = {s.exit_code: s.message for s in TEST_SKIPS.values()}


class Case(dt.DistributedTest._DistTestBase, common_utils.TestCase):
    """One test method in this rank: what TestDistBackend gives the tests,
    without MultiProcessTestCase's spawn."""

    def __init__(self, name, test_dir):
        super().__init__(name)
        self.rank = RANK
        self.file_name = os.path.join(test_dir, "store")

    @property
    def world_size(self):       # a string, as TestDistBackend's
        return os.environ["WORLD_SIZE"]

    @property
    def init_method(self):
        return f"{common_utils.FILE_SCHEMA}{self.file_name}"

    @property
    def destroy_pg_upon_exit(self):
        return False

    def setUp(self):
        super().setUp()
        dt.Barrier.barrier_id = 0
        name = self._testMethodName
        dist.init_process_group(
            backend=BACKEND, init_method=self.init_method, world_size=SIZE, rank=RANK,
            timeout=dt.timedelta(seconds=dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout)))
        # every rank initialized before the test starts, as TestDistBackend
        # does it (the tests' file barrier: a rank whose init failed makes it
        # time out in 10 s instead of leaving its peers in an MPI call)
        self._barrier()


class Result(unittest.TestResult):
    """This rank's outcome of one test: ("pass"|"fail"|"skip", message)."""

    def __init__(self):
        super().__init__()
        self.outcome = None

    def _set(self, status, msg):
        # the first failure wins (a test's error, then its tearDown's)
        if self.outcome is None or self.outcome[0] != "fail":
            self.outcome = (status, msg)

    def addSuccess(self, test):
        if self.outcome is None:
            self.outcome = ("pass", "")

    def addSkip(self, test, reason):
        self._set("skip", str(reason))

    def _error(self, exc_info):
        exc = exc_info[1]
        if isinstance(exc, SystemExit) and exc.code in SKIP_CODES:
            self._set("skip", SKIP_CODES[exc.code])
        else:
            self._set("fail", "\n".join(first_lines(exc_info)))

    def addError(self, test, err):
        self._error(err)

    def addFailure(self, test, err):
        self._error(err)

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._error(err)

    def addExpectedFailure(self, test, err):
        if self.outcome is None:
            self.outcome = ("pass", "")

    def addUnexpectedSuccess(self, test):
        self._set("fail", "unexpected success of a test marked expectedFailure")


# --- the watchdog --------------------------------------------------------------
class Watchdog(threading.Thread):
    """Aborts the job when a test runs past its time.  A rank whose test
    has finished (waiting for its peers in the exchange) waits GRACE more
    seconds, so that the rank still inside the test prints its stacks."""

    GRACE = 5.0

    def __init__(self):
        super().__init__(daemon=True)
        self.lock = threading.Lock()
        self.current = None         # (name, deadline, seconds)

    def arm(self, name, seconds):
        with self.lock:
            self.current = (name, time.monotonic() + seconds, seconds)

    def finished(self):
        """This rank's part of the test is done: only the exchange is left."""
        with self.lock:
            if self.current is not None:
                name, deadline, seconds = self.current
                self.current = (name, deadline + self.GRACE, seconds)

    def disarm(self):
        with self.lock:
            self.current = None

    def run(self):
        while True:
            time.sleep(0.5)
            with self.lock:
                cur = self.current
            if cur is not None and time.monotonic() > cur[1]:
                print(f"\nTIMEOUT: {cur[0]} ran past {cur[2]:.0f}s on rank {RANK} "
                      f"(backend {BACKEND}): aborting the job; every thread's stack:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                print(f"TIMEOUT: {cur[0]} hung (rank {RANK}, {cur[2]:.0f}s)", flush=True)
                world.Abort(1)


# --- selection and the list of accepted exceptions ---------------------------------
def all_tests():
    base = dt.DistributedTest._DistTestBase
    return sorted(n for n in dir(base) if n.startswith("test") and callable(getattr(base, n)))


def _match(pattern, name):
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def load_accepted(path):
    """({pattern: why}, {pattern: why} of the excluded) for this backend."""
    accepted, excluded = {}, {}
    for line in pathlib.Path(path).read_text().splitlines():
        entry, _, why = line.partition("#")
        entry = entry.split()
        if not entry:
            continue
        if entry[0] == "exclude":
            # exclude BACKEND PATTERN: not run on that backend
            if len(entry) != 3:
                sys.exit(f"{path}: 'exclude BACKEND PATTERN  # why', not {line!r}")
            if entry[1] == BACKEND:
                excluded[entry[2]] = why.strip()
        elif len(entry) == 1:
            accepted[entry[0]] = why.strip()
        else:
            sys.exit(f"{path}: 'PATTERN  # why', not {line!r}")
    return accepted, excluded


def select(names, excluded):
    chosen, left_out = [], {}
    for n in names:
        if GPU_NAMES.search(n):
            continue
        if args.k and not any(_match(p, n) for p in args.k):
            continue
        why = next((w for p, w in excluded.items() if fnmatch.fnmatchcase(n, p)), None)
        if why is not None:
            left_out[n] = why
            continue
        chosen.append(n)
    return chosen, left_out


def decorator_skip(name):
    f = getattr(dt.DistributedTest._DistTestBase, name)
    return getattr(f, "__unittest_skip_why__", "") if getattr(f, "__unittest_skip__", False) else None


def first_lines(exc_info):
    """The exception and where in the test it was raised: a few lines."""
    etype, exc, tb = exc_info
    frames = traceback.extract_tb(tb)
    # the innermost frame of torch's test file, and the innermost of all
    inner = [f for f in frames if f.filename.endswith("distributed_test.py")][-1:] + frames[-1:]
    where = []
    for f in inner:
        loc = f"at {os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
        if loc not in where:
            where.append(loc)
    what = "".join(traceback.format_exception_only(etype, exc)).strip().splitlines()
    if len(what) > 4:
        what = what[:4] + ["..."]
    return what + where


def run_one(name, idx, dog):
    test_dir = os.path.join(RUN_DIR, f"{idx:03d}")
    if RANK == 0:
        for d in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(test_dir, d))
    world.Barrier()
    os.environ["TEMP_DIR"] = test_dir
    os.environ["INIT_METHOD"] = "file://" + os.path.join(test_dir, "init_dir", "shared_init_file")
    dt.INIT_METHOD = os.environ["INIT_METHOD"]
    dt.BACKEND = "gloo" if name in CPU_BRANCH_TESTS else BACKEND
    result = Result()
    t0 = time.monotonic()
    dog.arm(name, args.timeout)
    env = dict(os.environ)
    try:
        Case(name, test_dir).run(result)
    except Exception:               # noqa: BLE001 - outside the test's own run: reported
        result._set("fail", "the driver: " + traceback.format_exc(limit=-3))
    finally:
        dt.BACKEND = BACKEND
        # each test in a process of its own under torch's driver: what one
        # sets in the environment (with_dist_debug_levels leaves
        # TORCH_DISTRIBUTED_DEBUG at its last level) must not reach the next
        os.environ.clear()
        os.environ.update(env)
        dist.set_debug_level_from_env()
    dog.finished()
    # every rank done before any destroys its groups (TestDistBackend: a
    # _barrier): a peer's closed connections would end a test's own wait
    # (test_barrier_timeout_*) early
    outcome = result.outcome or ("fail", "no outcome recorded")
    outcomes = world.allgather(outcome)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:          # noqa: BLE001 - reported, the run goes on
        outcome = ("fail", f"destroy_process_group() after the test raised: {e!r}")
    # a destroy's failure on any rank fails the test
    destroyed = world.allgather(outcome)
    if any(s == "fail" for s, _ in destroyed) and not any(s == "fail" for s, _ in outcomes):
        outcomes = destroyed
    dog.disarm()
    if RANK == 0:
        shutil.rmtree(test_dir, ignore_errors=True)
    return outcomes, time.monotonic() - t0


def combine(outcomes):
    statuses = [s for s, _ in outcomes]
    if "fail" in statuses:
        return "fail"
    if "skip" in statuses:
        return "skip"
    return "pass"


def main():
    accepted, excluded = load_accepted(args.accepted)
    chosen, left_out = select(all_tests(), excluded)
    if args.list:
        if RANK == 0:
            for n in chosen:
                why = decorator_skip(n)
                tag = ("skip: " + why) if why is not None else (
                    "forced: " + forced[n] if n in forced else "")
                print(f"{n}  {tag}".rstrip())
            for n, why in left_out.items():
                print(f"{n}  EXCLUDED: {why}")
            print(f"{len(chosen)} selected, {len(left_out)} excluded, "
                  f"{sum(n in forced for n in chosen)} forced")
            shutil.rmtree(RUN_DIR, ignore_errors=True)
        return 0

    dog = Watchdog()
    dog.start()
    t_start = time.monotonic()
    results = {}                # name -> (status, [per-rank outcome], seconds)
    if RANK == 0:
        print(f"# torch {torch.__version__}'s distributed_test.py, backend {BACKEND}, "
              f"{SIZE} ranks: {len(chosen)} tests ({sum(n in forced for n in chosen)} forced), "
              f"{len(left_out)} excluded", flush=True)
        for n, why in left_out.items():
            print(f"EXCLUDED {n}: {why}", flush=True)
    for idx, name in enumerate(chosen):
        outcomes, secs = run_one(name, idx, dog)
        status = combine(outcomes)
        results[name] = (status, outcomes, secs)
        if RANK == 0:
            tag = " (forced)" if name in forced else ""
            line = f"{status.upper():4} {name}{tag} {secs:.1f}s"
            if status == "skip":
                line += ": " + next(m for s, m in outcomes if s == "skip").splitlines()[0][:100]
            print(line, flush=True)
            if status == "fail":
                for r, (s, m) in enumerate(outcomes):
                    if s == "fail":
                        for ln in m.splitlines():
                            print(f"    [rank {r}] {ln}", flush=True)
    wall = time.monotonic() - t_start

    failed = {n for n, (s, _, _) in results.items() if s == "fail"}
    passed = {n for n, (s, _, _) in results.items() if s == "pass"}
    skipped = {n for n, (s, _, _) in results.items() if s == "skip"}
    problems = []
    if not (passed or failed):
        problems.append("no test ran" + (" (every selected test was skipped)" if skipped else ""))
    baseline = set()
    if args.baseline:
        bfile = pathlib.Path(args.baseline)
        if not bfile.exists():
            problems.append(f"no baseline file {bfile}")
        else:
            baseline = set(json.loads(bfile.read_text())["failed"])

    def accepted_by(n):
        return next((p for p in accepted if fnmatch.fnmatchcase(n, p)), None)

    excused_baseline = failed & baseline if args.baseline else set()
    excused_accepted = set() if args.record else {
        n for n in failed - excused_baseline if accepted_by(n)}
    if args.record:
        new = set()
    else:
        new = failed - excused_baseline - excused_accepted
        problems += [f"fails on {BACKEND}" + (" and not on the baseline" if args.baseline else "")
                     + f", not an accepted exception: {n}" for n in sorted(new)]
        for p in accepted:
            hits = [n for n in results if fnmatch.fnmatchcase(n, p)]
            if hits and all(n in passed for n in hits):
                problems.append(f"stale entry of {pathlib.Path(args.accepted).name} "
                                f"(every test it matches passes): {p}")

    if RANK == 0:
        if args.record:
            out = pathlib.Path(args.record)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({
                "backend": BACKEND, "ranks": SIZE, "torch": torch.__version__,
                "failed": sorted(failed), "passed": sorted(passed), "skipped": sorted(skipped),
                "errors": {n: [m for s, m in results[n][1] if s == "fail"][0][-2000:]
                           for n in sorted(failed)},
                "seconds": round(wall, 1)}, indent=1))
        print(f"\n# summary: backend {BACKEND}, {SIZE} ranks, {wall:.1f}s of tests")
        slow = sorted(results.items(), key=lambda kv: -kv[1][2])[:8]
        print("# slowest: " + ", ".join(f"{n} {v[2]:.1f}s" for n, v in slow))
        if excused_baseline:
            print(f"# {len(excused_baseline)} failure(s) gloo's baseline has too: "
                  + ", ".join(sorted(excused_baseline)))
        if excused_accepted:
            print(f"# {len(excused_accepted)} accepted exception(s): " + ", ".join(
                f"{n} ({accepted[accepted_by(n)]})" for n in sorted(excused_accepted)))
        if args.record and failed:
            print(f"# recorded as the baseline, {len(failed)} failure(s): " + ", ".join(sorted(failed)))
        for p in problems:
            print(f"FAILED: {p}")
        for n in sorted(new):
            print(f"# {n}:")
            for r, (st, m) in enumerate(results[n][1]):
                if st == "fail":
                    for ln in m.splitlines():
                        print(f"    [rank {r}] {ln}")
        print(f"# {len(excused_baseline) + len(excused_accepted) + (len(failed) if args.record else 0)}"
              f" failure(s) excused (baseline, accepted exceptions, or recorded), not counted below")
        print(f"{len(passed)} passed, {len(new)} failed, {len(skipped)} skipped", flush=True)
        shutil.rmtree(RUN_DIR, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
