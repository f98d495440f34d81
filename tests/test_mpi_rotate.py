"""Rotated calls (option ``rotate``, collectives/rotation.py) under MPI, at
any number of ranks.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_rotate.py

A rotated call is the unrotated call on the inputs rotated by the numpy
reference (reference_rotate.py), rotated back by it: bit for bit, for
Allreduce on each schedule, Reduce_scatter_block and Allgather, odd
lengths and rotation sizes below the block.  The certified bound holds on
Gaussian and heavy-tailed data; outlier channels cost the rotated wire far
less; Inf, NaN, values near a type's limit (float16, bfloat16, float32),
subnormals, zeros and single spikes go the exact way or stay within the
bound; bad options raise on every rank; nonblocking, persistent, wrapped
calls and error feedback (its residual kept rotated) work rotated too.
"""
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere
from reference_rotate import rotate as ref_rotate
from reference_rotate import unrotate as ref_unrotate

import equarx_mpi
from equarx_mpi import ErrorFeedback, QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
SEED = 7
BF16 = np.dtype(ml_dtypes.bfloat16)


def heavy(n, r, dtype=np.float32, outliers=40.0):
    """Student-t values with outlier channels (every 97th value 40x)."""
    rng = np.random.default_rng(100 + r)
    x = rng.standard_t(3, n)
    x[::97] *= outliers
    return x.astype(dtype)


def opts(**kw):
    return dict(dict(min_quantized_bytes=0, seed=SEED, algorithm="ring"), **kw)


def same_everywhere(y):
    return all(np.array_equal(a.view(np.uint8), y.view(np.uint8)) for a in WORLD.allgather(y))


@pytest.mark.parametrize("alg,wire,size,n", [
    ("ring", "int8", True, 5000), ("two_shot", "int4", True, 4099),
    ("rabenseifner", "int8", 64, 3001), ("ring", "fp8", 32, 777),
    ("two_shot", "int8-affine", True, 2048), ("ring", "int4", 8, 131),
    ("two_shot", "int3", True, 3000), ("two_shot", "int2", 32, 1029),
    ("ring", "int5", True, 2000), ("two_shot", "int6", 16, 1500)])
def test_allreduce_is_the_call_on_rotated_inputs(alg, wire, size, n):
    r = WORLD.Get_rank()
    x = heavy(n, r)
    with QuantizedComm(WORLD, **opts(algorithm=alg, wire=wire, rotate=size)) as qc:
        got = np.empty_like(x)
        qc.Allreduce(x, got)
        info = qc.last_call
    S = qc.block_size if size is True else size
    with QuantizedComm(WORLD, **opts(algorithm=alg, wire=wire)) as plain:
        z = np.empty(n, np.float32)
        plain.Allreduce(ref_rotate(x, S, SEED, 0), z)
    # one rank: every call is a copy, nothing is rotated
    want = ref_unrotate(z, S, SEED, 0, dtype=np.float32) if WORLD.Get_size() > 1 else x
    if WORLD.Get_size() > 1:
        everywhere(info.rotation == S and info.wire == wire, f"rotated: {info}")
    everywhere(np.array_equal(got.view(np.uint32), want.view(np.uint32)),
               f"bitwise the reference's: {np.abs(got - want).max()}")
    everywhere(same_everywhere(got), "identical on every rank")


@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_scatter_and_allgather_rotate_each_shard(in_place):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    m = 1000                                   # not a multiple of the block
    x = heavy(P * m, r)
    with QuantizedComm(WORLD, **opts(wire="int8", rotate=True, lossy_allgather=True)) as qc:
        got = x.copy()
        if in_place:
            qc.Reduce_scatter_block(MPI.IN_PLACE, got)
            got = got[:m].copy()
        else:
            got = np.empty(m, np.float32)
            qc.Reduce_scatter_block(x, got)
        gathered = np.empty(P * m, np.float32)
        mine = x[r * m:(r + 1) * m].copy()
        if in_place:
            gathered[r * m:(r + 1) * m] = mine
            qc.Allgather(MPI.IN_PLACE, gathered)
        else:
            qc.Allgather(mine, gathered)
        S = qc.block_size
    with QuantizedComm(WORLD, **opts(wire="int8", lossy_allgather=True)) as plain:
        y = np.concatenate([ref_rotate(x[s * m:(s + 1) * m], S, SEED, 0, start=s * m)
                            for s in range(P)])
        z = np.empty(m, np.float32)
        plain.Reduce_scatter_block(y, z)
        zg = np.empty(P * m, np.float32)
        plain.Allgather(ref_rotate(mine, S, SEED, 0, start=r * m), zg)
    want = ref_unrotate(z, S, SEED, 0, start=r * m, dtype=np.float32)
    wg = np.concatenate([ref_unrotate(zg[s * m:(s + 1) * m], S, SEED, 0, start=s * m,
                                      dtype=np.float32) for s in range(P)])
    if P == 1:                    # copies
        want, wg = x, x
    everywhere(np.array_equal(got, want), "Reduce_scatter_block: the reference's")
    everywhere(np.array_equal(gathered, wg), "Allgather: the reference's")


@pytest.mark.parametrize("in_place", [False, True])
def test_shards_with_bad_values_go_exact(in_place):
    """Reduce_scatter_block and Allgather, shards not a multiple of the
    block: an Inf block and a block whose rotation back would overflow go
    exact (MPI's sum; the owner's bits), in place as out of place."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    m, B = 1000, 256
    top = float(np.finfo(np.float32).max)
    x = heavy(P * m, r)
    for s in range(P):
        x[s * m + 3] = np.inf if r == 0 else 1.0
        x[s * m + 512:s * m + 768] = top / 4 * (1 - 2 * (np.arange(B) % 2)) / P
    exact = np.empty(m, np.float32)
    WORLD.Reduce_scatter_block(x, exact)
    with QuantizedComm(WORLD, **opts(wire="int8", rotate=True, lossy_allgather=True,
                                     block_size=B)) as qc:
        if in_place:
            got = x.copy()
            qc.Reduce_scatter_block(MPI.IN_PLACE, got)
            got = got[:m].copy()
        else:
            got = np.empty(m, np.float32)
            qc.Reduce_scatter_block(x, got)
        mine = x[r * m:(r + 1) * m].copy()
        gathered = np.zeros(P * m, np.float32)
        if in_place:
            gathered[r * m:(r + 1) * m] = mine
            qc.Allgather(MPI.IN_PLACE, gathered)
        else:
            qc.Allgather(mine, gathered)
    whole = WORLD.allgather(mine)
    everywhere(np.isinf(got[3]) and np.array_equal(got[512:768], exact[512:768]),
               "Reduce_scatter_block: the Inf and the large block are MPI's")
    everywhere(all(np.isinf(gathered[s * m + 3]) == (s == 0) for s in range(P)) and all(
        np.array_equal(gathered[s * m + 512:s * m + 768], whole[s][512:768]) for s in range(P)),
        "Allgather: the large blocks are their owners' bits")


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8", "int8-affine", "int4-affine", "int3",
                                  "int2"])
@pytest.mark.parametrize("alg", ["ring", "two_shot", "rabenseifner"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
def test_bound_holds(wire, alg, dtype):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    for x in (heavy(3000, r, dtype), np.random.default_rng(r).standard_normal(3000)
              .astype(dtype)):
        exact = WORLD.allreduce(x.astype(np.float64))
        with QuantizedComm(WORLD, **opts(algorithm=alg, wire=wire, rotate=True)) as qc:
            got = np.empty_like(x)
            qc.Allreduce(x, got)
            err = np.abs(got.astype(np.float64) - exact)
            b = qc.last_error_bound
            blocks = qc.block_bounds()
        per_value = np.repeat(blocks, qc.block_size)[:x.size]
        everywhere(err.max() <= b and (err <= per_value).all(),
                   f"error {err.max():.4g} within the bound {b:.4g} and per block")
        if P > 1:
            everywhere(b < np.inf, "a finite bound")
        everywhere(same_everywhere(got), "identical on every rank")


def rel(got, exact):
    return float(np.linalg.norm(got.astype(np.float64) - exact) / np.linalg.norm(exact))


@pytest.mark.parametrize("wire,gain", [("int8", 4.0), ("int4", 1.5)])
def test_outlier_channels_cost_the_rotated_wire_less(wire, gain):
    """The same heavy-tailed data, rotated and not (measured at 2-4 ranks:
    int8 7x lower relative L2 error, int4 2x); on Gaussian data rotation
    costs at most 10% more error."""
    r = WORLD.Get_rank()
    errors = {}
    for kind, x in (("heavy", heavy(1 << 15, r)),
                    ("gauss", np.random.default_rng(r).standard_normal(1 << 15)
                     .astype(np.float32))):
        exact = WORLD.allreduce(x.astype(np.float64))
        for rot in (False, True):
            with QuantizedComm(WORLD, **opts(wire=wire, rotate=rot)) as qc:
                got = np.empty_like(x)
                qc.Allreduce(x, got)
            errors[kind, rot] = rel(got, exact)
    if WORLD.Get_size() == 1:                # a copy: exact
        everywhere(max(errors.values()) == 0, f"one rank: exact {errors}")
        return
    everywhere(errors["heavy", False] > gain * errors["heavy", True],
               f"heavy-tailed: {errors['heavy', False]:.3g} unrotated vs "
               f"{errors['heavy', True]:.3g} rotated")
    everywhere(errors["gauss", True] <= 1.1 * errors["gauss", False],
               f"Gaussian: {errors['gauss', True]:.3g} rotated vs "
               f"{errors['gauss', False]:.3g}")


def limits(dtype):
    top = float(ml_dtypes.finfo(dtype).max)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    return top, tiny


@pytest.mark.parametrize("alg", ["ring", "two_shot", "rabenseifner"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64])
def test_bad_values_go_exact(dtype, alg):
    """Inf and NaN blocks, values near the type's maximum (their rotation,
    or the sum's rotation back, would overflow), subnormals, all-zero
    blocks, a single spike: exact where they go exact, within the bound
    elsewhere, identical on every rank; in place the same bits (ring and
    two-shot rotate piece by piece, over the caller's values)."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    B = 64
    top, tiny = limits(dtype)
    x = np.random.default_rng(r).standard_normal(12 * B + 5).astype(np.float64)
    x[0:B] = top / 2                         # the sum overflows
    x[B + 3] = np.inf if r == 0 else 1.0     # an Inf
    x[2 * B + 5] = np.nan if r == P - 1 else 0.0
    x[3 * B:4 * B] = 0.0                     # zeros
    x[4 * B:5 * B] = tiny * np.arange(B)     # subnormals
    x[5 * B:6 * B] = 0.0
    x[5 * B + 7] = 1e4 if dtype != np.float16 else 1e3   # a single spike
    x[6 * B:7 * B] = top / 4 * (1 - 2 * (np.arange(B) % 2))   # the rotation's sums overflow
    x = x.astype(dtype)
    exact = np.empty_like(x)
    with QuantizedComm(WORLD, accuracy="exact") as ex:     # MPI's own sum, bfloat16 too
        ex.Allreduce(x, exact)
    with QuantizedComm(WORLD, **opts(wire="int8", block_size=B, rotate=True,
                                      algorithm=alg)) as qc:
        got = np.empty_like(x)
        qc.Allreduce(x, got)
        b = qc.last_error_bound
        mine = x.copy()
        qc.Allreduce(MPI.IN_PLACE, mine)
    nan = np.isnan(got.astype(np.float64))
    everywhere(np.array_equal(np.isnan(mine.astype(np.float64)), nan)
               and np.array_equal(mine[~nan].view(np.uint8), got[~nan].view(np.uint8)),
               "in place: the same bits (NaN where out of place)")
    both = np.isfinite(exact.astype(np.float64))
    everywhere(np.array_equal(np.isnan(got.astype(np.float64)), np.isnan(exact.astype(
        np.float64))) and np.array_equal(got[~both & ~np.isnan(exact.astype(np.float64))],
                                         exact[~both & ~np.isnan(exact.astype(np.float64))]),
               "Inf and NaN where MPI has them")
    fin = np.isfinite(got.astype(np.float64)) & both
    err = np.abs(got[fin].astype(np.float64) - exact[fin].astype(np.float64))
    everywhere(err.max(initial=0) <= b, f"finite values within the bound: {err.max():.3g} "
                                        f"<= {b:.3g}")
    for lo in (0, 6 * B):         # blocks near the maximum: the exact way
        everywhere(np.array_equal(got[lo:lo + B].view(np.uint8),
                                  exact[lo:lo + B].view(np.uint8)) or P == 1,
                   f"block at {lo}: MPI's bits")
    everywhere(same_everywhere(got), "identical on every rank")


def test_bad_options_raise_on_every_rank():
    for kw, text in ((dict(rotate=3), "power of two"), (dict(rotate=512), "power of two"),
                     (dict(rotate=True, wire="bf16"), "block wires"),
                     (dict(rotate=True, rel_tol=0.01), "block wires"),
                     (dict(rotate=True, lossy_ops=("sum", "max")), "MAX")):
        raises_everywhere(ValueError, lambda: QuantizedComm(WORLD, **kw), text)
    if WORLD.Get_size() > 1:       # ranks that disagree on the rotation
        raises_everywhere(ValueError, lambda: QuantizedComm(WORLD, rotate=WORLD.Get_rank() == 0),
                          "rotate")
        raises_everywhere(ValueError,
                          lambda: QuantizedComm(WORLD, rotate=True, seed=WORLD.Get_rank()), "seed")


@pytest.mark.parametrize("rotate", [True, "auto"])
def test_nonblocking_persistent_and_wrapped_calls_rotate(rotate):
    r = WORLD.Get_rank()
    x = heavy(4000, r)
    with QuantizedComm(WORLD, **opts(wire="int4", rotate=rotate)) as qc:
        want = np.empty_like(x)
        qc.Allreduce(x, want)
        a = np.empty_like(x)
        qc.Iallreduce(x, a).Wait()
        b = np.empty_like(x)
        req = qc.Allreduce_init(x, b)
        req.Start()
        req.Wait()
        req.Free()
        info = qc.last_call
    wc = equarx_mpi.wrap(WORLD, **opts(wire="int4", rotate=rotate))
    c = np.empty_like(x)
    wc.Allreduce(x, c)
    everywhere(np.array_equal(a, want) and np.array_equal(b, want) and np.array_equal(c, want),
               "nonblocking, persistent and wrapped: the blocking call's result")
    if WORLD.Get_size() > 1:
        everywhere(info.rotation == 64, f"persistent call rotated: {info}")


@pytest.mark.parametrize("wire,alg", [("int8", "ring"), ("int4", "ring"), ("int3", "two_shot"),
                                      ("int2", "two_shot")])
def test_feedback_keeps_a_rotated_residual(wire, alg):
    """The running sum stays within the last residuals (telescoping), the
    residual is given in the caller's values, and an exact path in between
    turns it back once, without losing it."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = heavy(3000, r)
    exact = WORLD.allreduce(x.astype(np.float64))
    with QuantizedComm(WORLD, **opts(wire=wire, rotate=True, algorithm=alg)) as qc:
        ef, run, out = ErrorFeedback(), np.zeros(x.size), np.empty_like(x)
        for t in range(40):
            if t == 20:
                with qc.exact():
                    qc.Allreduce(x, out, feedback=ef)
            else:
                qc.Allreduce(x, out, feedback=ef)
            run += out.astype(np.float64) - exact
        total = WORLD.allreduce(ef.residual.astype(np.float64))
        with QuantizedComm(WORLD, **opts(wire=wire, algorithm=alg)) as plain:
            drift = np.zeros(x.size)
            for t in range(40):
                plain.Allreduce(x, out)
                drift += out.astype(np.float64) - exact
    A = WORLD.allreduce(float(np.abs(x).max()), MPI.MAX)
    slack = 40 * (P + 8) * P * A * 2.0 ** -24 * 64
    tele = np.abs(run + total).max()
    everywhere(tele <= slack, f"telescoping: {tele:.3g} <= {slack:.3g}")
    if P > 1:
        everywhere(np.abs(run).max() < np.abs(drift).max(),
                   f"running error {np.abs(run).max():.3g} below no feedback's "
                   f"{np.abs(drift).max():.3g}")


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8"])
def test_auto_rotates_where_outliers_are(wire):
    """rotate="auto": heavy-tailed data with outlier channels rotated (the
    same bits as rotate=True), Gaussian data not, fp8 never; the choice is
    the same on every rank (the scores are summed) and in last_call."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    gauss = np.random.default_rng(r).standard_normal(1 << 14).astype(np.float32)
    # outliers on one rank only: the others must still follow it
    data = heavy(1 << 14, r, outliers=40.0 if r == 0 else 1.0)
    with QuantizedComm(WORLD, **opts(wire=wire, rotate="auto")) as qc, \
            QuantizedComm(WORLD, **opts(wire=wire, rotate=True)) as always:
        got, want = np.empty_like(data), np.empty_like(data)
        qc.Allreduce(data, got)
        heavy_rot = qc.last_call.rotation
        always.Allreduce(data, want)
        qc.Allreduce(gauss, np.empty_like(gauss))
        gauss_rot = qc.last_call.rotation
        B = qc.block_size
    if P == 1:
        everywhere(heavy_rot == 0 and gauss_rot == 0, "one rank: a copy")
        return
    everywhere(gauss_rot == 0, f"Gaussian data not rotated ({gauss_rot})")
    if wire == "fp8":
        everywhere(heavy_rot == 0, "fp8 never rotated by auto")
    else:
        everywhere(heavy_rot == B and np.array_equal(got, want),
                   f"outliers rotated ({heavy_rot}), as rotate=True")
    everywhere(same_everywhere(got), "identical on every rank")


@pytest.mark.parametrize("case", ["channels", "nan", "spikes"])
def test_auto_decides_by_what_rotating_buys(case):
    """rotate="auto" through the call (the review's cases): outlier channels
    at any place in a row rotate int8; a NaN on one rank does not switch
    the rotation off for the finite blocks (int8 and int4 both gain on
    them); a spike in every block rotates int8 but not int4, which it would
    make worse."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    rng = np.random.default_rng(30 + r)
    if case == "channels":
        x = rng.standard_normal((256, 1024)).astype(np.float32)
        x[:, [300, 700]] *= 100
        x = x.reshape(-1)
    elif case == "nan":
        x = heavy(1 << 16, r)
        if r == P - 1:
            x[0] = np.nan
    else:
        x = rng.standard_normal(1 << 16).astype(np.float32)
        x[::61] *= 300
    got = {}
    # (int4's blocks of 64 meet a channel in 2 of 16: it gains only ~1.25x there)
    for wire in ("int8",) if case == "channels" else ("int8", "int4"):
        with QuantizedComm(WORLD, **opts(wire=wire, rotate="auto")) as qc:
            out = np.empty_like(x)
            qc.Allreduce(x, out)
            got[wire] = qc.last_call.rotation, qc.block_size
        everywhere(same_everywhere(out), f"{wire}: identical on every rank")
    if P == 1:
        everywhere(got["int8"][0] == 0, "one rank: a copy")
        return
    want = {"int8": True, "int4": case == "nan"}
    for wire, (rot, B) in got.items():
        everywhere(rot == (B if want[wire] else 0), f"{case} {wire}: rotation {rot}")


def test_hierarchical_rotates():
    """The step between nodes rotates (run under EQUARX_MPI_FAKE_NODES by
    run_tests.sh; on one node the hierarchical method is the ring)."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x = heavy(20000, r)
    exact = WORLD.allreduce(x.astype(np.float64))
    errs = {}
    for rot in (False, True):
        with QuantizedComm(WORLD, **opts(algorithm="hierarchical", wire="int8",
                                         rotate=rot)) as qc:
            got = np.empty_like(x)
            qc.Allreduce(x, got)
            info = qc.last_call
        err = np.abs(got.astype(np.float64) - exact)
        everywhere(err.max() <= info.error_bound, f"within the bound: {err.max():.3g} <= "
                                                  f"{info.error_bound:.3g}")
        everywhere(same_everywhere(got), "identical on every rank")
        errs[rot] = rel(got, exact)
        if P > 1 and info.wire is not None:
            everywhere(info.rotation == (qc.block_size if rot else 0), f"{info}")
    if P > 1:
        everywhere(errs[True] < errs[False], f"rotated {errs[True]:.3g} < {errs[False]:.3g}")
