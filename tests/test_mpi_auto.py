"""algorithm="auto" under MPI: every rank takes the same method whatever
profile it would find itself, auto's result is bitwise the chosen method's,
accuracy="exact" is MPI's (or the exact shared window's) result, and
last_call says what ran and why.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_auto.py
"""
import json
import os
import tempfile
from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere
from reference import BF16

from equarx_mpi import QuantizedComm
from equarx_mpi.call import policy
from equarx_mpi.collectives import exact
from equarx_mpi.model import profiles

WORLD = MPI.COMM_WORLD
SIZES = [16, 4 << 10, 48 << 10, 256 << 10, 1 << 20, 3 << 20]     # bytes per rank
LOSSY = ("ring", "two_shot", "rabenseifner", "hierarchical")


@contextmanager
def profile_env(value):
    """EQUARX_MPI_PROFILE=value on this rank only (None: unset) for a while."""
    old = os.environ.get(profiles.ENV)
    if value is None:
        os.environ.pop(profiles.ENV, None)
    else:
        os.environ[profiles.ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(profiles.ENV, None)
        else:
            os.environ[profiles.ENV] = old


def data(nbytes, dtype=np.float32, seed=0):
    n = max(1, nbytes // np.dtype(dtype).itemsize)
    return np.random.default_rng([seed, WORLD.Get_rank()]).standard_normal(n).astype(dtype)


def same_everywhere(value, what):
    everyone = WORLD.allgather(value)
    assert all(v == everyone[0] for v in everyone), f"{what} differs: {everyone}"


def reference(method, x, op=MPI.SUM):
    """The result of ``method`` run by name on x."""
    y = np.empty_like(x)
    if method in ("mpi", "copy"):
        exact.collective(WORLD, "Allreduce", x, y, op)
        return y
    with QuantizedComm(WORLD, algorithm=method, min_quantized_bytes=0) as qc:
        qc.Allreduce(x, y, op=op)
        assert qc.last_call.method == method, qc.last_call
    return y


def bitwise(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.mpi
def test_ranks_decide_with_rank_0s_profile():
    """Rank 1 names a profile that says the ring is nearly free, rank 2 a
    missing file, the others none: all decide with rank 0's (built-in)."""
    rank = WORLD.Get_rank()
    fast = profiles.builtin()
    for lay in fast["layouts"].values():
        if "ring" in lay.get("times", {}):
            lay["times"]["ring"] = [1e-9 for _ in lay["times"]["ring"]]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "fast.json")
        with open(path, "w") as f:
            json.dump(fast, f)
        mine = {0: "builtin", 1: path, 2: "/nonexistent/profile.json"}.get(rank)
        with profile_env(mine):
            qc = QuantizedComm(WORLD, algorithm="auto")
    with qc:
        same_everywhere(qc.profile_source, "profile source")
        assert qc.profile_source == "builtin"
        dec = [qc._choose("Allreduce", "sum", np.dtype(dt), n)
               for n in SIZES + [64 << 20, 1 << 30] for dt in (np.float32, np.float64, BF16)]
        same_everywhere(dec, "decisions")
        for n in SIZES:
            x = data(n)
            y = np.empty_like(x)
            qc.Allreduce(x, y)        # check=True: the ranks agree on the method
            same_everywhere((qc.last_call.method, qc.last_call.reason), "method")


@pytest.mark.mpi
def test_a_bad_profile_on_rank_0_raises_everywhere():
    mine = "/nonexistent/profile.json" if WORLD.Get_rank() == 0 else None
    with profile_env(mine):
        raises_everywhere(ValueError, lambda: QuantizedComm(WORLD), match=profiles.ENV)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
def test_auto_is_bitwise_the_method_it_picked(dtype):
    picked = set()
    with QuantizedComm(WORLD, algorithm="auto") as qc:
        for n in SIZES:
            x = data(n, dtype, seed=n)
            y = np.empty_like(x)
            qc.Allreduce(x, y)
            last = qc.last_call
            picked.add(last.method)
            same_everywhere(last.method, "method")
            everywhere(bitwise(y, reference(last.method, x)),
                       f"{n} B {np.dtype(dtype).name}: auto ({last.method}) against it by name")
            everywhere(last.method in policy.EXACT or last.reason.startswith("auto: "),
                       f"reason {last.reason!r}")
    everywhere(picked <= set(policy.EXACT + LOSSY), f"methods {picked}")


@pytest.mark.mpi
@pytest.mark.parametrize("op", [MPI.SUM, MPI.MAX, MPI.MIN])
def test_accuracy_exact_is_exact(op):
    with QuantizedComm(WORLD, algorithm="auto", accuracy="exact") as qc:
        for n in SIZES + [8 << 20]:
            for dtype in (np.float32, np.float64):
                x = data(n, dtype, seed=7)
                y = np.empty_like(x)
                qc.Allreduce(x, y, op=op)
                m = qc.last_call.method
                everywhere(m in policy.EXACT and qc.last_call.exact_values == 0, f"method {m}")
                want = np.empty_like(x)
                WORLD.Allreduce(x, want, op=op)
                if m == "shm" and op is MPI.SUM:
                    # exact, in the fixed order rank 0, 1, ...: the shared window's own result
                    everywhere(bitwise(y, reference("shm", x)), f"{n} B: shm by name")
                    everywhere(np.allclose(y, want, rtol=1e-5, atol=1e-5), "near MPI's")
                else:
                    everywhere(bitwise(y, want), f"{n} B {op}: MPI's result, bitwise")


@pytest.mark.mpi
def test_accuracy_bounds_the_method():
    P = WORLD.Get_size()
    for acc in (0.5, 0.0095, 0.0086, 0.001):
        with QuantizedComm(WORLD, algorithm="auto", accuracy=acc) as qc:
            for n in (1 << 20, 8 << 20):
                x = data(n)
                y = np.empty_like(x)
                qc.Allreduce(x, y)
                m = qc.last_call.method
                err = qc._choose.model.error(m)
                everywhere(err <= acc, f"accuracy {acc}: {m} has error {err}")
                if P > 1 and m not in policy.EXACT:
                    # measured against the exact sum: near the model's estimate
                    want = np.empty_like(x)
                    WORLD.Allreduce(x, want)
                    got = np.linalg.norm(y - want) / np.linalg.norm(want)
                    everywhere(got <= 1.5 * err, f"{m}: error {got} against {err}")
        if acc == 0.001:
            everywhere(P == 1 or m == "mpi" or m == "shm", f"0.1%: {m}")


@pytest.mark.mpi
def test_max_min_and_integers_stay_exact_under_auto():
    with QuantizedComm(WORLD, algorithm="auto", min_quantized_bytes=0) as qc:
        for op in (MPI.MAX, MPI.MIN):
            x = data(4 << 20, seed=3)
            y, want = np.empty_like(x), np.empty_like(x)
            qc.Allreduce(x, y, op=op)
            WORLD.Allreduce(x, want, op=op)
            everywhere(qc.last_call.method in policy.EXACT and bitwise(y, want), f"{op}")
        x = np.arange(1 << 20, dtype=np.int32) * (WORLD.Get_rank() + 1)
        y, want = np.empty_like(x), np.empty_like(x)
        qc.Allreduce(x, y)
        WORLD.Allreduce(x, want)
        everywhere(qc.last_call.method in ("mpi", "copy") and bitwise(y, want), "int32")


@pytest.mark.mpi
def test_halves_under_auto():
    """Reduce_scatter_block and Allgather: an allowed method, bitwise as
    the same method by name."""
    P = WORLD.Get_size()
    for m in (1 << 10, 1 << 18):
        x = data(4 * P * m, seed=m)
        got = np.empty(m, np.float32)
        with QuantizedComm(WORLD, algorithm="auto") as qc:
            qc.Reduce_scatter_block(x, got)
            meth = qc.last_call.method
        same_everywhere(meth, "method")
        want = np.empty(m, np.float32)
        if meth in ("mpi", "copy"):
            WORLD.Reduce_scatter_block(x, want)
        else:
            with QuantizedComm(WORLD, algorithm=meth, min_quantized_bytes=0) as named:
                named.Reduce_scatter_block(x, want)
        everywhere(bitwise(got, want), f"Reduce_scatter_block {m}: {meth}")
        mine = data(4 * m, seed=m + 1)
        out = np.empty(P * m, np.float32)
        with QuantizedComm(WORLD, algorithm="auto", lossy_allgather=True) as qc:
            qc.Allgather(mine, out)
            everywhere(qc.last_call.method in policy.EXACT + LOSSY, "Allgather method")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opts", [dict(algorithm="shm", exact_bounds=True),
                                  dict(exact_bounds=True)], ids=["shm", "exact_bounds"])
def test_an_error_on_one_rank_is_raised_everywhere(opts):
    """Rank 1's bad buffer leaves it without a method while the others take
    a path the library agrees on (the window; an exact sum whose bound the
    agreement carries, also where "shm" falls back to MPI: faked layouts):
    the agreement must still raise, not hang."""
    x = np.ones(100, np.float32)
    out = np.empty_like(x)
    if WORLD.Get_rank() == 1:
        out.flags.writeable = False
    with QuantizedComm(WORLD, **opts) as qc:
        qc.Allreduce(x, np.empty_like(x))
        raises_everywhere(ValueError, lambda: qc.Allreduce(x, out), "read-only")


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["int3", "int2"])
def test_auto_runs_low_bit_wires_on_two_shot(wire):
    """int3 and int2 (docs/FORMAT.md "int3 and int2"): auto never takes a
    schedule that requantizes partial sums at every hop.  On one node the
    built-in profile keeps them exact; faked as one rank per node (the link
    binds) it quantizes them, on two-shot, bitwise two-shot's result by
    name.  (At 1-4 ranks two-shot also wins without the rule; the rule's
    own test, over layouts where the ring would win, is
    test_costmodel.py::test_auto_never_requantizes_low_bit_wires_at_every_hop.)"""
    P = WORLD.Get_size()
    old = os.environ.get("EQUARX_MPI_FAKE_NODES")
    os.environ["EQUARX_MPI_FAKE_NODES"] = f"{P}x1"
    picked = set()
    try:
        with QuantizedComm(WORLD, algorithm="auto", wire=wire) as qc:
            for n in (1 << 20, 8 << 20):
                x = data(n, seed=n)
                y = np.empty_like(x)
                qc.Allreduce(x, y)
                m = qc.last_call.method
                same_everywhere(m, "method")
                picked.add(m)
                everywhere(m in policy.EXACT + ("two_shot",), f"{wire} {n} B: {m}")
                if m == "two_shot":
                    with QuantizedComm(WORLD, algorithm="two_shot", wire=wire,
                                       min_quantized_bytes=0) as named:
                        z = np.empty_like(x)
                        named.Allreduce(x, z)
                    everywhere(bitwise(y, z), f"{wire} {n} B: auto against two_shot by name")
    finally:
        if old is None:
            os.environ.pop("EQUARX_MPI_FAKE_NODES")
        else:
            os.environ["EQUARX_MPI_FAKE_NODES"] = old
    everywhere(P == 1 or "two_shot" in picked, f"{wire}: auto quantized nothing: {picked}")
