"""Data-parallel training in PyTorch (DistributedDataParallel) on
scikit-learn's digits, the gradient buckets averaged by each of torch's
options and equarx_mpi's: step time, time to a target accuracy, final
accuracy.

    mpirun -n 4 python examples/torch_dp_train.py [--methods gloo,equarx-int8,...]
    python -m equarx_mpi.cluster run --hosts 4 --rate 1gbit --exec -- \\
        examples/torch_dp_train.py --json dp.json

Model: an MLP 64-3072-3072-10 (ReLU), 9,670,666 float32 parameters, so a
step sums 36.9 MiB of gradient over the ranks in DDP's buckets (25 MiB
each): bandwidth-bound at 1 Gbit/s.  SGD with momentum; each global batch
of 64 split over the ranks.  Data, split, initial weights and batch order
are seeded and the same for every method; the methods train side by side,
one epoch each in turn, so a busy machine slows them alike.  Methods:

  gloo          DDP on a gloo group: exact, float32 on the wire
  equarx-exact  DDP on an "equarx" group with accuracy="exact" (MPI's own)
  equarx-int8   DDP on an "equarx" group, its defaults (auto: int8 where
                predicted 25% faster than exact)
  hook          DDP on gloo + equarx_mpi.torch.allreduce_hook (defaults)
  hook-ef       the same with error feedback per bucket
  hook-int4-rot-ef  the hook with wire="int4", rotate=True and error feedback
                (the residual kept rotated); algorithm="auto" still decides
                where it travels lossy (on one node: MPI's exact sum)
  hook-int3-ef, hook-int2-ef  the hook with wire="int3" / "int2" and error
                feedback (auto runs them on two-shot, never the ring)
  bf16-hook     DDP on gloo + torch's bf16_compress_hook (its body: torch
                2.13's hook refuses to run without CUDA 11+ and NCCL 2.10+,
                though nothing in it needs them)
  powersgd      DDP on gloo + torch's powerSGD_hook, rank 4 (error feedback
                and warm start, PowerSGD from step 3), in one bucket (its
                callbacks wait inside gloo's two worker threads: two buckets
                deadlock)
  perchannel    DDP on gloo + torch's quantization_perchannel_hook (8 bits
                per value in channels of 512, all-gather based: each rank
                receives every rank's bytes), with the all-gather results
                read as gloo returns them (a list per rank; torch 2.13's hook
                indexes them as NCCL's stacked tensor and fails on gloo with
                "IndexError: too many indices for tensor of dimension 2"); one
                bucket, as powersgd
  local         DDP on gloo with a hook that returns each rank's own bucket:
                no communication, so its step is the compute every method
                shares (forward, backward, DDP's copies, the optimizer), the
                floor under every other step time (its accuracy: rank 0's
                model, trained on its quarter of each batch alone)

Needs torch (pip install 'equarx_mpi[torch]') and scikit-learn.
"""
import argparse
import json
import os
import sys
import time

# one BLAS and numba thread per rank (each rank plays one chip), before
# numpy and torch load; values already set win
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("EQUARX_MPI_LOG", "0")     # the table says what ran

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import equarx_mpi.torch as eqt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_digits import load_data as digits  # noqa: E402

METHODS = ("gloo", "equarx-exact", "equarx-int8", "hook", "hook-ef", "hook-int4-rot-ef",
           "hook-int3-ef", "hook-int2-ef", "bf16-hook", "powersgd", "perchannel", "local")
#: the hook's methods: HookState's options (feedback: error feedback)
HOOKS = {"hook": {}, "hook-ef": dict(feedback=True),
         "hook-int4-rot-ef": dict(wire="int4", rotate=True, feedback=True),
         "hook-int3-ef": dict(wire="int3", feedback=True),
         "hook-int2-ef": dict(wire="int2", feedback=True)}
WIDTH = 3072
BATCH = 64


def load_data():
    """examples/dp_digits.py's split of the digits, as tensors."""
    return tuple(torch.from_numpy(a) for a in digits())


def bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook without its device check."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def perchannel_hook(process_group, bucket, bucket_size=512):
    """torch's quantization_perchannel_hook (ddp_comm_hooks/quantization_hooks.py),
    line for line but for reading each all-gather's result as gloo's list of
    one tensor per rank."""
    world_size, rank = process_group.size(), process_group.rank()
    tensor = bucket.buffer()
    channels = torch.nn.functional.pad(tensor, (0, bucket_size - len(tensor) % bucket_size),
                                       value=0).view(-1, bucket_size)
    observer = torch.ao.quantization.PerChannelMinMaxObserver()
    observer(channels)
    s_and_z = torch.stack(observer.calculate_qparams())
    fut = dist.all_gather(qh._get_allgather_out_list(s_and_z, world_size), s_and_z,
                          group=process_group, async_op=True).get_future()
    gathered = {}

    def quantize_and_allgather(fut):
        gathered["s_and_z"] = every = torch.stack(fut.wait())
        q = qh._quantize_per_channel_backend(channels, every[rank, 0, :], every[rank, 1, :])
        return dist.all_gather(qh._get_allgather_out_list(q, world_size), q,
                               group=process_group, async_op=True).get_future().wait()

    def dequantize_and_aggregate(fut):
        quantized = fut.wait()             # first: raises what went wrong before
        every, total = gathered["s_and_z"], None
        for r, q in enumerate(quantized):
            d = qh._dequantize_per_channel_backend(q, every[r][0], every[r][1])
            total = d if total is None else total + d
        return torch.flatten(total)[:tensor.size()[0]] / world_size
    return fut.then(quantize_and_allgather).then(dequantize_and_aggregate)


def local_hook(_, bucket):
    """This rank's own gradient, at once: no communication."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_model(width=WIDTH, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10))


class Trainer:
    """One method: its DDP model, optimizer, and what it measured."""

    def __init__(self, name, groups, width, lr):
        self.name = name
        model = make_model(width)
        # PowerSGD's and the per-channel hook's callbacks wait for a second
        # collective inside gloo's worker threads (two by default): with two
        # buckets in flight both threads wait and nothing runs (a deadlock,
        # seen at 4 ranks); one bucket keeps a thread free for them.
        cap = 1024 if name in ("powersgd", "perchannel") else 25
        if name == "equarx-exact":
            ddp = DDP(model, process_group=groups["equarx-exact"])
        elif name == "equarx-int8":
            ddp = DDP(model, process_group=groups["equarx"])
        else:
            ddp = DDP(model, process_group=groups["gloo"], bucket_cap_mb=cap)
        self.state = None
        if name in HOOKS:
            self.state = eqt.HookState(MPI.COMM_WORLD, process_group=groups["gloo"],
                                       **HOOKS[name])
            ddp.register_comm_hook(self.state, eqt.allreduce_hook)
        elif name == "bf16-hook":
            ddp.register_comm_hook(groups["gloo"], bf16_hook)
        elif name == "powersgd":
            self.state = psgd.PowerSGDState(process_group=groups["gloo"],
                                            matrix_approximation_rank=4,
                                            start_powerSGD_iter=3, use_error_feedback=True,
                                            warm_start=True)
            ddp.register_comm_hook(self.state, psgd.powerSGD_hook)
        elif name == "perchannel":
            ddp.register_comm_hook(groups["gloo"], perchannel_hook)
        elif name == "local":
            ddp.register_comm_hook(None, local_hook)
        self.model = ddp
        self.opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        self.steps, self.seconds, self.curve = [], 0.0, []

    def epoch(self, xs, ys, order, rank, size):
        self.model.train()
        for start in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[start:start + BATCH][rank::size]
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(self.model(xs[idx]), ys[idx])
            loss.backward()                 # DDP's buckets reduce during it
            self.opt.step()
            t = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            self.steps.append(t)
            self.seconds += t
        return float(loss.detach())

    def accuracy(self, xt, yt):
        self.model.eval()
        with torch.no_grad():
            return float((self.model.module(xt).argmax(1) == yt).float().mean())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--width", type=int, default=WIDTH, help="hidden width (default 3072)")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--target", type=float, default=0.95,
                   help="the accuracy whose training time is reported (default 0.95)")
    p.add_argument("--json", help="write the results here (rank 0)")
    a = p.parse_args(argv)
    methods = a.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}: choose from {', '.join(METHODS)}")
    torch.set_num_threads(1)
    made = not dist.is_initialized()       # (a test may have made it)
    if made:
        dist.init_process_group("equarx")
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"equarx": dist.group.WORLD, "gloo": dist.new_group(backend="gloo"),
              "equarx-exact": dist.new_group(backend="equarx",
                                             pg_options=eqt.Options(accuracy="exact"))}
    xs, ys, xt, yt = load_data()
    trainers = [Trainer(m, groups, a.width, a.lr) for m in methods]
    params = sum(q.numel() for q in trainers[0].model.parameters())
    say = print if rank == 0 else (lambda *s, **k: None)
    say(f"# DDP on digits: {size} ranks, MLP 64-{a.width}-{a.width}-10, {params:,} float32 "
        f"parameters ({params * 4 / 2**20:.1f} MiB of gradient a step), global batch {BATCH}, "
        f"{a.epochs} epochs, torch {torch.__version__}", flush=True)
    rng = np.random.default_rng(1)
    for e in range(a.epochs):
        order = torch.from_numpy(rng.permutation(len(ys)))
        for t in trainers:
            loss = t.epoch(xs, ys, order, rank, size)
            t.curve.append((t.seconds, loss, t.accuracy(xt, yt)))
        say(f"# epoch {e + 1}: " + ", ".join(f"{t.name} {t.curve[-1][2]:.3f}" for t in trainers),
            flush=True)
    rows = []
    for t in trainers:
        reach = next((s for s, _, acc in t.curve if acc >= a.target), None)
        path = "-"
        if t.name == "equarx-int8":
            info = eqt.qcomm(groups["equarx"]).last_call
            path = f"{info.method}/{info.wire}" if info.wire else info.method
        elif t.name.startswith("hook"):
            info = t.state.qc.last_call
            path = f"{info.method}/{info.wire}" if info.wire else info.method
        rows.append(dict(method=t.name, step_ms=float(np.median(t.steps[1:] or t.steps)) * 1e3,
                         seconds=t.seconds, to_target_s=reach, accuracy=t.curve[-1][2],
                         loss=t.curve[-1][1], path=path, curve=t.curve))
    base = rows[0]["step_ms"]
    say(f"# {'method':>12} {'step(ms)':>9} {'x_' + rows[0]['method']:>10} "
        f"{'to ' + format(a.target, '.2f') + '(s)':>10} {'accuracy':>8} {'loss':>8} {'path':>12}")
    for r in rows:
        reach = "never" if r["to_target_s"] is None else f"{r['to_target_s']:.1f}"
        say(f"  {r['method']:>12} {r['step_ms']:9.1f} {base / r['step_ms']:10.2f} {reach:>10} "
            f"{r['accuracy']:8.3f} {r['loss']:8.4f} {r['path']:>12}")
    say("# step(ms): median over the steps but the first of each rank's slowest time; "
        "to X(s): training time (steps only) until the test accuracy first reached X, "
        "checked after each epoch; path: the step's last bucket's")
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"ranks": size, "params": params, "epochs": a.epochs, "target": a.target,
                       "rows": rows}, f, indent=1)
    for t in trainers:
        if isinstance(t.state, eqt.HookState):
            t.state.free()
    if made:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
