"""``python -m equarx_mpi.tune [measure]``: measure this machine's profile
for algorithm="auto" (docs/TUNING.md).

    mpirun -n 8 python -m equarx_mpi.tune [--quick] [--output PATH] [--fresh]
    python -m equarx_mpi.tune predict --ranks 16,64,256,1024 --rate 10gbit,100gbit
    python -m equarx_mpi.tune check BENCH.json --layout 1x8

measure (the default, under mpirun): kernel rates, their speedup at T
threads (``--threads``) and a memory copy on one rank, then for each layout it can form from the job's ranks (the first 2,
4, ... ranks of one node; one rank on each of 2, 4, ... nodes; the whole
job) the message latency and bandwidth inside a node and between nodes, a
barrier, a copy and a kernel with every rank busy, and the time of every
method at a few sizes.  Ranks not being measured sleep.  Progress goes to
stderr; the profile to profiles.default_path() (merged into what is
there), where QuantizedComm finds it.  A few minutes at 8 ranks on 2 cores;
``--quick`` (the whole job only, two small sizes) takes seconds.

predict (tune/predict.py): the model's times and speedups over MPI for
clusters that were not measured.  check: the model's predictions against a
benchmark's JSON.  builtin (tune/builtin.py): the built-in profile.
"""
import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

from equarx_mpi.bench.common import arg_type, comma_list, human, mpi_library, parse_size
from equarx_mpi.call import options
from equarx_mpi.model import costmodel, profiles

DTYPES = ("float32", "float64", "float16", "bfloat16")
#: the quantized schedules over all ranks tune times: rabenseifner where
#: this version has it (without a measurement the model corrects it as
#: the ring, costmodel.CORRECTED_LIKE)
#: the schedules measured between ranks (the node-aware one is composed of them)
SCHEDULES = tuple(a for a in options.ALGORITHMS if a not in ("auto", "shm", "mpi",
                                                              "hierarchical"))
METHODS_ONE_NODE = ("mpi", "shm") + SCHEDULES
METHODS_NETWORK = ("mpi",) + SCHEDULES


def _settle(comm):
    """A barrier that sleeps instead of spinning, so idle ranks leave the
    cores to the ranks being measured."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def _best_time(fn, reps):
    """The shortest of ``reps`` timed calls after one untimed: what the
    machine does when nothing else runs (methods are timed by median)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _busy_time(fn, seconds):
    """Seconds per call of fn run back to back for about ``seconds``: with
    every rank busy, what a call costs including the turns it waits for a
    core (the shortest call would hide them)."""
    fn()
    count, t0 = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        t = time.perf_counter() - t0
        if t >= seconds:
            return t / count


def _kernel_times(wire, block, dtype_name, n, reps):
    """Seconds per value of each kernel (float32 ... bfloat16 input)."""
    from equarx_mpi.collectives.engine import warm
    from equarx_mpi.names import BFLOAT16, KERNEL_OP, ROUNDING, kernel_view
    from equarx_mpi.wire import formats
    dtype = BFLOAT16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    x = kernel_view(np.random.default_rng(0).standard_normal(n).astype(dtype), False)
    out = np.empty_like(x)
    fmt = formats.make_format(wire, block, x.dtype)
    warm(fmt, x.dtype)
    nb = fmt.nbytes(n)
    buf, buf2 = np.zeros(3 * nb, np.uint8), np.zeros(nb, np.uint8)
    w, w2 = fmt.views(buf[:nb], n), fmt.views(buf2, n)
    SUM, NEAR = KERNEL_OP["sum"], ROUNDING["sum"]
    fmt.encode(x, w, NEAR)
    buf[nb:2 * nb] = buf[:nb]
    buf[2 * nb:] = buf[:nb]
    t = {"encode": _best_time(lambda: fmt.encode(x, w2, NEAR), reps),
         "decode": _best_time(lambda: fmt.decode(w, out), reps),
         "decode_reduce": _best_time(lambda: fmt.decode_reduce(x, w, out, SUM), reps),
         "hop": _best_time(lambda: fmt.decode_reduce_encode(x, w, w2, SUM, NEAR), reps)}
    if hasattr(fmt, "decode_reduce_many"):
        ws = fmt.stack_views(buf, n, 3)
        t["many"] = _best_time(lambda: fmt.decode_reduce_many(x, 0, ws, out, SUM), reps) / 3
    else:
        t["many"] = t["decode_reduce"]
    return {k: v / n for k, v in t.items()}


def _busy_hop(args):
    """Seconds per value of the ring's hop kernel, every rank at it."""
    from equarx_mpi.names import KERNEL_OP, ROUNDING
    from equarx_mpi.wire import formats
    n = args.kernel_values
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    fmt = formats.make_format(args.wire, args.block, x.dtype)
    w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    w2 = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    fmt.encode(x, w, ROUNDING["sum"])
    return _busy_time(lambda: fmt.decode_reduce_encode(x, w, w2, KERNEL_OP["sum"],
                                                       ROUNDING["sum"]), args.busy) / n


def _fit(sizes, times):
    """(latency, seconds per byte) of t = a + b*size, least squares in
    relative terms; the latency at least half the smallest message's time
    (a link that passes small messages faster than its rate, like the
    emulated cluster's token bucket, fits a latency near 0 otherwise, and the
    model would then think every small message free)."""
    w = [1 / t ** 2 for t in times]
    A = sum(w)
    B = sum(wi * s for wi, s in zip(w, sizes))
    C = sum(wi * s * s for wi, s in zip(w, sizes))
    D = sum(wi * t for wi, t in zip(w, times))
    E = sum(wi * s * t for wi, s, t in zip(w, sizes, times))
    det = A * C - B * B
    a, b = (C * D - B * E) / det, (A * E - B * D) / det
    return [max(a, min(times) / 2, 1e-7), max(b, 1e-13)]


def _exchange(comm, sizes, reps):
    """(latency, s/byte) of a ring step: every rank of comm sends to its
    right neighbour and receives from its left, all at once."""
    P, r = comm.Get_size(), comm.Get_rank()
    ts = []
    for s in sizes:
        a, b = np.ones(s, np.uint8), np.empty(s, np.uint8)
        comm.Barrier()
        # every rank makes the same number of calls (a time limit would not)
        calls = max(reps, int(comm.bcast(0.05 / max(_best_time(
            lambda: comm.Sendrecv(a, (r + 1) % P, 3, b, (r - 1) % P, 3), 1), 1e-6))))
        t = _best_time(lambda: [comm.Sendrecv(a, (r + 1) % P, 3, b, (r - 1) % P, 3)
                                for _ in range(calls)], 1) / calls
        ts.append(comm.allreduce(t) / P)
    return _fit(sizes, ts)


def _layout_comms(world, node):
    """[(nodes, rpn, sub-communicator or COMM_NULL)] for every layout this
    job can measure (collective; the caller frees them)."""
    from mpi4py import MPI

    from equarx_mpi.collectives.nodes import layout
    rank = world.Get_rank()
    lay, leader = layout(world, node)
    N, L, uniform = lay.nodes, lay.ranks_per_node, lay.uniform
    me = sorted(set(world.allgather(leader))).index(leader)     # this node's index
    lr = node.Get_rank()
    grow = lambda top: sorted({min(2 ** k, top) for k in range(1, top.bit_length() + 1)})  # noqa
    wanted = [(1, k, me == 0 and lr < k) for k in grow(L) if L >= 2]
    wanted += [(n, 1, me < n and lr == 0) for n in grow(N) if N >= 2]
    if N >= 2 and L >= 2 and uniform:
        wanted.append((N, L, True))
    return [(n, k, world.Split(0 if inside else MPI.UNDEFINED, rank)) for n, k, inside in wanted]


def _methods_times(comm, methods, sizes, iters, opts, say):
    from equarx_mpi import QuantizedComm
    # as callers run them (check=True, the default): the agreement and the
    # exact paths' magnitude pass for the error bound are part of the cost
    qcs = {m: QuantizedComm(comm, algorithm=m, min_quantized_bytes=0, **opts)
           for m in methods}
    out = {m: [] for m in methods}
    P = comm.Get_size()
    for n in sizes:
        x = np.random.default_rng(comm.Get_rank()).standard_normal(n // 4).astype(np.float32)
        y = np.empty_like(x)
        ts = {m: [] for m in methods}
        for it in range(1 + iters):
            for m in methods:
                comm.Barrier()
                t0 = time.perf_counter()
                qcs[m].Allreduce(x, y)
                if it:
                    ts[m].append(time.perf_counter() - t0)
        for m in methods:
            out[m].append(comm.allreduce(float(np.median(ts[m]))) / P)
        say("#   " + human(n).rjust(9) + "  " + "  ".join(
            f"{m} {out[m][-1] * 1e3:.3f} ms" for m in methods))
    threads = qcs[methods[0]].threads
    for q in qcs.values():
        q.free()
    return out, threads


def _measure_layout(sub, nodes, rpn, args, alone, say):
    from equarx_mpi.collectives.nodes import split_nodes
    P = sub.Get_size()
    lay = {"nodes": nodes, "rpn": rpn, "wire": args.wire, "block": args.block}
    lay["sync"] = sub.allreduce(_best_time(lambda: [sub.Barrier() for _ in range(200)],
                                           1) / 200) / P
    n = args.copy_bytes
    a, b = np.ones(n, np.uint8), np.empty(n, np.uint8)
    sub.Barrier()
    lay["copy"] = sub.allreduce(_busy_time(lambda: np.copyto(b, a), args.busy) / n) / P
    sub.Barrier()
    lay["share"] = max(1.0, sub.allreduce(_busy_hop(args) / alone) / P)
    node = split_nodes(sub)
    lay["p2p"] = _exchange(node, args.p2p_sizes, args.reps) if rpn > 1 else None
    lay["net"] = None
    if nodes > 1:
        leaders = sub.Split(0 if node.Get_rank() == 0 else 1, sub.Get_rank())
        if node.Get_rank() == 0:
            lay["net"] = _exchange(leaders, args.p2p_sizes, args.reps)
        _settle(sub)
        lay["net"] = sub.bcast(lay["net"])
        leaders.Free()
    node.Free()
    methods = METHODS_ONE_NODE if nodes == 1 else METHODS_NETWORK
    if nodes > 1 and rpn > 1:
        methods += ("hierarchical",)
    say(f"# layout {nodes}x{rpn}: sync {lay['sync'] * 1e6:.1f} us, copy "
        f"{1e-9 / lay['copy']:.2f} GB/s per rank, kernels x{lay['share']:.2f} when all busy"
        + (f", node messages {lay['p2p'][0] * 1e6:.1f} us + {1e-9 / lay['p2p'][1]:.2f} GB/s"
           if lay["p2p"] else "")
        + (f", network {lay['net'][0] * 1e6:.1f} us + {1e-9 / lay['net'][1]:.3f} GB/s"
           if lay["net"] else ""))
    lay["sizes"] = list(args.sizes)
    # and the threads they ran with: the model's correction is at those
    lay["times"], lay["threads"] = _methods_times(sub, methods, args.sizes, args.iters,
                                                  dict(wire=args.wire, block_size=args.block),
                                                  say)
    return lay


def measure(args):
    from mpi4py import MPI

    from equarx_mpi.collectives.nodes import split_nodes
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    say = (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush())) \
        if rank == 0 else (lambda text: None)
    t_start = time.perf_counter()
    key = world.bcast(profiles.host_key())
    path = world.bcast(args.output or profiles.default_path(key))
    node = split_nodes(world)
    if rank == 0:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
    say(f"# equarx_mpi.tune: {world.Get_size()} ranks, {mpi_library()}; profile -> {path}")
    prof = {"version": profiles.VERSION, "source": "tune", "key": key,
            "cores": world.bcast(os.cpu_count()), "kernels": {}, "layouts": {}}
    if rank == 0:
        prof["machine"] = {"cpu": profiles.cpu_model(), "mpi": mpi_library(),
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                               timespec="seconds"),
                           "command": " ".join(["python -m equarx_mpi.tune"] + sys.argv[1:]),
                           "ranks": world.Get_size(), "load_before": os.getloadavg()}
        say("# kernels and a copy on rank 0, the other ranks idle")
        for wire in args.wires:
            dts = DTYPES if wire == args.wire and not args.quick else ("float32",)
            prof["kernels"][wire] = {dt: _kernel_times(wire, args.block if wire == args.wire
                                                       else _block(wire), dt,
                                                       args.kernel_values, args.reps)
                                     for dt in dts}
            k = prof["kernels"][wire]["float32"]
            say(f"#   {wire} float32: " + ", ".join(f"{name} {1e-9 / k[name]:.2f} G values/s"
                                                   for name in costmodel.KERNELS))
        n = args.copy_bytes
        a, b = np.ones(n, np.uint8), np.empty(n, np.uint8)
        prof["copy"] = _best_time(lambda: np.copyto(b, a), args.reps) / n
        say(f"#   copy {1e-9 / prof['copy']:.2f} GB/s")
        prof["threads"] = _thread_speedups(args, node.Get_size(), say)
    _settle(world)
    prof = world.bcast(prof)
    alone = prof["kernels"][args.wire]["float32"]["hop"]
    todo = _layout_comms(world, node)
    node.Free()
    if args.quick:          # the whole job only: the last layout
        for _, _, sub in todo[:-1]:
            if sub != MPI.COMM_NULL:
                sub.Free()
        todo = todo[-1:]
    for i, (nodes, rpn, sub) in enumerate(todo):
        say(f"# [{i + 1}/{len(todo)}] layout {nodes} node(s) x {rpn} rank(s)")
        if sub != MPI.COMM_NULL:      # rank 0 is in every layout
            lay = _measure_layout(sub, nodes, rpn, args, alone, say)
            prof["layouts"][f"{nodes}x{rpn}"] = lay
            sub.Free()
        _settle(world)
    if rank == 0:
        prof["machine"]["load_after"] = os.getloadavg()
        prof["machine"]["seconds"] = round(time.perf_counter() - t_start, 1)
        _save(prof, path, args.fresh)
        say(f"# saved {path} ({prof['machine']['seconds']} s)")
    return 0


def _thread_speedups(args, local, say):
    """{wire: {"T": {kernel: rate at T threads / rate at 1}}} (float32, wall
    time, in turns: bench kernels --threads; the fused hop as "hop"), {}
    at T = 1.  T: --threads, else a QuantizedComm's here (option threads,
    else the cores over the ``local`` ranks), else where that is one this
    process's cores (rank 0 measures alone, the other ranks asleep)."""
    from equarx_mpi.bench.kernels import bench_threads
    from equarx_mpi.threads import default_threads
    T = args.threads or options.resolve({})["threads"] or default_threads(local)
    T = T if T > 1 or args.threads else default_threads(1)
    n, out = max(args.kernel_values, 1 << 20), {}     # a thread's part >= MIN_PART values
    for (wire, name), (_, _, ratio) in (bench_threads(n, args.wires, T, args.reps)
                                        if T > 1 else {}).items():
        name = "hop" if name == "decode_reduce_encode" else name
        out.setdefault(wire, {}).setdefault(str(T), {})[name] = ratio
        say(f"#   {wire} at {T} threads: {name} x{ratio:.2f}")
    return out


def _block(wire):
    from equarx_mpi.wire.formats import default_block
    return default_block(wire)


def _save(prof, path, fresh):
    """Write prof to path, over the layouts already there (same machine)."""
    if os.path.exists(path) and not fresh:
        try:
            old = profiles.load(path)
            if old.get("key") == prof["key"]:
                prof = profiles.merge(old, prof)
        except (OSError, ValueError):
            pass
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(prof, f, indent=1)
    os.replace(tmp, path)


def build_parser(commands=""):
    """measure's options; ``commands``: the list of tune's commands, shown in
    --help (python -m equarx_mpi.tune passes it)."""
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune",
                                usage="mpirun -n P python -m equarx_mpi.tune [measure] "
                                      "[options]\n"
                                      "       python -m equarx_mpi.tune COMMAND [options]",
                                description=__doc__.split("\n\n")[2], epilog=commands,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", metavar="PATH", help="where to save (default: "
                   "$XDG_CACHE_HOME or ~/.cache, then equarx_mpi/profile-<host key>.json)")
    p.add_argument("--fresh", action="store_true", help="replace the file instead of "
                   "merging the measured layouts into it")
    p.add_argument("--quick", action="store_true", help="the whole job only, two small sizes")
    p.add_argument("--wire", default="int8", help="wire the methods are timed with "
                   "(default int8)")
    p.add_argument("--wires", type=arg_type(comma_list(str)), default=None, metavar="W,W",
                   help="wires whose kernels are measured (default: --wire)")
    p.add_argument("--block", type=int, default=256, help="values per block (default 256)")
    p.add_argument("--sizes", type=arg_type(comma_list(parse_size)), default=None,
                   metavar="S,S", help="message sizes per rank (default 16K,64K,256K,1M,4M,"
                   "16M,64M, with --quick 64K,1M; among them the shared window's one-shot "
                   "limit, 64K, and the named algorithms' floors, 256K and 4M)")
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="kernel threads whose speedup over one is measured (default: "
                   "the communicator's, or this process's cores where that is one; "
                   "1: none)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per size and method "
                   "(default 5, --quick 2)")
    return p


def _defaults(args):
    q = args.quick
    args.wires = args.wires or [args.wire]
    if args.wire not in args.wires:
        args.wires.insert(0, args.wire)
    args.sizes = args.sizes or ([64 << 10, 1 << 20] if q else
                                [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
                                 64 << 20])
    args.iters = args.iters or (2 if q else 5)
    args.reps = 3 if q else 7
    args.busy = 0.05 if q else 0.3          # seconds of back-to-back calls
    args.kernel_values = (1 << 16) if q else (1 << 21)
    args.copy_bytes = (1 << 20) if q else (16 << 20)
    args.p2p_sizes = [1 << 10, 1 << 16] if q else [1 << 10, 1 << 14, 1 << 18, 1 << 22]
    return args


def main(argv=None, commands=""):
    """``python -m equarx_mpi.tune [measure] ARGS`` (tune/__main__.py)."""
    return measure(_defaults(build_parser(commands).parse_args(argv)))
