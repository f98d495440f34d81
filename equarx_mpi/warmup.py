"""Fill numba's on-disk cache with every kernel, once, after installing.

    python -m equarx_mpi.warmup          # or equarx_mpi.warmup() in Python
    python -m equarx_mpi.warmup --jobs 2 # two processes, one per core

The kernels are compiled by numba on first use and cached on disk.  A cold
cache costs the first quantized call of a process a few seconds (the
kernels its schedule runs for that input type and wire; docs/PERFORMANCE.md
"Cold start"); with the cache filled, loading takes
a fraction of a second.  This compiles (or loads) every kernel the
schedules use with the library's defaults (sums, rounded to nearest), for
every input type (float32, float64, float16, bfloat16) and every wire
format (formats.WIRES and the error-bounded mode's), and says where the
cache is; quantized MAX/MIN and stochastic rounding (opt-in) compile
their kernels on first use.

Where numba keeps it: in ``__pycache__`` next to the kernel modules
(equarx_mpi/kernels/__pycache__/*.nbi, *.nbc) when that folder is
writable; else in a per-user folder (numba's user-wide cache, under
~/.cache); or wherever NUMBA_CACHE_DIR points, which replaces both.  For a
read-only install (a shared site-packages, a container image), set
NUMBA_CACHE_DIR to a writable folder both when running this and when
running jobs (or run this as the installing user, so __pycache__ is
filled).  Run it on one rank, before jobs start: ranks compiling the same
kernel at once all pay for it (QuantizedComm staggers them: one rank per
node first, the others load its result).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def _dispatchers():
    """Every numba kernel of the package's loaded modules."""
    from numba.core.dispatcher import Dispatcher
    seen = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith(__package__ + ".") and mod is not None:
            for obj in vars(mod).values():
                if isinstance(obj, Dispatcher):
                    seen[id(obj)] = obj
    return list(seen.values())


def _counts(dispatchers):
    hits = sum(sum(d.stats.cache_hits.values()) for d in dispatchers)
    misses = sum(sum(d.stats.cache_misses.values()) for d in dispatchers)
    return hits, misses


def cache_locations(dispatchers=None):
    """The folders numba reads and writes the kernels' cache in."""
    out = set()
    for d in dispatchers or _dispatchers():
        path = getattr(getattr(d, "_cache", None), "_cache_path", None)
        if path:
            out.add(path)
    return sorted(out)


def warmup(verbose=False, part=0, parts=1):
    """Compile, or load from numba's cache, every kernel for every input
    type and wire format (with parts > 1: the part-th of that many shares,
    for processes that fill the cache side by side).  Returns a dict:
    seconds, compiled (kernel signatures compiled now), loaded (found in
    the cache), cache (folders)."""
    from equarx_mpi.bounds import bound
    from equarx_mpi.collectives import rotation
    from equarx_mpi.collectives.engine import warm
    from equarx_mpi.names import QUANTIZED_DTYPES, kernel_view
    from equarx_mpi.wire import formats
    t0 = time.perf_counter()
    ds = _dispatchers()
    hits0, misses0 = _counts(ds)
    if part == 0:
        bound.warm(bound.ROUNDING)
        for acc in (np.float32, np.float64):
            rotation.warm(np.dtype(acc))
    pairs = [(wire, dt) for wire in formats.WIRES + (formats.MODE_WIRE,)
             for dt in QUANTIZED_DTYPES]
    for wire, dt in pairs[part::parts]:
        kd = kernel_view(np.zeros(1, dt), False).dtype
        t = time.perf_counter()
        warm(formats.make_format(wire, formats.default_block(wire), kd), kd)
        if verbose:
            print(f"  {wire:11s} {np.dtype(dt).name:9s} {time.perf_counter() - t:7.2f} s",
                  flush=True)
    ds = _dispatchers()
    hits, misses = _counts(ds)
    return dict(seconds=time.perf_counter() - t0, compiled=misses - misses0,
                loaded=hits - hits0, cache=cache_locations(ds))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.warmup",
                                description=__doc__.split("\n\n")[1],
                                epilog=__doc__.split("\n\n", 3)[3],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    p.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                   help="compile in N processes side by side (default 1)")
    p.add_argument("--part", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.part is not None:           # one share, for the process that asked
        print(json.dumps(warmup(part=args.part, parts=args.jobs)), flush=True)
        return 0
    if not args.quiet:
        where = os.environ.get("NUMBA_CACHE_DIR")
        print(f"# equarx_mpi.warmup: NUMBA_CACHE_DIR={where or '(unset)'}", flush=True)
    others = [subprocess.Popen([sys.executable, "-m", "equarx_mpi.warmup", "--jobs",
                                str(args.jobs), "--part", str(k)], stdout=subprocess.PIPE,
                               text=True) for k in range(1, args.jobs)]
    r = warmup(verbose=not args.quiet, parts=args.jobs)
    for o in others:
        out, _ = o.communicate()
        if o.returncode:
            print(f"# equarx_mpi.warmup: part {others.index(o) + 1} of {args.jobs} failed "
                  f"(exit {o.returncode})", file=sys.stderr)
            return o.returncode
        got = json.loads(out.strip().splitlines()[-1])
        r["compiled"] += got["compiled"]
        r["loaded"] += got["loaded"]
        r["cache"] = sorted(set(r["cache"]) | set(got["cache"]))
    print(f"# {r['compiled']} kernel signatures compiled, {r['loaded']} loaded from the "
          f"cache, {r['seconds']:.2f} s", flush=True)
    for path in r["cache"]:
        print(f"# cache: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
else:
    # ``equarx_mpi.warmup`` names both this module (python -m) and its
    # function; importing the module sets the package's attribute to the
    # module, so the module calls the function too.
    class _CallableModule(type(sys)):
        def __call__(self, *args, **kwargs):
            return warmup(*args, **kwargs)

    sys.modules[__name__].__class__ = _CallableModule
