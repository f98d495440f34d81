"""Stochastic rounding (rmode ROUND_STOCHASTIC, wires STOCHASTIC_WIRES) draws
value g's uniform number from a hash of (seed, call, rank, g), g the
value's index in the whole message: ``begin_call`` fixes the first three
and where the call's input lies, and each piece's position follows from
where its ``own``/``src`` view starts in that input.  So the codes depend
only on the values, the seed, how many calls this format ran before and
the rank, not on how the schedule cut or ordered the pieces; no rank
quantizes one value twice in a call, so no two draws share a key.
"""
import numpy as np

from equarx_mpi import kernels as K

_MASK = (1 << 64) - 1
_NO_STREAM = np.uint64(0)


def mix64(z):
    """splitmix64's finalizer (kernels.stochastic.mix64) on a Python int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def call_key(seed, call, rank):
    """The 64-bit key of one call's stochastic rounding on one rank: seed,
    call number and rank absorbed in turn, splitmix64 style."""
    z = 0
    for v in (seed, call, rank):
        z = mix64(((z ^ v) + K.GOLDEN) & _MASK)
    return z


def address(a):
    return a.__array_interface__["data"][0]


class Streams:
    """The stochastic keying of a wire format (a base of wire/base.py Format)."""

    def __init__(self):
        self.calls = 0          # calls begun so far: part of the stochastic key
        self._key = None

    def begin_call(self, seed, rank, own, own_offset):
        """Key the stochastic rounding of the next call: ``own`` (a kernel
        view) holds its input, own[i] being the message's value i + own_offset."""
        self._key = call_key(seed, self.calls, rank)
        self._base, self._item, self._offset = address(own), own.itemsize, own_offset
        self.calls += 1

    def _stream(self, own, rmode):
        """The stream of a piece whose values are ``own`` (a view into the
        call's input): the call's key advanced to the piece's first value."""
        if rmode != K.ROUND_STOCHASTIC:
            return _NO_STREAM
        if self._key is None:
            raise ValueError(f"{self.name}: stochastic rounding before begin_call")
        at = (address(own) - self._base) // self._item + self._offset
        return np.uint64((self._key + at * K.GOLDEN) & _MASK)
