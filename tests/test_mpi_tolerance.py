"""The error-bounded mode (abs_tol / rel_tol; tolerance.py, docs/ERROR.md)
under MPI: on every dtype, collective and kind of data at the limits, the
reported bound is at most the tolerance and every finite result value is
within the bound of the exact sum (math.fsum: test_mpi_bound.exact_error);
the same bound and error on every rank; too fine a tolerance, a persistent
request, bad options: the same ValueError on every rank; loose tolerances
send fewer bytes than int8, smooth data far fewer.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_tolerance.py
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere
from reference import BF16
from test_mpi_bound import KINDS, call, exact_error, make

from equarx_mpi import ErrorFeedback, QuantizedComm
from equarx_mpi.wire import mixed

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]
BLOCK = 64
#: a relative tolerance each dtype can meet at 8 ranks (tolerance.budget)
REL = {"float32": 1e-3, "float64": 1e-9, "float16": 0.05, "bfloat16": 0.05}


@pytest.fixture(autouse=True, scope="module")
def predicting():
    """Prediction (DELTA blocks) on, as across nodes: these tests run on one
    node, where it is off by default (wire/mixed.PREDICT)."""
    mixed.PREDICT = True
    yield
    mixed.PREDICT = None


def comm(**opts):
    opts.setdefault("block_size", BLOCK)
    return QuantizedComm(WORLD, min_quantized_bytes=0, chunks=2, **opts)


def verify(qc, out, parts, tol, desc):
    """The bound is within the tolerance and holds on every finite value;
    the same on every rank.  Returns the largest error seen."""
    b = qc.last_error_bound
    err = exact_error(out, parts, "sum")
    seen = err[~np.isnan(err)]
    worst = float(seen.max()) if seen.size else 0.0
    blocks = qc.block_bounds()
    per_block = np.repeat(blocks, qc.block_size)[:out.size]
    with np.errstate(invalid="ignore"):
        fine = b <= tol and worst <= b and (blocks <= b).all() and not (err > per_block).any()
    everywhere(fine, f"{desc}: error {worst} <= bound {b} <= tol {tol}, per block too")
    everywhere(len(set(WORLD.allgather(np.float64(b).tobytes()))) == 1,
               f"{desc}: the same bound on every rank")
    return worst


def one(qc, what, dt, kind, seed, tol, in_place=False):
    """One call; False if the tolerance was refused (on every rank alike)."""
    n = P * (3 * BLOCK + 5) + (3 * BLOCK + 7 if what == "Allreduce" else 0)
    xs = make(seed, kind, n, dt)
    try:
        out, parts = call(qc, what, xs, "sum", in_place)
        got = None
    except ValueError as e:
        got = str(e)
    everyone = WORLD.allgather(got)
    everywhere(len(set(everyone)) == 1, f"the same outcome everywhere: {everyone}")
    if got is not None:
        assert "need" in got or "overflow" in got, got
        return False
    desc = (what, dt.name, kind, in_place, qc.last_call.method, tol)
    verify(qc, out, parts, tol, desc)
    if what == "Allreduce":
        same = WORLD.allgather(out.tobytes())
        everywhere(len(set(same)) == 1, f"{desc}: the same result on every rank")
    return qc.last_call.method == "two_shot" or P == 1


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_tolerance_holds(dt):
    ran = 0
    for mode in ("rel", "abs"):
        qc = comm(rel_tol=REL[dt.name]) if mode == "rel" else comm(abs_tol=REL[dt.name] * 4)
        try:
            for k, kind in enumerate(KINDS):
                for what in ("Allreduce", "Reduce_scatter_block"):
                    t = _tolerance(qc, what, dt, kind, 100 + k)
                    ran += one(qc, what, dt, kind, 100 + k, t, in_place=bool(k % 2))
        finally:
            qc.free()
    everywhere(ran >= 16, f"{dt.name}: most cases ran quantized ({ran})")


def _tolerance(qc, what, dt, kind, seed):
    """The call's tolerance: abs_tol, or rel_tol times the largest finite
    input magnitude on any rank."""
    o = qc.options
    if o["abs_tol"] is not None:
        return o["abs_tol"]
    n = P * (3 * BLOCK + 5) + (3 * BLOCK + 7 if what == "Allreduce" else 0)
    xs = np.array(make(seed, kind, n, dt), np.float64)
    fin = np.abs(xs[np.isfinite(xs)])
    return o["rel_tol"] * float(fin.max(initial=0.0))


def test_loose_tolerance_sends_fewer_bytes_than_int8():
    """Gaussian data: a loose rel_tol sends fewer bytes than int8, a tight
    one more; a smooth 2-D field with an offset far fewer at a tolerance
    int8 meets.  Every result within its bound."""
    if P == 1:
        pytest.skip("one rank sends nothing")
    n = 64 * 1024
    rng = np.random.default_rng(WORLD.Get_rank())
    g = rng.standard_normal(n).astype(np.float32)
    y, x = np.mgrid[0:256, 0:256] / 256.0
    field = (20 + np.sin(6 * x + WORLD.Get_rank()) * np.cos(4 * y)).astype(np.float32).ravel()
    sent = {}
    for name, data, opts in [("int8", g, dict(wire="int8", algorithm="two_shot")),
                             ("loose", g, dict(rel_tol=0.2)),
                             ("tight", g, dict(rel_tol=1e-6 * P * P)),
                             ("int8-field", field, dict(wire="int8", algorithm="two_shot")),
                             ("field", field, dict(rel_tol=5e-3 * P))]:
        qc = comm(**opts)
        out = np.empty_like(data)
        qc.Allreduce(data, out)
        sent[name] = qc.last_call.bytes_sent
        if "rel_tol" in opts:
            parts = np.array(WORLD.allgather(data), np.float64)
            M = float(np.abs(parts).max())
            verify(qc, out, parts, opts["rel_tol"] * M, name)
            everywhere(qc.last_call.method == "two_shot" and qc.last_call.wire == "mixed", name)
        qc.free()
    everywhere(sent["loose"] < sent["int8"] < sent["tight"], f"bytes {sent}")
    everywhere(sent["field"] < 0.7 * sent["int8-field"], f"bytes {sent}")


def test_too_fine_a_tolerance_raises_everywhere():
    qc = comm(rel_tol=1e-9)
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    if P == 1:          # one rank: a copy, exact: any tolerance holds
        qc.allreduce(x)
        assert qc.last_error_bound == 0.0
    else:
        raises_everywhere(ValueError, lambda: qc.allreduce(x), match="need rel_tol >=")
        raises_everywhere(ValueError, lambda: qc.allreduce(x.astype(np.float16)),
                          match="rounding to float16")
    x64 = x.astype(np.float64)
    qc.allreduce(x64)                          # fine in float64
    assert qc.last_error_bound <= 1e-9 * WORLD.allreduce(float(np.abs(x64).max()), MPI.MAX)
    qc.free()


def test_persistent_and_bad_options_raise_everywhere():
    qc = comm(abs_tol=1e-3)
    x = np.ones(1024, np.float32)
    if P > 1:
        raises_everywhere(ValueError, lambda: qc.Allreduce_init(x, np.empty_like(x)),
                          match="persistent")
        raises_everywhere(ValueError, lambda: qc.Allreduce(x, np.empty_like(x),
                                                           feedback=ErrorFeedback()),
                          match="error feedback")
    qc.free()
    raises_everywhere(ValueError, lambda: comm(rel_tol=1e-3, algorithm="ring"),
                      match="two_shot")
    raises_everywhere(ValueError, lambda: comm(rel_tol=1e-3, wire="int8"),
                      match="leave wire unset")
    raises_everywhere(ValueError, lambda: comm(rel_tol=-1.0), match="finite number > 0")


def test_exact_paths_zeros_max_allgather_iallreduce_nocheck():
    qc = comm(rel_tol=1e-3)
    z = np.zeros(4096, np.float16)
    z[::3] = -0.0
    out = qc.allreduce(z)
    everywhere(qc.last_error_bound == 0.0 and (out == 0).all(), "zeros: exact, bound 0")
    x = np.random.default_rng(WORLD.Get_rank()).standard_normal(4096).astype(np.float32)
    m = qc.allreduce(x, MPI.MAX)
    everywhere(qc.last_error_bound == 0.0 and qc.last_call.wire is None
               and (m == np.max(WORLD.allgather(x), axis=0)).all(), "MAX: exact")
    g = np.empty(4096 * P, np.float32)
    qc.Allgather(x, g)
    everywhere(qc.last_error_bound == 0.0 and (g == np.concatenate(WORLD.allgather(x))).all(),
               "Allgather: exact")
    out = np.empty_like(x)
    qc.Iallreduce(x, out).Wait()
    parts = np.array(WORLD.allgather(x), np.float64)
    tol = 1e-3 * float(np.abs(parts).max())
    verify(qc, out, parts, tol, "Iallreduce")
    qc.free()
    qc = comm(rel_tol=1e-3, check=False)
    out = qc.allreduce(x)
    verify(qc, out, parts, tol, "check=False")
    qc.free()


@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.float64)], ids=lambda d: d.name)
def test_prediction_on_smooth_fields_spends_the_tolerance(dt):
    """Smooth fields with offsets (a temperature near 280 K, a pressure near
    1e5 Pa) at tolerances finer than int16 gives: the blocks go DELTA
    (kernels/delta.py), so far fewer bytes than int8 at a tolerance int8
    does not even meet, the error comes close
    to the tolerance (the steps follow the budget) and stays within the
    bound; the same bits on every rank."""
    if P == 1:
        pytest.skip("one rank sends nothing")
    n = 64 * 1024
    x = np.arange(n) / 32768.0
    r = WORLD.Get_rank()
    fields = {"temperature": (280.0 + 12.0 * np.sin(2 * np.pi * (x + 0.1 * r))
                              + 3.0 * np.cos(2 * np.pi * 3 * x), 0.001 * P),
              "pressure": (1e5 + 900.0 * np.sin(2 * np.pi * (x + 0.2 * r)), 0.05 * P)}
    if dt == np.float32:        # float32's own additions near 1e5 need most of such a tolerance
        del fields["pressure"]
    for name, (f, tol) in fields.items():
        data = f.astype(dt)
        sent, outs = {}, {}
        for mode, opts in [("int8", dict(wire="int8", algorithm="two_shot")),
                           ("tol", dict(abs_tol=tol))]:
            qc = comm(block_size=256, **opts)
            outs[mode] = qc.allreduce(data)
            sent[mode] = WORLD.allreduce(qc.last_call.bytes_sent, MPI.MAX)
            if mode == "tol":
                parts = np.array(WORLD.allgather(data), np.float64)
                worst = verify(qc, outs[mode], parts, tol, (name, dt.name))
                # each rank's share of the budget shrinks with P: measured 0.43 of
                # the tolerance at 8 ranks (temperature, float32), above 0.5 at 2-4
                least = 0.5 if P <= 4 else 0.4
                everywhere(worst > least * tol, f"{name}: error {worst} spends tol {tol}")
                same = WORLD.allgather(outs[mode].tobytes())
                everywhere(len(set(same)) == 1, f"{name}: the same result on every rank")
            qc.free()
        everywhere(sent["tol"] < 0.85 * sent["int8"], f"{name} {dt.name}: bytes {sent}")
    # by default (wire/mixed.PREDICT None) prediction is off on one node,
    # where these ranks run: the mode as before it, more bytes
    mixed.PREDICT = None
    try:
        qc = comm(block_size=256, abs_tol=tol)
        qc.allreduce(data)
        plain = WORLD.allreduce(qc.last_call.bytes_sent, MPI.MAX)
        qc.free()
    finally:
        mixed.PREDICT = True
    everywhere(plain > 1.5 * sent["tol"], f"one node, default: {plain} bytes, {sent}")
