"""Numba kernels: pure functions on contiguous 1-D arrays, nothing else.
``common`` holds the element helpers, ``loops`` the block formats' shared
block loops, each wire format its own module."""
import hashlib
import os


def _drop_stale_cache():
    """numba's on-disk cache checks only the file that defines a kernel, not
    the helpers it inlines from common.py: after any kernel source changes,
    drop this package's cached kernels (all the package's numba code lives
    here), so none is stale.  Ranks racing here at worst recompile."""
    here = os.path.dirname(os.path.abspath(__file__))
    cache = os.path.join(here, "__pycache__")
    digest = hashlib.sha1()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(name.encode() + f.read())
    stamp = os.path.join(cache, "kernels.stamp")
    try:
        with open(stamp) as f:
            if f.read() == digest.hexdigest():
                return
    except OSError:
        pass
    try:
        for name in os.listdir(cache) if os.path.isdir(cache) else ():
            if name.endswith((".nbi", ".nbc")):
                try:
                    os.remove(os.path.join(cache, name))
                except OSError:
                    pass
        # the stamp needs the folder numba has not made yet on a fresh
        # checkout: without it the next process would drop what this one compiles
        os.makedirs(cache, exist_ok=True)
        tmp = f"{stamp}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(digest.hexdigest())
        os.replace(tmp, stamp)
    except OSError:             # no cache folder yet, or a read-only install
        pass


_drop_stale_cache()

from equarx_mpi.kernels.affine import (  # noqa: E402,F401
    af_decode,
    af_decode_reduce,
    af_decode_reduce_encode,
    af_encode,
)
from equarx_mpi.kernels.common import (  # noqa: E402,F401
    OP_MAX,
    OP_MIN,
    OP_SUM,
    ROUND_DOWN,
    ROUND_NEAREST,
    ROUND_STOCHASTIC,
    ROUND_UP,
)
from equarx_mpi.kernels.delta import HEADS as MX_HEADS  # noqa: E402,F401
from equarx_mpi.kernels.fp8 import f8_decode, f8_decode_reduce, f8_decode_reduce_encode, f8_encode  # noqa: E402,F401
from equarx_mpi.kernels.int4 import i4_decode, i4_decode_reduce, i4_decode_reduce_encode, i4_encode  # noqa: E402,F401
from equarx_mpi.kernels.int8 import (  # noqa: E402,F401
    i8_decode,
    i8_decode_reduce,
    i8_decode_reduce_encode,
    i8_encode,
)
from equarx_mpi.kernels.int8_many import i8_decode_reduce_encode_many, i8_decode_reduce_many  # noqa: E402,F401
from equarx_mpi.kernels.lowbit import (  # noqa: E402,F401
    lb_decode,
    lb_decode_reduce,
    lb_decode_reduce_encode,
    lb_encode,
)
from equarx_mpi.kernels.mixed import META as MX_META  # noqa: E402,F401
from equarx_mpi.kernels.mixed import mx_block_errors, mx_decode, mx_encode  # noqa: E402,F401
from equarx_mpi.kernels.mixed_many import mx_decode_reduce_encode_many, mx_decode_reduce_many  # noqa: E402,F401
from equarx_mpi.kernels.plain import (  # noqa: E402,F401
    plain_decode,
    plain_decode_reduce,
    plain_decode_reduce_encode,
    plain_decode_reduce_encode_many,
    plain_decode_reduce_many,
    plain_encode,
)
from equarx_mpi.kernels.stochastic import GOLDEN  # noqa: E402,F401
