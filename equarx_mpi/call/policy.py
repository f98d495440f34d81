"""The choice of method for each call, in one place: exact MPI, the shared
window, or a quantized schedule.

Lossy only where the caller allowed it and it clearly pays: SUM may be
quantized by default; MAX and MIN only when ``lossy_ops`` names them (then
rounded so MAX is never below and MIN never above the true result); every
other op and every non-float dtype is exact.  A quantized method is taken
only where the cost model predicts it at least ``lossy_margin`` (default
1.25) times faster than the best exact method, under algorithm="auto" and
for the named algorithms alike (their size floor), unless
``min_quantized_bytes`` sets the floor instead; ``comm.exact()`` and
``accuracy="exact"`` keep calls exact.

algorithm="auto" picks, per call, the fastest predicted method among those
allowed: the exact ones (MPI; the shared window on one node) and the
quantized ones (ring; two-shot; rabenseifner; hierarchical on several
nodes of equal size) whose error on standard-normal data (costmodel.error) is within
``accuracy``, and for the 2-3-bit wires (int3, int2) none that requantizes
partial sums at every hop; among quantized ones the most accurate within NEAR_TIE of
the fastest wins."""

import numpy as np

from equarx_mpi.call.options import disabled
from equarx_mpi.collectives.registry import KINDS, SCHEDULES
from equarx_mpi.names import (  # noqa: F401 (EXACT: policy's word)
    EXACT,
    KERNEL_OP,
    QUANTIZED_DTYPES,
    ROUND_STOCHASTIC,
    dtype_name,
    rounding,
)
from equarx_mpi.wire.formats import DIRECTED_WIRES, NO_HOP_WIRES

#: auto takes the exact shared window from this size only: below it the
#: window's two synchronizations cost more than MPI's small-message
#: algorithms, whatever the model (docs/PERFORMANCE.md, issue 20)
WINDOW_FROM = 1 << 20
#: among quantized methods, one this much slower than the fastest but more
#: accurate wins (at 1024 ranks the int8 ring's error is 16x two-shot's)
NEAR_TIE = 1.05


def choose(opts, what, opname, dtype, nbytes, P, layout, model, feedback=False,
           wrapped=False, off=False):
    """(method, reason): how this call runs, and why, in words for
    ``last_call``.  Methods: "copy" (one rank), "mpi" (MPI's own
    collective), "shm" (exact, through a shared window on one node), or a
    quantized schedule: "ring", "two_shot", "rabenseifner", "hierarchical".  ``model``: the
    communicator's costmodel.Model; ``feedback``: the call carries an
    ErrorFeedback (auto leaves out the hierarchical schedule, which cannot);
    ``wrapped``: a wrapped communicator's call, whose exact calls give MPI's
    own bits (auto leaves out the window, which adds in another order);
    ``off``: EQUARX_MPI_DISABLE was set when the communicator was made.
    ``opts["accuracy"] == "exact"`` (also inside ``comm.exact()``) keeps
    every call exact."""
    fixed = _without_model(opts, what, opname, dtype, P, layout, off)
    if fixed is not None:
        return fixed
    alg = opts["algorithm"]
    # exact from here on: through the window where auto may pick it and it pays
    window = alg == "auto" and layout.one_node and what == "Allreduce" and not wrapped
    times = {}

    def t(m):
        if m not in times:
            times[m] = model.time(m, nbytes, np.dtype(dtype).itemsize, dtype_name(dtype))
        return times[m]

    margin = opts["lossy_margin"]
    # MPI's own unless another method clearly pays, within what the model measured
    known = nbytes >= model.measured_from
    window = window and nbytes >= WINDOW_FROM
    best_exact = "shm" if window and t("shm") * margin <= t("mpi") else "mpi"
    # lossy must beat the fastest exact method, the window too where it may run
    fastest_exact = min(["mpi", "shm"], key=t) if window else "mpi"
    why_exact = _exact_op(opts, what, opname)
    # stochastic rounding has twice the error variance of nearest (costmodel)
    rmode = "stochastic" if rounding(opname, opts["rounding"]) == ROUND_STOCHASTIC else "nearest"

    def error(m):
        return model.error(m, rmode)
    lossy, why = ([], why_exact) if why_exact else _lossy_candidates(opts, what, layout, error,
                                                                     feedback)
    least = opts["min_quantized_bytes"]
    if lossy and least is not None and nbytes < least:
        return best_exact, f"{nbytes} bytes is below min_quantized_bytes={least}"
    if not lossy:
        return best_exact, why
    if least is not None and alg != "auto":      # the caller's floor, not the model's
        return lossy[0], why
    if not known:
        return best_exact, (f"{alg}: {nbytes} bytes is below the smallest size the profile "
                            f"measured ({model.measured_from}): MPI's own")
    best = lossy[0] if alg != "auto" else near_fastest(lossy, t, error)
    if t(best) * margin > t(fastest_exact):
        return best_exact, (f"{alg}: lossy is not predicted {margin:g}x faster than exact: "
                            f"{_predicted(times, fastest_exact)}, {_predicted(times, best)}")
    return best, (f"{alg}: {_predicted(times, best)}, error {error(best):.2%}; "
                  f"{_predicted(times, best_exact)}")


def _without_model(opts, what, opname, dtype, P, layout, off):
    """(method, reason) for the calls whose path no size or model changes,
    else None."""
    alg = opts["algorithm"]
    if P == 1:
        return "copy", "one rank: a copy"
    if off:
        return "mpi", "EQUARX_MPI_DISABLE is set"
    if alg == "mpi":
        return "mpi", "algorithm='mpi'"
    if dtype not in QUANTIZED_DTYPES:
        return "mpi", f"dtype {np.dtype(dtype).name} is always exact"
    if what != "Allgather" and opname not in KERNEL_OP:
        return "mpi", f"op {opname} is always exact"
    if alg == "shm":
        return ("shm", "algorithm='shm': exact, through a shared window") \
            if layout.one_node and what == "Allreduce" else (
                "mpi", "algorithm='shm' reduces only Allreduce on one node: MPI")
    if what == "Allgather" and opts["wire"] == "mixed":
        return "mpi", "the error-bounded mode (abs_tol/rel_tol) quantizes sums only"
    return None


def _exact_op(opts, what, opname):
    """Why op ``opname`` stays exact under these options, or None."""
    if what == "Allgather":
        return None
    if opname not in opts["lossy_ops"]:
        return f"op {opname.upper()} is exact unless lossy_ops includes {opname!r}"
    if opname != "sum" and opts["wire"] not in DIRECTED_WIRES:
        return (f"{opname.upper()} travels quantized only on wires that round up and "
                f"down: {', '.join(DIRECTED_WIRES)}")
    return None


def near_fastest(methods, t, error):
    """The most accurate of ``methods`` predicted within NEAR_TIE of the
    fastest."""
    fastest = min(methods, key=t)
    return min((m for m in methods if t(m) <= t(fastest) * NEAR_TIE),
               key=lambda m: (error(m), t(m)))


def _predicted(times, m):
    return f"{m} predicted {times[m] * 1e3:.3g} ms"


#: how the fall-back reason names a kind of collective
_KIND_WORDS = {"allreduce": "allreduce", "reduce_scatter": "reduce-scatter",
               "allgather": "all-gather"}


def _lossy_candidates(opts, what, layout, error, feedback):
    """(quantized methods this call may take, and why, in words): the
    algorithm asked for, or under auto every one that fits the call, the
    layout, error feedback and ``accuracy`` (``error``: a method's
    predicted error), in the registry's order (collectives/registry.py)."""
    alg, acc = opts["algorithm"], opts["accuracy"]
    if acc == "exact":
        return [], "accuracy='exact'"
    # another name (crossover() takes any): a reduction, not an Allreduce
    kind = KINDS.get(what, "reduce_scatter")
    if alg == "auto":
        # the 2-3-bit wires: each value quantized at most twice (two-shot),
        # never once per hop (docs/FORMAT.md "int3 and int2")
        hops = opts["wire"] not in NO_HOP_WIRES
        cands = [name for name, s in SCHEDULES.items()
                 if kind in s.kinds and s.fits(layout, True) and (s.feedback or not feedback)
                 and (hops or not s.requantizes(kind))]
        why = "auto"
    else:
        s = SCHEDULES[alg]
        if s.covers and not (kind in s.kinds and s.fits(layout, False)):
            cands, why = ["ring"], f"{alg} covers {s.covers}; this call: the ring"
        elif kind not in s.kinds:
            cands, why = ["ring"], (f"{alg} has no {_KIND_WORDS[kind]} of its own: "
                                    f"this call: the ring")
        else:
            cands, why = [alg], "quantized"
    if acc is None:
        return cands, why
    fits = [m for m in cands if error(m) <= acc]
    if not fits:
        errs = ", ".join(f"{m} {error(m):.2%}" for m in cands)
        return [], f"accuracy={acc:g}: no quantized method is that accurate ({errs})"
    return fits, why


class Chooser:
    """choose() for one communicator, remembered per call shape: the model
    takes tens of microseconds, and a shape's answer never changes.
    EQUARX_MPI_DISABLE is read once, here: the communicator's maker agrees
    it across ranks, so that every rank (and crossover) answers alike.
    ``tell(shape, method, reason)``, if given, hears of each shape's first
    lossy call (the log)."""

    def __init__(self, opts, P, layout, model, tell=None):
        self.opts, self.P, self.layout, self.model = opts, P, layout, model
        self._exact_opts = dict(opts, accuracy="exact")
        self.off = disabled()
        self._seen, self._told, self.tell = {}, set(), tell

    def __call__(self, what, opname, dtype, nbytes, feedback=False, wrapped=False,
                 exact=False, quiet=False):
        """(method, reason); ``exact``: inside comm.exact(); ``quiet``: not
        told (a call refused for its arguments)."""
        key = (what, opname, dtype, nbytes, feedback, wrapped, exact)
        got = self._choose(key)
        if self.tell is not None and not quiet and got[0] not in EXACT \
                and key not in self._told:
            if len(self._told) >= 1024:        # a line per kind, at most 1024 remembered
                self._told.clear()
            self._told.add(key)
            self.tell(key, *got)
        return got

    def _choose(self, key):
        got = self._seen.get(key)
        if got is None:
            if len(self._seen) >= 1024:
                self._seen.clear()
            what, opname, dtype, nbytes, feedback, wrapped, exact = key
            got = choose(self._exact_opts if exact else self.opts, what, opname, dtype, nbytes,
                         self.P, self.layout, self.model, feedback, wrapped, self.off)
            if exact and got[1] == "accuracy='exact'":
                got = got[0], "inside comm.exact()"
            self._seen[key] = got
        return got

    def crossover(self, what, opname, dtype, upto, wrapped=False):
        """The smallest size (quarter-octave steps from 1 KiB) that is
        quantized, or None up to ``upto``."""
        n = 1024
        while n <= upto:
            for step in (4, 5, 6, 7):
                size = n * step // 4
                if self._choose((what, opname, dtype, size, False, wrapped, False))[0] \
                        not in EXACT:
                    return size
            n *= 2
        return None
