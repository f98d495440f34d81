"""mpi4py's buffer forms as numpy views (buffers.py) and their checks
(validate.check_buffers), one process.

    pytest -q tests/test_buffers.py
"""
import array

import numpy as np
import pytest
from mpi4py import MPI

from equarx_mpi import QuantizedComm
from equarx_mpi.call.buffers import OPAQUE, message
from equarx_mpi.call.validate import BFLOAT16, check_buffers

X = np.arange(12, dtype=np.float32)


def same_memory(a, b):
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


@pytest.mark.parametrize("spec, start, n", [
    (X, 0, 12),
    ([X, MPI.FLOAT], 0, 12),
    ([X, "f"], 0, 12),                       # a typecode, as mpi4py accepts
    ([X, 5], 0, 5),
    ([X, 5, MPI.FLOAT], 0, 5),
    ([X, (5, 3), MPI.FLOAT], 3, 5),
    ([X, [5, 3], MPI.FLOAT], 3, 5),
    ([X, (5, 3)], 3, 5),
    ((X, 5, 3, MPI.FLOAT), 3, 5),
    ([X, (0, 12), MPI.FLOAT], 12, 0),
])
def test_forms_view_the_same_memory(spec, start, n):
    v = message(spec)
    assert v.dtype == np.float32 and v.size == n and v.ndim == 1
    assert n == 0 or same_memory(v, X[start:])


def test_buffer_protocol_objects():
    a = array.array("d", range(6))
    v = message(a)
    assert v.dtype == np.float64 and v.tolist() == list(range(6)) and v.flags.writeable
    assert message(bytearray(8)).dtype == np.uint8
    v = message([bytearray(16), MPI.FLOAT])       # MPI reads bytes as the datatype says
    assert v.dtype == np.float32 and v.size == 4 and v.flags.writeable
    assert message(memoryview(a)[2:]).tolist() == [2, 3, 4, 5]
    assert not message(b"abcd").flags.writeable
    assert message([np.zeros(3, np.float64), MPI.INT]).size == 6


def test_any_contiguous_layout_in_memory_order():
    f = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    v = message(f)
    assert v.size == 12 and same_memory(v, f) and (v == f.ravel(order="F")).all()
    assert message(np.ones((), np.float32)).size == 1          # 0-d
    assert message(np.ones(4, BFLOAT16)).dtype == BFLOAT16
    with pytest.raises(ValueError, match="C-contiguous or Fortran-contiguous"):
        message(np.ones((4, 4), np.float32)[:, :2])


def test_blocks():
    assert message(X, blocks=3).size == 12
    assert message([X, 2, MPI.FLOAT], blocks=3).size == 6       # count per block
    with pytest.raises(ValueError, match="equal blocks"):
        message(X, blocks=5)


class _Device:
    """Looks like device memory to mpi4py: no buffer protocol."""
    __cuda_array_interface__ = {"version": 3, "shape": (4,), "typestr": "<f4",
                                "data": (0, False)}


def test_what_only_mpi_can_read_is_opaque():
    vec = MPI.FLOAT.Create_vector(2, 1, 2).Commit()
    try:
        assert message([X, 1, vec]) is OPAQUE
    finally:
        vec.Free()
    assert message(_Device()) is OPAQUE
    assert message([MPI.BOTTOM, 1, MPI.FLOAT]) is OPAQUE


@pytest.mark.parametrize("spec, exc, text", [
    (None, TypeError, "None is not a buffer"),
    (list(X), TypeError, "numpy array"),
    ([1.0, MPI.FLOAT], TypeError, "not a buffer"),
    ([X, -1, MPI.FLOAT], ValueError, "negative count"),
    ([X, 1.5, MPI.FLOAT], TypeError, "integer"),
    ([X, (2, 13), MPI.FLOAT], ValueError, "past the buffer"),
    ([X, 13, MPI.FLOAT], ValueError, "holds 12"),
    ([X, "no such typecode"], TypeError, "typecode"),
    ([bytearray(6), MPI.FLOAT], ValueError, "whole number"),
])
def test_errors_say_what_to_pass(spec, exc, text):
    with pytest.raises(exc, match=text):
        message(spec)


def test_checks_agree_on_counts_not_shapes():
    a, b = np.ones(16, np.float32), np.ones((4, 4), np.float32)
    _, _, meta_a, err_a = check_buffers("Allreduce", a, np.empty_like(a), MPI.SUM, 2)
    _, _, meta_b, err_b = check_buffers("Allreduce", b, np.empty_like(b), MPI.SUM, 2)
    assert err_a is err_b is None and meta_a == meta_b


def test_in_place_and_same_buffer_twice():
    y = np.ones(8, np.float32)
    for send in (MPI.IN_PLACE, None, y):
        s, r, _, err = check_buffers("Allreduce", send, [y, MPI.FLOAT], MPI.SUM, 2)
        assert err is None and s is None and same_memory(r, y)
    s, r, meta, err = check_buffers("Reduce_scatter_block", None, y, MPI.SUM, 2)
    assert err is None and dict(meta)["count"] == 8
    _, _, _, err = check_buffers("Allreduce", [y, 3, MPI.FLOAT], [y, (3, 4), MPI.FLOAT],
                                 MPI.SUM, 2)
    assert err is None                      # disjoint parts of one array


def test_opaque_is_an_error_for_the_explicit_api():
    _, r, _, err = check_buffers("Allreduce", _Device(), _Device(), MPI.SUM, 2)
    assert isinstance(err, TypeError) and "wrap" in str(err)
    _, r, _, err = check_buffers("Allreduce", _Device(), _Device(), MPI.SUM, 2, opaque_ok=True)
    assert err is None and r is OPAQUE


def test_an_empty_message_at_one_rank_is_a_copy():
    qc = QuantizedComm(MPI.COMM_SELF)
    qc.Allreduce(np.empty(0, np.float32), np.empty(0, np.float32))
    info = qc.last_call
    qc.free()
    assert info.method == "copy" and info.error_bound == 0.0, info
