"""The defects found when the library was tried from outside (issue 7),
one test each; every one failed before the format was changed.

    mpirun -n 2 python -m pytest --with-mpi tests/test_mpi_limits.py
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere
from reference import BF16

import equarx_mpi
from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
F32MAX = np.finfo(np.float32).max
SUB32 = np.finfo(np.float32).smallest_subnormal


@pytest.fixture
def qc():
    with QuantizedComm(WORLD, min_quantized_bytes=0) as q:
        yield q


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16],
                         ids=lambda d: np.dtype(d).name)
def test_dtype_max_stays_finite(dtype):
    """1. +-max of the type was decoded as +-Inf (127 x a rounded-up scale)."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    big = np.array(0x7F7F, np.uint16).view(BF16) if dtype == BF16 else np.finfo(dtype).max
    with QuantizedComm(WORLD, min_quantized_bytes=0, lossy_ops=("sum", "max", "min")) as q:
        for op, v in ((MPI.MAX, big), (MPI.MIN, -big)):
            got = q.allreduce(np.full(1000, v, dtype), op)
            everywhere((got == v).all(), f"quantized {op} of the type's max is exact")
        x = np.full(1000, big if r == 0 else 0, dtype)
        everywhere((q.allreduce(x) == big).all(), "SUM of max and zeros is max")
        mine = np.full(300, big, dtype)
        full = np.empty(P * 300, dtype)
        q.Allgather(mine, full)
        everywhere((full == big).all(), "Allgather of max")
        part = np.empty(300, dtype)
        q.Reduce_scatter_block(np.full(P * 300, big if r == 0 else 0, dtype), part)
        everywhere((part == big).all(), "Reduce_scatter_block of max and zeros")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_subnormal_block_maximum(qc, dtype):
    """2. A block whose largest magnitude was subnormal lost up to 63 steps."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    sub = np.finfo(dtype).smallest_subnormal
    for top in (189, 1000, 60000):
        x = np.zeros(512, dtype)
        x[0] = top * sub if r == 0 else 0
        x[1] = 3 * sub
        got = qc.allreduce(x)
        everywhere(got[0] == top * sub, f"sum of {top} x 2^-min comes back exactly")
        # each of the P quantizations after rank 0's value joined: half a step
        everywhere(abs(got[1] - 3 * P * sub) <= P * (top / 254 + 1) * sub, "small value kept")
    if dtype == np.float64:
        # an ordinary array with one tiny block (the old guard looked only at the maximum)
        x = np.random.default_rng(r).standard_normal(1024)
        x[256:512] *= 1e-42
        got = qc.allreduce(x)
        exact = np.sum(WORLD.allgather(x), axis=0)
        rel = np.abs(got[256:512] - exact[256:512]).max() / np.abs(exact[256:512]).max()
        everywhere(rel <= 0.5 / 127 * P * 1.001, f"tiny float64 block within its steps ({rel:.2e})")


def test_block_maximum_comes_back_exactly():
    """3. A float64 0/1 mask reduced with MAX came back as 0.99999999627."""
    r = WORLD.Get_rank()
    mask = (np.random.default_rng(r).random(1 << 19) < 0.5).astype(np.float64)   # 4 MiB
    got = equarx_mpi.allreduce(mask, WORLD, op=MPI.MAX)
    want = np.max(WORLD.allgather(mask), axis=0)
    everywhere(got.tobytes() == want.tobytes(), "mask MAX with library defaults")
    with QuantizedComm(WORLD, min_quantized_bytes=0, lossy_ops=("sum", "max")) as q:
        everywhere(q.allreduce(mask, MPI.MAX).tobytes() == want.tobytes(),
                   "mask MAX quantized on request: still exact")
        const = np.full(1 << 16, 0.1)
        everywhere((q.allreduce(const) == 0.1 * WORLD.Get_size()).all()
                   or WORLD.Get_size() > 2, "constant blocks sum exactly")
        everywhere((q.allreduce(const, MPI.MAX) == 0.1).all(), "constant blocks, MAX")


@pytest.mark.mpi(min_size=2)
def test_helper_option_on_one_rank_raises_everywhere():
    """4a. One rank alone passing chunks=2 deadlocked."""
    c = WORLD.Dup()
    try:
        x = np.ones(100000, np.float32)
        equarx_mpi.allreduce(x, c)
        opts = {"chunks": 2} if WORLD.Get_rank() == 1 else {}
        raises_everywhere(ValueError, lambda: equarx_mpi.allreduce(x, c, **opts),
                          "options differs between ranks")
        everywhere((equarx_mpi.allreduce(x, c) == WORLD.Get_size()).all(), "usable after")
    finally:
        c.Free()


@pytest.mark.mpi(min_size=2)
def test_helper_misspelled_option_on_one_rank_raises_everywhere():
    """4b. A TypeError on one rank alone left the others waiting."""
    x = np.ones(1000, np.float32)
    opts = {"chunk": 2} if WORLD.Get_rank() == 1 else {}
    raises_everywhere(TypeError, lambda: equarx_mpi.allreduce(x, WORLD, **opts),
                      "unknown option(s) chunk")


def test_signs_of_zero_and_nan(qc):
    """5. -0.0 blocks came back +0.0; negative NaN positive; payloads lost."""
    r = WORLD.Get_rank()
    z = np.full(1000, -0.0, np.float32)
    got = qc.allreduce(z)
    everywhere(np.signbit(got).all() and (got == 0).all(), "a block of -0.0 stays -0.0")
    mixed = np.where(np.arange(1000) % 2, -0.0, 0.0).astype(np.float32)
    got = qc.allreduce(mixed)
    everywhere((np.signbit(got) == np.signbit(mixed)).all(), "mixed zeros keep their signs")
    x = np.random.default_rng(r).standard_normal(1000).astype(np.float32)
    x[10] = np.array(0xFFC01234, np.uint32).view(np.float32)       # -NaN with payload
    got = qc.allreduce(x)
    want = x.copy()
    WORLD.Allreduce(MPI.IN_PLACE, want)
    everywhere(got.view(np.uint32)[10] == want.view(np.uint32)[10],
               f"NaN bits as MPI gives them ({got.view(np.uint32)[10]:#x})")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
def test_16_bit_wire_keeps_largest_values_finite(dtype):
    """8. bits=16 turned float16 65504 and float32 max into Inf."""
    r = WORLD.Get_rank()
    big = np.finfo(dtype).max
    with QuantizedComm(WORLD, bits=16, min_quantized_bytes=0) as q:
        got = q.allreduce(np.full(5000, big if r == 0 else 0, dtype))
    everywhere(np.isfinite(got).all() and (got == big).all(), f"{big} through the 16-bit wire")


def test_lossy_ops_is_validated_everywhere():
    raises_everywhere(ValueError, lambda: QuantizedComm(WORLD, lossy_ops=("prod",)),
                      "lossy_ops")
