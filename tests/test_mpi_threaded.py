"""The option threads under MPI: every schedule and wire gives the same bits
with kernels on 1, 2 and 3 threads, in pieces or not.

    mpirun -n 3 python -m pytest --with-mpi tests/test_mpi_threaded.py
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import threaded

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
CASES = [("ring", "int8", "nearest"), ("ring", "int4", "stochastic"), ("ring", "bf16", "nearest"),
         ("two_shot", "int8", "nearest"), ("two_shot", "fp8", "nearest"),
         ("two_shot", "int8-affine", "nearest"), ("two_shot", "int4", "stochastic"),
         ("two_shot", "fp32", "nearest"), ("rabenseifner", "int8", "nearest"),
         ("rabenseifner", "int4", "stochastic"), ("rabenseifner", "int8-affine", "nearest")]


@pytest.mark.parametrize("algorithm,wire,rounding", CASES)
def test_threads_do_not_change_a_bit(algorithm, wire, rounding, monkeypatch):
    # small parts, so that small messages are cut too
    monkeypatch.setattr(threaded, "MIN_PART", 2048)
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    n = 3 * 2048 * max(P, 2) * 3 + 1234          # parts on every rank's shard
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    x[7] = np.inf if r == 0 else 1.0             # a flagged block
    got = {}
    for threads in (1, 2, 3):
        for chunks in (1, 3):
            with QuantizedComm(WORLD, algorithm=algorithm, wire=wire, rounding=rounding,
                               threads=threads, chunks=chunks, min_quantized_bytes=0) as qc:
                everywhere(qc.threads == threads, f"threads {qc.threads}")
                out = qc.allreduce(x)
                rs = np.empty(n // P, np.float32)
                qc.Reduce_scatter_block(x[:rs.size * P], rs)
                got[threads, chunks] = out.tobytes() + rs.tobytes()
    first = got[1, 1]
    everywhere(all(v == first for v in got.values()),
               f"the same bits at 1-3 threads and 1 or 3 pieces: "
               f"{[k for k, v in got.items() if v != first]}")


def test_default_and_bad_values():
    with QuantizedComm(WORLD) as qc:
        everywhere(qc.threads >= 1, f"default {qc.threads}")
    for bad in (0, -1, 1.5, "2", 257):
        msg = raises_everywhere(ValueError, lambda: QuantizedComm(WORLD, threads=bad))
        assert "threads" in msg


def test_new_schedules_with_the_old_features(monkeypatch):
    """Rabenseifner and two-shot on the block wires, threaded, with what came
    before them: nonblocking and persistent calls, check=False, window
    buffers (qc.empty), and a wrapped communicator: the same bits as the
    plain blocking call."""
    from equarx_mpi import wrap
    monkeypatch.setattr(threaded, "MIN_PART", 2048)
    r = WORLD.Get_rank()
    n = 40000 + 17
    x = np.random.default_rng(10 + r).standard_normal(n).astype(np.float32)
    for algorithm, wire in (("rabenseifner", "int8"), ("two_shot", "fp8"),
                            ("rabenseifner", "int4-affine")):
        opts = dict(algorithm=algorithm, wire=wire, min_quantized_bytes=0)
        with QuantizedComm(WORLD, **opts) as qc:
            want = qc.allreduce(x)
        got = {}
        with QuantizedComm(WORLD, threads=2, check=False, **opts) as qc:
            out = np.empty_like(x)
            qc.Iallreduce(x, out).Wait()
            got["Iallreduce"] = out.copy()
            req = qc.Allreduce_init(x, out)
            for _ in range(2):
                req.Start()
                req.Wait()
            req.Free()
            got["persistent"] = out.copy()
            buf = qc.empty(n, np.float32)
            buf[:] = x
            qc.Allreduce(MPI.IN_PLACE, buf)
            got["window buffer"] = np.array(buf)
        w = wrap(WORLD, **opts)
        try:
            out = np.empty_like(x)
            w.Allreduce(x, out)
            got["wrapped"] = out
        finally:
            w.free()            # the library's duplicates; WORLD's own handle stays
        bad = [k for k, v in got.items() if v.tobytes() != want.tobytes()]
        everywhere(not bad, f"{algorithm}/{wire}: {bad} differ from the blocking call")


def test_error_feedback_with_threads(monkeypatch):
    """Error feedback decodes what each (threaded) quantization sent: the
    same outputs and residuals at 1 and 2 threads over three calls."""
    from equarx_mpi import ErrorFeedback
    monkeypatch.setattr(threaded, "MIN_PART", 2048)
    x = np.random.default_rng(WORLD.Get_rank()).standard_normal(50001).astype(np.float32) + 3
    got = {}
    for threads in (1, 2):
        for algorithm in ("ring", "two_shot"):
            with QuantizedComm(WORLD, algorithm=algorithm, wire="int4", threads=threads,
                               min_quantized_bytes=0) as qc:
                ef, outs = ErrorFeedback(), []
                for _ in range(3):
                    out = np.empty_like(x)
                    qc.Allreduce(x, out, feedback=ef)
                    outs.append(out.tobytes())
                got[threads, algorithm] = b"".join(outs) + ef.residual.tobytes()
    everywhere(all(got[1, a] == got[2, a] for a in ("ring", "two_shot")),
               "feedback: the same bits at 1 and 2 threads")
