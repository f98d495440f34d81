"""Numba kernels: pure functions on contiguous 1-D arrays, nothing else.
``common`` holds the element helpers, each wire format its own module."""
from .common import (OP_MAX, OP_MIN, OP_SUM, ROUND_DOWN, ROUND_NEAREST,  # noqa: F401
                     ROUND_UP)
from .int8 import (i8_decode, i8_decode_reduce, i8_decode_reduce_encode,  # noqa: F401
                   i8_decode_reduce_encode_many, i8_decode_reduce_many, i8_encode)
from .plain import (plain_decode, plain_decode_reduce,  # noqa: F401
                    plain_decode_reduce_encode, plain_decode_reduce_encode_many,
                    plain_decode_reduce_many, plain_encode)
