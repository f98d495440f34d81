"""The low-bit wires (docs/FORMAT.md "int3 and int2", "int5 and int6"):
int4's symmetric blocks with L levels each side, W-bit codes packed in
groups of G codes, one set of kernels (kernels/lowbit.py): the gradient
wires int3 (L 3, 8 codes in 3 bytes) and int2 (L 1, 4 in a byte), in
wire/formats.py's REGISTRY with hops=False (algorithm="auto" never runs
them on a schedule that requantizes partial sums at every hop), and int5
(L 15, 8 in 5 bytes) and int6 (L 31, 4 in 3 bytes), between int4 and int8
for rotated activations."""
import numpy as np

from equarx_mpi import kernels as K
from equarx_mpi.wire.base import _Symmetric, pad8
from equarx_mpi.wire.many import ComposedMany

#: wire name -> (levels L each side, bits W a code, codes G a group)
SHAPES = {"int3": (3, 3, 8), "int2": (1, 2, 4), "int5": (15, 5, 8), "int6": (31, 6, 4)}


class LowBit(ComposedMany, _Symmetric):
    """Symmetric codes in [-L, L], W bits each: per block its largest
    magnitude in the accumulation type, then ceil(W n / 8) code bytes."""

    def __init__(self, name, block, kdtype):
        self.name = name
        self.levels, self.width, group = SHAPES[name]
        if block % group:
            raise ValueError(f"{name} packs {group} codes per group: block {block} must be a "
                             f"multiple of {group}")
        super().__init__(block, kdtype)

    def _coefs(self, u):
        # docs/FORMAT.md "int3 and int2": (a/L)(1/2 + (5L + 1) u) to nearest
        L = self.levels
        return (0.5 + (5 * L + 1) * u) / L, (1 + (5 * L + 1) * u) / L

    def _code_bytes(self, n):
        return (self.width * n + 7) // 8

    def nbytes(self, n):
        return pad8(self.head.itemsize * -(-n // self.block) + self._code_bytes(n))

    def views(self, buf, n):
        h = self.head.itemsize * -(-n // self.block)
        return buf[:h].view(self.head), buf[h:h + self._code_bytes(n)].view(np.uint8)

    def part(self, w, lo, hi):
        B = self.block
        return w[0][lo // B:-(-hi // B)], w[1][self.width * lo // 8:self._code_bytes(hi)]

    def encode(self, src, w, rmode, at=None):
        K.lb_encode(src, w[0], w[1], self.block, self.scratch, rmode, self.levels)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.lb_decode(w[0], w[1], out, self.block, self.levels, skipped)]

    def decode_reduce(self, own, w, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.lb_decode_reduce(own, w[0], w[1], out, self.block, self.levels, op,
                                           self.scratch, skipped)]

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        K.lb_decode_reduce_encode(own, wi[0], wi[1], wo[0], wo[1], self.block, self.levels, op,
                                  self.scratch, rmode)
