"""A bound from each quantization's measured error (option
``measured_bounds``; docs/ERROR.md "Measured bounds").

A format's own bound on a quantization is its worst case from the headers
(half a step, the same for every value of the block).  A rotated call pays
sqrt(S) on top when its result is rotated back: that worst case holds for
errors of S values all aligned, where the real errors, rotated back, are a
sum of S errors with mixed signs.  Here the quantizing rank measures
instead: for each piece it quantizes, e = D(w) - v (wire/watched.py), and
bounds what e becomes in the caller's values,

    t = max |R^T e|   (rotated: R^T e as computed, plus its rounding
                       rho(max |e|), plus sqrt(S) u max |e| for the
                       rounding of e itself: |e - fl(e)| <= u |e|)
      = max |e| / (1 - u)   (not rotated)

and hands the Tally t / sqrt(S) in place of the format's bound (never more
than it), so that the sqrt(S) the rotation back applies to the schedule's
bound gives back exactly t for this quantization: R^T is linear, so the
result's error is at most the sum of each quantization's t plus sqrt(S)
times the (rotated) additions' roundings.  The piece's magnitude in the
trailer grows by what the bound shrank: decoded magnitudes (mag plus
bound) and the additions' roundings stay covered.
"""
import math

import numpy as np

from equarx_mpi.bounds.bound import acc_rounding, largest


class Measured:
    """The measured bounds of one schedule run's quantizations on this rank.
    ``rotation``: the call's (collectives/rotation.py), or None; ``kdtype``:
    the schedule's kernel element type; ``tmp``: an accumulation-type array
    at least as long as any piece."""

    def __init__(self, rotation, kdtype, tmp):
        self._rot, self._tmp = rotation, tmp
        self._u = acc_rounding(kdtype)[0]
        self._q = {}            # id of a piece's views -> its measured bound

    def __call__(self, e, own, w):
        """A watcher (wire/watched.py): e = D(w) - v of the piece w."""
        rot, u = self._rot, self._u
        # Inf or NaN (a plain wire's store overflowed: that result is Inf;
        # a transform that overflowed) makes t Inf: the format's bound stands
        E = largest(e, finite_only=False)
        t = E / (1 - u)
        if rot is not None and t < math.inf:
            back = self._tmp[:e.size]
            rot.backward(e, back)     # the signs come last: any will do for magnitudes
            root = math.sqrt(rot.size)
            t = (largest(back, finite_only=False) + rot.rho(E, e.dtype) + root * u * t) / root
        self._q[id(w)] = t

    def adjust(self, w, q, m):
        """(bound, magnitude) of the piece w for its trailer: the format's
        (q, m), or the measured bound where it is lower."""
        t = self._q.pop(id(w), math.inf)
        if not t < q:           # NaN (an Inf in e) or no gain: the format's
            return q, m
        with np.errstate(over="ignore"):
            return t, m + (q - t)
