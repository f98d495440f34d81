"""Wire formats: how a piece of values is laid out in a message, and which
kernels turn values into that layout and back.

A format knows nothing about communication; the ring in ``ring.py`` asks
it for byte counts and calls these four operations on pieces:

    encode(src, w)                     w = Q(src)
    decode(w, out)                     out = D(w)
    decode_reduce(own, w, out, op)     out = own (op) D(w)
    decode_reduce_encode(own, wi, wo, op)   wo = Q(own (op) D(wi)); wi may be wo

``src``/``own`` are read-only 1-D views in the kernel element type (see
kernels.py), ``out`` a writable one.  A piece's bytes are padded to a multiple
of 8 so the next piece's views stay aligned.
"""
import numpy as np

from . import kernels as K


def _pad8(n):
    return (n + 7) & ~7


class Int8Block:
    """Dynamic block-wise symmetric int8: per block one float32 scale,
    then the int8 codes (docs/FORMAT.md)."""
    name = "int8"
    bits = 8

    def __init__(self, block_size):
        self.block = block_size

    def nbytes(self, n):
        nb = -(-n // self.block)
        return _pad8(4 * nb + n)

    def views(self, buf, n):
        nb = -(-n // self.block)
        return buf[:4 * nb].view(np.float32), buf[4 * nb:4 * nb + n].view(np.int8)

    def encode(self, src, w, scratch):
        K.i8_encode(src, w[0], w[1], self.block, scratch)

    def decode(self, w, out, scratch):
        K.i8_decode(w[0], w[1], out, self.block, scratch)

    def decode_reduce(self, own, w, out, op, scratch):
        K.i8_decode_reduce(own, w[0], w[1], out, self.block, op, scratch)

    def decode_reduce_encode(self, own, wi, wo, op, scratch):
        K.i8_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1],
                                  self.block, op, scratch)


class Plain:
    """Uncompressed values on the wire (bfloat16 or float32): the baselines
    the paper compares against.  Partial sums are rounded to the wire type
    at every hop, like any 16-bit ring AllReduce."""

    def __init__(self, name, wire_dtype, kernel_dtype):
        self.name = name
        self.bits = 8 * np.dtype(wire_dtype).itemsize
        self._kdt = np.dtype(kernel_dtype)

    def nbytes(self, n):
        return _pad8(n * self._kdt.itemsize)

    def views(self, buf, n):
        return buf[:n * self._kdt.itemsize].view(self._kdt)

    def encode(self, src, w, scratch):
        K.plain_encode(src, w)

    def decode(self, w, out, scratch):
        K.plain_decode(w, out)

    def decode_reduce(self, own, w, out, op, scratch):
        K.plain_decode_reduce(own, w, out, op)

    def decode_reduce_encode(self, own, wi, wo, op, scratch):
        K.plain_decode_reduce_encode(own, wi, wo, op)


def make_format(bits, block_size):
    """The wire format for ``bits``: 8 = int8 blocks, 16 = bfloat16, 32 = float32."""
    if bits == 8:
        return Int8Block(block_size)
    if bits == 16:
        return Plain("bf16", np.uint16, np.uint16)
    if bits == 32:
        return Plain("fp32", np.float32, np.float32)
    raise ValueError(f"bits must be 8, 16 or 32, not {bits!r}")


SUPPORTED_BITS = (8, 16, 32)
