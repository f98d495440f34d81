"""Shared-window exact AllReduce (equarx_mpi/shm.py), at any number of ranks.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_shm.py

Every rank builds every rank's input from one seed and computes the
reference itself: the reduction in the fixed order rank 0, 1, ..., P-1 with
numpy, in float32 for 16-bit types and rounded once.  Per-rank checks are
combined across ranks before asserting.
"""
import os

import mpi_helpers
import numpy as np
import pytest
from mpi4py import MPI
from reference import BF16

from equarx_mpi import QuantizedComm
from equarx_mpi.bounds.mpi_bound import largest
from equarx_mpi.collectives.nodes import FAKE_NODES_ENV, parse_nodes, split_nodes
from equarx_mpi.collectives.shm import ShmAllreduce

DTYPES = [np.float32, np.float64, np.float16, BF16]
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def everywhere(comm, ok, what):
    mpi_helpers.everywhere(ok, what, comm)


def same_on_all_ranks(comm, arr):
    ref = comm.bcast(arr.tobytes() if comm.Get_rank() == 0 else None)
    everywhere(comm, arr.tobytes() == ref, "bitwise identical results")


def inputs(P, n, dtype, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(P)]


def combine(op, a, b):
    """The kernels' rule: IEEE a + b, or max/min keeping a NaN from either
    side and, on ties such as -0.0 vs 0.0, the left value."""
    if op is MPI.SUM:
        return a + b
    pick = a >= b if op is MPI.MAX else a <= b
    return np.where(np.isnan(a) | np.isnan(b), a + b, np.where(pick, a, b))


def fixed_order(xs, op=MPI.SUM):
    acc_dt = np.float64 if xs[0].dtype == np.float64 else np.float32
    acc = xs[0].astype(acc_dt)
    for x in xs[1:]:
        acc = combine(op, acc, x.astype(acc_dt))
    return acc.astype(xs[0].dtype)


def equal_bits(a, b):
    """Bitwise equal, except that any NaN matches any NaN (the payload of a
    NaN made by Inf - Inf, or rounded to 16 bits, is not numpy's concern)."""
    na, nb = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    return (na == nb).all() and np.array_equal(a[~na].view(np.uint8), b[~nb].view(np.uint8))


@pytest.fixture(params=["world", "self", "dup", "split"])
def comm(request):
    w = MPI.COMM_WORLD
    c = {"world": lambda: w, "self": lambda: MPI.COMM_SELF, "dup": w.Dup,
         "split": lambda: w.Split(w.Get_rank() % 2, -w.Get_rank())}[request.param]()
    yield c
    if request.param in ("dup", "split"):
        c.Free()


@pytest.fixture(params=["auto", "two-phase"])
def shm(request, comm):
    # oneshot_bytes=0: every size takes the reduce-scatter + all-gather path
    with ShmAllreduce(comm, oneshot_bytes=0 if request.param == "two-phase" else None) as sh:
        yield sh


def test_serial_self_all_dtypes():
    """COMM_SELF, also without mpirun: compiles (and caches) every kernel."""
    with ShmAllreduce(MPI.COMM_SELF, oneshot_bytes=0) as sh:
        for dtype in DTYPES:
            x = inputs(1, 1000, dtype, 0)[0]
            y = np.empty_like(x)
            sh.allreduce(x, y)
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
            mine = sh.reduce_scatter(x, keep_acc=True)
            assert mine.dtype == (np.float64 if dtype == np.float64 else np.float32)
            sh.allgather(y)
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_parse_nodes():
    assert parse_nodes("2x2", 4) == [2, 2]
    assert parse_nodes("3,1", 4) == [3, 1]
    for bad in ("2x2", "5", "a,b", "0,4"):
        with pytest.raises(ValueError):
            parse_nodes(bad, 4 if bad != "2x2" else 5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 7, 1000, 100003])
def test_sum_matches_fixed_order_bitwise(shm, dtype, n):
    check_sum(shm, dtype, n)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [5, 3000, 100003])
def test_largest_magnitude_skips_inf_and_nan(shm, dtype, n):
    """allreduce's return value, the largest finite input magnitude on any
    rank (the exact sum's error bound rests on it), whichever rank and
    whichever slice holds it, beside Inf and NaN; 0.0 for MAX."""
    comm = shm.comm
    P, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(n)
    big = float(np.finfo(dtype).max) if dtype != BF16 else 3.3e38
    for trial in range(3):
        xs = [(rng.standard_normal(n) * 0.5).astype(dtype) for _ in range(P)]
        holder, at = int(rng.integers(P)), int(rng.integers(n))
        xs[holder][at] = -big if trial == 1 else 1000.0
        for k in range(P):
            xs[k][int(rng.integers(n))] = [np.inf, -np.inf, np.nan][(trial + k) % 3]
        want = max(float(np.abs(np.where(np.isfinite(x), x, 0).astype(np.float64)).max())
                   for x in xs)
        out = np.empty_like(xs[r])
        got = shm.allreduce(xs[r], out)
        everywhere(comm, got == want, f"largest magnitude {got} != {want}")
        everywhere(comm, shm.allreduce(xs[r], out, MPI.MAX) == 0.0, "MAX returns 0.0")
    # the bottom of the range: zeros and -0.0, one smallest subnormal, a NaN
    # with its sign bit set (its magnitude bits lie above Inf's)
    tiny = np.array(1, f"u{np.dtype(dtype).itemsize}").view(dtype)
    xs = [np.where(np.arange(n) % 2, -0.0, 0.0).astype(dtype) for _ in range(P)]
    xs[P - 1][n // 2] = -tiny
    xs[0][n - 1] = -np.float64(np.nan)
    out = np.empty_like(xs[r])
    got = shm.allreduce(xs[r], out)
    everywhere(comm, got == float(np.abs(tiny.astype(np.float64))),
               f"smallest subnormal: got {got}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_sum_large_odd_size(dtype):
    with ShmAllreduce(MPI.COMM_WORLD) as sh:
        check_sum(sh, dtype, 1000003)


def check_sum(shm, dtype, n):
    comm = shm.comm
    P, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(P, n, dtype, seed=n)
    xs[r].flags.writeable = False        # a read-only sendbuf is fine
    out = np.full_like(xs[r], 7)
    most = shm.allreduce(xs[r], out)
    everywhere(comm, equal_bits(out, fixed_order(xs)), "equal to the fixed-order reference")
    everywhere(comm, most == max(largest(x) for x in xs), "the largest finite input magnitude")
    same_on_all_ranks(comm, out)
    # in place, both spellings, and again: the same bits from call to call
    for send in (MPI.IN_PLACE, None):
        again = xs[r].copy()
        shm.allreduce(send, again)
        everywhere(comm, np.array_equal(again.view(np.uint8), out.view(np.uint8)),
                   "in place equals out of place")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("opname", OPS)
@pytest.mark.parametrize("n", [1000, 40000], ids=["one-shot", "two-phase"])
def test_special_values_and_ops(comm, dtype, opname, n):
    op = OPS[opname]
    P, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(P, n, dtype, seed=3)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 6e4, -6e4], dtype)
    for k, x in enumerate(xs):
        # rank k puts specials at positions that overlap its neighbours'
        pos = (np.arange(0, n, 97) + 13 * k) % n
        x[pos] = specials[(np.arange(pos.size) + k) % specials.size]
        x[:4] = -0.0                       # all -0.0: -0.0; mixed zeros: +0.0
        x[4:8] = -0.0 if k % 2 else 0.0
    out = np.empty_like(xs[r])
    with ShmAllreduce(comm) as shm:     # 40000 values: above the one-shot size for any dtype
        shm.allreduce(xs[r], out, op)
    everywhere(comm, equal_bits(out, fixed_order(xs, op)), f"{opname} with NaN/Inf/-0.0")
    same_on_all_ranks(comm, out)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
def test_empty_buffers(shm, dtype):
    comm = shm.comm
    P, r = comm.Get_size(), comm.Get_rank()
    for n in (5, 30000):
        xs = inputs(P, n, dtype, seed=n)
        ref = fixed_order(xs)
        w = shm.empty((n,), dtype)
        w[...] = xs[r]
        shm.allreduce(MPI.IN_PLACE, w)               # the window, in place
        everywhere(comm, equal_bits(w, ref), "empty() buffer in place")
        w[...] = xs[r]
        out = np.empty_like(w)
        shm.allreduce(w, out)                        # the window as sendbuf
        everywhere(comm, equal_bits(out, ref) and equal_bits(w, xs[r]),
                   "empty() buffer as sendbuf, left unchanged")


@pytest.mark.mpi(min_size=1)
def test_window_grows_across_calls(comm):
    P, r = comm.Get_size(), comm.Get_rank()
    with ShmAllreduce(comm) as sh:
        old = sh.empty(10, np.float32)
        caps = []
        for n in (10, 3000, 70000, 300000):
            xs = inputs(P, n, np.float32, seed=n)
            out = np.empty_like(xs[r])
            sh.allreduce(xs[r], out)
            caps.append(sh.cap)
            everywhere(comm, equal_bits(out, fixed_order(xs)), f"n={n} after growth")
        everywhere(comm, caps[-1] > caps[0], "the window grew")
        # a buffer from the first window stays usable (now copied like any array)
        old[...] = r + 1
        sh.allreduce(MPI.IN_PLACE, old)
        everywhere(comm, (old == P * (P + 1) / 2).all(), "empty() buffer from before growth")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("keep_acc", [False, True])
def test_halves_compose(comm, dtype, keep_acc):
    P, r = comm.Get_size(), comm.Get_rank()
    n = 10007
    xs = inputs(P, n, dtype, seed=11)
    with ShmAllreduce(comm) as sh:
        mine = sh.reduce_scatter(xs[r], keep_acc=keep_acc)
        lo, hi = sh.bounds(n, dtype)
        ref = fixed_order(xs)
        acc_ref = (fixed_order([x.astype(np.float32) for x in xs])
                   if keep_acc and np.dtype(dtype).itemsize == 2 else ref)
        ok = mine.size == hi - lo and equal_bits(mine, acc_ref[lo:hi])
        out = np.empty_like(xs[r])
        sh.allgather(out)
        everywhere(comm, ok and equal_bits(out, ref), "reduce_scatter + allgather")
        # the hierarchical step: each rank replaces its slice before the gather
        mine = sh.reduce_scatter(xs[r], keep_acc=keep_acc)
        mine[...] = r + 1
        sh.allgather(out)
        owner = np.concatenate([np.full(sh.bounds(n, dtype, k)[1] - sh.bounds(n, dtype, k)[0],
                                        k + 1) for k in range(P)])
        everywhere(comm, np.array_equal(out.astype(np.float64), owner),
                   "slices replaced between the halves")
        # the slices are whole 64-byte lines and cover the message
        b = [sh.bounds(n, dtype, k) for k in range(P)]
        per = 64 // np.dtype(dtype).itemsize
        everywhere(comm, b[0][0] == 0 and b[-1][1] == n and all(
            b[k][1] == b[k + 1][0] and (b[k][1] % per == 0 or b[k][1] == n)
            for k in range(P - 1)), "slice bounds")


@pytest.mark.mpi(min_size=1)
def test_argument_errors(comm):
    with ShmAllreduce(comm) as sh:
        x = np.ones(10, np.float32)
        for send, recv, op, exc in [(x, np.empty(10), MPI.SUM, TypeError),
                                    (x, np.empty(11, np.float32), MPI.SUM, ValueError),
                                    (x, np.empty(10, np.float32), MPI.PROD, TypeError),
                                    (x, np.empty(10, np.float32), "sum", TypeError),
                                    (np.ones(10, np.int32), np.empty(10, np.int32), MPI.SUM,
                                     TypeError),
                                    (x, np.empty((10, 2), np.float32)[:, 0], MPI.SUM,
                                     ValueError)]:
            with pytest.raises(exc):
                sh.allreduce(send, recv, op)
        with pytest.raises(RuntimeError):
            sh.allgather(np.empty(10, np.float32))
    with pytest.raises(RuntimeError):
        sh.allreduce(x, np.empty_like(x))


@pytest.mark.mpi(min_size=2)
def test_fake_nodes():
    w = MPI.COMM_WORLD
    P, r = w.Get_size(), w.Get_rank()
    # not one node: the same ValueError on every rank, also through the env var
    with pytest.raises(ValueError, match="one node"):
        ShmAllreduce(w, nodes=f"1,{P - 1}")
    os.environ[FAKE_NODES_ENV] = f"{P - 1},1"
    try:
        with pytest.raises(ValueError, match="one node"):
            ShmAllreduce(w)
    finally:
        del os.environ[FAKE_NODES_ENV]
    # on its fake node's communicator it works; node 0 holds ranks 0..P//2-1
    spec = f"2x{P // 2}" if P % 2 == 0 else f"{P // 2},{P - P // 2}"
    node = split_nodes(w, nodes=spec)
    first = r < P // 2
    members = node.allgather(r)
    everywhere(w, members == (list(range(P // 2)) if first else list(range(P // 2, P))),
               "fake node membership")
    xs = inputs(P, 5000, np.float32, seed=5)
    mine = xs[:P // 2] if first else xs[P // 2:]
    out = np.empty(5000, np.float32)
    with ShmAllreduce(node) as sh:
        sh.allreduce(xs[r], out)
    node.Free()
    everywhere(w, equal_bits(out, fixed_order(mine)), "allreduce on a fake node")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [300, 20000])
def test_back_to_back_calls(n):
    """Many calls in a row with new data each time: a rank that leaves a call
    early must not overwrite what a slower rank still reads (one-shot areas
    alternate; two-phase result regions are written after the first sync)."""
    w = MPI.COMM_WORLD
    P, r = w.Get_size(), w.Get_rank()
    xs = inputs(P, n, np.float32, seed=9)
    ok = True
    with ShmAllreduce(w) as sh:
        out = np.empty(n, np.float32)
        for call in range(60):
            sh.allreduce(xs[r] * np.float32(call), out)
            ok &= equal_bits(out, fixed_order([x * np.float32(call) for x in xs]))
    everywhere(w, ok, "every call's result")


def mixed_calls(allreduce, empty, P, r, dtype, sizes, ops, want):
    """In place and as sendbuf, with a window buffer on some ranks only: a
    description of each result that differs from want(xs, op) (the result
    of ordinary buffers everywhere), or of a window buffer that lost its
    values while another array was the input, or while it was the sendbuf."""
    bad = []
    for n in sizes:
        w = empty(n, dtype)
        for opname, op in ops.items():
            xs = inputs(P, n, dtype, seed=n + len(opname))
            ref, keep = want(xs, op), xs[r] * 2
            # which ranks pass their window buffer: the first, the odd, the last
            for pattern, mine in (("first", r == 0), ("odd", r % 2 == 1), ("last", r == P - 1)):
                where = f"n={n} {opname} {pattern}"
                w[...] = xs[r] if mine else keep
                buf = w if mine else xs[r].copy()
                allreduce(MPI.IN_PLACE, buf, op)
                if not equal_bits(buf, ref):
                    bad.append(f"{where} in place: wrong result")
                if not (mine or equal_bits(w, keep)):
                    bad.append(f"{where} in place: window buffer changed")
                w[...] = xs[r] if mine else keep
                out = np.full(n, 7, dtype)
                allreduce(w if mine else xs[r], out, op)
                if not equal_bits(out, ref):
                    bad.append(f"{where} sendbuf: wrong result")
                if not equal_bits(w, xs[r] if mine else keep):
                    bad.append(f"{where} sendbuf: window buffer changed")
    return bad


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_window_buffer_on_some_ranks_only(shm, dtype):
    """Whether a rank passes its empty() buffer is its own business: the
    others read its slot where its data starts, whatever they pass."""
    comm = shm.comm
    P, r = comm.Get_size(), comm.Get_rank()
    bad = mixed_calls(shm.allreduce, shm.empty, P, r, dtype, (1000, 40000), OPS, fixed_order)
    everywhere(comm, not bad, f"window buffer on some ranks: {bad[:4]}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_quantized_comm_window_buffer_on_some_ranks_only(check, dtype):
    """qc.empty() on some ranks only, with and without the agreement: the
    bits of ordinary buffers everywhere (no error: nothing documents that
    ranks must agree on it).  Reduce_scatter_block does not use the window,
    but takes a window buffer too."""
    w = MPI.COMM_WORLD
    P, r = w.Get_size(), w.Get_rank()
    with QuantizedComm(w, algorithm="shm", min_quantized_bytes=0, check=check) as qc:
        def plain(xs, op):
            out = np.empty_like(xs[r])
            qc.Allreduce(xs[r], out, op)
            return out
        bad = mixed_calls(qc.Allreduce, qc.empty, P, r, dtype, (1000, 100000), OPS, plain)
        everywhere(w, not bad and qc.last_call.method == "shm",
                   f"window buffer on some ranks ({qc.last_call.method}): {bad[:4]}")
        m = 10000
        xs = inputs(P, P * m, dtype, seed=2)
        want, got = np.empty(m, dtype), np.empty(m, dtype)
        qc.Reduce_scatter_block(xs[r], want)
        window = qc.empty(P * m, dtype)              # collective
        window[...] = xs[r]
        qc.Reduce_scatter_block(window if r == 0 else xs[r], got)
        everywhere(w, equal_bits(got, want), "Reduce_scatter_block from a window buffer")


@pytest.mark.mpi(min_size=2)
def test_auto_window_buffer_on_rank_0_only_at_64_mib():
    """Where auto takes the window: rank 0's window buffer in place, the
    others' ordinary arrays, check=False."""
    w, n = MPI.COMM_WORLD, 16 << 20
    x = inputs(1, n, np.float32, seed=w.Get_rank())[0]
    with QuantizedComm(w, algorithm="auto", check=False) as qc:
        plain = qc.allreduce(x)
        window = qc.empty(n, np.float32)             # collective
        buf = window if w.Get_rank() == 0 else np.empty(n, np.float32)
        buf[...] = x
        qc.Allreduce(MPI.IN_PLACE, buf)
        everywhere(w, equal_bits(buf, plain), f"{qc.last_call.method}: ordinary arrays' bits")
