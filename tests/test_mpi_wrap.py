"""equarx_mpi.wrap: the drop-in communicator, every buffer form, the
exact-by-default policy, and the environment overrides under mpirun.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_wrap.py

The tests marked mpi run under mpirun; the others (environment overrides,
warmup) start their own mpirun or process.
"""
import array
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import WORLD, allreduce_as, everywhere, raises_everywhere

import equarx_mpi
from equarx_mpi.call.validate import BFLOAT16

mpi = pytest.mark.mpi(min_size=1)
mpi2 = pytest.mark.mpi(min_size=2)
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
N = 3000


def data(n=N, dtype=np.float32, seed=0):
    return np.random.default_rng(seed + RANK).standard_normal(n).astype(dtype)


def bits(a):
    return np.asarray(a).reshape(-1, order="A").view(np.uint8).tobytes()




# --- buffers ------------------------------------------------------------------------

@mpi
def test_every_buffer_form_gives_the_same_bits(w):
    x = data()
    ref = np.empty_like(x)
    w.Allreduce(x, ref)
    quantized = w.last_call.method != "mpi"
    pad = np.zeros(N + 7, np.float32)
    pad[7:] = x
    forms = [
        (array.array("f", x.tobytes()), array.array("f", bytes(4 * N))),
        ([bytearray(x.tobytes()), MPI.FLOAT], [bytearray(4 * N), MPI.FLOAT]),
        (memoryview(x), memoryview(np.empty_like(x))),
        ([x, N, MPI.FLOAT], [np.empty(N + 5, np.float32), N, MPI.FLOAT]),
        ([pad, (N, 7), MPI.FLOAT], [np.empty(N + 3, np.float32), (N, 3), MPI.FLOAT]),
        ([x, "f"], [np.empty(N, np.float32), "f"]),
        (x.reshape(30, 100), np.empty((100, 30), np.float32, order="F")),
        (np.asfortranarray(x.reshape(100, 30, order="F")), np.empty(N, np.float32)),
        # shapes differ between ranks, counts agree (legal MPI)
        (x.reshape((3, 1000) if RANK % 2 else (N,)), np.empty((1000, 3) if RANK % 2 else N,
                                                          np.float32)),
    ]
    bad = []
    for k, (send, recv) in enumerate(forms):
        w.Allreduce(send, recv)
        got = recv
        if isinstance(recv, list):
            buf, spec = recv[0], recv[1]
            start = spec[1] if isinstance(spec, tuple) else 0
            got = np.frombuffer(buf, np.float32)[start:start + N]
        got = np.frombuffer(got, np.float32) if not isinstance(got, np.ndarray) else got
        if bits(got) != bits(ref) or (quantized and w.last_call.method == "mpi"):
            bad.append(k)
    everywhere(not bad, f"buffer forms {bad} give other bits than the numpy array")


@mpi
def test_in_place_none_and_same_buffer(w):
    x = data()
    ref = w.allreduce(x)
    results = []
    for send in (MPI.IN_PLACE, None, "same"):
        y = x.copy()
        w.Allreduce(y if send == "same" else send, [y, MPI.FLOAT])
        results.append(bits(y) == bits(ref))
    m = N - N % P
    rs = np.empty(m // P, np.float32)
    w.Reduce_scatter_block(x[:m], rs)
    y = x[:m].copy()
    w.Reduce_scatter_block(None, y)
    results.append(bits(y[:m // P]) == bits(rs))
    everywhere(all(results), f"in place forms {results}")


# --- lossy only where asked for --------------------------------------------------------

@mpi
def test_exact_by_default():
    c = equarx_mpi.wrap(WORLD, min_quantized_bytes=1 << 14)
    x = data(20000)
    checks = {}
    for name, op, arr in (("max", MPI.MAX, x), ("min", MPI.MIN, x), ("prod", MPI.PROD, x),
                          ("int32 sum", MPI.SUM, (x * 100).astype(np.int32)),
                          ("small sum", MPI.SUM, x[:100])):
        got, ref = np.empty_like(arr), np.empty_like(arr)
        c.Allreduce(arr, got, op)
        WORLD.Allreduce(arr, ref, op)
        checks[name] = bits(got) == bits(ref) and c.last_call.method == "mpi"
    ag, ref = np.empty(P * x.size, np.float32), np.empty(P * x.size, np.float32)
    calls = c.stats.calls
    c.Allgather(x, ag)
    WORLD.Allgather(x, ref)
    checks["allgather"] = bits(ag) == bits(ref) and c.stats.calls == calls   # not even seen
    c.Allreduce(x, ag[:x.size])
    checks["sum quantized"] = c.last_call.method == ("ring" if P > 1 else "mpi")
    c.free()
    everywhere(all(checks.values()), f"exact unless asked: {checks}")


@mpi2
def test_allgather_quantized_when_asked():
    c = equarx_mpi.wrap(WORLD, min_quantized_bytes=0, lossy_allgather=True)
    x = data()
    out = np.empty(P * N, np.float32)
    c.Allgather(x, out)
    ok = c.last_call.call == "Allgather" and c.last_call.wire == "int8"
    ok &= np.allclose(out[RANK * N:(RANK + 1) * N], x, atol=0.05)
    c.free()
    everywhere(ok, "lossy_allgather=True quantizes Allgather")


@mpi
def test_lowercase_allreduce_keeps_mpi4pys_meaning(w):
    x = data()
    arr = w.allreduce(x)
    ok = arr.shape == x.shape and arr.dtype == x.dtype and w.last_call.call == "Allreduce"
    ok &= w.allreduce(RANK) == P * (P - 1) // 2
    ok &= w.allreduce([RANK]) == list(range(P))
    ok &= w.allreduce((RANK, "a"), op=lambda a, b: a if a[0] > b[0] else b) == (P - 1, "a")
    ints = w.allreduce(np.arange(5) + RANK)
    ok &= (ints == P * np.arange(5) + P * (P - 1) // 2).all()
    ok &= w.allreduce(np.float64(1.5)) == 1.5 * P
    everywhere(ok, "allreduce of objects as in mpi4py")


@mpi
def test_bfloat16_and_float16_exact_through_wrap():
    c = equarx_mpi.wrap(WORLD)           # default threshold: small calls are exact
    ok = True
    for dt in (BFLOAT16, np.float16):
        x = np.full(100, 1.5, dt)
        c.Allreduce(MPI.IN_PLACE, x)
        ok &= (x.astype(np.float32) == 1.5 * P).all() and c.last_call.wire is None
    c.free()
    everywhere(ok, "16-bit floats below the threshold")


@mpi2
def test_exact_window_calls_run_the_window():
    # auto, or algorithm="shm", may pick the exact shared window on one
    # node: a wrapped communicator runs it as QuantizedComm does (not MPI
    # under the window's name, with no bound), blocking, nonblocking and
    # persistent
    c = equarx_mpi.wrap(WORLD, algorithm="shm")
    q = equarx_mpi.QuantizedComm(WORLD, algorithm="shm")
    x = data(5000, np.float64)
    ref = np.empty_like(x)
    q.Allreduce(x, ref)
    checks = {}
    for how in ("blocking", "nonblocking", "persistent"):
        got = np.empty_like(x)
        allreduce_as(how, c, x, got)
        info = c.last_call
        checks[how] = (info.method == q.last_call.method and bits(got) == bits(ref)
                       and info.error_bound == q.last_call.error_bound < np.inf)
    c.free()
    q.free()
    everywhere(all(checks.values()), f"the window through wrap: {checks} "
                                     f"(QuantizedComm: {q.last_call.method})")


@mpi2
def test_auto_exact_calls_are_mpis_own_with_a_bound():
    # QuantizedComm's auto may add exactly through the shared window (rank
    # order); a wrapped communicator's exact calls give MPI's own bits, and
    # still a finite bound (it once ran MPI with the window's bound: Inf)
    # (exact_bounds: MPI's own path computes no bound unless asked)
    c = equarx_mpi.wrap(WORLD, algorithm="auto", accuracy="exact", exact_bounds=True)
    q = equarx_mpi.QuantizedComm(WORLD, algorithm="auto", accuracy="exact")
    checks, window = {}, 0
    for n in (1, 1000, 1 << 16, 1 << 20, 1 << 22):     # the window from 32 MiB at 2, 8 ranks
        x = data(n, np.float64)
        got, ref = np.empty_like(x), np.empty_like(x)
        c.Allreduce(x, got)
        WORLD.Allreduce(x, ref)
        q.Allreduce(x, np.empty_like(x))
        window += q.last_call.method == "shm"
        info = c.last_call
        checks[n] = (info.method == "mpi" and bits(got) == bits(ref)
                     and 0 < info.error_bound < np.inf)
    c.free()
    q.free()
    everywhere(all(checks.values()), f"wrapped exact calls: {checks}")
    # the sizes cover the window's: else this test shows nothing
    everywhere(window > 0 or not q.layout.one_node, "QuantizedComm's auto took the window")


# --- errors on every rank ------------------------------------------------------------

@mpi
def test_errors_are_raised_on_every_rank(w):
    x = data()
    raises_everywhere(ValueError, lambda: w.Allreduce(np.ones((20, 20), np.float32)[:, ::2],
                                                      np.empty(200, np.float32)), "contiguous")
    raises_everywhere(TypeError, lambda: w.Allreduce(x, [np.empty_like(x), 2, 3, 4, 5]),
                      "numpy array")
    if P > 1:
        n = N + (RANK == 1)
        raises_everywhere(ValueError, lambda: w.Allreduce(data(n), np.empty(n, np.float32)),
                          "count")
    everywhere(bits(w.allreduce(x)) == bits(w.allreduce(x)), "usable after errors")


# --- what happened ---------------------------------------------------------------------

@mpi2
def test_last_call_and_stats(w):
    before = w.stats
    x = data(1 << 16)
    w.Allreduce(MPI.IN_PLACE, x)
    info, s = w.last_call, w.stats
    full = 2 * (P - 1) * x.nbytes // P
    ok = info.method == "ring" and 0 < info.bytes_sent < full / 3 and info.seconds > 0
    ok &= s.calls == before.calls + 1 and s.quantized_calls == before.quantized_calls + 1
    ok &= s.bytes_uncompressed - before.bytes_uncompressed == full
    ok &= s.bytes_sent - before.bytes_sent == info.bytes_sent
    everywhere(ok, f"last_call {info} and stats {s}")


@mpi2
def test_mpis_own_requests_are_recorded_in_the_order_made():
    x, y = data(1000), np.empty(1000, np.float32)
    c = equarx_mpi.wrap(WORLD, algorithm="ring")     # 4 KB: below the threshold, exact
    c.Allreduce(x, y, MPI.MAX)                        # bound 0
    # an exact float SUM through MPI's own persistent request: each Start
    # is a call, whose values come later (bound Inf, docs/ERROR.md)
    req = c.Allreduce_init(x, y, MPI.SUM)
    for _ in range(2):
        req.Start()
        req.Wait()
    persistent = (c.last_call.method == "mpi" and c.last_call.error_bound == np.inf
                  and c.stats.calls == 3)
    req.Free()
    c.free()
    c = equarx_mpi.wrap(WORLD, algorithm="ring", min_quantized_bytes=0)
    # a quantized Iallreduce queued, then MPI's own: last_call is the last
    # one made once both finish (MPI's had been recorded first, then
    # overwritten by the queued one)
    big = data(1 << 18)
    r1 = c.Iallreduce(big, np.empty_like(big))
    r2 = c.Iallreduce(x, y, MPI.MAX)
    MPI.Request.Waitall([r1, r2])
    c.Iallreduce(big, np.empty_like(big)).Wait()     # the queue is empty again
    ordered = c.last_call.method == "ring"
    r1 = c.Iallreduce(big, np.empty_like(big))
    r2 = c.Iallreduce(x, y, MPI.MAX)
    MPI.Request.Waitall([r1, r2])
    ordered &= c.last_call.method == "mpi" and c.last_call.error_bound == 0.0
    c.free()
    everywhere(persistent and ordered, f"persistent {persistent}, in order {ordered}")


# --- the README's example ---------------------------------------------------------------

@mpi
def test_port_example():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "examples"))
    import port_mpi4py as ex
    a, b = ex.problem(RANK, 20000)
    best = ex.exact_answer(WORLD, a, b)
    w0, loss0, bad0 = ex.train(WORLD, a, b, 20)
    c = equarx_mpi.wrap(WORLD, min_quantized_bytes=0)
    w1, loss1, bad1 = ex.train(c, a, b, 20)
    s = c.stats
    c.free()
    err0 = np.linalg.norm(w0 - best) / np.linalg.norm(best)
    err1 = np.linalg.norm(w1 - best) / np.linalg.norm(best)
    ok = s.calls == 21 and s.quantized_calls == (20 if P > 1 else 0)
    ok &= err1 < max(10 * err0, 0.02) and abs(loss1 - loss0) <= 1e-3 * loss0
    ok &= isinstance(loss1, float) and bad0 == bad1 == 0
    everywhere(ok, f"example: stats {s}, error {err0:.2e} -> {err1:.2e}")
    ex.main(["--size", "64K", "--steps", "3"])               # the command line runs


# --- the environment, under mpirun (serial tests: each starts its own mpirun) ---------

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
PROBE = r"""
import json, sys
import numpy as np
from mpi4py import MPI
import equarx_mpi
w = equarx_mpi.wrap(MPI.COMM_WORLD, **json.loads(sys.argv[1]))
x = np.ones(1000, np.float32)
w.Allreduce(MPI.IN_PLACE, x)
out = dict(sum=w.last_call._replace(seconds=0)._asdict(), value=float(x[0]))
w.Allgather(x[:10], np.empty(20, np.float32))
out["allgather"] = w.last_call.call
print(json.dumps(out), flush=True)
"""


def probe(env, code_opts=None):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", **env)
    r = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-c", PROBE,
                        json.dumps(code_opts or {})], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(s) for s in r.stdout.splitlines() if s.startswith("{")]
    assert len(lines) == 2 and lines[0] == lines[1], r.stdout
    return lines[0], r.stderr


def test_environment_overrides_under_mpirun():
    got, _ = probe({})
    assert got["sum"]["method"] == "mpi" and got["value"] == 2     # below the threshold
    got, _ = probe({"EQUARX_MPI_MIN_QUANTIZED_BYTES": "0"})
    assert got["sum"]["method"] == "ring" and got["sum"]["wire"] == "int8"
    got, _ = probe({"EQUARX_MPI_MIN_QUANTIZED_BYTES": "0", "EQUARX_MPI_WIRE": "bf16"})
    assert got["sum"]["wire"] == "bf16"
    got, _ = probe({"EQUARX_MPI_WIRE": "bf16"}, {"wire": "int8", "min_quantized_bytes": 0})
    assert got["sum"]["wire"] == "int8"                              # code wins
    got, _ = probe({"EQUARX_MPI_DISABLE": "1"}, {"min_quantized_bytes": 0})
    assert got["sum"]["method"] == "mpi" and "DISABLE" in got["sum"]["reason"]
    got, err = probe({"EQUARX_MPI_LOG": "1", "EQUARX_MPI_LOSSY_ALLGATHER": "1",
                      "EQUARX_MPI_MIN_QUANTIZED_BYTES": "0"})
    assert got["allgather"] == "Allgather"                          # went through the policy
    logged = [s for s in err.splitlines() if s.startswith("equarx_mpi: ")]
    assert len(logged) == 2 and "Allreduce 4000 B float32 SUM -> ring/int8" in logged[0], err


def test_warmup_fills_the_cache_and_names_it():
    # A standalone process, as after an install: a child that inherits this
    # rank's Open MPI/PMIx identity joins our job and corrupts its shared
    # memory (a later collective of this rank crashed).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_")) or "ALLOW_RUN_AS_ROOT" in k}
    run = [sys.executable, "-m", "equarx_mpi.warmup", "-q"]
    subprocess.run(run, env=env, check=True, capture_output=True, timeout=600)
    out = subprocess.run(run, env=env, check=True, capture_output=True, text=True,
                         timeout=600).stdout
    assert "# 0 kernel signatures compiled" in out, out
    paths = [s.split(": ", 1)[1] for s in out.splitlines() if s.startswith("# cache: ")]
    assert paths and all(os.path.isdir(p) for p in paths), out


def test_module_names_stay_callable():
    # importing a submodule sets the package attribute to the module: wrap's
    # module has its own name; warmup's module (python -m) calls its function
    import importlib
    importlib.import_module("equarx_mpi.wrapping")
    assert callable(equarx_mpi.wrap) and equarx_mpi.wrap.__name__ == "wrap"
    mod = importlib.import_module("equarx_mpi.warmup")
    assert callable(equarx_mpi.warmup) and callable(mod) and mod.warmup.__name__ == "warmup"


def test_bench_overlap_runs():
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    r = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "equarx_mpi.bench",
                        "--overlap", "-b", "64K", "-e", "64K", "-m", "mpi,int8-raw",
                        "-w", "1", "-n", "2", "-q"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [s.split() for s in r.stdout.splitlines() if s.strip() and not s.startswith("#")]
    assert [row[3] for row in rows] == ["mpi", "int8-raw"] and rows[1][4] == "ring/int8", r.stdout
    assert "hidden: median" in r.stdout
