"""Plain numpy reference of the rotation (kernels/rotate.py, docs/FORMAT.md
"Rotation"), written from the spec: the same operations in the same order
(signs, butterfly stage by stage, one scaling multiply), so the kernels
must match it bit for bit.  Chunks of one length are done together, as the
rows of a matrix."""
import numpy as np
from reference import _MASK, BF16, GOLDEN, acc_dtype, mix64, to_acc

DOMAIN = 0x524F544154450001


def sign_stream(seed, key):
    z = 0
    for v in (DOMAIN, seed, key):
        z = mix64(((z ^ (v & _MASK)) + GOLDEN) & _MASK)
    return z


def sign_bits(n, seed, key, start=0):
    """Sign bit (0/1) of values start .. start + n - 1: bit g % 64 of word
    g // 64, word k = mix64(stream + (k + 1) * GOLDEN)."""
    g = np.uint64(start) + np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        words = mix64(np.uint64(sign_stream(seed, key))
                      + ((g >> np.uint64(6)) + np.uint64(1)) * np.uint64(GOLDEN))
    return ((words >> (g & np.uint64(63))) & np.uint64(1)).astype(np.uint8)


def chunks(n, size):
    """(start, length) of each chunk: whole chunks of size, then the tail's
    powers of two, largest first."""
    out, lo = [], 0
    while lo < n:
        m = size if n - lo >= size else 1 << ((n - lo).bit_length() - 1)
        out.append((lo, m))
        lo += m
    return out


def flip(v, bits):
    """v with bits xor-ed into the sign bits (exact, NaN too)."""
    u = np.uint32 if v.dtype == np.float32 else np.uint64
    shift = u(31 if v.dtype == np.float32 else 63)
    return (v.view(u) ^ (bits.astype(u) << shift)).view(v.dtype)


def scale(m, acc):
    return acc(1.0 / np.sqrt(np.float64(m)))


def _stage(x, h):
    """Stage h of each row of x, in place: pairs (v[i], v[i+h]) -> sum, difference."""
    y = x.reshape(x.shape[0], -1, 2, h)
    a, b = y[:, :, 0].copy(), y[:, :, 1].copy()
    y[:, :, 0], y[:, :, 1] = a + b, a - b


def hadamard(x, m):
    """(H x) * c for each row of x (rows of m values), stage by stage: below
    64 values h = 1, 2, ..., m/2; from 64 on, each 64 values as eight rows
    of eight (stages 8, 16, 32, then 1, 2, 4), stored transposed, then
    stages 64, ..., m/2."""
    x = x.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        low = (8, 16, 32, 1, 2, 4) if m >= 64 else tuple(1 << i for i in range(m.bit_length() - 1))
        for h in low + tuple(1 << i for i in range(6, m.bit_length() - 1)):
            _stage(x, h)
        if m >= 64:
            g = x.reshape(x.shape[0], m // 64, 8, 8)
            g[:] = g.transpose(0, 1, 3, 2).copy()
        if m > 1:
            x *= scale(m, x.dtype.type)
    return x


def _by_length(v, size, fn):
    out = np.empty_like(v)
    spans = chunks(v.size, size)
    for m in sorted({m for _, m in spans}):
        los = [lo for lo, mm in spans if mm == m]
        rows = np.stack([v[lo:lo + m] for lo in los])
        for lo, r in zip(los, fn(rows, m)):
            out[lo:lo + m] = r
    return out


def rotate(x, size, seed, key, start=0):
    """The rotation of x (any float dtype, bfloat16 too) in its
    accumulation type."""
    v = flip(to_acc(x), sign_bits(np.asarray(x).size, seed, key, start))
    return _by_length(v, size, hadamard)


def unrotate(y, size, seed, key, start=0, dtype=None):
    """The inverse rotation of y (float32 or float64), as dtype (default:
    y's; a 16-bit type rounds to nearest even)."""
    v = flip(_by_length(np.asarray(y).reshape(-1), size, hadamard),
             sign_bits(np.asarray(y).size, seed, key, start))
    if dtype is None or np.dtype(dtype) == v.dtype:
        return v
    if np.dtype(acc_dtype(dtype)) != v.dtype:
        raise ValueError(f"{v.dtype} is not the accumulation type of {np.dtype(dtype)}")
    with np.errstate(over="ignore"):
        return v.astype(dtype)


__all__ = ["BF16", "chunks", "rotate", "sign_bits", "sign_stream", "unrotate"]
