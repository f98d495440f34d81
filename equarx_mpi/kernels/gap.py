"""The largest finite difference between two buffers, in one pass: error
feedback's bound on how far a call's input moved from the caller's values
(feedback.py), where numpy would make float64 copies of both."""
import numpy as np
from numba import njit

from equarx_mpi.kernels.common import CACHE, load


@njit(**CACHE)
def max_finite_gap(a, b):
    """The largest |a[i] - b[i]| over the i where it is finite (float64
    differences of kernel elements: Inf - Inf and NaN left out), or 0.0."""
    mx = 0.0
    for i in range(a.size):
        d = abs(np.float64(load(a, i)) - np.float64(load(b, i)))
        if d < np.inf:
            mx = max(mx, d)
    return mx
