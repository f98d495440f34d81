"""rounding="stochastic" under MPI, at any number of ranks.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_stochastic.py

Every rank builds every rank's input from one seed and compares with the
numpy simulation of the schedule keyed as the library keys it
(reference.call_key(seed, call, rank) and each value's index): bit for
bit, identical on all ranks, the same on a rerun and whatever the pieces,
within the per-value bound (a whole step per quantization), blocks with
Inf/NaN equal to MPI's own reduction.  Averaged over calls the error
shrinks like 1/sqrt(calls), where rounding to nearest keeps its bias.
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere
from reference import BF16, INT8, allgather, call_key, ring_allreduce
from reference_formats import INT4
from reference_two_shot import two_shot_allreduce
from test_mpi_property import make, mpi

from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
DTYPES = [np.float32, np.float64, np.float16, BF16]
SEED = 2 ** 63 + 12345
#: (algorithm, wire, block) with stochastic rounding
PATHS = [("ring", "int8", 256), ("two_shot", "int8", 256), ("ring", "int4", 64),
         ("two_shot", "int4", 64)]
KINDS = ["normal", "nan", "inf", "signed-zeros", "constant", "mask", "limits",
         "subnormal-sweep", "mixed-ranks", "outliers"]


def keys(call, P):
    return [call_key(SEED, call, r) for r in range(P)]


def simulate(alg, wire, block, xs, call, kind="allreduce"):
    P = len(xs)
    if alg == "two_shot":
        return two_shot_allreduce(xs, block, with_bound=True, kind=kind, keys=keys(call, P),
                                  wire=wire)
    return ring_allreduce(xs, block, with_bound=True, kind=kind, keys=keys(call, P),
                          codec=INT8 if wire == "int8" else INT4)


def check_against_simulation(out, xs, alg, wire, block, call, what):
    """out: this rank's Allreduce result of call number ``call``."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    if P == 1:
        everywhere(out.tobytes() == xs[0].tobytes(), f"{what}: one rank copies")
        return
    ref, bound, flagged = simulate(alg, wire, block, xs, call)
    fixed = mpi("Allreduce", xs[r][flagged], "sum")
    ok = ~flagged
    x64 = [x.astype(np.float64) for x in xs]
    with np.errstate(invalid="ignore", over="ignore"):
        true = np.sum(x64, axis=0)
        slack = P * 2.0 ** -52 * np.sum(np.abs(x64), axis=0)
        err = np.abs(out.astype(np.float64) - true)
        within = (err[ok] <= bound[ok] + slack[ok]) | np.isinf(true[ok].astype(out.dtype))
    everywhere(out[ok].tobytes() == ref[ok].tobytes(), f"{what}: equal to the simulation")
    everywhere(out[flagged].tobytes() == fixed.tobytes(), f"{what}: flagged blocks as MPI")
    everywhere(within.all(), f"{what}: within the per-value bound")
    first = WORLD.bcast(out.tobytes() if r == 0 else None)
    everywhere(out.tobytes() == first, f"{what}: identical on all ranks")


#: every kind of input on the ring's int8, the telling ones on the others
#: (the generator and the keying are shared): seconds per test at 8 ranks
CASES = ([(PATHS[0], k) for k in KINDS]
         + [(p, k) for p in PATHS[1:] for k in ("normal", "nan", "limits", "mixed-ranks")])


@pytest.mark.parametrize("path,kind", CASES, ids=lambda c: c if isinstance(c, str)
                         else f"{c[0]}-{c[1]}")
def test_allreduce_matches_simulation_bitwise(path, kind):
    alg, wire, block = path
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    rng = np.random.default_rng(KINDS.index(kind) + 100 * P)
    with QuantizedComm(WORLD, algorithm=alg, wire=wire, rounding="stochastic", seed=SEED,
                       min_quantized_bytes=0, chunks=2) as qc:
        for dt in DTYPES:
            n = int(rng.integers(1, 6)) * block * max(P, 1) + int(rng.integers(-1, 2))
            xs = make(rng, kind if not (dt == BF16 and kind == "limits") else "normal",
                      n, P, np.dtype(dt), block)
            for call in range(2):           # the call number is part of the key
                out = np.empty_like(xs[r])
                qc.Allreduce(xs[r], out)
                check_against_simulation(out, xs, alg, wire, block, call,
                                         f"{np.dtype(dt).name} {n} call {call}")


@pytest.mark.parametrize("path", PATHS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_halves_match_simulation_bitwise(path):
    """Reduce_scatter_block (the last hop at full precision) and Allgather
    (each block quantized once by its owner, identical everywhere)."""
    alg, wire, block = path
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    rng = np.random.default_rng(7)
    m = 3 * block + 5
    xs = [rng.standard_normal(P * m).astype(np.float32) for _ in range(P)]
    seg = [x[:m].copy() for x in xs]
    with QuantizedComm(WORLD, algorithm=alg, wire=wire, rounding="stochastic", seed=SEED,
                       min_quantized_bytes=0) as qc:
        mine = np.empty(m, np.float32)
        qc.Reduce_scatter_block(xs[r], mine)
        gathered = np.empty(P * m, np.float32)
        qc.Allgather(seg[r], gathered)
    if P == 1:
        everywhere(mine.tobytes() == xs[0].tobytes() and gathered.tobytes() == seg[0].tobytes(),
                   "one rank copies")
        return
    ref = simulate(alg, wire, block, xs, 0, kind="reduce_scatter")[0]
    everywhere(mine.tobytes() == ref[r * m:(r + 1) * m].tobytes(),
               "Reduce_scatter_block equal to the simulation")
    codec = INT8 if wire == "int8" else INT4
    want = allgather(seg, block, codec, keys=keys(1, P))       # the second call
    everywhere(gathered.tobytes() == want.tobytes(), "Allgather equal to the simulation")


@pytest.mark.parametrize("path", PATHS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_reproducible_and_independent_of_pieces(path):
    """The same seed gives the same bits on a rerun (a fresh QuantizedComm)
    whatever the pieces and in place or not; another seed other bits."""
    alg, wire, block = path
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = np.random.default_rng(r).standard_normal(40 * block + 3).astype(np.float32)

    def run(seed, **opts):
        with QuantizedComm(WORLD, algorithm=alg, wire=wire, rounding="stochastic", seed=seed,
                           min_quantized_bytes=0, **opts) as qc:
            outs = [qc.allreduce(x) for _ in range(2)]
            a = x.copy()
            qc.Allreduce(MPI.IN_PLACE, a)
            return b"".join(o.tobytes() for o in outs + [a])

    first = run(5)
    for opts in (dict(chunks=1), dict(chunks=3), dict(max_message_bytes=4096)):
        everywhere(run(5, **opts) == first, f"seed 5 with {opts}: the same bits")
    differ = run(6) != first
    everywhere(differ == (P > 1), "another seed: other bits (with 2+ ranks)")


def _mean_error_rms(rounding, calls):
    """RMS over values of the mean error of the first t results, for t in
    calls; every input value 0.3 of a step above a code (a = 1 per block)."""
    r = WORLD.Get_rank()
    n, block = 4096, 256
    rng = np.random.default_rng(r)
    x = ((rng.integers(-120, 120, n) + 0.3) / 127).astype(np.float32)
    x[::block] = 1.0
    exact = WORLD.allreduce(x.astype(np.float64))
    total, rms = np.zeros(n), {}
    with QuantizedComm(WORLD, rounding=rounding, seed=1, min_quantized_bytes=0) as qc:
        for t in range(1, max(calls) + 1):
            total += qc.allreduce(x) - exact
            if t in calls:
                rms[t] = float(np.sqrt(np.mean((total / t)[x != 1] ** 2)))
    return rms


def test_mean_error_over_calls_shrinks_like_one_over_sqrt_calls():
    """Nearest rounding makes the same error every call; stochastic
    rounding's errors average out: 16 times the calls, a quarter the error."""
    P = WORLD.Get_size()
    calls = [16, 64, 256]
    sr, near = _mean_error_rms("stochastic", calls), _mean_error_rms("nearest", calls)
    if P == 1:
        everywhere(sr[16] == near[16] == 0, "one rank: exact")
        return
    slope = np.polyfit(np.log(calls), np.log([sr[t] for t in calls]), 1)[0]
    if WORLD.Get_rank() == 0:
        print(f"\nP={P} RMS mean error after {calls} calls: stochastic "
              f"{[f'{sr[t]:.3g}' for t in calls]} (slope {slope:.3f}), nearest "
              f"{[f'{near[t]:.3g}' for t in calls]}")
    everywhere(-0.6 < slope < -0.4, f"stochastic: slope {slope:.3f} of log error vs log calls")
    everywhere(abs(near[256] / near[16] - 1) < 1e-6, f"nearest: the same mean error {near}")
    everywhere(near[256] > 4 * sr[256], f"after 256 calls nearest {near} >> stochastic {sr}")


@pytest.mark.parametrize("alg", ["ring", "two_shot"])
def test_error_model_holds_with_stochastic_rounding(alg):
    """accuracy= trusts costmodel.error: measured, the relative L2 error of
    one call on standard-normal data is within 10% of the model's with
    either rounding (stochastic had no term: 1.20% against 0.85%)."""
    from equarx_mpi.model import costmodel
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    if P == 1:
        return
    n = 1 << 18
    x = np.random.default_rng(100 + r).standard_normal(n).astype(np.float32)
    exact = WORLD.allreduce(x.astype(np.float64))
    for rounding in ("nearest", "stochastic"):
        with QuantizedComm(WORLD, algorithm=alg, rounding=rounding, min_quantized_bytes=0) as q:
            out = q.allreduce(x)
            assert q.last_call.method == alg
        e = float(np.linalg.norm(out - exact) / np.linalg.norm(exact))
        model = costmodel.error(alg, "int8", 256, P, 1, rounding)
        everywhere(abs(e / model - 1) < 0.1, f"{alg} {rounding}: measured {e:.4%}, "
                                             f"model {model:.4%}")
