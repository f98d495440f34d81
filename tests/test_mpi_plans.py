"""The call plan per signature, MPI's own path without agreement, the lossy
margin, comm.exact() and the lossy log line, under MPI.

    mpirun -n 2 python -m pytest --with-mpi tests/test_mpi_plans.py
"""
import sys

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere

import equarx_mpi
from equarx_mpi import QuantizedComm
from equarx_mpi import comm as comm_module

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()


@pytest.fixture
def agreements(monkeypatch):
    """How many argument agreements this rank made."""
    made = []
    real = comm_module.agree

    def counted(*args, **kwargs):
        made.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(comm_module, "agree", counted)
    return made


def _mpi(x, op=MPI.SUM):
    out = np.empty_like(x)
    WORLD.Allreduce(x, out, op)
    return out


@pytest.mark.parametrize("make", ["QuantizedComm", "wrap"])
def test_mpi_path_agrees_on_nothing_and_keeps_a_plan(make, agreements):
    qc = QuantizedComm(WORLD) if make == "QuantizedComm" else equarx_mpi.wrap(WORLD.Dup())
    inner = qc if make == "QuantizedComm" else qc._equarx()
    rng = np.random.default_rng(WORLD.Get_rank())
    for n, dtype in ((1, np.float64), (8, np.float64), (1000, np.float32), (7, np.int32)):
        x = (rng.standard_normal(n) * 100).astype(dtype)
        for _ in range(3):                                 # the first prepares, two run the plan
            out = np.empty_like(x)
            qc.Allreduce(x, out)
            everywhere(np.array_equal(out, _mpi(x)), f"{n} {dtype}: MPI's bits")
            info = qc.last_call
            want = "copy" if P == 1 and make == "QuantizedComm" else "mpi"
            everywhere(info.method == want, f"{info}")
        y = x.copy()
        qc.Allreduce(MPI.IN_PLACE, y)                      # in place has its own plan
        everywhere(np.array_equal(y, _mpi(x)), "in place")
    everywhere(qc.stats.calls == 16 and qc.stats.quantized_calls == 0, f"{qc.stats}")
    everywhere(len(inner._ledger.plans) == 8, f"{len(inner._ledger.plans)} plans")
    everywhere(not agreements, f"agreements made: {agreements}")
    everywhere(qc.last_call.error_bound == 0.0, "integers: exact")
    qc.free()


@pytest.mark.mpi(min_size=2)
def test_exact_bounds_agrees_and_certifies(agreements):
    with QuantizedComm(WORLD) as plain, QuantizedComm(WORLD, exact_bounds=True) as bounded:
        x = np.full(100, 1.0 + WORLD.Get_rank(), np.float32)
        plain.Allreduce(x, np.empty_like(x))
        everywhere(plain.last_error_bound == np.inf, "not computed by default")
        bounded.Allreduce(x, np.empty_like(x))
        b = bounded.last_error_bound
        everywhere(0 < b < 1e-3, f"certified: {b}")
        everywhere(len(agreements) == 1, f"{agreements}")


@pytest.mark.mpi(min_size=2)
def test_a_plan_on_one_rank_meets_a_fresh_call_on_another():
    """Rank 0 repeats a planned call while rank 1's buffers differ in what
    the signature sees (a view, Fortran order): both still end in MPI's
    own collective, with MPI's result."""
    with QuantizedComm(WORLD) as qc:
        base = np.arange(64, dtype=np.float64)
        qc.Allreduce(base, np.empty_like(base))
        for other in (np.arange(128, dtype=np.float64)[:64],
                      np.arange(64, dtype=np.float64).reshape(8, 8, order="F")):
            x = base if WORLD.Get_rank() != 1 else other
            out = np.empty(x.shape, x.dtype, order="F" if x.flags.f_contiguous else "C")
            qc.Allreduce(x, out)
            everywhere(np.array_equal(out.reshape(-1, order="A"), base * P), "met")


def test_an_argument_error_on_every_rank_on_mpis_path_raises_everywhere():
    with QuantizedComm(WORLD) as qc:
        x = np.ones(10, np.float32)
        qc.Allreduce(x, np.empty_like(x))
        raises_everywhere(TypeError, lambda: qc.Allreduce(x, np.empty(10, np.float64)), "dtype")
        raises_everywhere(ValueError, lambda: qc.Allreduce(x, np.empty(9, np.float32)),
                          "needs 10")
        out = np.empty_like(x)
        qc.Allreduce(x, out)
        everywhere((out == P).all(), "usable after the errors")


@pytest.mark.mpi(min_size=2)
def test_lossy_margin_moves_the_crossover():
    got = []
    for margin in (1.0, 1.25, 2.0, 1e6):
        with QuantizedComm(WORLD, lossy_margin=margin) as qc:
            got.append(qc.crossover(np.float32, upto=1 << 30))
    finite = [c for c in got[:3] if c is not None]
    everywhere(finite == sorted(finite), f"crossover grows with the margin: {got}")
    everywhere(got[3] is None, f"a margin no method meets: never lossy ({got})")
    # the named algorithms' floor follows the same rule
    with QuantizedComm(WORLD, algorithm="ring", lossy_margin=1e6) as qc:
        x = np.ones(1 << 16, np.float32)
        qc.Allreduce(x, np.empty_like(x))
        everywhere(qc.last_call.method == "mpi" and "1e+06x" in qc.last_call.reason,
                   qc.last_call.reason)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", ["QuantizedComm", "wrap"])
def test_exact_keeps_a_stretch_of_code_exact(make):
    opts = dict(algorithm="ring", min_quantized_bytes=0)
    qc = QuantizedComm(WORLD, **opts) if make == "QuantizedComm" else \
        equarx_mpi.wrap(WORLD.Dup(), **opts)
    x = np.random.default_rng(WORLD.Get_rank()).standard_normal(5000)
    out = np.empty_like(x)
    qc.Allreduce(x, out)
    everywhere(qc.last_call.wire == "int8", "lossy outside")
    with qc.exact():
        for _ in range(2):
            qc.Allreduce(x, out)
            everywhere(qc.last_call.method == "mpi" and np.array_equal(out, _mpi(x)),
                       f"exact inside: {qc.last_call}")
        with qc.exact():                                   # nests
            qc.Allreduce(x, out)
        qc.Allreduce(x, out)
        everywhere(qc.last_call.method == "mpi", "still exact after the inner block")
    qc.Allreduce(x, out)
    everywhere(qc.last_call.wire == "int8", "lossy again after")
    everywhere(qc.stats.quantized_calls == 2, f"{qc.stats}")
    qc.free()


@pytest.mark.mpi(min_size=2)
def test_each_kind_of_lossy_call_is_logged_once(capfd, monkeypatch):
    monkeypatch.delenv("EQUARX_MPI_LOG", raising=False)
    with QuantizedComm(WORLD, algorithm="ring", min_quantized_bytes=0) as qc:
        capfd.readouterr()
        for n in (3000, 3000, 4000, 3000):
            x = np.ones(n, np.float32)
            qc.Allreduce(x, np.empty_like(x))
        x = np.ones(3000, np.float32)
        qc.Allreduce(x, np.empty_like(x), MPI.MAX)         # exact: no line
        lines = [s for s in capfd.readouterr().err.splitlines() if "travels lossy" in s]
    want = 2 if WORLD.Get_rank() == 0 else 0
    everywhere(len(lines) == want and "12000 B float32 SUM" in lines[0] if want else
               not lines, f"{lines}")


@pytest.mark.mpi(min_size=2)
def test_an_error_on_mpis_path_is_raised_there_without_waiting():
    """MPI's own path agrees on nothing, also with exact_bounds (which only
    float sums need): a rank whose integer or MAX call is bad raises at
    once, as mpi4py does, instead of waiting in an agreement the others
    never join (here the others make no call at all)."""
    with QuantizedComm(WORLD, exact_bounds=True) as qc:
        for x, op in ((np.ones(8, np.int32), MPI.SUM), (np.ones(8, np.float32), MPI.MAX)):
            out = np.empty_like(x)
            out.flags.writeable = False
            if WORLD.Get_rank() == 1:
                with pytest.raises(ValueError, match="read-only"):
                    qc.Allreduce(x, out, op)
            WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_half_refused_on_one_rank_near_the_floor_raises_everywhere():
    """A Reduce_scatter_block's size is its whole input (P*m values), also
    when judging the path of a call refused on one rank: every rank is on
    the library's path and raises."""
    m = 4
    with QuantizedComm(WORLD, algorithm="ring", min_quantized_bytes=P * m * 4) as qc:
        out = np.empty(m, np.float32)
        if WORLD.Get_rank() == 1:
            out.flags.writeable = False
        raises_everywhere(ValueError, lambda: qc.Reduce_scatter_block(
            np.ones(P * m, np.float32), out), "read-only")


def test_a_planned_copy_keeps_mpis_shapes():
    """One rank: the plan's copy takes a recvbuf of another shape of the
    same size, as MPI (and the first, fully checked call) does."""
    with QuantizedComm(MPI.COMM_SELF) as qc:
        for _ in range(3):
            out = np.empty(8)
            qc.Allreduce(np.arange(8.0).reshape(2, 4), out)
            assert (out == np.arange(8.0)).all()


@pytest.mark.mpi(min_size=2)
def test_exact_survives_a_free_of_a_wrapped_constant():
    w = equarx_mpi.wrap(MPI.COMM_WORLD, algorithm="ring", min_quantized_bytes=0)
    x = np.random.default_rng(WORLD.Get_rank()).standard_normal(5000)
    with w.exact():
        w.Allreduce(x, np.empty_like(x))
        w.free()                      # a wrapped COMM_WORLD: only the library's part goes
        out = np.empty_like(x)
        w.Allreduce(x, out)           # a new QuantizedComm, made inside the block
        everywhere(w.last_call.method == "mpi" and np.array_equal(out, _mpi(x)),
                   f"{w.last_call}")
    w.Allreduce(x, out)
    everywhere(w.last_call.wire == "int8", "lossy again after the block")
    w.free()


@pytest.mark.parametrize("make", ["QuantizedComm", "wrap"])
def test_the_same_arrays_again_skip_the_signature_and_stay_right(make):
    """A call with the very arrays of the last planned one runs its plan
    without the signature (records.Ledger.plan): new contents, every call
    counted, an exact() block's plan not taken outside it, and the arrays
    not held (a weak reference only: tests/test_mpi_stale_plans.py)."""
    opts = dict(algorithm="ring", min_quantized_bytes=0)
    qc = QuantizedComm(WORLD, **opts) if make == "QuantizedComm" else equarx_mpi.wrap(
        WORLD.Dup(), **opts)
    ledger = (qc if make == "QuantizedComm" else qc._equarx())._ledger
    rng = np.random.default_rng(WORLD.Get_rank())
    x, out = np.empty(64), np.empty(64)
    with qc.exact():
        for i in range(5):
            x[:] = rng.standard_normal(64) * 10 ** i
            qc.Allreduce(x, out)
            everywhere(np.array_equal(out, _mpi(x)) and qc.last_call.method in ("mpi", "copy"),
                       f"call {i}: {qc.last_call}")
        everywhere(ledger._recent is not None, "the plan is the recent one")
    everywhere(qc.stats.calls == 5, f"{qc.stats}")
    qc.Allreduce(x, out)                  # the same arrays, outside the block
    want = "int8" if P > 1 else None
    everywhere(qc.last_call.wire == want, f"lossy again outside the block: {qc.last_call}")
    everywhere(sys.getrefcount(out) == 2, "only a weak reference")
    qc.free()
    everywhere(ledger._recent is None, "free() forgets the last arrays")
