"""``python -m equarx_mpi.bench kernels``: throughput of the int8 kernels,
numba against the C reference in native/ (bench/native.py loads it).

    python -m equarx_mpi.bench kernels [-n COUNT ...] [--block B] [--repeat R]
                                       [--clock cpu|wall] [--isa native|avx2]

One process, one core, float32 input, SUM.  Bandwidths are GB/s of float32
input (4 bytes per value), the median of ``repeat`` timings; each timing
loops the kernel until it has run for about a millisecond, so pieces that
fit in cache are measured in cache, like the ring's pieces.  numba and C
take turns, and numba/C is the median of the per-turn ratios, so load from
other processes hits both alike.

``--threads T`` measures instead every wire's kernels through its format
at 1 and T threads (option ``threads``, wire/threaded.py), wall time, in
turns: the rate at T over the rate at 1 is the speedup a rank gets from
T cores.

``--rotate S,S`` times instead the rotation (kernels/rotate.py: rotate
and unrotate, float32, one core) at those sizes against numpy's copyto of
the same array, in ns per value (median of ``repeat`` turns; the three
take turns).

``--isa avx2`` measures both sides as compiled for a plain AVX2 machine on
this one: C built with ``-O3 -march=haswell`` into its own library, numba in
a child process with NUMBA_CPU_NAME=haswell (and the haswell features only).
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

from equarx_mpi import kernels as K
from equarx_mpi.bench.common import arg_type, comma_list
from equarx_mpi.bench.native import ISAS, NATIVE_DIR, Native  # noqa: F401 (Native: tests/test_formats.py)
from equarx_mpi.model.profiles import cpu_model

PROG = "python -m equarx_mpi.bench kernels"
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def _rates(fns, nbytes, repeat, clock=time.thread_time, min_time=1e-3):
    """GB/s of each of fns in each of ``repeat`` turns (one list per
    function) of an inner loop of about min_time; the functions take turns,
    so that load from other processes hits all of them alike."""
    inner = []
    for fn in fns:
        fn()
        t0 = time.perf_counter()
        fn()
        inner.append(max(1, int(min_time / max(time.perf_counter() - t0, 1e-9))))
    rates = [[] for _ in fns]
    for _ in range(repeat):
        for fn, k, r in zip(fns, inner, rates):
            t0 = clock()
            for _ in range(k):
                fn()
            r.append(nbytes * k / max(clock() - t0, 1e-9) / 1e9)
    return rates


def bench(n, block, repeat, native, clock=time.thread_time):
    """{name: (numba GB/s, C GB/s, numba/C)} for the four int8 kernels and
    the copy (numpy's copyto, memcpy): medians of the rates and of the
    per-turn ratios.  The C calls get their pointers ready-made, so
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
    res = {}
    for name, fns in cases.items():
        r_nb, r_c = _rates(fns, 4 * n, repeat, clock)
        res[name] = (float(np.median(r_nb)), float(np.median(r_c)),
                     float(np.median(np.divide(r_nb, r_c))))
    return res


def bench_threads(n, wires, threads, repeat):
    """{(wire, kernel): (GB/s at 1 thread, at ``threads``, median ratio)}
    for each wire's encode, decode, decode_reduce and the ring's fused hop
    on float32, wall time; the two take turns."""
    from equarx_mpi.wire import formats
    from equarx_mpi.wire.threaded import Threaded
    rng = np.random.default_rng(0)
    own = rng.standard_normal(n).astype(np.float32)
    own.flags.writeable = False
    out = np.empty(n, np.float32)
    res = {}
    for wire in wires:
        block = formats.default_block(wire)
        make = lambda: formats.make_format(wire, block, np.float32)  # noqa: E731
        fmts = (make(), Threaded(make, threads))
        bufs = [np.zeros(make().nbytes(n), np.uint8) for _ in fmts]
        ws = [f.views(b, n) for f, b in zip(fmts, bufs)]
        for f, w in zip(fmts, ws):
            f.encode(own, w, K.ROUND_NEAREST)
        cases = {
            "encode": [lambda f=f, w=w: f.encode(own, w, K.ROUND_NEAREST)
                       for f, w in zip(fmts, ws)],
            "decode": [lambda f=f, w=w: f.decode(w, out) for f, w in zip(fmts, ws)],
            "decode_reduce": [lambda f=f, w=w: f.decode_reduce(own, w, out, K.OP_SUM)
                              for f, w in zip(fmts, ws)],
            "decode_reduce_encode": [
                lambda f=f, w=w: f.decode_reduce_encode(own, w, w, K.OP_SUM, K.ROUND_NEAREST)
                for f, w in zip(fmts, ws)],
        }
        for name, fns in cases.items():
            r1, rT = _rates(fns, 4 * n, repeat, time.perf_counter, min_time=5e-3)
            res[wire, name] = (float(np.median(r1)), float(np.median(rT)),
                               float(np.median(np.divide(rT, r1))))
    return res


def _threads_main(args):
    from equarx_mpi.wire import formats
    print(f"# every wire's kernels through its format, float32, SUM; 1 against "
          f"{args.threads} threads (wall time, in turns), median of {args.repeat}")
    print(f"# {cpu_model()}; {len(os.sched_getaffinity(0))} cores for this process; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"# {'wire':<12}{'kernel':<22}{'count':>10}{'1 thread[GB/s]':>16}"
          f"{f'{args.threads} threads[GB/s]':>18}{'ratio':>7}")
    for n in args.count:
        for (wire, name), (r1, rT, ratio) in bench_threads(
                n, formats.WIRES, args.threads, args.repeat).items():
            print(f"  {wire:<12}{name:<22}{n:>10}{r1:>16.2f}{rT:>18.2f}{ratio:>7.2f}",
                  flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    return 0


def bench_rotate(n, size, repeat, clock=time.thread_time):
    """{name: (ns per value, its median ratio to the copy's)} for rotate,
    unrotate (float32, out of place) and numpy's copyto, taking turns."""
    from equarx_mpi.kernels import rotate as R
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    y, z = np.empty_like(x), np.empty_like(x)
    R.rotate(x, y, size, 1, 2)
    fns = [lambda: R.rotate(x, y, size, 1, 2), lambda: R.unrotate(y, z, size, 1, 2),
           lambda: np.copyto(z, x)]
    rates = [np.array(r) for r in _rates(fns, 4 * n, repeat, clock)]
    return {name: (float(np.median(4 / r)), float(np.median(rates[2] / r)))
            for name, r in zip(("rotate", "unrotate", "copy"), rates)}


def _rotate_main(args):
    print(f"# the rotation, float32, one core, {args.clock} time; median of {args.repeat} "
          "turns (rotate, unrotate, copy in turn)")
    print(f"# {cpu_model()}; numba for {_numba_target()}; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"# {'kernel':<10}{'size':>6}{'count':>10}{'ns/value':>10}{'x copy':>8}")
    for n in args.count:
        for size in args.rotate:
            for name, (ns, ratio) in bench_rotate(n, size, args.repeat, CLOCKS[args.clock]).items():
                print(f"  {name:<10}{size:>6}{n:>10}{ns:>10.3f}{ratio:>8.2f}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    return 0


def _numba_target():
    import llvmlite.binding as ll
    from numba.core import config
    return config.CPU_NAME or ll.get_host_cpu_name()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--count", type=int, nargs="+", default=[1 << 16, 1 << 22],
                    help="values per kernel call (default: 65536, cache resident, "
                         "and 4194304)")
    ap.add_argument("--block", type=int, default=256,
                    help="values per block, one scale each (default 256)")
    ap.add_argument("--repeat", type=int, default=15, help="timings per median (default 15)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: the thread's time on a core (default; a busy machine's "
                         "other processes then cost only cache and memory "
                         "bandwidth, not the time they hold the core); wall: "
                         "elapsed time")
    ap.add_argument("--isa", choices=sorted(ISAS), default="native",
                    help="native: both sides for this CPU (default); avx2: both "
                         "compiled for a plain AVX2 (haswell) CPU")
    ap.add_argument("--threads", type=int, default=0,
                    help="measure every wire at 1 and this many threads instead")
    ap.add_argument("--rotate", type=arg_type(comma_list(int)), default=None, metavar="S,S",
                    help="time the rotation at these sizes instead (powers of two, 2..4096)")
    args = ap.parse_args(argv)
    if args.rotate:
        if any(not 2 <= s <= 4096 or s & (s - 1) for s in args.rotate):
            ap.error(f"--rotate {args.rotate}: powers of two from 2 to 4096")
        return _rotate_main(args)
    if args.block < 1 or args.repeat < 1 or min(args.count) < 1:
        ap.error("--count, --block and --repeat must be positive")
    if args.threads:
        if args.threads < 2:
            ap.error("--threads: at least 2")
        return _threads_main(args)
    build, _, env = ISAS[args.isa]
    if env is not None and any(os.environ.get(k) != v for k, v in env.items()):
        # numba reads its target when it is imported: measure in a child
        r = subprocess.run([sys.executable, "-m", "equarx_mpi.bench", "kernels", *argv],
                           env={**os.environ, **env})
        return r.returncode
    native = Native.for_isa(args.isa)
    with open(os.path.join(NATIVE_DIR, build, "cflags")) as f:
        c_cmd = f.read().strip()
    print("# int8 block kernels, float32 input, SUM, one core; "
          f"block {args.block}, median of {args.repeat}, {args.clock} time")
    print(f"# {cpu_model()}; isa {args.isa}: numba for {_numba_target()}, C: {c_cmd}")
    print(f"# load average {os.getloadavg()[0]:.2f} at the start")
    print("# rates in GB/s of float32 input; copy = numpy copyto (numba column) "
          "and C memcpy (C column); numba/C = median of per-turn ratios")
    print(f"# {'kernel':<21}{'count':>10}{'numba[GB/s]':>13}{'C[GB/s]':>10}"
          f"{'numba/C':>9}{'numba/memcpy':>14}{'numba/np.copy':>15}")
    for n in args.count:
        res = bench(n, args.block, args.repeat, native, CLOCKS[args.clock])
        np_copy, c_copy, _ = res["copy"]
        for name, (r_nb, r_c, ratio) in res.items():
            print(f"  {name:<21}{n:>10}{r_nb:>13.2f}{r_c:>10.2f}{ratio:>9.2f}"
                  f"{r_nb / c_copy:>14.2f}{r_nb / np_copy:>15.2f}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    return 0
