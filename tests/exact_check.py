"""Rigorous, vectorized checks of |result - exact| <= bound for long arrays.

The exact value of each result position is a sum of float64 terms (the
inputs of an AllReduce; one term for MAX, MIN or an Allgather).  Each
|result_i - exact_i| is computed with error-free transformations (TwoSum
in float64: out minus each term, the rounding errors kept), which pins
it down to a relative 2^-48 or so; where that is not enough to decide
against the bound, or a float64 step overflowed, the difference is taken
exactly with Fractions.  So no float rounding of the check itself can
hide an error above the bound, and long arrays cost numpy passes, not a
Python loop per value.
"""
from fractions import Fraction

import numpy as np

U64 = 2.0 ** -53


def _two_sum(a, b):
    """(s, e): s = fl(a + b) and s + e = a + b exactly (Knuth), no overflow."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _exact_error(o, column):
    d = Fraction(float(o)) - sum(Fraction(float(t)) for t in column)
    try:
        return abs(d), float(abs(d))
    except OverflowError:
        return abs(d), np.inf


def errors_above(out, terms, bound):
    """(err, above) for a result ``out`` (any float dtype, n values) and
    ``terms`` ((k, n) float64: the exact result is their column sum):
    err[i] ~ |out_i - exact_i| (relative error below 2^-40; NaN where out_i
    or a term is not finite: outside the bound's scope), above[i] whether
    the exact |out_i - exact_i| exceeds bound[i] (a scalar or n values),
    decided exactly."""
    o = np.asarray(out).astype(np.float64).reshape(-1)
    terms = np.atleast_2d(np.asarray(terms, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), o.shape)
    with np.errstate(all="ignore"):
        ok = np.isfinite(o) & np.isfinite(terms).all(axis=0)
        s = np.where(ok, o, 0.0)
        t = np.zeros_like(s)
        mag = np.zeros_like(s)
        for row in terms:
            s, e = _two_sum(s, -np.where(ok, row, 0.0))
            t += e
            mag += np.abs(e)
        err = np.abs(s + t)
        # |err - exact error| <= (k + 1) u (mag + err): the k-1 additions of
        # the e's, the last one's rounding; x4 covers computing this itself.
        # Additions that land in the subnormal range are exact, so a slack
        # that underflows to 0 is right too.
        slack = 4 * (terms.shape[0] + 2) * U64 * (mag + err)
        sure = np.isfinite(s) & np.isfinite(mag) & np.isfinite(slack)
        above = ok & sure & (err - slack > bound)
        unsure = ok & (~sure | ((err + slack > bound) & ~above))
    err[~ok] = np.nan
    for i in np.flatnonzero(unsure):
        d, err[i] = _exact_error(o[i], terms[:, i])
        above[i] = d > Fraction(float(bound[i])) if np.isfinite(bound[i]) else False
    return err, above
