"""Iallreduce and Allreduce_init: the same bits as the blocking call, many
requests completed in any order, errors at the call on every rank.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_nonblocking.py
"""
import time

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import WORLD, everywhere, raises_everywhere

import equarx_mpi
from equarx_mpi import QuantizedComm
from equarx_mpi.call.nonblocking import PersistentRequest, Request
from equarx_mpi.call.validate import BFLOAT16

pytestmark = pytest.mark.mpi(min_size=1)
P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def data(n, dtype=np.float32, seed=0):
    return np.random.default_rng(seed + 10 * RANK).standard_normal(n).astype(dtype)


def bits(a):
    return a.view(np.uint8).tobytes()


@pytest.fixture(scope="module")
def qc():
    q = QuantizedComm(WORLD, min_quantized_bytes=1 << 12)
    yield q
    q.free()


def blocking(qc, x, op=MPI.SUM):
    out = np.empty_like(x)
    qc.Allreduce(x, out, op)
    return out


def test_same_bits_as_blocking(qc):
    ok = []
    for n, dt, op in ((5000, np.float32, MPI.SUM), (3001, np.float64, MPI.SUM),
                      (4096, BFLOAT16, MPI.SUM), (100, np.float32, MPI.SUM),
                      (5000, np.float32, MPI.MAX), (5000, np.int64, MPI.SUM)):
        x = data(n, dt) if dt != np.int64 else np.arange(n) * (RANK + 1)
        out = np.empty_like(x)
        req = qc.Iallreduce(x, out, op)
        req.Wait()
        ok.append(isinstance(req, MPI.Request) and bits(out) == bits(blocking(qc, x, op))
                  and req.info.call == "Allreduce")
    everywhere(all(ok), f"Iallreduce == Allreduce bit for bit: {ok}")


def test_persistent_rounds_follow_the_buffers(qc):
    x = data(6000)
    out = np.empty_like(x)
    req = qc.Allreduce_init(x, out)
    ok = []
    for k in range(3):
        x[:] = data(6000, seed=k)          # new values in the same buffer
        req.Start()
        req.Wait()
        ok.append(bits(out) == bits(blocking(qc, x)))
    req.Test()                             # inactive: complete at once
    req.Free()
    everywhere(all(ok) and req.info is not None, f"persistent rounds {ok}")


def test_many_outstanding_completed_in_any_order(qc):
    # integer values: MPI's own sums are exact in any order, so its
    # nonblocking algorithm gives the bits of the blocking one too
    sizes = [100, 9000, 700, 12000, 50, 20000, 3000, 300, 17, 5000, 1024, 8000]
    xs = [np.round(100 * data(n, seed=k)) for k, n in enumerate(sizes)]
    refs = [blocking(qc, x) for x in xs]
    w = equarx_mpi.wrap(WORLD, min_quantized_bytes=1 << 12)
    rng = np.random.default_rng(0)        # the same order on every rank
    ok = {}
    for finish in ("Waitall", "Testall", "each, reversed", "waitall"):
        outs = [np.empty_like(x) for x in xs]
        # our requests and MPI's own (the wrapped communicator's small,
        # exact calls return MPI's Iallreduce request) in one list
        reqs = [(w if k % 2 == 0 else qc).Iallreduce(x, o)
                for k, (x, o) in enumerate(zip(xs, outs))]
        ok["mixed"] = (any(isinstance(r, Request) for r in reqs)
                       and any(not isinstance(r, Request) for r in reqs)) or P == 1
        order = list(rng.permutation(len(reqs)))
        if finish == "Waitall":
            MPI.Request.Waitall([reqs[i] for i in order])
        elif finish == "Testall":
            deadline = time.monotonic() + 120
            while not MPI.Request.Testall([reqs[i] for i in order]):
                ok["in time"] = time.monotonic() < deadline
                time.sleep(0.001)
        elif finish == "waitall":
            equarx_mpi.waitall([reqs[i] for i in order])
        else:
            for r in reversed(reqs):
                r.Wait()
        ok[finish] = all(bits(o) == bits(r) for o, r in zip(outs, refs))
    w.free()
    everywhere(all(ok.values()), f"outstanding requests: {ok}")


def test_persistent_startall_waitall_testall(qc):
    xs = [data(5000, seed=k) for k in range(4)]
    outs = [np.empty_like(x) for x in xs]
    reqs = [qc.Allreduce_init(x, o) for x, o in zip(xs, outs)]
    ok = []
    for _ in range(2):
        equarx_mpi.startall(reqs)
        if _ == 0:
            MPI.Request.Waitall([r.request for r in reqs])   # the MPI requests of this round
        deadline = time.monotonic() + 120
        while not equarx_mpi.testall(reqs):
            ok.append(time.monotonic() < deadline)
            time.sleep(0.001)
        ok.append(all(bits(o) == bits(blocking(qc, x)) for x, o in zip(xs, outs)))
    for r in reqs:
        r.Free()
    everywhere(all(ok) and all(isinstance(r, PersistentRequest) for r in reqs), f"{ok}")


def test_progress_without_mpi_calls(qc):
    # the caller never enters MPI until the request is done: the thread drives it
    x = data(1 << 16)
    out = np.empty_like(x)
    req = qc.Iallreduce(x, out)
    deadline = time.monotonic() + 120
    while not req._done.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    done = req._done.is_set()
    req.Wait()
    everywhere(done and bits(out) == bits(blocking(qc, x)), "progress in the thread")


def test_blocking_call_waits_for_earlier_requests(qc):
    a, b = data(8000, seed=1), data(8000, seed=2)
    oa = np.empty_like(a)
    req = qc.Iallreduce(a, oa)
    ob = blocking(qc, b)                 # runs after the queued call, on every rank
    req.Wait()
    everywhere(bits(oa) == bits(blocking(qc, a)) and bits(ob) == bits(blocking(qc, b)),
               "program order")


def test_errors_are_raised_at_the_call_on_every_rank(qc):
    x = data(5000)
    raises_everywhere(TypeError, lambda: qc.Iallreduce(x, np.empty(5000, np.float64)), "dtype")
    raises_everywhere(TypeError, lambda: qc.Allreduce_init(x, None), "not a buffer")
    if P > 1:
        n = 5000 + (RANK == 1)
        raises_everywhere(ValueError, lambda: qc.Iallreduce(data(n), np.empty(n, np.float32)),
                          "count")
    req = qc.Allreduce_init(x, out := np.empty_like(x))
    req.Start()
    raises_everywhere(ValueError, req.Start, "active")
    req.Wait()
    everywhere(bits(out) == bits(blocking(qc, x)), "usable after the errors")


def test_without_thread_multiple_requests_complete_at_once():
    q = QuantizedComm(WORLD, min_quantized_bytes=0)
    q._exec.threaded = False        # what MPI without MPI_THREAD_MULTIPLE gives
    x = data(3000)
    out = np.empty_like(x)
    req = q.Iallreduce(x, out)
    done = req._done.is_set()
    req.Wait()
    ok = done and bits(out) == bits(blocking(q, x))
    q.free()
    everywhere(ok, "completed at the call")


def wait_until_done(req):
    deadline = time.monotonic() + 120
    while not req._done.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_requests_outlive_free():
    q = QuantizedComm(WORLD, min_quantized_bytes=0)
    x = data(3000)
    outs = [np.empty_like(x) for _ in range(3)]
    p, active = q.Allreduce_init(x, outs[0]), q.Allreduce_init(x, outs[1])
    p.Start()
    p.Wait()
    active.Start()
    r = q.Iallreduce(x, outs[2])
    q.free()                      # completes the calls in flight
    done = active.Test() and r.Test() and active.Wait() and r.Wait()
    raises_everywhere(ValueError, p.Start, "has been freed")
    raises_everywhere(ValueError, active.Start, "has been freed")
    p.Free()
    with QuantizedComm(WORLD, min_quantized_bytes=0) as q:
        ref = blocking(q, x)
    everywhere(done and all(bits(o) == bits(ref) for o in outs), "requests after free()")


def test_persistent_request_is_active_until_completed(qc):
    x = data(5000)
    out = np.empty_like(x)
    p = qc.Allreduce_init(x, out)
    p.Start()
    wait_until_done(p._req)       # finished, but not completed by Wait or Test
    raises_everywhere(ValueError, p.Start, "active")
    p.Wait()
    p.Start()
    MPI.Request.Waitall([p.request])    # completed by MPI's own call: inactive
    p.Start()
    ok = p.Test() or p.Wait()
    p.Free()
    raises_everywhere(ValueError, p.Start, "freed persistent request")
    everywhere(ok and p.info is not None and bits(out) == bits(blocking(qc, x)),
               "persistent request's states")
