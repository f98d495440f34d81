"""Data-parallel training of an MLP on scikit-learn's digits, the gradient
averaged by each AllReduce method of examples/methods.py: final accuracy,
loss curves, time per epoch and the AllReduce share of it.

    mpirun -n 4 python examples/dp_digits.py [--methods mpi,bf16,int8] [--plot FILE] [--json FILE]

Model 64-1024-1024-10 (ReLU, softmax cross-entropy), 1,126,410 float32
parameters kept in one flat buffer, so each step sums one 4.30 MiB gradient
buffer over the ranks.  Minibatch SGD with momentum; each global batch of 64
is split over the ranks, every rank scales its gradient by 1/64, and the
AllReduce SUM gives the batch mean.  Data (sklearn.datasets.load_digits, no
download), split, initial weights and batch order are seeded and the same for
every method; the methods train side by side, one epoch each in turn, so a
busy machine slows them alike.  Needs scikit-learn (matplotlib for --plot).
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
from methods import METHODS, Reducers, limit_blas_threads, parse_methods  # noqa: E402

SIZES = (64, 1024, 1024, 10)


def load_data(seed=0, test_fraction=0.2):
    """Digits scaled to [0, 1]: (x_train, y_train, x_test, y_test), a fixed split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


class MLP:
    """ReLU MLP whose parameters and gradient each live in one flat float32
    buffer (``params``, ``grad``) with per-layer views into it."""

    def __init__(self, sizes=SIZES, seed=0):
        shapes = [s for a, b in zip(sizes[:-1], sizes[1:]) for s in ((a, b), (b,))]
        n = sum(int(np.prod(s)) for s in shapes)
        self.params = np.zeros(n, np.float32)
        self.grad = np.zeros(n, np.float32)
        self.p, self.g, at = [], [], 0
        for s in shapes:
            k = int(np.prod(s))
            self.p.append(self.params[at:at + k].reshape(s))
            self.g.append(self.grad[at:at + k].reshape(s))
            at += k
        rng = np.random.default_rng(seed)
        for w in self.p[::2]:                                   # He init; biases stay 0
            w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / w.shape[0])

    def logits(self, x):
        acts = [x]
        for i in range(0, len(self.p), 2):
            z = acts[-1] @ self.p[i] + self.p[i + 1]
            acts.append(np.maximum(z, 0) if i + 2 < len(self.p) else z)
        return acts

    def loss_and_grad(self, x, y, scale):
        """Sum of the cross-entropy over (x, y); ``grad`` = scale * d(sum)/d(params)."""
        acts = self.logits(x)
        z = acts[-1] - acts[-1].max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        loss = -float(logp[np.arange(len(y)), y].sum())
        d = np.exp(logp)
        d[np.arange(len(y)), y] -= 1.0
        d *= np.float32(scale)
        for i in range(len(self.p) - 2, -1, -2):
            self.g[i][...] = acts[i // 2].T @ d      # (matmul's out= into a view is slower)
            self.g[i + 1][...] = d.sum(0)
            if i:
                d = (d @ self.p[i].T) * (acts[i // 2] > 0)
        return loss

    def evaluate(self, x, y):
        """(mean cross-entropy, accuracy) on (x, y)."""
        z = self.logits(x)[-1]
        z = z - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        return float(-logp[np.arange(len(y)), y].mean()), float((z.argmax(1) == y).mean())


class Run:
    """One method's training run.  ``sync(buf)`` sums the flat gradient over
    the ranks in place.  It is made once per run and always gets the same
    buffer, so a stateful method fits here unchanged: an error-feedback
    reducer (add the previous step's compression residual before reducing,
    keep the new residual) is such a callable, given by its METHODS entry."""

    def __init__(self, name, sync, comm, seed=0, lr=0.05, momentum=0.9, sizes=SIZES):
        self.name, self.sync, self.comm = name, sync, comm
        self.model = MLP(sizes, seed)
        self.velocity = np.zeros_like(self.model.params)
        self.lr, self.momentum = np.float32(lr), np.float32(momentum)
        self.history = []                       # per epoch: dict of the numbers below

    def epoch(self, x, y, order, batch, test):
        comm, rank, size = self.comm, self.comm.Get_rank(), self.comm.Get_size()
        loss_sum, ar_time, seen = 0.0, 0.0, 0
        comm.Barrier()
        t0 = time.perf_counter()
        for start in range(0, len(order) - batch + 1, batch):  # drops the last partial batch
            mine = np.array_split(order[start:start + batch], size)[rank]
            loss_sum += self.model.loss_and_grad(x[mine], y[mine], 1.0 / batch)
            t1 = time.perf_counter()
            self.sync(self.model.grad)
            ar_time += time.perf_counter() - t1
            self.velocity *= self.momentum
            self.velocity += self.model.grad
            self.model.params -= self.lr * self.velocity
            seen += batch
        elapsed = time.perf_counter() - t0
        times = np.array([elapsed, ar_time])
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)        # the slowest rank counts
        elapsed, ar_time = times
        test_loss, test_acc = self.model.evaluate(*test)
        self.history.append(dict(train_loss=comm.allreduce(loss_sum) / seen,
                                 test_loss=test_loss, test_acc=test_acc,
                                 epoch_s=elapsed, allreduce_s=ar_time))

    def same_on_ranks(self):
        return len(set(self.comm.allgather(zlib.crc32(self.model.params.tobytes())))) == 1


def train(comm, methods, epochs=20, batch=64, lr=0.05, momentum=0.9, seed=0, sizes=SIZES):
    """Train one model per method, epoch by epoch in turn; returns the Runs."""
    xtr, ytr, xte, yte = load_data(seed)
    with Reducers(comm, methods) as reducers:
        runs = [Run(m, reducers[m], comm, seed, lr, momentum, sizes) for m in methods]
        for e in range(epochs):
            order = np.random.default_rng([seed, e]).permutation(len(ytr))
            for r in runs:
                r.epoch(xtr, ytr, order, batch, (xte, yte))
    return runs


def summary(runs):
    rows = {}
    for r in runs:
        h = r.history
        rows[r.name] = dict(
            test_acc=h[-1]["test_acc"], train_loss=h[-1]["train_loss"],
            test_loss=h[-1]["test_loss"],
            epoch_s=float(np.median([e["epoch_s"] for e in h])),
            allreduce_share=float(np.median([e["allreduce_s"] / e["epoch_s"] for e in h])),
            same_on_ranks=r.same_on_ranks(),
            curve=[dict(epoch=i + 1, train_loss=e["train_loss"], test_loss=e["test_loss"],
                        test_acc=e["test_acc"]) for i, e in enumerate(h)])
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in rows.items():
        ep = [c["epoch"] for c in r["curve"]]
        a.semilogy(ep, [c["train_loss"] for c in r["curve"]], label=name)
        b.plot(ep, [100 * c["test_acc"] for c in r["curve"]], label=name)
    a.set(xlabel="epoch", ylabel="train loss (cross-entropy)")
    b.set(xlabel="epoch", ylabel="test accuracy [%]")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated, from {', '.join(METHODS)} (default: all)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=5, help="table row every k epochs")
    ap.add_argument("--plot", metavar="FILE", help="PNG of the loss curves (matplotlib)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = ap.parse_args()
    methods = parse_methods(ap, args.methods)
    comm = MPI.COMM_WORLD
    if args.batch < comm.Get_size():
        ap.error(f"--batch {args.batch} is smaller than the {comm.Get_size()} ranks")
    limiter = limit_blas_threads(comm)  # noqa: F841 (keeps the limit for the run)
    runs = train(comm, methods, args.epochs, args.batch, args.lr, args.momentum, args.seed)
    rows = summary(runs)
    if comm.Get_rank() != 0:
        return
    n = runs[0].model.params.size
    print(f"# digits MLP {'-'.join(map(str, SIZES))}, {comm.Get_size()} data-parallel ranks, "
          f"global batch {args.batch}, SGD lr {args.lr} momentum {args.momentum}, "
          f"{args.epochs} epochs; AllReduce of {n} float32 ({n * 4 / 2**20:.2f} MiB) per step")
    print("# train loss (mean cross-entropy over the epoch) / test accuracy [%]")
    print("# epoch  " + "  ".join(f"{m:>16s}" for m in rows))
    for e in range(args.every - 1, args.epochs, args.every):
        cells = [f"{r['curve'][e]['train_loss']:9.5f} {100 * r['curve'][e]['test_acc']:6.2f}"
                 for r in rows.values()]
        print(f"{e + 1:7d}  " + "  ".join(cells))
    ref = rows.get("mpi")
    print("# method  test_acc[%]  vs_mpi[pp]  train_loss  epoch[s]  allreduce_share  "
          "same_on_ranks")
    for m, r in rows.items():
        d = f"{100 * (r['test_acc'] - ref['test_acc']):+10.2f}" if ref else f"{'-':>10s}"
        print(f"{m:8s}  {100 * r['test_acc']:11.2f}  {d}  {r['train_loss']:10.5f}  "
              f"{r['epoch_s']:8.3f}  {100 * r['allreduce_share']:14.1f}%  {r['same_on_ranks']}")
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ranks=comm.Get_size(), sizes=SIZES, parameters=n,
                           **{k: getattr(args, k) for k in
                              ("epochs", "batch", "lr", "momentum", "seed")},
                           methods=rows), f, indent=1)


if __name__ == "__main__":
    main()
