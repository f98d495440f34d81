"""Throughput of the int8 kernels: numba against the C reference in native/.

    python -m equarx_mpi.kernelbench [-n COUNT ...] [--block B] [--repeat R]

One process, one core, float32 input, SUM.  Bandwidths are GB/s of float32
input (4 bytes per value), the median of ``repeat`` timings; each timing
loops the kernel until it has run for about a millisecond, so pieces that
fit in cache are measured in cache, like the ring's pieces.
"""
import argparse
import ctypes
import os
import shutil
import subprocess
import time

import numpy as np

from . import kernels as K

NATIVE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "native")
LIB_PATH = os.path.join(NATIVE_DIR, "build", "libequarx_ref.so")


def build_native():
    """Run ``make -C native``; raise with make's output when it fails."""
    if shutil.which("make") is None:
        raise RuntimeError(f"{LIB_PATH} is missing and there is no `make`: "
                           f"build it with `make -C {NATIVE_DIR}`")
    r = subprocess.run(["make", "-C", NATIVE_DIR], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`make -C {NATIVE_DIR}` failed:\n{r.stdout}{r.stderr}")


class Native:
    """ctypes wrappers of native/equarx_ref.c with the numba kernels' argument
    order (float32 arrays, SUM only)."""

    def __init__(self, path=LIB_PATH, build=True):
        if build and os.path.isdir(NATIVE_DIR):
            build_native()          # make is a no-op when the library is fresh
        if not os.path.exists(path):
            raise RuntimeError(f"C reference library {path} not found: "
                               f"run `make -C {NATIVE_DIR}`")
        lib = ctypes.CDLL(path)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        sigs = {
            "eqx_encode_f32": ([p, i64, i64, p, p], None),
            "eqx_decode_f32": ([p, p, i64, i64, p], i64),
            "eqx_decode_reduce_sum_f32": ([p, p, p, i64, i64, p, p], i64),
            "eqx_decode_reduce_encode_sum_f32": ([p, p, p, p, p, i64, i64, p], None),
            "eqx_copy_f32": ([p, p, i64], None),
        }
        for name, (args, res) in sigs.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = res
        self.lib = lib

    @staticmethod
    def _ptr(a, dtype, writable=False):
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise TypeError(f"expected a C-contiguous {np.dtype(dtype).name} array, "
                            f"not {a.dtype} with flags {a.flags}")
        if writable and not a.flags.writeable:
            raise ValueError("output array is read-only")
        return a.ctypes.data

    def i8_encode(self, src, heads, codes, block):
        self.lib.eqx_encode_f32(self._ptr(src, np.float32), src.size, block,
                                self._ptr(heads, np.float32, True),
                                self._ptr(codes, np.int8, True))

    def i8_decode(self, heads, codes, out, block):
        return self.lib.eqx_decode_f32(self._ptr(heads, np.float32), self._ptr(codes, np.int8),
                                       out.size, block, self._ptr(out, np.float32, True))

    def i8_decode_reduce(self, own, heads, codes, out, block, scratch):
        return self.lib.eqx_decode_reduce_sum_f32(
            self._ptr(own, np.float32), self._ptr(heads, np.float32),
            self._ptr(codes, np.int8), own.size, block, self._ptr(out, np.float32, True),
            self._ptr(scratch, np.float32, True))

    def i8_decode_reduce_encode(self, own, heads_in, codes_in, heads_out, codes_out,
                                block, scratch):
        self.lib.eqx_decode_reduce_encode_sum_f32(
            self._ptr(own, np.float32), self._ptr(heads_in, np.float32),
            self._ptr(codes_in, np.int8), self._ptr(heads_out, np.float32, True),
            self._ptr(codes_out, np.int8, True), own.size, block,
            self._ptr(scratch, np.float32, True))

    def copy(self, src, dst):
        self.lib.eqx_copy_f32(self._ptr(src, np.float32), self._ptr(dst, np.float32, True),
                              src.size)


def _rates(fns, nbytes, repeat, min_time=1e-3):
    """Median GB/s of each of fns over ``repeat`` timings of an inner loop;
    the functions take turns, so that load from other processes hits all
    of them alike."""
    inner = []
    for fn in fns:
        fn()
        t0 = time.perf_counter()
        fn()
        inner.append(max(1, int(min_time / max(time.perf_counter() - t0, 1e-9))))
    rates = [[] for _ in fns]
    for _ in range(repeat):
        for fn, k, r in zip(fns, inner, rates):
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            r.append(nbytes * k / (time.perf_counter() - t0) / 1e9)
    return [float(np.median(r)) for r in rates]


def bench(n, block, repeat, native):
    """{name: (numba GB/s, C GB/s)} for the four int8 kernels and the copy
    (numpy's copyto, memcpy).  The C calls get their pointers ready-made, so
    that ctypes costs little; the numba calls go through the dispatcher, as
    the ring's do (about 2 us a call)."""
    rng = np.random.default_rng(0)
    own = rng.standard_normal(n).astype(np.float32)
    other = rng.standard_normal(n).astype(np.float32)
    nb = -(-n // block)
    sc, co = np.empty(nb, np.float32), np.empty(n, np.int8)
    K.i8_encode(other, sc, co, block, np.empty(block, np.float32), K.ROUND_NEAREST)
    sc_w, co_w = sc.copy(), co.copy()           # the fused hop's in-place wire
    out = np.empty(n, np.float32)
    scratch = np.empty(block, np.float32)
    skip = np.empty(nb, np.int64)
    own.flags.writeable = False
    p = {name: a.ctypes.data for name, a in
         dict(own=own, sc=sc, co=co, sc_w=sc_w, co_w=co_w, out=out, scratch=scratch).items()}
    lib = native.lib
    cases = {
        "encode": (lambda: K.i8_encode(own, sc_w, co_w, block, scratch, K.ROUND_NEAREST),
                   lambda: lib.eqx_encode_f32(p["own"], n, block, p["sc_w"], p["co_w"])),
        "decode": (lambda: K.i8_decode(sc, co, out, block, skip),
                   lambda: lib.eqx_decode_f32(p["sc"], p["co"], n, block, p["out"])),
        "decode_reduce": (
            lambda: K.i8_decode_reduce(own, sc, co, out, block, K.OP_SUM, scratch, skip),
            lambda: lib.eqx_decode_reduce_sum_f32(p["own"], p["sc"], p["co"], n, block,
                                                  p["out"], p["scratch"])),
        "decode_reduce_encode": (
            lambda: K.i8_decode_reduce_encode(own, sc_w, co_w, sc_w, co_w, block,
                                              K.OP_SUM, scratch, K.ROUND_NEAREST),
            lambda: lib.eqx_decode_reduce_encode_sum_f32(
                p["own"], p["sc_w"], p["co_w"], p["sc_w"], p["co_w"], n, block,
                p["scratch"])),
        "copy": (lambda: np.copyto(out, own),
                 lambda: lib.eqx_copy_f32(p["own"], p["out"], n)),
    }
    return {name: tuple(_rates(fns, 4 * n, repeat)) for name, fns in cases.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m equarx_mpi.kernelbench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--count", type=int, nargs="+", default=[1 << 16, 1 << 22],
                    help="values per kernel call (default: 64Ki, cache resident, "
                         "and 4Mi)")
    ap.add_argument("--block", type=int, default=256, help="values per scale")
    ap.add_argument("--repeat", type=int, default=15, help="timings per median")
    args = ap.parse_args(argv)
    if args.block < 1 or args.repeat < 1 or min(args.count) < 1:
        ap.error("--count, --block and --repeat must be positive")
    native = Native()
    print("# int8 block kernels, float32 input, SUM, one core; "
          f"block {args.block}, median of {args.repeat}")
    print("# rates in GB/s of float32 input; copy = numpy copyto (numba column) "
          "and C memcpy (C column)")
    print(f"# {'kernel':<21}{'count':>10}{'numba[GB/s]':>13}{'C[GB/s]':>10}"
          f"{'numba/C':>9}{'numba/memcpy':>14}{'numba/np.copy':>15}")
    for n in args.count:
        res = bench(n, args.block, args.repeat, native)
        np_copy, c_copy = res["copy"]
        for name, (r_nb, r_c) in res.items():
            print(f"  {name:<21}{n:>10}{r_nb:>13.2f}{r_c:>10.2f}{r_nb / r_c:>9.2f}"
                  f"{r_nb / c_copy:>14.2f}{r_nb / np_copy:>15.2f}")


if __name__ == "__main__":
    main()
