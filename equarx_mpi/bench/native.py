"""The C reference of the int8 wire format (native/, see native/README.md),
loaded through ctypes with the numba kernels' argument order: what
tests/test_native.py checks the kernels against bit for bit, and what
``python -m equarx_mpi.bench kernels`` times them against.

No MPI and no numba here: building and loading the C library only.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np

#: native/ at the top of the source tree (equarx_mpi/bench/ is two below);
#: a wheel has none: then only an already built library can be loaded
NATIVE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "native")
LIB_PATH = os.path.join(NATIVE_DIR, "build", "libequarx_ref.so")

#: isa -> (C build folder under native/, CFLAGS (None: the Makefile's
#: -O3 -march=native), environment of the numba process (None: this one))
ISAS = {
    "native": ("build", None, None),
    "avx2": ("build/avx2", "-O3 -march=haswell",
             {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}),
}


def build_native(build="build", cflags=None):
    """Run ``make -C native`` (into native/<build>, with CFLAGS when given);
    raise with make's output when it fails."""
    if shutil.which("make") is None:
        raise RuntimeError(f"{NATIVE_DIR}/{build} is missing and there is no `make`: "
                           f"build it with `make -C {NATIVE_DIR}`")
    cmd = ["make", "-C", NATIVE_DIR, f"BUILD={build}"]
    if cflags is not None:
        cmd.append(f"CFLAGS={cflags}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{r.stdout}{r.stderr}")


class Native:
    """ctypes wrappers of native/equarx_ref.c with the numba kernels' argument
    order (float32 arrays, SUM only)."""

    def __init__(self, path=LIB_PATH, build=True, cflags=None):
        if build and os.path.isdir(NATIVE_DIR) and (shutil.which("make")
                                                    or not os.path.exists(path)):
            # make is a no-op when the library is fresh (same sources and flags)
            build_native(os.path.relpath(os.path.dirname(path), NATIVE_DIR), cflags)
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

    @classmethod
    def for_isa(cls, isa="native", build=True):
        """The C reference as built for ``isa`` (a key of ISAS)."""
        folder, cflags, _ = ISAS[isa]
        return cls(os.path.join(NATIVE_DIR, folder, "libequarx_ref.so"), build, cflags)

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
