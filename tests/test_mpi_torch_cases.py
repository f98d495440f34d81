"""The "equarx" backend on the cases a review and real clients found (issue
"as trustworthy as gloo"), each against gloo on the same inputs where gloo
applies: asynchronous calls that never wait for peers in the caller's
thread, timeouts, groups destroyed in any order, torch's layouts and
future values, in-place and empty buffers, integer AVG, complex
reductions, dropped sends, messages above MPI's int counts.

    mpirun -n 2 python -m pytest --with-mpi -q tests/test_mpi_torch_cases.py

Skips as tests/test_mpi_torch.py does (mpi_helpers.torch_suite).
"""
import datetime
import gc
import os
import time

import pytest
from mpi4py import MPI
from mpi_helpers import WORLD, equarx_and_gloo, everywhere, raises_everywhere, torch_suite

torch, dist, eqt, R, P = torch_suite()
from equarx_mpi.torch import calls  # noqa: E402

pytestmark = pytest.mark.mpi
Op = dist.ReduceOp


gloo = pytest.fixture(equarx_and_gloo, scope="module", autouse=True, name="gloo")


def mine(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + R)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


# --- asynchronous calls: no peer is waited for in the caller's thread -----------------
@pytest.mark.mpi(min_size=2)
def test_async_on_two_groups_in_different_orders():
    """Each rank starts async all_reduces on two groups in its own order,
    then waits on both: gloo completes, and so must "equarx"."""
    a, b = dist.new_group(backend="equarx"), dist.new_group(backend="equarx")
    xa, xb = torch.full((1000,), 1.0), torch.full((1000,), 2.0)
    order = [(a, xa), (b, xb)] if R % 2 == 0 else [(b, xb), (a, xa)]
    works = [dist.all_reduce(x, group=g, async_op=True) for g, x in order]
    for w in works:
        w.wait()
    everywhere(torch.equal(xa, torch.full((1000,), float(P))) and
               torch.equal(xb, torch.full((1000,), 2.0 * P)), "both sums")
    dist.destroy_process_group(a)
    dist.destroy_process_group(b)


@pytest.mark.mpi(min_size=2)
def test_async_then_send_while_peer_receives_first():
    """Rank 0 starts an async all_reduce, then sends; rank 1 receives
    first, then all_reduces."""
    x, msg = torch.full((8,), float(R)), torch.arange(4.0)
    if R == 0:
        w = dist.all_reduce(x, async_op=True)
        dist.send(msg, 1)
        w.wait()
    elif R == 1:
        got = torch.zeros(4)
        dist.recv(got, 0)
        dist.all_reduce(x)
        everywhere(torch.equal(got, msg), "the message", comm=MPI.COMM_SELF)
    else:
        dist.all_reduce(x)
    everywhere(torch.equal(x, torch.full((8,), P * (P - 1) / 2)), "the sum")


@pytest.mark.mpi(min_size=2)
def test_timeout_raises_and_breaks_only_that_group(gloo):
    """A call that a peer never makes: wait(timeout) gives up on time, and
    the group's own timeout raises torch's DistBackendError ("Timed out")
    on the rank that made it; the group refuses later calls; it is
    destroyed without waiting; every other group works."""
    g = dist.new_group(backend="equarx", timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(2), group=g)             # the group works first
    ok = True
    if R == 0:
        t0 = time.monotonic()
        w = dist.all_reduce(torch.ones(2), group=g, async_op=True)
        returned = time.monotonic() - t0
        try:
            w.wait(timeout=datetime.timedelta(seconds=0.5))
            ok = False
        except RuntimeError as e:
            ok = "did not complete" in str(e)
        try:
            w.wait()
            ok = False
        except dist.DistBackendError as e:
            ok = ok and " Timed out " in str(e) and "all_reduce" in str(e)
        waited = time.monotonic() - t0
        ok = ok and returned < 1.5 and 1.9 < waited < 30
        try:
            dist.barrier(group=g)
            ok = False
        except dist.DistBackendError as e:
            ok = ok and "cannot be used any more" in str(e)
    everywhere(ok, "the async call returned at once, timed out, and broke its group")
    dist.destroy_process_group(g)
    x = torch.ones(3)
    dist.all_reduce(x)
    everywhere(torch.equal(x, torch.full((3,), float(P))), "the default group still works")


@pytest.mark.mpi(min_size=2)
def test_blocking_barrier_times_out():
    """torch's test_barrier_timeout_*: rank 0 alone calls barrier."""
    g = dist.new_group(backend="equarx", timeout=datetime.timedelta(seconds=1))
    msg = None
    if R == 0:
        t0 = time.monotonic()
        try:
            dist.barrier(group=g)
        except dist.DistBackendError as e:
            msg = str(e) if time.monotonic() - t0 >= 0.9 else "too early"
    everywhere(R != 0 or (msg is not None and " Timed out " in msg and "barrier" in msg),
               f"rank 0's barrier timed out: {msg}")
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
def test_abort_waits_for_nothing():
    """abort() with a call queued that no peer makes: it returns at once,
    and the group refuses later calls."""
    g = dist.new_group(backend="equarx", timeout=datetime.timedelta(seconds=3))
    ok = True
    if R == 0:
        w = dist.all_reduce(torch.ones(2), group=g, async_op=True)
        t0 = time.monotonic()
        g.abort()
        ok = time.monotonic() - t0 < 1.0
        try:
            dist.all_reduce(torch.ones(2), group=g)
            ok = False
        except RuntimeError:
            pass
        try:        # refused, or its agreement gives up at the group's timeout
            w.wait()
            ok = False
        except RuntimeError:
            pass
    everywhere(ok, "abort returned at once; the group refuses calls")
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
def test_destroy_shm_groups_in_any_order():
    """Groups whose QuantizedComm holds a shared-memory window (freed
    collectively), destroyed in a different order on each rank."""
    opts = eqt.Options(algorithm="shm")
    groups = [dist.new_group(backend="equarx", pg_options=opts) for _ in range(2)]
    for g in groups:
        x = torch.ones(1 << 12)
        dist.all_reduce(x, group=g)
        everywhere(eqt.qcomm(g).last_call.method == "shm", "the window was used")
    for g in (groups if R % 2 == 0 else groups[::-1]):
        dist.destroy_process_group(g)
    x = torch.ones(3)
    dist.all_reduce(x)
    everywhere(torch.equal(x, torch.full((3,), float(P))), "the default group after")


# --- torch's layouts and values ---------------------------------------------------------
def test_all_gather_coalesced_layout(gloo):
    """outputs[r][i] is input i of rank r, as on gloo, with as many inputs
    as ranks and with another count."""
    for k in (P, P + 1):
        ins = [mine(i + 1, seed=i) for i in range(k)]
        ours = [[torch.zeros(i + 1) for i in range(k)] for _ in range(P)]
        ref = [[torch.zeros(i + 1) for i in range(k)] for _ in range(P)]
        dist.all_gather_coalesced(ours, ins)
        dist.all_gather_coalesced(ref, ins, group=gloo)
        everywhere(all(torch.equal(o, r) for lo, lr in zip(ours, ref) for o, r in zip(lo, lr)),
                   f"all_gather_coalesced of {k} inputs")


def test_async_all_gather_future(gloo):
    outs = {name: [torch.zeros(2) for _ in range(P)] for name in ("ours", "gloo")}
    t = torch.full((2,), float(R))
    ours = dist.all_gather(outs["ours"], t, async_op=True).get_future().wait()
    ref = dist.all_gather(outs["gloo"], t, group=gloo, async_op=True).get_future().wait()
    everywhere(len(ours) == len(ref) == P and all(torch.equal(a, b) for a, b in zip(ours, ref)),
               "the future holds the list of outputs, as gloo's")


def test_all_reduce_coalesced_aliases(gloo):
    t, u = torch.ones(3), torch.ones(3)
    dist.all_reduce_coalesced([t, t])
    dist.all_reduce_coalesced([u, u], group=gloo)
    everywhere(torch.equal(t, u), f"a tensor passed twice: {t} (gloo {u})")


def test_reduce_scatter_tensor_in_place(gloo):
    """out is this rank's chunk of inp (ZeRO's, Megatron's pattern)."""
    x = mine(4 * P, seed=3)
    ours, ref = x.clone(), x.clone()
    dist.reduce_scatter_tensor(ours.chunk(P)[R], ours)
    dist.reduce_scatter_tensor(ref.chunk(P)[R], ref, group=gloo)
    # (gloo and MPI add in one order at 2 ranks, not beyond)
    same = torch.equal if P <= 2 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    everywhere(same(ours.chunk(P)[R], ref.chunk(P)[R]), "the chunk's sum")


def test_empty_receives(gloo):
    """All-gathers and gathers of empty tensors; an all-to-all where a rank
    receives nothing."""
    outs = [torch.ones(0) for _ in range(P)]
    dist.all_gather(outs, torch.ones(0))
    gathered = [torch.ones(0) for _ in range(P)] if R == 0 else None
    dist.gather(torch.ones(0), gathered, dst=0)
    # rank r sends r + 1 rows to every rank but the last, which gets none
    send = [R + 1 if j < P - 1 else 0 for j in range(P)]
    recv = [r + 1 if R < P - 1 else 0 for r in range(P)]
    inp = torch.full((sum(send), 2), float(R))
    ours, ref = torch.full((sum(recv), 2), -1.0), torch.full((sum(recv), 2), -1.0)
    dist.all_to_all_single(ours, inp, recv, send)
    dist.all_to_all_single(ref, inp, recv, send, group=gloo)
    everywhere(torch.equal(ours, ref), "an uneven all_to_all_single")


@pytest.mark.mpi(min_size=2)
def test_integer_avg_rounds_toward_zero():
    """NCCL's integer AVG: the sum divided by the ranks toward zero."""
    x = torch.tensor([-3, 3, 7, -1], dtype=torch.int64) if R == 0 else \
        torch.zeros(4, dtype=torch.int64)
    dist.all_reduce(x, op=Op.AVG)
    want = torch.div(torch.tensor([-3, 3, 7, -1]), P, rounding_mode="trunc")
    everywhere(torch.equal(x, want), f"{x} against {want}")
    n = torch.tensor(5, dtype=torch.int64)          # Lightning's batch counter
    dist.all_reduce(n, op=Op.AVG)
    everywhere(n.item() == 5, "an equal counter averages to itself")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_reductions(gloo, dtype):
    x = torch.complex(mine(4 * P, seed=5), mine(4 * P, seed=6)).to(dtype)
    results = {}
    for name, g in (("ours", None), ("gloo", gloo)):
        r = x.clone()
        dist.reduce(r, dst=0, group=g)
        out = torch.zeros(4, dtype=dtype)
        dist.reduce_scatter_tensor(out, x.clone(), group=g)
        lst = torch.zeros(4, dtype=dtype)
        dist.reduce_scatter(lst, list(x.clone().chunk(P)), group=g)
        results[name] = (r if R == 0 else x, out, lst)
    everywhere(all(torch.allclose(a, b, rtol=1e-6, atol=1e-6 if dtype == torch.complex64 else 1e-12)
                   for a, b in zip(results["ours"], results["gloo"])),
               f"{dtype} reduce and reduce_scatter")
    raises_everywhere(TypeError, lambda: dist.reduce(x.clone(), dst=0, op=Op.MAX),
                      match="complex tensors reduce with SUM and AVG only")


@pytest.mark.mpi(min_size=2)
def test_all_to_all_dtypes_differ_between_ranks():
    n = 2 * P
    for theirs in (torch.int32, torch.float64):
        dtype = torch.float32 if R == 0 else theirs
        raises_everywhere(TypeError, lambda: dist.all_to_all_single(
            torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)), match="dtype differs")
        raises_everywhere(TypeError, lambda: dist.all_to_all(
            [torch.zeros(2, dtype=dtype) for _ in range(P)],
            [torch.ones(2, dtype=dtype) for _ in range(P)]), match="dtype differs")


# --- point to point -----------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_a_call_agrees_once(monkeypatch, algorithm):
    """One agreement per all_reduce and reduce_scatter (issue "one home"):
    the group's fields ride on its QuantizedComm's agreement, on MPI's own
    path and on a quantized one; a mismatch is still caught everywhere."""
    from equarx_mpi.call import agree
    seen = []
    real = agree.agree

    def counted(*args, **kw):
        seen.append(args[1])
        return real(*args, **kw)
    for module in ("equarx_mpi.torch.group", "equarx_mpi.comm"):
        monkeypatch.setattr(f"{module}.agree", counted)
    g = dist.new_group(backend="equarx",
                       pg_options=eqt.Options(algorithm=algorithm, min_quantized_bytes=0))
    x, out = torch.ones(4096 * P), torch.empty(4096)
    seen.clear()
    dist.all_reduce(x, group=g)
    dist.reduce_scatter_tensor(out, x, group=g)
    dist.all_reduce(x, group=g, async_op=True).wait()
    everywhere(seen == ["all_reduce", "reduce_scatter_tensor", "all_reduce"], str(seen))
    raises_everywhere(ValueError, lambda: dist.all_reduce(
        torch.ones(10 + R), group=g), match="element count differs")
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
def test_dropped_isend_is_delivered():
    """The sender keeps neither the Work nor the tensor: the group does,
    until MPI has sent it (4 MiB: sent when the receive is posted)."""
    n = 1 << 20
    if R == 0:
        dist.isend(torch.full((n,), 7.0), 1)
        gc.collect()
        junk = [torch.full((n,), -1.0) for _ in range(4)]     # reuse freed memory
    WORLD.Barrier()
    if R == 1:
        got = torch.zeros(n)
        dist.recv(got, 0)
        junk = torch.equal(got, torch.full((n,), 7.0))
    everywhere(R != 1 or junk is True, "the dropped send's values")


@pytest.mark.mpi(min_size=2)
def test_qcomm_off_group():
    g = dist.new_group([0], backend="equarx")
    if R == 0:
        everywhere(eqt.qcomm(g) is not None, "rank 0's QuantizedComm", comm=MPI.COMM_SELF)
    else:
        with pytest.raises(ValueError, match="not a member"):
            eqt.qcomm(g)


# --- messages above MPI's C-int counts ----------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_large_message_path(gloo, monkeypatch):
    """The derived-datatype path of every byte-moving call, on small
    tensors (INT_MAX lowered to 1000 bytes), against gloo."""
    monkeypatch.setattr(calls, "INT_MAX", 1000)
    monkeypatch.setattr(calls, "_CHUNK", 384)       # 1 GiB blocks and a rest
    x = mine(1000, seed=7)                          # 4000 bytes
    results = {}
    for name, g in (("ours", None), ("gloo", gloo)):
        b = x.clone()
        dist.broadcast(b, src=0, group=g)
        ag = [torch.zeros(1000) for _ in range(P)]
        dist.all_gather(ag, x, group=g)
        agt = torch.zeros(1000 * P)
        dist.all_gather_into_tensor(agt, x, group=g)
        ga = [torch.zeros(1000) for _ in range(P)] if R == 0 else None
        dist.gather(x, ga, dst=0, group=g)
        sc = torch.zeros(1000)
        dist.scatter(sc, [mine(1000, seed=8 + j) for j in range(P)] if R == 0 else None,
                     src=0, group=g)
        a2a = torch.zeros(400 * P)
        dist.all_to_all_single(a2a, mine(400 * P, seed=9), group=g)
        pp = torch.zeros(1000)
        reqs = [dist.isend(x, (R + 1) % P, group=g), dist.irecv(pp, (R - 1) % P, group=g)]
        for q in reqs:
            q.wait()
        results[name] = [b, *ag, agt, *(ga or []), sc, a2a, pp]
    everywhere(all(torch.equal(a, b) for a, b in zip(results["ours"], results["gloo"])),
               "every call as gloo's")


@pytest.mark.large
@pytest.mark.skipif(os.environ.get("EQUARX_MPI_LARGE") != "1",
                    reason="set EQUARX_MPI_LARGE=1 (needs ~5 GiB per rank)")
@pytest.mark.mpi(min_size=2)
def test_broadcast_and_send_above_2_gib():
    n = (1 << 31) + 4096 + 3                        # bytes
    if R == 0:      # byte i is i mod 251 (a prime: no 1 GiB block repeats another)
        t = torch.arange(251, dtype=torch.uint8).repeat(n // 251 + 1)[:n]
    else:
        t = torch.zeros(n, dtype=torch.uint8)
    dist.broadcast(t, src=0)
    probe = torch.tensor([0, 1 << 30, (1 << 31) - 1, 1 << 31, n - 1])
    everywhere(torch.equal(t[probe], probe.remainder(251).to(torch.uint8)),
               "the broadcast's bytes at every 1 GiB block and the rest")
    if R < 2:
        t[-1] = 0 if R == 1 else 99
        if R == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        everywhere(t[-1].item() == 99, "the last byte of a >2 GiB send", comm=MPI.COMM_SELF)
    WORLD.Barrier()
