"""Tensor-parallel prefill of a decoder-only transformer in numpy, with the
two activation AllReduces per layer done by each method of methods.py.

    mpirun -n 2 python examples/tp_prefill.py                 # defaults below
    mpirun -n 4 python examples/tp_prefill.py --methods mpi,bf16,int8 --json out.json

Megatron-style tensor parallelism over P ranks (each rank plays one chip):
fused QKV and fused gate+up (GeGLU, as in Gemma) are column-parallel, so each
rank holds heads/P whole heads and mlp/P MLP columns; attention-out and
MLP-down are row-parallel, so each rank ends a block with a partial sum of the
full (tokens x hidden) activations, summed by an in-place AllReduce.

Default dims, Gemma-3-like proportions (head dim 256 and MLP = 4 x hidden as in
Gemma 3 12B) scaled to 2 cores: 2 layers, hidden 2048, 8 heads of dim 256, MLP
8192, 1024 tokens: about 146 GFLOP per layer, and each AllReduce carries
1024 x 2048 float32 = 8 MiB, the message size of a real prefill.  Gemma 3 has
62 (27B) or 48 (12B) layers; every layer does the same work, so 2 layers give
the same AllReduce share and speedup, in seconds instead of minutes.
Simplified against Gemma 3: no embedding lookup (the prompt's hidden states
are random), no grouped-query attention, no sliding-window layers, no logits.
Kept: RMSNorm before and after each block (Gemma's "sandwich" norms), rotary
embeddings, causal softmax attention, tanh-GELU gating, residual stream.

Random weights from a fixed seed, generated per head / per MLP column block
from (seed, layer, matrix, block), so a rank builds only its shard and the
P = 1 model is exactly the concatenation of all shards.  The exact run (mpi)
is checked against the single-process forward first (relative L2 < 1e-5).
"""
import argparse
import json
import os
import sys
import time
import zlib

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

DEFAULTS = dict(layers=2, hidden=2048, heads=8, head_dim=None, mlp=8192, tokens=1024)
SMALL = dict(layers=2, hidden=128, heads=8, head_dim=None, mlp=512, tokens=64)
PAPER = ("EQuARX paper (TPU, Gemma 3, int8): AllReduce 1.8x over bf16 AllReduce; "
         "prefill end to end 1.25x (27B), 1.1x (12B), i.e. AllReduce about 45% / 20% "
         "of prefill time")
_Q, _K, _V, _O, _GATE, _UP, _DOWN, _X = range(8)


class Config:
    def __init__(self, layers, hidden, heads, head_dim, mlp, tokens, seed=0):
        self.layers, self.hidden, self.heads, self.mlp, self.tokens = layers, hidden, heads, mlp, tokens
        self.head_dim = head_dim or hidden // heads
        self.seed = seed

    def check(self, P):
        """An error message, or None."""
        if min(self.layers, self.hidden, self.heads, self.head_dim, self.mlp, self.tokens) < 1:
            return "all dims must be positive"
        if self.heads % P:
            return f"heads ({self.heads}) must be divisible by the number of ranks ({P})"
        if self.mlp % self.heads:
            return f"mlp ({self.mlp}) must be divisible by heads ({self.heads})"
        if self.head_dim % 2:
            return f"head dim ({self.head_dim}) must be even (rotary embeddings)"
        return None

    def describe(self):
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads x head dim "
                f"{self.head_dim}, MLP {self.mlp} (GeGLU), {self.tokens} tokens; AllReduce "
                f"{self.tokens} x {self.hidden} float32 = "
                f"{self.tokens * self.hidden * 4 / 2**20:.2f} MiB, 2 per layer")

    def flops_per_layer(self):
        T, H, A, M = self.tokens, self.hidden, self.heads * self.head_dim, self.mlp
        return 2 * T * (4 * H * A + 3 * H * M) + 4 * T * T * A


def _block(cfg, layer, kind, index, shape, fan_in):
    rng = np.random.default_rng([cfg.seed, layer, kind, index])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(fan_in ** -0.5)


def shard_weights(cfg, rank, size):
    """This rank's weights: heads [rank*h, (rank+1)*h) and MLP column blocks
    likewise, h = heads/size.  Norm gains are 1 (Gemma stores gain - 1 = 0)."""
    H, d, h = cfg.hidden, cfg.head_dim, cfg.heads // size
    mb = cfg.mlp // cfg.heads                       # MLP columns per block
    mine = range(rank * h, (rank + 1) * h)
    layers = []
    for L in range(cfg.layers):
        qkv = [_block(cfg, L, kind, b, (H, d), H) for kind in (_Q, _K, _V) for b in mine]
        gate_up = [_block(cfg, L, kind, b, (H, mb), H) for kind in (_GATE, _UP) for b in mine]
        layers.append(dict(
            qkv=np.concatenate(qkv, axis=1),
            o=np.concatenate([_block(cfg, L, _O, b, (d, H), cfg.heads * d) for b in mine]),
            gate_up=np.concatenate(gate_up, axis=1),
            down=np.concatenate([_block(cfg, L, _DOWN, b, (mb, H), cfg.mlp) for b in mine])))
    return layers


def prompt(cfg):
    """The prompt's hidden states after embedding (random, the same on every rank)."""
    return _block(cfg, 0, _X, 0, (cfg.tokens, cfg.hidden), 1)


def rmsnorm(x, eps=1e-6):
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def rope_tables(T, d, theta=10000.0):
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x, cos, sin):
    """Rotary embedding, rotate-half form, on (T, d)."""
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attention(qkv, h, d, cos, sin, mask):
    """Causal attention of h local heads; qkv is (T, 3*h*d) as [q | k | v]."""
    T = qkv.shape[0]
    q, k, v = (qkv[:, i * h * d:(i + 1) * h * d] for i in range(3))
    out = np.empty((T, h * d), np.float32)
    scale = np.float32(d ** -0.5)
    for j in range(h):
        cols = slice(j * d, (j + 1) * d)
        s = rope(q[:, cols], cos, sin) @ rope(k[:, cols], cos, sin).T
        s *= scale
        s += mask
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        out[:, cols] = s @ v[:, cols]
    return out


def geglu(gate_up):
    g, u = np.split(gate_up, 2, axis=1)
    c = np.float32(np.sqrt(2 / np.pi))
    return np.float32(0.5) * g * (1 + np.tanh(c * (g + np.float32(0.044715) * g * g * g))) * u


def forward(cfg, x, layers, reduce, size):
    """Final hidden states (tokens x hidden).  ``reduce(buf)`` sums the
    row-parallel partial outputs over the ranks in place."""
    h = cfg.heads // size
    cos, sin = rope_tables(cfg.tokens, cfg.head_dim)
    mask = np.triu(np.full((cfg.tokens, cfg.tokens), -np.inf, np.float32), 1)
    x = x.copy()
    for w in layers:
        part = attention(rmsnorm(x) @ w["qkv"], h, cfg.head_dim, cos, sin, mask) @ w["o"]
        reduce(part)
        x += rmsnorm(part)
        part = geglu(rmsnorm(x) @ w["gate_up"]) @ w["down"]
        reduce(part)
        x += rmsnorm(part)
    return rmsnorm(x)


def serial_forward(cfg):
    """The single-process model (P = 1): all shards, no reduction."""
    return forward(cfg, prompt(cfg), shard_weights(cfg, 0, 1), lambda buf: None, 1)


def rel_l2(a, ref):
    ref = ref.astype(np.float64)
    return float(np.linalg.norm(a.astype(np.float64) - ref) / np.linalg.norm(ref))


class Timed:
    """A reduce function that adds up the seconds spent inside it.  A Barrier
    first, timed apart as ``wait``: on a shared machine the ranks drift apart
    in the matmuls, and that wait would otherwise count as AllReduce time."""

    def __init__(self, comm, fn):
        self.comm, self.fn, self.seconds, self.wait = comm, fn, 0.0, 0.0

    def __call__(self, buf):
        t0 = time.perf_counter()
        self.comm.Barrier()
        t1 = time.perf_counter()
        self.fn(buf)
        self.seconds += time.perf_counter() - t1
        self.wait += t1 - t0


def quiet_wait(comm):
    """Wait for every rank without busy-polling the cores (while rank 0 runs
    the serial model, spinning ranks would take its CPU)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def run(comm, cfg, names, repeat, check=True):
    """Collective.  Returns a dict of results, the same on every rank."""
    P, rank = comm.Get_size(), comm.Get_rank()
    x, layers = prompt(cfg), shard_weights(cfg, rank, P)
    names = ["mpi"] + [n for n in names if n != "mpi"]
    res = dict(config=vars(cfg).copy(), ranks=P, repeat=repeat, paper=PAPER)
    with Reducers(comm, names) as reducers:
        outs = {n: forward(cfg, x, layers, reducers[n], P) for n in names}     # warm-up
        exact = outs["mpi"]
        if check:
            rel = rel_l2(exact, serial_forward(cfg)) if rank == 0 else None
            quiet_wait(comm)
            res["serial_check_rel_l2"] = comm.bcast(rel)
        times = {n: [] for n in names}
        for _ in range(repeat):
            for n in names:                         # interleaved: noise hits all alike
                red = Timed(comm, reducers[n])
                comm.Barrier()
                t0 = time.perf_counter()
                outs[n] = forward(cfg, x, layers, red, P)
                times[n].append((time.perf_counter() - t0, red.seconds, red.wait))
    rows, reps = [], {}
    for n in names:
        reps[n] = np.array(comm.allgather(times[n])).max(axis=0)   # (repeat, 3), max over ranks
        total, ar, wait = np.median(reps[n], axis=0)
        crcs = comm.allgather(zlib.crc32(outs[n].tobytes()))
        rows.append(dict(method=n, total_s=float(total), allreduce_s=float(ar), wait_s=float(wait),
                         rel_l2=rel_l2(outs[n], exact),
                         max_abs=float(np.abs(outs[n] - exact).max()),
                         same_on_ranks=len(set(crcs)) == 1))
    base = rows[0]
    f = base["allreduce_s"] / base["total_s"]
    for r in rows:
        # Ratios of the same repeat (adjacent in time), then the median:
        # steadier on a shared machine than a ratio of medians.
        ratio = np.median(reps["mpi"] / reps[r["method"]], axis=0)
        r["fraction"] = r["allreduce_s"] / r["total_s"]
        r["speedup_e2e"], r["speedup_allreduce"] = float(ratio[0]), float(ratio[1])
        r["speedup_e2e_est"] = 1 / ((1 - f) + f / r["speedup_allreduce"])
    res["rows"] = rows
    return res


def report(res, cfg):
    lines = [f"# tensor-parallel prefill, {res['ranks']} ranks: {cfg.describe()}",
             f"# {cfg.flops_per_layer() * cfg.layers / 1e9:.3g} GFLOP per forward; "
             f"median of {res['repeat']} forwards after a warm-up, methods interleaved; "
             "times are the max over ranks; allreduce excludes the wait for the slowest "
             "rank (a Barrier before each call, column wait)"]
    if "serial_check_rel_l2" in res:
        lines.append(f"# exact TP run vs single-process forward: relative L2 "
                     f"{res['serial_check_rel_l2']:.2e} (must be < 1e-5)")
    lines.append("# speedups vs mpi: median over repeats of the ratio within a repeat; est = "
                 "Amdahl 1/((1-f) + f/s) from mpi's AllReduce share f and the AllReduce "
                 "speedup s; errors vs the mpi output")
    head = ("method", "prefill[ms]", "allreduce[ms]", "wait[ms]", "share", "AR speedup",
            "e2e speedup", "e2e est", "rel L2", "max abs", "same on ranks")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in res["rows"]:
        lines.append(
            f"| {r['method']} | {r['total_s'] * 1e3:.1f} | {r['allreduce_s'] * 1e3:.1f} | "
            f"{r['wait_s'] * 1e3:.1f} | "
            f"{r['fraction']:.1%} | {r['speedup_allreduce']:.2f}x | {r['speedup_e2e']:.3f}x | "
            f"{r['speedup_e2e_est']:.3f}x | {r['rel_l2']:.2e} | {r['max_abs']:.2e} | "
            f"{r['same_on_ranks']} |")
    lines.append(f"# {PAPER}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"default {v or 'hidden/heads'} ({SMALL[k] or 'hidden/heads'} with --small)")
    p.add_argument("--repeat", type=int, default=5, help="timed forwards per method")
    p.add_argument("--methods", default=",".join(STATELESS),
                   help=f"comma-separated, from {','.join(METHODS)} (mpi always runs: the reference)")
    p.add_argument("--json", help="also write the results to this file (rank 0)")
    p.add_argument("--small", action="store_true", help="tiny dims, for tests")
    p.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    dims = {k: getattr(a, k) if getattr(a, k) is not None else v
            for k, v in (SMALL if a.small else DEFAULTS).items()}
    cfg = Config(**dims)
    names = a.methods.split(",")
    err = cfg.check(comm.Get_size())
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        err = f"unknown methods {unknown}; known: {list(METHODS)}"
    if a.repeat < 1:
        err = "--repeat must be at least 1"
    if err:                                         # same arguments, same error on every rank
        p.error(err)
    limiter = limit_blas_threads(comm)  # noqa: F841 (keeps the limit for the run)
    res = run(comm, cfg, names, a.repeat, check=not a.no_check)
    if comm.Get_rank() == 0:
        print(report(res, cfg), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    if not a.no_check and res.get("serial_check_rel_l2", 0) >= 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    main()
