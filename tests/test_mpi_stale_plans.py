"""A repeated call's plan is never stale and never keeps the caller's
arrays (records.Ledger.plan): arrays changed in place between calls (their
dtype, size, shape or flags, as numpy allows) get what fresh arrays of the
same kind get, ranks whose caches differ still meet, numpy's resize()
works after any number of calls, and check="all" agrees MPI's path too.

    mpirun -n 2 python -m pytest --with-mpi tests/test_mpi_stale_plans.py
"""
import gc

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import allreduce_as, everywhere, raises_everywhere

import equarx_mpi
from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def _make(how, **opts):
    """(the communicator, the QuantizedComm behind it)."""
    if how == "wrap":
        w = equarx_mpi.wrap(WORLD.Dup(), **opts)
        return w, w._equarx()
    qc = QuantizedComm(WORLD, **opts)
    return qc, qc


def _outcome(comm, call):
    """What a call did, comparable across two communicators: its error, or
    its result's bits, its record (but for the time) and what it added to
    the totals."""
    before = comm.stats
    try:
        out = call()
    except (TypeError, ValueError, BufferError) as e:
        return ("raised", type(e).__name__, str(e))
    after = comm.stats
    info = comm.last_call._replace(seconds=0.0)
    added = tuple(a - b for a, b in zip(after[:4], before[:4]))
    return ("ran", out.dtype.str, out.shape, out.tobytes(), info, added)


def _reinterpret(dtype):
    def change(a):
        a.dtype = dtype
    return change


def _grow(a):
    a.resize(2 * a.size, refcheck=False)


def _read_only(a):
    a.flags.writeable = False


# (name, the arrays' first dtype, what happens to both arrays in place)
CHANGES = [
    ("int32 as float32", np.int32, _reinterpret(np.float32)),
    ("float32 as bfloat16", np.float32, _reinterpret(ml_dtypes.bfloat16)),
    ("float32 as float16", np.float32, _reinterpret(np.float16)),
    ("float64 as int64", np.float64, _reinterpret(np.int64)),
    ("float64 grown", np.float64, _grow),
    ("int32 grown", np.int32, _grow),
    ("float32 reshaped", np.float32, lambda a: setattr(a, "shape", (4, -1))),
    ("recvbuf read-only", np.float64, None),
]
FORMS = ["out of place", "in place", "same array"]


def _data(dtype, n, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 3).astype(dtype)
    return rng.integers(-100, 100, n).astype(dtype)


def _call(comm, form, x, y):
    if form == "out of place":
        comm.Allreduce(x, y)
        return y
    if form == "in place":
        comm.Allreduce(MPI.IN_PLACE, x)
        return x
    comm.Allreduce(x, x)
    return x


@pytest.mark.parametrize("how", ["QuantizedComm", "wrap"])
@pytest.mark.parametrize("opts", [{}, {"abs_tol": 1e-3}], ids=["defaults", "abs_tol"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("change", CHANGES, ids=[c[0] for c in CHANGES])
def test_arrays_changed_in_place_get_what_fresh_arrays_get(how, opts, form, change):
    """Three calls plan the arrays; then they change in place on every rank.
    The next call must do what the same call on fresh copies does on a
    communicator with no plan: the same bits, record, bound and totals, or
    the same error."""
    name, dtype, mutate = change
    held, _ = _make(how, **opts)
    fresh, _ = _make(how, **opts)
    x = _data(dtype, 64, RANK)
    y = np.zeros_like(x)
    first = x.copy()
    for _ in range(3):
        x[...] = first          # in place would grow it P-fold a call
        _call(held, form, x, y)
    recv = y if form == "out of place" else x
    for a in (x, y):
        if mutate is not None:
            mutate(a)
    if mutate is None:
        _read_only(recv)
    fx, fy = x.copy(), y.copy()
    if mutate is None:
        _read_only(fy if form == "out of place" else fx)
    got = _outcome(held, lambda: _call(held, form, x, y))
    want = _outcome(fresh, lambda: _call(fresh, form, fx, fy))
    everywhere(got == want, f"{name}, {form}: held {got[:3]} {got[-2:]}, fresh "
                            f"{want[:3]} {want[-2:]}")
    held.free()
    fresh.free()


@pytest.mark.parametrize("how", ["QuantizedComm", "wrap"])
@pytest.mark.parametrize("call", ["blocking in exact()", "nonblocking", "persistent"])
def test_views_changed_in_place_in_every_kind_of_call(how, call):
    """Views of larger buffers, planned (also inside exact()), then seen as
    float32 in place: a blocking call inside exact(), an Iallreduce and an
    Allreduce_init on them do what they do on fresh arrays of that kind."""
    held, _ = _make(how, min_quantized_bytes=0)
    fresh, _ = _make(how, min_quantized_bytes=0)
    bx, by = _data(np.int32, 96, RANK), np.zeros(96, np.int32)
    x, y = bx[16:80], by[:64]
    for _ in range(3):
        held.Allreduce(x, y)
        with held.exact():
            held.Allreduce(x, y)
    x.dtype = y.dtype = np.float32
    fx, fy = x.copy(), y.copy()

    def run(comm, a, b):
        if call == "blocking in exact()":
            with comm.exact():
                comm.Allreduce(a, b)
        else:
            allreduce_as(call, comm, a, b)
        return b
    got = _outcome(held, lambda: run(held, x, y))
    want = _outcome(fresh, lambda: run(fresh, fx, fy))
    everywhere(got == want, f"{call}: held {got[:3]} {got[-2:]}, fresh {want[:3]} {want[-2:]}")
    held.free()
    fresh.free()


def _reference(x):
    """The exact sum over ranks (float64; integers exactly) and the largest
    magnitude summed."""
    every = WORLD.allgather(x.astype(np.float64).reshape(-1))
    return np.sum(every, axis=0), max(float(np.abs(e).max()) for e in every)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["QuantizedComm", "wrap"])
@pytest.mark.parametrize("change", [c for c in CHANGES if c[0] in (
    "int32 as float32", "float32 as bfloat16", "float32 as float16", "float64 grown")],
    ids=lambda c: c[0])
def test_ranks_whose_caches_differ_still_meet(how, change):
    """Rank 0 changes its planned arrays in place; the others pass fresh
    arrays of the same dtype and count (a legal MPI program).  Every rank
    must reach the same collective (the float calls here are quantized: an
    agreement the stale plan skipped would hang) and get the same bits,
    within the call's certified bound of the exact sum."""
    name, dtype, mutate = change
    comm, _ = _make(how, min_quantized_bytes=0)
    x = _data(dtype, 64, RANK)
    y = np.empty_like(x)
    for _ in range(3):
        comm.Allreduce(x, y)
    if RANK == 0:
        mutate(x)
        mutate(y)
    else:
        x, y = x.copy(), y.copy()
        mutate(x)
        mutate(y)
        x, y = x.copy(), np.empty_like(y)        # fresh arrays of that kind
    x[...] = _data(x.dtype, x.size, 7 + RANK).reshape(x.shape)
    comm.Allreduce(x, y)
    info = comm.last_call
    ref, most = _reference(x)
    bound = info.error_bound
    if not np.isfinite(bound):                   # MPI's own float sum: its order's error
        bound = P * P * float(np.finfo(x.dtype).eps) * most
    err = float(np.abs(y.astype(np.float64).reshape(-1) - ref).max())
    everywhere(err <= bound, f"{name}: error {err} > bound {bound} ({info})")
    everywhere(len({b.tobytes() for b in WORLD.allgather(y)}) == 1, f"{name}: same bits")
    everywhere(len(set(WORLD.allgather((info.method, info.wire)))) == 1, f"{name}: {info}")
    everywhere(info.wire is not None or x.dtype.kind != "f" or P == 1,
               f"{name}: quantized as fresh arrays are ({info})")
    comm.free()


@pytest.mark.parametrize("how", ["QuantizedComm", "wrap"])
def test_resize_works_after_any_number_of_calls(how):
    """numpy's resize() (default refcheck) refuses an array anything else
    references: the library must hold none of the caller's arrays after a
    call returns, whatever the call (planned, quantized, exact(), views,
    nonblocking, persistent once freed)."""
    comm, qc = _make(how, min_quantized_bytes=0)
    x, y = np.ones(16), np.empty(16)
    big, out = np.ones(1 << 15, np.float32), np.empty(1 << 15, np.float32)
    for _ in range(5):
        comm.Allreduce(x, y)
        comm.Allreduce(MPI.IN_PLACE, x)
        comm.Allreduce(big, out)                      # quantized from 2 ranks on
        with comm.exact():
            comm.Allreduce(big, out)
    comm.Iallreduce(x, y).Wait()
    req = comm.Allreduce_init(big, out)
    req.Start()
    req.Wait()
    req.Free()
    comm.Allreduce(y[:8], x[:8])                     # views of them
    gc.collect()
    # each raises if anything but its name here refers to it
    x.resize(32)
    y.resize(32)
    big.resize(1 << 16)
    out.resize(1 << 16)
    everywhere(x.size == 32 and out.size == 1 << 16, "resized")
    with comm.exact():
        comm.Allreduce(x, y)                          # the grown arrays: a fresh plan
    everywhere(np.array_equal(y, _mpi_sum(x)), f"after resize: {qc.last_call}")
    comm.free()


def _mpi_sum(x):
    out = np.empty_like(x)
    WORLD.Allreduce(x, out)
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("groups", ["equal", "one and the rest"])
def test_allreduce_helper_refuses_an_intercommunicator_everywhere(groups):
    if groups == "equal" and P % 2:
        pytest.skip("equal groups need an even number of ranks")
    color = RANK % 2 if groups == "equal" else int(RANK > 0)
    local = WORLD.Split(color, RANK)
    inter = local.Create_intercomm(0, WORLD, 1 - color if groups == "equal" else
                                   (1 if color == 0 else 0), tag=7)
    raises_everywhere(TypeError, lambda: equarx_mpi.allreduce(np.ones(4), inter),
                      "intra-communicator")
    inter.Free()
    local.Free()


def test_check_all_is_an_option_and_an_environment_variable(monkeypatch):
    monkeypatch.setenv("EQUARX_MPI_CHECK", "all")
    with QuantizedComm(WORLD) as qc:
        everywhere(qc.options["check"] == "all", f"{qc.options['check']}")
    monkeypatch.delenv("EQUARX_MPI_CHECK")
    raises_everywhere(ValueError, lambda: QuantizedComm(WORLD, check="some"), "'all'")


@pytest.mark.parametrize("how", ["QuantizedComm", "wrap"])
def test_check_all_agrees_mpis_path_and_keeps_no_plan(how, monkeypatch):
    from equarx_mpi import comm as comm_module
    made = []
    real = comm_module.agree
    monkeypatch.setattr(comm_module, "agree", lambda *a, **k: made.append(a[1]) or real(*a, **k))
    comm, qc = _make(how, check="all")
    x = np.arange(10, dtype=np.int32)
    for _ in range(3):
        out = np.empty_like(x)
        comm.Allreduce(x, out)
        everywhere(np.array_equal(out, x * P), "right")
    comm.Iallreduce(MPI.IN_PLACE, out).Wait()
    everywhere(len(made) == 4 and not qc._ledger.plans, f"agreed {made}")
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["QuantizedComm", "wrap"])
@pytest.mark.parametrize("mismatch", ["count", "dtype", "op", "either side of the crossover",
                                      "in exact() on one rank"])
def test_check_all_turns_a_mismatch_into_one_error(how, mismatch):
    """What MPI leaves undefined (a crash, a truncation error on one rank, a
    hang between MPI's path and the library's) is the same ValueError on
    every rank with check="all"."""
    comm, qc = _make(how, check="all", algorithm="ring", min_quantized_bytes=4096)
    cut = qc.crossover(np.float32, upto=1 << 20)
    everywhere(cut is not None, "ring quantizes from some size")
    n, dtype, op = 100, np.float64, MPI.SUM
    last = RANK == P - 1
    if mismatch == "count" and last:
        n = 101
    if mismatch == "dtype" and last:
        dtype = np.int64
    if mismatch == "op" and last:
        op = MPI.MAX
    if mismatch == "either side of the crossover":
        n, dtype = (cut // 4 if last else cut // 4 - 64), np.float32
    if mismatch == "in exact() on one rank":
        n, dtype = cut // 4, np.float32
    x = np.ones(n, dtype)

    def run():
        if mismatch == "in exact() on one rank" and last:
            with comm.exact():
                comm.Allreduce(x, np.empty_like(x), op)
        else:
            comm.Allreduce(x, np.empty_like(x), op)
    for _ in range(2):                      # also once a plan could have been kept
        raises_everywhere(ValueError, run, "differs between ranks")
    y = np.ones(8)
    comm.Allreduce(MPI.IN_PLACE, y)
    everywhere((y == P).all(), "usable after the error")
    comm.free()
