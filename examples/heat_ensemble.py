"""An ensemble of 2-D heat-equation runs whose mean and variance fields are
formed by AllReduce, exact and quantized, with the error each method makes.

    mpirun -n 2 python examples/heat_ensemble.py
    mpirun -n 4 python examples/heat_ensemble.py --dtype float32 --bc periodic --json out.json

Physics: dT/dt = kappa lap(T) + q(x, y), explicit finite differences (FTCS)
on an N x N grid, r = kappa dt / dx^2 = 0.2 (stable below 0.25).  Every member
starts at T0 = 300 K plus 0.1 K of white noise and is heated by 3 Gaussian
sources at random places, widths and strengths; edges held at T0 (Dirichlet)
or periodic.  Member g (= rank * members + i) is seeded by (seed, g), so the
ensemble is the same however it is spread over the ranks.

Every --every steps the ensemble statistics are formed: S = sum of the member
fields and Q = sum of their squares, two in-place AllReduce SUM calls of N x N
values each (default 512 x 512 float64 = 2 MiB per call), mean = S/M,
variance = Q/M - mean^2 (population variance, M members in all).

The offset trap: temperatures are 300 K plus anomalies of a few K.  A block
scale follows the largest magnitude in its block, i.e. the 300 K offset, so
int8 spends its 255 levels on the offset (a step of about 2.4 K per member for
the sums) and the anomalies drown; the variance, a small difference of two
huge numbers (Q/M - mean^2, both about 9e4 K^2), is the hard case and comes
out as noise.  --anomaly reduces anomalies instead: every rank subtracts a
reference state, the previous reduced mean (identical on all ranks; 300 K at
first), before the reduction and adds it back after: mean = ref + S'/M,
variance = Q'/M - (S'/M)^2.  Default: both modes side by side.

The members never read the statistics, so one simulation serves every method
and mode: at each reduction point every (method, mode) pair reduces the same
fields, interleaved, so machine noise hits all alike.  Total time = the
simulation time + that pair's AllReduce time.  Errors are those of the last
reduction, against a float64 two-pass exact reduction.
"""
import argparse
import json
import os
import sys
import time

# One BLAS (OpenBLAS, MKL, OpenMP) and numba thread per rank, set before
# numpy and numba load (each reads these once, when it loads): every rank
# plays one chip, and a BLAS left at one thread per core makes P ranks run
# P x cores threads.  OpenBLAS's idle threads then busy-wait about 0.1 s
# after each matmul, on the cores the AllReduce that follows needs: on the
# emulated 4 x 1 Gbit/s cluster an 8 MiB int8 call after a matmul took 88 ms
# instead of 31 (docs/PERFORMANCE.md "BLAS threads").  Values already in
# the environment win: set them to give each rank more cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from methods import METHODS, STATELESS, Reducers, limit_blas_threads  # noqa: E402

T0 = 300.0          # K, initial and boundary temperature
R = 0.2             # kappa dt / dx^2
N_SOURCES = 3
DEFAULTS = dict(grid=512, members=2, steps=400, every=20)
SMALL = dict(grid=64, members=2, steps=40, every=10)
MODES = {"off": ("plain",), "on": ("anomaly",), "both": ("plain", "anomaly")}


class Config:
    def __init__(self, grid, members, steps, every, bc="dirichlet", seed=0):
        self.grid, self.members, self.steps, self.every = grid, members, steps, every
        self.bc, self.seed = bc, seed

    def check(self):
        if self.grid < 8 or min(self.members, self.steps, self.every) < 1:
            return "need --grid >= 8 and positive --members, --steps, --every"
        if self.bc not in ("dirichlet", "periodic"):
            return f"--bc must be dirichlet or periodic, not {self.bc!r}"
        return None


def init_member(cfg, g):
    """Member g's initial field and its heating per step (K)."""
    N = cfg.grid
    rng = np.random.default_rng([cfg.seed, g])
    u = T0 + 0.1 * rng.standard_normal((N, N))
    y, x = np.mgrid[0:N, 0:N]
    src = np.zeros((N, N))
    for _ in range(N_SOURCES):
        cy, cx = rng.uniform(0.15, 0.85, 2) * N
        w = rng.uniform(0.02, 0.06) * N
        src += rng.uniform(0.005, 0.02) * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * w * w))
    if cfg.bc == "dirichlet":
        u[[0, -1], :] = u[:, [0, -1]] = T0
        src[[0, -1], :] = src[:, [0, -1]] = 0.0
    return u, src


def step(u, src, bc):
    """One explicit step, in place."""
    if bc == "periodic":
        lap = (np.roll(u, 1, 0) + np.roll(u, -1, 0) + np.roll(u, 1, 1)
               + np.roll(u, -1, 1) - 4 * u)
        u += R * lap + src
    else:
        c = u[1:-1, 1:-1]
        c += R * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4 * c) \
            + src[1:-1, 1:-1]


def simulate_member(cfg, g):
    """Member g's final field, on its own (the serial reference)."""
    u, src = init_member(cfg, g)
    for _ in range(cfg.steps):
        step(u, src, cfg.bc)
    return u


def ensemble_stats(fields, reduce, M, dtype, ref=None, bound=lambda: None):
    """(mean, variance, seconds in AllReduce, bounds of S and Q or None) of the
    whole ensemble; ``ref`` (optional) is subtracted before the reduction and
    added back after.  ``bound()`` reads the library's bound of its last call."""
    shift = 0.0 if ref is None else ref
    anomalies = [u - shift for u in fields]
    s = np.sum(anomalies, axis=0).astype(dtype)
    q = np.sum([a * a for a in anomalies], axis=0).astype(dtype)
    t0 = time.perf_counter()
    reduce(s)
    b_s = bound()
    reduce(q)
    seconds = time.perf_counter() - t0
    b_q = bound()
    m = s.astype(np.float64) / M
    var = q.astype(np.float64) / M - m * m
    bounds = None
    if b_s is not None and b_q is not None:
        # last_error_bound bounds the max abs error of the returned sum;
        # propagated through mean = S/M and var = Q/M - (S/M)^2 (float64 here).
        dm = float(np.max(b_s)) / M
        bounds = (dm, float(np.max(b_q)) / M + float(np.max((2 * np.abs(m) + dm) * dm)))
    return shift + m, var, seconds, bounds


def exact_stats(comm, fields, M):
    """float64 two-pass mean and variance: the reference."""
    s = np.sum(fields, axis=0)
    comm.Allreduce(MPI.IN_PLACE, s)
    mean = s / M
    d = np.sum([(u - mean) ** 2 for u in fields], axis=0)
    comm.Allreduce(MPI.IN_PLACE, d)
    return mean, d / M


def rel_l2(a, ref):
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def run(comm, cfg, names, modes, dtype):
    """Collective.  Returns a dict of results (the same on every rank)."""
    P, rank = comm.Get_size(), comm.Get_rank()
    M = P * cfg.members
    names = ["mpi"] + [n for n in names if n != "mpi"]
    state = [init_member(cfg, rank * cfg.members + i) for i in range(cfg.members)]
    fields = [u for u, _ in state]
    pairs = [(n, mode) for n in names for mode in modes]
    refs = {p: np.full((cfg.grid, cfg.grid), T0) for p in pairs if p[1] == "anomaly"}
    ar = dict.fromkeys(pairs, 0.0)
    last = {}
    t_sim = 0.0
    with Reducers(comm, names) as reducers:
        def bound_of(n):
            qc = reducers.qc(n)
            # the certified bound of the call just made (None for plain MPI)
            return lambda: getattr(qc, "last_error_bound", None) if qc is not None else None

        for n in names:                     # warm-up: kernels compile on first use
            ensemble_stats(fields, reducers[n], M, dtype)
        for k in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            for u, src in state:
                step(u, src, cfg.bc)
            t_sim += time.perf_counter() - t0
            if k % cfg.every and k != cfg.steps:
                continue
            for n, mode in pairs:
                comm.Barrier()              # time the reduction, not the ranks' drift
                mean, var, sec, bounds = ensemble_stats(
                    fields, reducers[n], M, dtype, refs.get((n, mode)), bound_of(n))
                if mode == "anomaly":
                    refs[n, mode] = mean
                ar[n, mode] += sec
                last[n, mode] = (mean, var, bounds)
    mean_x, var_x = exact_stats(comm, fields, M)
    heat_x = mean_x.sum()
    added_x = heat_x - T0 * mean_x.size
    t_sim = comm.allreduce(t_sim, op=MPI.MAX)
    rows = []
    for n, mode in pairs:
        mean, var, bounds = last[n, mode]
        a = comm.allreduce(ar[n, mode], op=MPI.MAX)
        rows.append(dict(
            method=n, mode=mode, allreduce_s=a, total_s=t_sim + a,
            mean_rel_l2=rel_l2(mean, mean_x),
            anomaly_rel_l2=rel_l2(mean - T0, mean_x - T0),
            mean_max_abs=float(np.abs(mean - mean_x).max()),
            mean_bound=None if bounds is None else bounds[0],
            var_rel_l2=rel_l2(var, var_x),
            var_max_abs=float(np.abs(var - var_x).max()),
            var_bound=None if bounds is None else bounds[1],
            heat_rel_err=float(abs(mean.sum() - heat_x) / abs(heat_x)),
            heat_err_of_added=float(abs(mean.sum() - heat_x) / abs(added_x))))
    return dict(config=vars(cfg).copy(), ranks=P, members_total=M, dtype=np.dtype(dtype).name,
                reductions=-(-cfg.steps // cfg.every),
                sim_s=t_sim, exact_mean_anomaly_max=float(np.abs(mean_x - T0).max()),
                exact_var_max=float(var_x.max()), rows=rows)


def report(res):
    c, dt = res["config"], np.dtype(res["dtype"])
    mib = c["grid"] ** 2 * dt.itemsize / 2**20
    lines = [
        f"# heat ensemble, {res['ranks']} ranks x {c['members']} members = {res['members_total']}; "
        f"grid {c['grid']} x {c['grid']}, {c['bc']} boundary, {c['steps']} steps, statistics "
        f"every {c['every']} steps: 2 AllReduce of {c['grid']}^2 {dt.name} = {mib:.2f} MiB each",
        f"# simulation {res['sim_s'] * 1e3:.0f} ms (max over ranks, shared by all rows); "
        f"exact final mean: T0 = {T0:g} K + anomaly up to {res['exact_mean_anomaly_max']:.2f} K, "
        f"variance up to {res['exact_var_max']:.3g} K^2",
        "# errors of the last reduction vs float64 two-pass exact; 'of anomaly' = relative to "
        "mean - T0; heat = sum of the mean field ('of added': relative to the heat the "
        "sources added); bound = the library's certified bound on max abs (n/a: plain MPI reports none)"]
    head = ("method", "mode", "allreduce[ms]", "total[ms]", "mean rel L2", "of anomaly",
            "mean max abs[K]", "bound[K]", "var rel L2", "var max abs[K^2]", "var bound",
            "heat rel err", "of added")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))

    def b(x):
        return "n/a" if x is None else f"{x:.2e}"
    for r in res["rows"]:
        lines.append(
            f"| {r['method']} | {r['mode']} | {r['allreduce_s'] * 1e3:.1f} | "
            f"{r['total_s'] * 1e3:.0f} | {r['mean_rel_l2']:.2e} | {r['anomaly_rel_l2']:.2e} | "
            f"{r['mean_max_abs']:.2e} | {b(r['mean_bound'])} | {r['var_rel_l2']:.2e} | "
            f"{r['var_max_abs']:.2e} | {b(r['var_bound'])} | {r['heat_rel_err']:.2e} | "
            f"{r['heat_err_of_added']:.2e} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k, type=int, default=None, help=f"default {v} ({SMALL[k]} with --small)")
    p.add_argument("--bc", default="dirichlet", help="dirichlet (edges at T0) or periodic")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                   help="type of the reduced fields (the simulation is float64)")
    p.add_argument("--anomaly", default="both", choices=list(MODES),
                   help="reduce anomalies from the previous mean (on), raw fields (off), or both")
    p.add_argument("--methods", default=",".join(STATELESS),
                   help=f"comma-separated, from {','.join(METHODS)} (mpi always runs)")
    p.add_argument("--json", help="also write the results to this file (rank 0)")
    p.add_argument("--small", action="store_true", help="tiny sizes, for tests")
    a = p.parse_args(argv)
    dims = {k: getattr(a, k) if getattr(a, k) is not None else v
            for k, v in (SMALL if a.small else DEFAULTS).items()}
    cfg = Config(bc=a.bc, **dims)
    names = a.methods.split(",")
    err = cfg.check()
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        err = f"unknown methods {unknown}; known: {list(METHODS)}"
    if err:                                         # same arguments, same error on every rank
        p.error(err)
    comm = MPI.COMM_WORLD
    limiter = limit_blas_threads(comm)  # noqa: F841 (keeps the limit for the run)
    res = run(comm, cfg, names, MODES[a.anomaly], np.dtype(a.dtype))
    if comm.Get_rank() == 0:
        print(report(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
