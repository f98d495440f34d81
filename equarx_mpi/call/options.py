"""Options of a QuantizedComm: defaults, validation, and overrides from
the environment, in one place.

Every option can be set by an environment variable ``EQUARX_MPI_<NAME>``
(``EQUARX_MPI_WIRE=bf16``, ``EQUARX_MPI_LOSSY_OPS=sum,max``): it replaces
the default, and an option passed in code still wins.  A value that does
not parse is ignored with a warning (as mpi4py does with MPI4PY_RC_*); an
unknown option passed in code is a TypeError.  ``EQUARX_MPI_DISABLE=1``
makes every call take the exact MPI collective, whatever the code asks;
``EQUARX_MPI_LOG=1`` logs every call's decision on rank 0 (stderr); by
default (``lossy``) rank 0 logs each kind of call the first time it is
chosen to travel lossy; ``0`` logs nothing.
``EQUARX_MPI_PROFILE=path`` names the profile algorithm="auto" decides
with (costmodel.py).

What each option means, its environment variable and its default:
docs/OPTIONS.md (the one place they are explained); DEFAULTS below is the
code's side of it, and tests/test_docs.py checks the two agree.
"""
import math
import os
import warnings

import numpy as np

from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.wire import formats
from equarx_mpi.wire.formats import STOCHASTIC_WIRES

#: auto, the quantized schedules (collectives/registry.py), the exact ones
ALGORITHMS = ("auto",) + tuple(SCHEDULES) + ("shm", "mpi")
LOSSY_OPS = ("sum", "max", "min")
ROUNDINGS = ("nearest", "stochastic")
#: No single message exceeds this (MPI counts are 32-bit in many places).
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

DEFAULTS = dict(
    wire="int8",
    block_size=None,        # the wire's own, formats.default_block: 256, int4 64, int4-affine 128
    algorithm="auto",
    chunks=None,
    threads=None,           # kernel threads per rank; None: the node's cores / its ranks
    accuracy=None,          # None: any error the wire gives; "exact"; or a relative L2 error
    min_quantized_bytes=None,
    lossy_ops=("sum",),
    lossy_allgather=False,
    check=True,             # "all": MPI's own path agreed too (debugging, porting)
    lossy_margin=1.25,      # auto and the named algorithms' floors: lossy only this much faster
    exact_bounds=False,     # exact float SUMs through MPI: compute their bound on every call
    measured_bounds=False,  # quantized calls: bound each quantization by its measured error
    max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
    rounding="nearest",     # of SUM's codes; "stochastic": unbiased, keyed by seed
    seed=0,
    rotate=False,           # True: a randomized Hadamard rotation per block; its size; "auto"
    abs_tol=None,           # the error-bounded mode (tolerance.py): at most one of the two
    rel_tol=None,
)
#: the algorithms of the error-bounded mode: two-shot, or exact
TOLERANCE_ALGORITHMS = ("two_shot", "mpi", "shm")
ENV_PREFIX = "EQUARX_MPI_"


def disabled():
    """EQUARX_MPI_DISABLE=1: every call exact."""
    return os.environ.get(ENV_PREFIX + "DISABLE", "0") not in ("", "0")


def logging():
    """EQUARX_MPI_LOG: "1" logs each call's decision on rank 0, "lossy" (the
    default) each new lossy decision, "0" none."""
    t = os.environ.get(ENV_PREFIX + "LOG", "lossy").strip().lower()
    if t in ("", "0", "none", "off", "false", "no"):
        return "none"
    if t in ("1", "all", "on", "true", "yes"):
        return "all"
    if t != "lossy":
        warnings.warn(f"ignoring {ENV_PREFIX}LOG={t!r}: 0, lossy or 1", stacklevel=2)
    return "lossy"


def _parse_env(name, text):
    t = text.strip()
    if name in ("wire", "algorithm", "rounding"):
        return t
    if name == "accuracy":
        return None if t.lower() == "none" else t if t == "exact" else float(t)
    if name in ("abs_tol", "rel_tol"):
        return None if t.lower() == "none" else float(t)
    if name == "lossy_ops":
        return tuple(s.strip().lower() for s in t.split(",") if s.strip())
    if name == "lossy_margin":
        return float(t)
    if name == "check" and t.lower() == "all":
        return "all"
    if name == "rotate" and (t.isdigit() and int(t) > 1 or t.lower() == "auto"):
        return int(t) if t.isdigit() else "auto"
    if name in ("check", "lossy_allgather", "exact_bounds", "measured_bounds", "rotate"):
        if t.lower() in ("1", "true", "yes", "on"):
            return True
        if t.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(t)
    if t.lower() == "none" and DEFAULTS[name] is None:
        return None
    return int(t, 0)


def _from_env():
    out = {}
    for name in DEFAULTS:
        text = os.environ.get(ENV_PREFIX + name.upper())
        if text is None:
            continue
        try:
            value = _parse_env(name, text)
            check(_tolerance_defaults(dict(DEFAULTS, **{name: value}), {}))
        except (TypeError, ValueError) as e:
            warnings.warn(f"ignoring {ENV_PREFIX}{name.upper()}={text!r}: {e}", stacklevel=3)
            continue
        out[name] = value
    return out


def resolve(given):
    """The full, normalised option dict for options ``given`` in code
    (TypeError for an unknown name, ValueError for a bad value)."""
    given = dict(given)
    unknown = sorted(set(given) - set(DEFAULTS) - {"bits"})
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; "
                        f"options are {', '.join(sorted(DEFAULTS))}")
    bits = given.pop("bits", None)
    if bits is not None:
        if bits not in formats.BITS_TO_WIRE:
            raise ValueError(f"bits must be one of {tuple(formats.BITS_TO_WIRE)}, not {bits!r}")
        wire = formats.BITS_TO_WIRE[bits]
        if given.get("wire", wire) != wire:
            raise ValueError(f"bits={bits} and wire={given['wire']!r} disagree")
        given["wire"] = wire
    opts = dict(DEFAULTS, **_from_env())
    opts.update(given)
    _tolerance_defaults(opts, given)
    if opts["block_size"] is None and opts["wire"] in formats.WIRES + (formats.MODE_WIRE,):
        opts["block_size"] = formats.default_block(opts["wire"])
    if isinstance(opts["lossy_ops"], str):
        opts["lossy_ops"] = (opts["lossy_ops"],)
    opts["lossy_ops"] = tuple(sorted(set(o.lower() if isinstance(o, str) else o
                                         for o in opts["lossy_ops"])))
    check(opts)
    if isinstance(opts["rotate"], np.bool_):
        opts["rotate"] = bool(opts["rotate"])
    # numpy integers pass check() as the sizes they are; the rest of the
    # library does arithmetic with Python's (int.bit_length, no overflow)
    for k in ("seed", "block_size", "rotate", "chunks", "threads", "min_quantized_bytes",
              "max_message_bytes"):
        if isinstance(opts[k], np.integer):
            opts[k] = int(opts[k])
    opts["lossy_margin"] = float(opts["lossy_margin"])
    return opts


def _tolerance_defaults(opts, given):
    """With a tolerance the wire is "mixed" and the algorithm two-shot
    (also for "auto", the default: the mode's own choice), unless the code
    names others (check() then refuses them)."""
    if opts["abs_tol"] is not None or opts["rel_tol"] is not None:
        if "wire" not in given:
            opts["wire"] = "mixed"
        if opts["algorithm"] == "auto" or ("algorithm" not in given and
                                           opts["algorithm"] not in TOLERANCE_ALGORITHMS):
            opts["algorithm"] = "two_shot"
    return opts


def _check_tolerance(o):
    tols = [name for name in ("abs_tol", "rel_tol") if o[name] is not None]
    for name in tols:
        t = o[name]
        if (isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer,
                                                                   np.floating))
                or not math.isfinite(t) or t <= 0):
            raise ValueError(f"{name} must be None or a finite number > 0, not {t!r}")
    if len(tols) == 2:
        raise ValueError("give abs_tol or rel_tol, not both")
    if not tols:
        if o["wire"] == "mixed":
            raise ValueError("wire='mixed' is the error-bounded mode's: set abs_tol= or "
                             "rel_tol= instead")
        return
    if o["wire"] != "mixed":
        raise ValueError(f"{tols[0]}= picks each block's format itself: leave wire unset "
                         f"(got wire={o['wire']!r})")
    if o["algorithm"] not in TOLERANCE_ALGORITHMS:
        raise ValueError(f"{tols[0]}= runs on algorithm 'two_shot' (or the exact 'mpi', "
                         f"'shm'), not {o['algorithm']!r}")
    if set(o["lossy_ops"]) - {"sum"}:
        raise ValueError(f"{tols[0]}= bounds SUM; MAX and MIN stay exact: lossy_ops must "
                         f"be ('sum',), not {o['lossy_ops']}")
    if o["rounding"] != "nearest" or o["accuracy"] not in (None, "exact"):
        raise ValueError(f"{tols[0]}= picks the rounding and the error itself: leave "
                         f"rounding and accuracy unset")
    if o["measured_bounds"]:
        raise ValueError(f"{tols[0]}= budgets each block's error before it is coded: "
                         f"measured_bounds does not apply")


def _check_rotate(o, block):
    r = o["rotate"]
    if r is False or r is True or isinstance(r, np.bool_) or r == "auto":
        if not r:
            return
    elif not _is_int(r) or r < 2 or r > block or r & (r - 1):
        raise ValueError(f"rotate must be False, True (the block's size), 'auto' or a power "
                         f"of two from 2 to block_size {block}, not {r!r}")
    if o["wire"] not in formats.ROTATE_WIRES:
        raise ValueError(f"rotate= works with the block wires {formats.ROTATE_WIRES}, not "
                         f"{o['wire']!r}" + (" (set abs_tol/rel_tol or rotate, not both)"
                                             if o["wire"] == formats.MODE_WIRE else ""))
    if set(o["lossy_ops"]) - {"sum"}:
        raise ValueError(f"rotate= rotates sums (a rotation does not commute with MAX or "
                         f"MIN): lossy_ops must be ('sum',), not {o['lossy_ops']}")


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check(o):
    """Raise ValueError for a bad value."""
    if o["wire"] not in formats.WIRES + (formats.MODE_WIRE,):
        raise ValueError(f"wire must be one of {formats.WIRES}, not {o['wire']!r}")
    b = o["block_size"]
    if b is None:
        b = formats.default_block(o["wire"])
    elif not _is_int(b) or b < 32 or b > 4096 or b & (b - 1):
        raise ValueError(f"block_size must be None or a power of two from 32 to 4096, "
                         f"not {b!r}")
    if o["algorithm"] not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {o['algorithm']!r}")
    _check_tolerance(o)
    a = o["accuracy"]
    if not (a is None or a == "exact" or (isinstance(a, (int, float, np.floating))
                                          and not isinstance(a, bool) and 0 < a < 1)):
        raise ValueError(f"accuracy must be None, 'exact' or a relative error between 0 and 1 "
                         f"(0.02 = 2%), not {a!r}")
    c = o["chunks"]
    if c is not None and (not _is_int(c) or c < 1):
        raise ValueError(f"chunks must be None or an integer >= 1, not {c!r}")
    t = o["threads"]
    if t is not None and (not _is_int(t) or not 1 <= t <= 256):
        raise ValueError(f"threads must be None or an integer from 1 to 256, not {t!r}")
    q = o["min_quantized_bytes"]
    if q is not None and (not _is_int(q) or q < 0):
        raise ValueError(f"min_quantized_bytes must be None or an integer >= 0, not {q!r}")
    bad = [op for op in o["lossy_ops"] if op not in LOSSY_OPS]
    if bad:
        raise ValueError(f"lossy_ops may hold {', '.join(LOSSY_OPS)}, not {bad}")
    lm = o["lossy_margin"]
    if isinstance(lm, bool) or not isinstance(lm, (int, float, np.integer, np.floating)) \
            or not 1 <= lm < math.inf:
        raise ValueError(f"lossy_margin must be a number >= 1 (1.25: lossy only where "
                         f"predicted 25% faster than exact), not {lm!r}")
    if not isinstance(o["check"], (bool, np.bool_)) and o["check"] != "all":
        raise ValueError(f"check must be True, False or 'all', not {o['check']!r}")
    for name in ("lossy_allgather", "exact_bounds", "measured_bounds"):
        if not isinstance(o[name], (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, not {o[name]!r}")
    if o["rounding"] not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, not {o['rounding']!r}")
    if o["rounding"] == "stochastic" and o["wire"] not in STOCHASTIC_WIRES:
        raise ValueError(f"rounding='stochastic' takes the wires {STOCHASTIC_WIRES}, "
                         f"not {o['wire']!r}")
    if not _is_int(o["seed"]) or not 0 <= o["seed"] < 2 ** 64:
        raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, not {o['seed']!r}")
    _check_rotate(o, b)
    mm = o["max_message_bytes"]
    one_block = formats.max_block_bytes(o["wire"], b)
    if not _is_int(mm) or not one_block <= mm < 2 ** 31:
        raise ValueError(f"max_message_bytes must be an integer from one block's "
                         f"{one_block} bytes to 2**31 - 1, not {mm!r}")
