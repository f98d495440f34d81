"""``python -m equarx_mpi.bench coldstart``: what a fresh install pays for
numba's compiling, with its cache empty, against the targets of
docs/PERFORMANCE.md "Cold start".

    python -m equarx_mpi.bench coldstart [-n RANKS] [--wire W] [--dtype T]
                                         [--size S] [--algorithm A] [--no-warmup]

Run it as one process, not under mpirun: it launches, each with an empty
temporary NUMBA_CACHE_DIR (so numba's real cache is neither read nor
written), and deletes that folder afterwards:

  (a) ``mpirun -n RANKS`` (the mpirun next to sys.executable, else the one
      on PATH) of this module's ``--child`` mode: each rank times
      ``QuantizedComm(COMM_WORLD)``, its first quantized Allreduce and a
      second one; the slowest rank's times are printed.  The first call is
      forced onto a quantized schedule (``--algorithm``, ring by default,
      with ``min_quantized_bytes=0``) and the child reports the method it
      ran (``last_call.method``).
  (b) ``python -m equarx_mpi.warmup -q``: every wire and input type.

Wall seconds are what a user waits; the CPU seconds (of every child
process, from getrusage) are what was compiled, and change less with
other load on the machine.
"""
import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

PROG = "python -m equarx_mpi.bench coldstart"
#: issue 20's targets: seconds of (a) QuantizedComm + first quantized call
#: at 2 ranks, (b) python -m equarx_mpi.warmup
TARGET_FIRST, TARGET_WARMUP = 3.0, 120.0
_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def _child(args):
    """Under mpirun: time QuantizedComm(COMM_WORLD) and two calls."""
    t0 = time.perf_counter()
    import numpy as np
    from mpi4py import MPI

    from equarx_mpi import QuantizedComm
    from equarx_mpi.names import BFLOAT16
    t_import = time.perf_counter() - t0
    world = MPI.COMM_WORLD
    dtype = BFLOAT16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    x = np.random.default_rng(world.Get_rank()).standard_normal(
        args.size // dtype.itemsize).astype(dtype)
    y = np.empty_like(x)
    world.Barrier()
    t = time.perf_counter()
    # min_quantized_bytes=0: the named schedule whatever the cost model says
    qc = QuantizedComm(world, wire=args.wire, algorithm=args.algorithm, min_quantized_bytes=0)
    t_create = time.perf_counter() - t
    times = []
    for _ in range(2):
        t = time.perf_counter()
        qc.Allreduce(x, y)
        times.append(time.perf_counter() - t)
    method = qc.last_call.method
    cpu = time.process_time()
    got = world.gather((t_import, t_create, times[0], times[1], cpu, method), root=0)
    qc.free()
    if world.Get_rank() == 0:
        worst = [max(g[i] for g in got) for i in range(4)]
        print("RESULT", *(f"{v:.6f}" for v in worst), f"{sum(g[4] for g in got):.6f}",
              ",".join(sorted({g[5] for g in got})), flush=True)


def _mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else shutil.which("mpirun") or "mpirun"


def _run(cmd, env):
    """(wall seconds, CPU seconds of the children, stdout) of cmd."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if r.returncode:
        raise SystemExit(f"{PROG}: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return wall, cpu, r.stdout


def _fresh_env():
    cache = tempfile.mkdtemp(prefix="equarx-coldstart-")
    return cache, dict(os.environ, NUMBA_CACHE_DIR=cache, **_MPI_ENV)


def _verdict(seconds, target):
    return "met" if seconds <= target else "not met"


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--ranks", type=int, default=2, help="ranks of (a) (default 2)")
    p.add_argument("--wire", default="int8", help="wire of the first call (default int8)")
    p.add_argument("--dtype", default="float32",
                   choices=("float32", "float64", "float16", "bfloat16"))
    p.add_argument("--size", default="1M", help="bytes of the first call (default 1M)")
    p.add_argument("--algorithm", default="ring", choices=("ring", "two_shot"),
                   help="the quantized schedule of the first call (default ring)")
    p.add_argument("--no-warmup", action="store_true", help="skip (b)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from equarx_mpi.bench.common import parse_size
    try:
        args.size = parse_size(args.size)
    except ValueError as e:
        p.error(str(e))
    if args.ranks < 2:
        p.error(f"need --ranks >= 2 (a quantized call), got {args.ranks}")
    if args.child:
        _child(args)
        return 0
    print(f"# {PROG}: empty NUMBA_CACHE_DIR per step; wall and CPU [s] (CPU: all child "
          f"processes)", flush=True)
    cache, env = _fresh_env()
    try:
        cmd = [_mpirun(), "-n", str(args.ranks), sys.executable, "-m", "equarx_mpi.bench",
               "coldstart", "--child", "--wire", args.wire, "--dtype", args.dtype,
               "--size", str(args.size), "--algorithm", args.algorithm]
        wall, cpu, out = _run(cmd, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")]
    if not line:
        raise SystemExit(f"{PROG}: no result from the ranks:\n{out[-3000:]}")
    imp, create, first, second, rank_cpu, method = line[0].split()[1:]
    imp, create, first, second = (float(v) for v in (imp, create, first, second))
    cold = create + first
    print(f"# (a) {args.ranks} ranks, {args.wire} {args.dtype} {args.size} B, {method}: "
          f"import {imp:.2f}, QuantizedComm {create:.2f}, first call {first:.2f}, "
          f"second {second:.4f}; mpirun {wall:.1f} wall, {cpu:.1f} CPU", flush=True)
    if not set(method.split(",")) <= {"ring", "two_shot", "hierarchical"}:
        print(f"# (a) warning: the first call ran {method}, not quantized", flush=True)
    print(f"cold first call (QuantizedComm + first Allreduce)  {cold:7.2f} s   "
          f"target {TARGET_FIRST:g} s   {_verdict(cold, TARGET_FIRST)}", flush=True)
    if args.no_warmup:
        return 0
    cache, env = _fresh_env()
    try:
        wall, cpu, out = _run([sys.executable, "-m", "equarx_mpi.warmup", "-q"], env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    summary = [ln for ln in out.splitlines() if "kernel signatures" in ln]
    print(f"# (b) {summary[0].lstrip('# ') if summary else out.strip()[-200:]}; "
          f"{cpu:.1f} CPU", flush=True)
    print(f"python -m equarx_mpi.warmup (cold)                 {wall:7.2f} s   "
          f"target {TARGET_WARMUP:g} s   {_verdict(wall, TARGET_WARMUP)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
