"""Threads per rank (equarx_mpi/threads.py): the decision with fake
numbers, where the thread count comes from, the one warning a
QuantizedComm gives, and that the examples and the cluster runner start
the ranks' BLAS at one thread.

    pytest -q tests/test_threads.py
"""
import os
import subprocess
import sys
import types
import warnings

import pytest
from mpi4py import MPI

from equarx_mpi import cluster, threads
from equarx_mpi.comm import QuantizedComm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS")


@pytest.fixture
def fresh(monkeypatch):
    """Not yet warned, no silencing variable, no thread variables."""
    monkeypatch.setattr(threads, "_warned", False)
    for name in (threads.ENV,) + THREAD_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("ranks, per_rank, cores, expected", [
    (1, 1, 2, False),
    (2, 1, 2, False),
    (4, 1, 2, False),     # more ranks than cores, one thread each: mpirun's choice
    (1, 2, 2, False),
    (2, 2, 2, True),      # the emulated cluster's shape on one node
    (4, 2, 2, True),
    (1, 4, 2, True),
    (8, 4, 32, False),
    (8, 8, 32, True),
])
def test_decision(ranks, per_rank, cores, expected):
    assert threads.oversubscribed(ranks, per_rank, cores) is expected


def test_env_threads(fresh):
    assert threads._env_threads(THREAD_VARS) is None
    fresh.setenv("OMP_NUM_THREADS", "4,2")          # nested OpenMP: the outer count
    assert threads._env_threads(THREAD_VARS) == (4, "$OMP_NUM_THREADS=4")
    fresh.setenv("OPENBLAS_NUM_THREADS", "3")       # OpenBLAS's own variable first
    assert threads._env_threads(THREAD_VARS)[0] == 3
    fresh.setenv("OPENBLAS_NUM_THREADS", "zero")    # unreadable: the next one
    assert threads._env_threads(THREAD_VARS)[0] == 4


def test_blas_threads_without_threadpoolctl(fresh):
    fresh.setitem(sys.modules, "threadpoolctl", None)     # import fails
    fresh.setenv("OPENBLAS_NUM_THREADS", "3")
    assert threads.blas_threads(16)[0] == 3
    fresh.delenv("OPENBLAS_NUM_THREADS")
    fresh.setattr(threads, "_openblas_numpy", lambda: True)
    assert threads.blas_threads(16) == (16, "OpenBLAS's default, one thread per core")
    fresh.setattr(threads, "_openblas_numpy", lambda: False)
    assert threads.blas_threads(16)[0] == 1


def test_blas_threads_from_threadpoolctl(fresh):
    fake = types.ModuleType("threadpoolctl")
    fake.threadpool_info = lambda: [
        dict(user_api="openmp", internal_api="openmp", num_threads=9),
        dict(user_api="blas", internal_api="openblas", num_threads=5)]
    fresh.setitem(sys.modules, "threadpoolctl", fake)
    fresh.setenv("OPENBLAS_NUM_THREADS", "1")           # threadpoolctl knows better
    n, source = threads.blas_threads(2)
    assert n == 5 and "openblas" in source


def test_numba_threads_only_once_started(fresh):
    numba = types.SimpleNamespace(get_num_threads=lambda: 7)
    parallel = types.SimpleNamespace(_is_initialized=False)
    fresh.setitem(sys.modules, "numba", numba)
    fresh.setitem(sys.modules, "numba.np.ufunc.parallel", parallel)
    assert threads.numba_threads()[0] == 1
    parallel._is_initialized = True
    assert threads.numba_threads()[0] == 7


def _fake_node(monkeypatch, per_rank, cores):
    monkeypatch.setattr(threads, "cores", lambda: cores)
    monkeypatch.setattr(threads, "blas_threads", lambda n: (per_rank, "fake BLAS"))
    monkeypatch.setattr(threads, "numba_threads", lambda: (1, "fake numba"))


def test_warns_once(fresh):
    _fake_node(fresh, per_rank=2, cores=2)
    with pytest.warns(RuntimeWarning, match=r"4 rank\(s\) on this node x 2 threads each "
                                            r"\(fake BLAS\) > 2 cores"):
        assert threads.check(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not threads.check(4)             # once per process


def test_the_librarys_own_threads_count(fresh):
    _fake_node(fresh, per_rank=1, cores=4)
    with pytest.warns(RuntimeWarning, match=r"x 4 threads each \(the library's kernels"):
        assert threads.check(2, kernel_threads=4)


def test_silent_when_within_or_silenced(fresh):
    _fake_node(fresh, per_rank=1, cores=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not threads.check(4)
        _fake_node(fresh, per_rank=2, cores=2)
        fresh.setenv(threads.ENV, "0")
        assert not threads.check(4)


def test_a_failing_probe_never_fails(fresh):
    def broken(n):
        raise OSError("no BLAS here")
    fresh.setattr(threads, "blas_threads", broken)
    assert not threads.check(64)


def test_quantized_comm_warns_on_creation(fresh):
    """The node's first rank checks when a QuantizedComm is made; here one
    rank alone with a fake node of 1 core and 2 threads per rank."""
    _fake_node(fresh, per_rank=2, cores=1)
    with pytest.warns(RuntimeWarning, match="x 2 threads each"):
        qc = QuantizedComm(MPI.COMM_SELF)
    qc.free()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        QuantizedComm(MPI.COMM_SELF).free()


def test_quantized_comm_counts_its_kernel_threads(fresh):
    _fake_node(fresh, per_rank=1, cores=2)
    with pytest.warns(RuntimeWarning, match="threads=3"):
        qc = QuantizedComm(MPI.COMM_SELF, threads=3)
    qc.free()


def test_cluster_gives_ranks_one_thread():
    env = cluster.launch_env({"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"})
    assert env["OPENBLAS_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["NUMBA_NUM_THREADS"] == env["EQUARX_MPI_THREADS"] == "1"
    assert env["OMP_NUM_THREADS"] == "2"         # the user's own value wins
    # the BLAS's variables and the library's own kernel threads
    assert set(cluster.THREAD_ENV) == set(THREAD_VARS) | {"EQUARX_MPI_THREADS"}


@pytest.mark.parametrize("example", ["tp_prefill", "minilm_tp", "dp_digits", "heat_ensemble"])
def test_examples_start_blas_at_one_thread(example):
    """Imported in a fresh process without thread variables, the example
    sets them before numpy loads its BLAS, so the BLAS starts at one thread."""
    pytest.importorskip("threadpoolctl")
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'examples')!r}); "
            f"import {example}, threadpoolctl; "
            "print(max(p['num_threads'] for p in threadpoolctl.threadpool_info() "
            "if p['user_api'] == 'blas'))")
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    if r.returncode and "ModuleNotFoundError" in r.stderr:
        pytest.skip(f"{example} needs the examples extra: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "1"
