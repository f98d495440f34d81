"""Error feedback (equarx_mpi.ErrorFeedback) under MPI, at any number of ranks.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_feedback.py

The running sum of many AllReduce results of biased data stays within
the ranks' last residuals of the exact running sum (the telescoping
identity, checked to rounding), while without feedback the distance grows
with every call; results are bitwise reproducible and identical on every
rank; reset, shape changes, exact paths, flagged blocks and wrong use;
Inf, NaN and overflow in one call of a sequence (the residual stays finite,
later calls are within their bounds), and -0.0 passing unchanged.
"""
import os
import sys

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere
from reference import unit_roundoff

from equarx_mpi import ErrorFeedback, QuantizedComm
from equarx_mpi.feedback import check

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD


def biased(n, dtype, r, block=256):
    """Every value 0.3 of a step above an int8 code of its block (whose
    largest magnitude, 1, comes first): rounding to nearest loses the same
    0.3 steps every call."""
    rng = np.random.default_rng(r + 1)
    x = ((rng.integers(-120, 120, n) + 0.3) / 127)
    x[::block] = 1.0
    return x.astype(dtype)


def running_distances(qc, x, calls, ef, in_place=False):
    """Per call, max |running sum of results - exact running sum| and the
    bound on it: the sum over ranks of max |residual| (0 without feedback)."""
    exact = WORLD.allreduce(x.astype(np.float64))
    run, dist, res = np.zeros(x.size), [], []
    out = np.empty_like(x)
    for t in range(1, calls + 1):
        if in_place:
            out[...] = x
            qc.Allreduce(MPI.IN_PLACE, out, feedback=ef)
        else:
            qc.Allreduce(x, out, feedback=ef)
        run += out.astype(np.float64) - exact      # the exact sum is the same every call
        dist.append(np.abs(run).max())
        res.append(0.0 if ef is None else float(np.abs(ef.residual).max()))
    return np.array(dist), WORLD.allreduce(np.array(res)), run


CASES = [  # (algorithm, wire, rounding, dtype, calls, in place)
    ("ring", "int8", "nearest", np.float32, 1000, False),
    ("two_shot", "int8", "nearest", np.float32, 200, True),
    ("ring", "int8", "stochastic", np.float32, 200, False),
    ("ring", "int4", "nearest", np.float32, 200, False),
    ("ring", "fp8", "nearest", np.float32, 200, False),
    ("two_shot", "int4", "stochastic", np.float32, 200, False),
    ("two_shot", "int8-affine", "nearest", np.float64, 100, True),
    ("two_shot", "int8", "nearest", np.float16, 200, False),
    ("ring", "int8", "nearest", np.float64, 200, True),
    ("ring", "int3", "nearest", np.float32, 200, False),
    ("two_shot", "int3", "nearest", np.float32, 200, True),
    ("two_shot", "int2", "nearest", np.float32, 200, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    str(np.dtype(v).name) if i == 3 else str(v) for i, v in enumerate(c)))
def test_running_sum_stays_within_the_last_residuals(case):
    """sum_t out_t = sum_t exact_t - sum_r e_r (telescoping), so the
    distance is at most R_t = sum_r max|e_r| (+ rounding), at every call.
    Each e_r holds one quantization's loss per value: at most h steps
    (h = 1/2 to nearest, 1 stochastic) of a block of partial sums of
    x + e, whose magnitudes are at most P A + R_{t-1} (A = max |x|), and
    for 16-bit values the roundings to the input and output type, so
    R_t <= P (h / L + 2 u16) (P A + R_{t-1}) (+ roundoff): bounded
    (about P^2 A h / L) while P h < L.  Without feedback the same loss
    comes back every call."""
    alg, wire, rounding, dt, calls, in_place = case
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    # levels L: a rounding loses at most h / L of its block's largest
    # magnitude (fp8 e4m3: half a unit of 3 fraction bits, 1/16 of the value;
    # int8-affine: a step is the range / 255, at most 2 A / 255)
    L = {"int8": 127, "int4": 7, "fp8": 8, "int8-affine": 127, "int3": 3, "int2": 1}[wire]
    x = biased(1000, dt, r, block=64 if wire in ("int4", "int3", "int2") else 256)
    opts = dict(algorithm=alg, wire=wire, rounding=rounding, min_quantized_bytes=0)
    with QuantizedComm(WORLD, **opts) as qc:
        ef = ErrorFeedback()
        dist, res, run = running_distances(qc, x, calls, ef, in_place)
        plain = running_distances(qc, x, calls, None)[0]
    total_res = WORLD.allreduce(ef.residual.astype(np.float64))
    A = WORLD.allreduce(float(np.abs(x).max()), MPI.MAX)
    u, u_in = unit_roundoff(np.float64 if dt == np.float64 else np.float32), unit_roundoff(dt)
    # float additions (unit roundoff each, in the accumulation type) the
    # residual does not see, over all calls: the hops', and x + e
    rounding_slack = calls * (P + 2) * P * A * u * 2
    if P == 1:
        everywhere(dist.max() == 0 and plain.max() == 0, "one rank: exact, nothing carried")
        return
    h = 0.5 if rounding == "nearest" else 1.0
    grown = P * A + np.r_[0.0, res[:-1]]                  # partial sums' largest magnitude
    limit = P * ((h + 640 * u) / L + 2 * u_in) * grown * (1 + 4 * P * u)
    everywhere((res <= limit).all(), f"sum of max |residual| {res.max():.4g} <= "
                                     f"{limit.max():.4g} at every call")
    everywhere((dist <= res + rounding_slack).all(),
               f"distance {dist.max():.4g} within the last residuals {res.max():.4g} "
               f"at every call (+ {rounding_slack:.2g})")
    tele = np.abs(run + total_res).max()
    everywhere(tele <= rounding_slack, f"telescoping: |running error + sum of residuals| "
                                       f"{tele:.3g} <= {rounding_slack:.2g}")
    if WORLD.Get_rank() == 0:
        print(f"\n{case}: P={P} max distance with feedback {dist.max():.4g}, max sum of "
              f"residuals {res.max():.4g}, telescoping {tele:.3g}; without: "
              f"{plain[calls // 10 - 1]:.4g} after {calls // 10} calls, {plain[-1]:.4g} after "
              f"{calls}")
    # without feedback: rounding to nearest loses the same every call (linear
    # growth); stochastic rounding's losses are a random walk (sqrt(10) = 3.2)
    growth, margin = (9, 20) if rounding == "nearest" else (2, 5)
    everywhere(plain[-1] > growth * plain[calls // 10 - 1],
               f"without feedback the distance grows {plain[-1] / plain[calls // 10 - 1]:.3g}x "
               f"from {calls // 10} to {calls} calls")
    everywhere(plain[-1] > margin * dist.max(), f"without feedback the distance grows: "
                                                f"{plain[-1]:.4g} after {calls} calls vs "
                                                f"{dist.max():.4g} with it")


@pytest.mark.parametrize("wire", ["int3", "int2"])
def test_low_bit_two_shot_residual_is_bounded_at_any_rank_count(wire):
    """Two-shot quantizes a value at most twice, the owner's own share not
    at all, so (docs/ERROR_FEEDBACK.md "Low-bit wires") with c = h/L (1 +
    O(u)) < 1 a sender's residual is at most E_s = c A / (1 - c) and an
    owner's at most E_o = c (P A + (P - 1) E_s) / (1 - c), whatever the
    number of calls: a bound that holds at every P, where the ring's
    (P h < L) fails for int2 from 2 ranks and for int3 from 6."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = (np.random.default_rng(r + 5).standard_normal(1000) * 0.5).astype(np.float32)
    x[::64] = 1.0
    with QuantizedComm(WORLD, algorithm="two_shot", wire=wire, min_quantized_bytes=0) as qc:
        ef = ErrorFeedback()
        dist, res, run = running_distances(qc, x, 300, ef)
        plain = running_distances(qc, x, 300, None)[0]
    if P == 1:
        everywhere(dist.max() == 0, "one rank: exact")
        return
    L = {"int3": 3, "int2": 1}[wire]
    u = unit_roundoff(np.float32)
    c = (0.5 + (5 * L + 1) * u) / L * (1 + 4 * P * u)
    A = WORLD.allreduce(float(np.abs(x).max()), MPI.MAX)
    e_s = c * A / (1 - c)
    e_o = c * (P * A + (P - 1) * e_s) / (1 - c)
    mine = WORLD.allreduce(float(np.abs(ef.residual).max()), MPI.MAX)
    everywhere(mine <= e_o, f"largest residual {mine:.4g} <= {e_o:.4g}")
    everywhere((res <= P * e_o).all(), f"sum of max |residual| {res.max():.4g} <= {P * e_o:.4g}")
    slack = 300 * (P + 2) * P * A * u * 2
    everywhere((dist <= res + slack).all(), f"distance {dist.max():.4g} within the residuals")
    everywhere(plain[-1] > 9 * plain[29] and plain[-1] > 5 * dist.max(),
               f"without feedback the distance grows: {plain[29]:.4g} after 30 calls, "
               f"{plain[-1]:.4g} after 300; with it at most {dist.max():.4g}")
    if r == 0:
        print(f"\n{wire} two-shot P={P}: distance with feedback {dist.max():.4g}, largest "
              f"residual {mine:.4g} (bound {e_o:.4g}), sum of residuals {res.max():.4g}; "
              f"without: {plain[29]:.4g} after 30 calls, {plain[-1]:.4g} after 300")


def test_bitwise_reproducible_and_identical_on_ranks():
    r = WORLD.Get_rank()
    x = biased(3000, np.float32, r)

    def run():
        with QuantizedComm(WORLD, min_quantized_bytes=0) as qc:
            ef = ErrorFeedback()
            outs = [qc.allreduce(x * (1 + t / 8), feedback=ef) for t in range(20)]
        return b"".join(o.tobytes() for o in outs), ef.residual.tobytes()

    a, b = run(), run()
    everywhere(a == b, "the same results and residual on a rerun")
    first = WORLD.bcast(a[0] if r == 0 else None)
    everywhere(a[0] == first, "results identical on every rank")


def test_reset_shape_and_dtype():
    """The first call fixes count and dtype; another raises ValueError on
    every rank until reset(); after reset the next call is a fresh one's."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = biased(1000, np.float32, r)
    with QuantizedComm(WORLD, min_quantized_bytes=0) as qc:
        ef, fresh = ErrorFeedback(), ErrorFeedback()
        assert ef.residual is None and "empty" in repr(ef)
        first = qc.allreduce(x, feedback=ef)
        again = qc.allreduce(x, feedback=ef)
        everywhere((again.tobytes() != first.tobytes()) == (P > 1), "the residual changes call 2")
        raises_everywhere(ValueError, lambda: qc.allreduce(x[:500], feedback=ef),
                          match="holds the residual of 1000 float32 values, not 500")
        raises_everywhere(ValueError, lambda: qc.allreduce(x.astype(np.float64), feedback=ef),
                          match="not 1000 float64")
        with pytest.raises(ValueError):
            ef.residual[0] = 1                      # read-only
        ef.reset()
        everywhere(qc.allreduce(x, feedback=ef).tobytes() == first.tobytes(),
                   "after reset: the first call's result")
        ef.reset()
        half = qc.allreduce(x[:500], feedback=ef)
        everywhere(half.tobytes() == qc.allreduce(x[:500], feedback=fresh).tobytes(),
                   "after reset any shape: as a fresh ErrorFeedback")
        everywhere(ef.residual.shape == (500,) and ef.residual.dtype == np.float32,
                   "the residual follows the new shape")


def test_errors_raise_on_every_rank():
    r = WORLD.Get_rank()
    x = biased(1000, np.float32, r)
    with QuantizedComm(WORLD, min_quantized_bytes=0) as qc:
        # only rank 0's ErrorFeedback is bound to another shape
        ef = ErrorFeedback()
        if r == 0:
            qc_self = QuantizedComm(MPI.COMM_SELF)
            qc_self.allreduce(x[:10], feedback=ef)
            qc_self.free()
        raises_everywhere(ValueError, lambda: qc.allreduce(x, feedback=ef),
                          match="holds the residual of 10 float32 values")
        raises_everywhere(ValueError, lambda: qc.allreduce(x, MPI.MAX, feedback=ErrorFeedback()),
                          match="feedback= needs op SUM, not MAX")
        raises_everywhere(TypeError, lambda: qc.allreduce(x, feedback=True),
                          match="feedback must be an equarx_mpi.ErrorFeedback")
        raises_everywhere(ValueError, lambda: qc.allreduce(np.arange(10), feedback=ErrorFeedback()),
                          match="takes float32, float64, float16 or bfloat16")
    err = check(ErrorFeedback(), "sum", x, "hierarchical")
    assert isinstance(err, ValueError) and "'ring' or 'two_shot'" in str(err)
    assert check(ErrorFeedback(), "sum", x, "two_shot") is None


@pytest.mark.parametrize("opts", [dict(algorithm="mpi"), dict(min_quantized_bytes=1 << 30),
                                  dict(algorithm="shm")], ids=str)
def test_exact_paths_hand_the_residual_on(opts):
    """An exact call reduces x + e exactly: the residual is delivered and
    starts again at zero."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = biased(1000, np.float32, r)
    ef = ErrorFeedback()
    with QuantizedComm(WORLD, min_quantized_bytes=0) as qc:
        qc.allreduce(x, feedback=ef)
    e = ef.residual.copy()
    with QuantizedComm(WORLD, **opts) as qc:
        out = qc.allreduce(x, feedback=ef)
        exact_path = qc.last_call.method in ("mpi", "shm", "copy")
    want = WORLD.allreduce(x + e)                 # float32, as MPI sums it
    everywhere(exact_path, f"{opts} takes an exact path")
    everywhere(np.abs(out - want).max() <= P * 4 * 2.0 ** -24 * np.abs(want).max(),
               "the result is the exact sum of x + e")
    everywhere((ef.residual == 0).all(), "nothing left over")


@pytest.mark.parametrize("alg", ["ring", "two_shot"])
def test_flagged_blocks_carry_nothing(alg):
    """A block with NaN is reduced exactly: its residual restarts at zero
    on every rank, and the NaN does not leak into the next call."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = biased(1024, np.float32, r)
    y = x.copy()
    if r == P - 1:
        y[300] = np.nan
    with QuantizedComm(WORLD, algorithm=alg, min_quantized_bytes=0) as qc:
        ef = ErrorFeedback()
        qc.allreduce(x, feedback=ef)
        out = qc.allreduce(y, feedback=ef)
        e = ef.residual.copy()
        nxt = qc.allreduce(x, feedback=ef)
    others = np.arange(256, 512) != 300
    everywhere(np.isnan(out[300]) and np.isfinite(out[256:512][others]).all(),
               "the flagged block: NaN where the input had it, MPI's exact sums elsewhere")
    everywhere((e[256:512] == 0).all(), "no residual in the flagged block")
    everywhere(np.isfinite(e).all() and np.isfinite(nxt).all(), "nothing non-finite carried")
    everywhere(P == 1 or np.abs(e).max() > 0, "the other blocks carry their losses")


def test_examples_reducers_with_feedback():
    """examples/methods.py: an "+ef" method keeps one ErrorFeedback per
    buffer shape."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from methods import Reducers
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    with Reducers(WORLD, ["int4", "int4+ef"]) as red:
        outs = {}
        for name in ("int4", "int4+ef"):
            for n in (1000, 700, 1000):
                buf = biased(n, np.float32, r)
                red[name](buf)
                outs.setdefault(name, []).append(buf)
    same = [a.tobytes() == b.tobytes() for a, b in zip(outs["int4"], outs["int4+ef"])]
    # with feedback: the first call of each shape as without, the second
    # call of shape 1000 carries that shape's residual
    everywhere(same[:2] == [True, True] and same[2] == (P == 1), f"per-shape residuals {same}")


@pytest.mark.parametrize("opts,dtype", [
    (dict(algorithm="ring"), np.float32), (dict(algorithm="two_shot"), np.float64),
    (dict(algorithm="ring", wire="int4"), "bfloat16"), (dict(algorithm="mpi"), np.float32),
    (dict(algorithm="mpi", check=False), np.float32), (dict(algorithm="shm"), np.float32),
    (dict(algorithm="shm", check=False), np.float16),
    (dict(algorithm="ring", min_quantized_bytes=1 << 30), np.float16)], ids=str)
def test_bound_holds_against_the_callers_values(opts, dtype):
    """With feedback each rank reduces x + e, not x; last_error_bound still
    bounds |result - exact sum of the x| (it adds how far each rank's
    values moved), per value and per block, identical on every rank."""
    from fractions import Fraction
    dtype = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
    r = WORLD.Get_rank()
    ef = ErrorFeedback()
    with QuantizedComm(WORLD, **{"min_quantized_bytes": 0, **opts}) as qc:
        for t in range(4):
            x = (biased(1000, np.float64, r + 7 * t) * 10.0 ** (2 - 2 * t)).astype(dtype)   # residuals of bigger calls carried into smaller
            out = qc.allreduce(x, feedback=ef)
            parts = np.array(WORLD.allgather(x.astype(np.float64)))
            exact = [sum(Fraction(v) for v in col) for col in parts.T]
            err = max(abs(Fraction(float(o)) - e) for o, e in zip(out.astype(np.float64), exact))
            bound = qc.last_error_bound
            blocks = qc.block_bounds()
            B = qc.block_size
            per_block = [max(abs(Fraction(float(out[i])) - exact[i])
                             for i in range(j * B, min((j + 1) * B, x.size)))
                         for j in range(blocks.size)]
            everywhere(err <= Fraction(bound) and np.isfinite(bound),
                       f"call {t}: error {float(err):.3g} within the (finite) bound {bound:.3g}")
            everywhere(all(e <= Fraction(float(b)) for e, b in zip(per_block, blocks)),
                       f"call {t}: every block within its bound")
            everywhere(len(set(WORLD.allgather(bound))) == 1, "one bound on every rank")


def test_a_residual_carried_to_one_rank_is_bounded():
    """A residual made on the whole communicator, then used on COMM_SELF
    (a copy): the result moved by the residual, and the bound says so."""
    r = WORLD.Get_rank()
    ef = ErrorFeedback()
    x = biased(1000, np.float32, r)
    with QuantizedComm(WORLD, algorithm="ring", min_quantized_bytes=0) as qc:
        qc.allreduce(x, feedback=ef)
    with QuantizedComm(MPI.COMM_SELF) as one:
        y = one.allreduce(x, feedback=ef)
        err = float(np.abs(y.astype(np.float64) - x.astype(np.float64)).max())
        everywhere(err <= one.last_error_bound and (WORLD.Get_size() == 1 or err > 0),
                   f"moved {err:.3g} within the bound {one.last_error_bound:.3g}")


DTYPES = [np.float32, np.float64, np.float16, "bfloat16"]


def _dtype(dt):
    return np.dtype(ml_dtypes.bfloat16 if dt == "bfloat16" else dt)


def _name(v):
    return v if isinstance(v, str) else np.dtype(v).name


def _ids(v):
    return "-".join(map(str, v.values())) if isinstance(v, dict) else _name(v)


# (options, input dtype): the exact paths (auto picks one at this size),
# and the quantized schedules with each wire
SEQUENCES = ([(dict(algorithm=a), dt) for a in ("mpi", "shm") for dt in DTYPES]
             + [(dict(algorithm="auto"), dt) for dt in (np.float16, "bfloat16")]
             + [(dict(algorithm=a, wire=w), dt) for a in ("ring", "two_shot")
                for w in ("int8", "bf16", "fp32") for dt in DTYPES]
             + [(dict(algorithm=a, wire=w), np.float16) for a in ("ring", "two_shot")
                for w in ("int4", "fp8")])


@pytest.mark.parametrize("opts,dt", SEQUENCES, ids=_ids)
def test_inf_nan_and_overflow_do_not_poison_later_calls(opts, dt):
    """Call 1 has an Inf (rank 0), a NaN (the last rank) and values whose
    sum overflows the type (every rank); calls 0 and 2-4 are finite.  The
    residual stays finite, and every later result is finite and within
    the bound it reports (a residual of Inf - Inf was NaN forever; a 16-bit
    store's overflow left -Inf)."""
    dt = _dtype(dt)
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    big = float(ml_dtypes.finfo(dt).max)
    ef = ErrorFeedback()
    with QuantizedComm(WORLD, **{"min_quantized_bytes": 0, **opts}) as qc:
        for t in range(5):
            # float32 values: their sums are exact in float64
            x = biased(1024, np.float32, r + 5 * t).astype(dt)
            if t == 1:
                x[300:310] = 0.75 * big
                if r == 0:
                    x[7] = np.inf
                if r == P - 1:
                    x[600] = np.nan
            with np.errstate(over="ignore"):
                exact = WORLD.allreduce(x.astype(np.float64))
            out = x.copy()
            qc.Allreduce(MPI.IN_PLACE, out, feedback=ef)
            got = out.astype(np.float64)
            everywhere(np.isfinite(ef.residual).all(), f"call {t}: a finite residual")
            if t == 1:
                bad = ~(np.abs(exact) <= big)             # Inf, NaN, beyond dt
                everywhere(got[7] == np.inf and np.isnan(got[600]),
                           "call 1: Inf and NaN where an input had them")
                everywhere(P == 1 or np.isinf(got[300:310]).all(), "call 1: the overflow is Inf")
                got, exact = got[~bad], exact[~bad]
            bound = qc.last_error_bound
            everywhere(np.isfinite(got).all(), f"call {t}: finite results where the sums are")
            err = np.abs(got - exact).max()
            everywhere(err <= bound, f"call {t}: error {err:.3g} within the bound {bound:.3g}")


@pytest.mark.parametrize("opts,dt", [(dict(algorithm=a), dt) for a in ("mpi", "shm")
                                     for dt in DTYPES]
                         + [(dict(algorithm="auto"), np.float32),
                            (dict(algorithm="ring", wire="int8"), np.float32)]
                         + [(dict(algorithm=a, wire="fp32"), dt) for a in ("ring", "two_shot")
                            for dt in DTYPES], ids=_ids)
def test_negative_zero_passes(opts, dt):
    """A zero residual is the identity of the addition: where every rank
    holds -0.0 the result has the sign it has without feedback, which on
    the exact paths is MPI's -0.0; at one rank each call returns its
    input bit for bit."""
    dt = _dtype(dt)
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    ef = ErrorFeedback()
    with QuantizedComm(WORLD, **{"min_quantized_bytes": 0, **opts}) as qc:
        for t in range(3):
            x = biased(1024, np.float32, r + 5 * t).astype(dt)
            x[1::5] = -0.0
            out = qc.allreduce(x, feedback=ef)
            plain = qc.allreduce(x)
            exact_path = qc.last_call.method in ("mpi", "shm", "copy")
            sign, want = np.signbit(out[1::5]), np.signbit(plain[1::5])
            everywhere((sign == want).all(), f"call {t}: -0.0 as without feedback "
                                             f"({np.count_nonzero(sign != want)} differ)")
            everywhere(not exact_path or sign.all(), f"call {t}: MPI's -0.0 on an exact path")
            everywhere(P > 1 or out.tobytes() == x.tobytes(), f"call {t}: one rank: the input")


@pytest.mark.parametrize("alg", ["mpi", "shm"])
def test_exact_sum_that_overflows_carries_nothing(alg):
    """A 16-bit exact call whose finite inputs overflow in the sum: the
    result is Inf there, and that value's residual restarts at zero (it
    kept the rounding of x + e)."""
    P = WORLD.Get_size()
    if P == 1:
        return
    x = np.random.default_rng(WORLD.Get_rank()).standard_normal(1024).astype(np.float16)
    ef = ErrorFeedback()
    with QuantizedComm(WORLD, algorithm="ring", min_quantized_bytes=0) as q:
        q.Allreduce(MPI.IN_PLACE, x.copy(), feedback=ef)          # a residual everywhere
    everywhere((ef.residual != 0).any(), "the quantized call left a residual")
    x[7] = 0.75 * 65504
    with QuantizedComm(WORLD, algorithm=alg) as q:
        y = x.copy()
        q.Allreduce(MPI.IN_PLACE, y, feedback=ef)
    everywhere(np.isinf(y[7]), "the sum overflowed")
    everywhere(ef.residual[7] == 0 and np.isfinite(ef.residual).all(),
               f"residual there {ef.residual[7]}")
