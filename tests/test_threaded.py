"""Kernels over threads (wire/threaded.py): the same bytes and results as
one thread, for every wire and kernel, on data with flagged blocks, to
nearest and stochastically; and the default thread count.

    python -m pytest tests/test_threaded.py
"""
import numpy as np
import pytest
from reference import BF16

from equarx_mpi.names import KERNEL_OP, ROUND_NEAREST, ROUND_STOCHASTIC, kernel_view
from equarx_mpi.threads import default_threads
from equarx_mpi.wire import formats
from equarx_mpi.wire.threaded import Threaded

WIRES = list(formats.WIRES)
DTYPES = [np.float32, np.float64, np.float16, BF16]


def data(n, dtype, seed, block):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10).astype(dtype)
    x[3 * block + 5] = np.inf                 # flagged blocks, on different parts
    x[n - 2] = np.nan
    return kernel_view(x, writable=False)


def pair(wire, dtype, threads=3):
    """(one-thread format, threaded format); parts of 2 blocks at least,
    so small arrays are cut."""
    kd = kernel_view(np.zeros(1, dtype), False).dtype
    block = formats.default_block(wire)
    make = lambda: formats.make_format(wire, block, kd)  # noqa: E731
    return make(), Threaded(make, threads, min_part=2 * block)


def encoded(fmt, src, rmode=ROUND_NEAREST):
    buf = np.zeros(fmt.nbytes(src.size), np.uint8)
    fmt.encode(src, fmt.views(buf, src.size), rmode)
    return buf


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", WIRES)
def test_every_kernel_gives_the_same_bits(wire, dtype):
    one, many = pair(wire, dtype)
    B = one.block
    n = 11 * B + 37                           # a short last block
    own, other = data(n, dtype, 1, B), data(n, dtype, 2, B)
    buf1, bufT = encoded(one, other), encoded(many, other)
    assert buf1.tobytes() == bufT.tobytes(), "encode"
    w1, wT = one.views(buf1, n), many.views(bufT, n)
    outs = []
    for fmt, w in ((one, w1), (many, wT)):
        out = np.zeros(n, own.dtype)
        skipped = sorted(fmt.decode(w, out))
        red = np.zeros(n, own.dtype)
        skipped_r = sorted(fmt.decode_reduce(own, w, red, KERNEL_OP["sum"]))
        wo = buf1.copy() if fmt is one else bufT.copy()
        fmt.decode_reduce_encode(own, fmt.views(wo, n), fmt.views(wo, n), KERNEL_OP["sum"],
                                 ROUND_NEAREST)      # the ring's hop, in place
        outs.append((out.tobytes(), skipped, red.tobytes(), skipped_r, wo.tobytes()))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("wire", [w for w in WIRES if w not in ("bf16", "fp32")] + ["fp32"])
@pytest.mark.parametrize("count", [1, 3])
def test_many_input_reductions_give_the_same_bits(wire, count):
    one, many = pair(wire, np.float32)
    B = one.block
    n = 9 * B + 5
    own = data(n, np.float32, 3, B)
    size = one.nbytes(n)
    stack = np.concatenate([encoded(one, data(n, np.float32, 10 + i, B)) for i in range(count)])
    res = []
    for fmt in (one, many):
        ws = fmt.stack_views(stack.copy(), n, count)
        out = np.zeros(n, np.float32)
        skipped = sorted(fmt.decode_reduce_many(own, 1, ws, out, KERNEL_OP["sum"]))
        wo = np.zeros(size, np.uint8)
        fmt.decode_reduce_encode_many(own, 1, ws, fmt.views(wo, n), KERNEL_OP["sum"],
                                      ROUND_NEAREST)
        res.append((out.tobytes(), skipped, wo.tobytes()))
    assert res[0] == res[1]


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_stochastic_rounding_is_keyed_by_index_not_by_thread(wire):
    one, many = pair(wire, np.float32, threads=4)
    n = 40 * one.block + 3
    x = data(n, np.float32, 4, one.block)
    got = []
    for fmt in (one, many):
        fmt.begin_call(7, 1, x, 0)
        got.append(encoded(fmt, x, ROUND_STOCHASTIC).tobytes())
    assert got[0] == got[1]


def test_default_keeps_ranks_times_threads_within_the_cores():
    import os
    cores = len(os.sched_getaffinity(0))
    assert default_threads(1) == cores
    assert default_threads(cores) == 1
    assert default_threads(4 * cores) == 1
    assert default_threads(0) == cores


def test_one_thread_needs_no_wrapper():
    with pytest.raises(ValueError, match="threads"):
        Threaded(lambda: formats.make_format("int8", 256, np.float32), 1)
