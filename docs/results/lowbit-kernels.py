"""Kernel speed of the low-bit wires against int8 and int4 (the registry's
``slower``: time over int8's for encode, decode, decode_reduce, the fused
hop), as docs/results/formats-kernels.txt measures: one process, one core,
1 MiB of float32 (262144 values, in cache), median of 21 timings, wires
interleaved; fused = decode_reduce_encode (the encode that restores its
input subtracted).

    PYTHONPATH=. python docs/results/lowbit-kernels.py > docs/results/lowbit-kernels.txt
"""
import time

import numpy as np

from equarx_mpi.wire import formats

n = 1 << 18
x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
own = np.random.default_rng(1).standard_normal(n).astype(np.float32)
out = np.empty_like(x)
setups = []
for wire, B in [("int8", 256), ("int4", 64), ("int3", 64), ("int2", 64), ("int5", 64),
                ("int6", 64)]:
    f = formats.make_format(wire, B, np.float32)
    w = f.views(np.zeros(f.nbytes(n), np.uint8), n)
    f.encode(x, w, 0)
    f.decode(w, out)
    f.decode_reduce(own, w, out, 0)
    f.decode_reduce_encode(own, w, w, 0, 0)
    setups.append((wire, B, f, w))
names = ["encode", "decode", "decode_reduce", "fused"]
res = {(s[0], s[1], k): [] for s in setups for k in names}
for rep in range(21):
    for wire, B, f, w in setups:
        for k, fn in zip(names, [lambda: f.encode(x, w, 0), lambda: f.decode(w, out),
                                 lambda: f.decode_reduce(own, w, out, 0),
                                 lambda: (f.encode(x, w, 0),
                                          f.decode_reduce_encode(own, w, w, 0, 0))]):
            t = time.thread_time()
            fn()
            res[(wire, B, k)].append(time.thread_time() - t)
med = {key: float(np.median(v)) for key, v in res.items()}
for key in list(med):
    if key[2] == "fused":
        med[key] -= med[(key[0], key[1], "encode")]
print("# wire block  GB/s of float32 input: encode decode decode_reduce fused;  time over int8's")
for wire, B, f, w in setups:
    gbs = [4 * n / med[(wire, B, k)] / 1e9 for k in names]
    ratio = [med[(wire, B, k)] / med[("int8", 256, k)] for k in names]
    print(f"{wire:5s} {B:4d}  " + " ".join(f"{g:6.2f}" for g in gbs) + "   "
          + " ".join(f"{r:5.2f}" for r in ratio))
