"""e1 of the low-bit wires (wire/formats.py REGISTRY): the relative L2 error
of ONE quantization (encode + decode through the library's formats) of
2^22 standard-normal float32 values, per block size, with bytes per value
(float32 input).  int4 for comparison (between int3 and int5).

    PYTHONPATH=. python docs/results/lowbit-e1.py > docs/results/lowbit-e1.txt
"""
import numpy as np

from equarx_mpi import kernels as K
from equarx_mpi.wire import formats

x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)
print("# wire  block  e1 (relative L2)  bytes/value (float32)")
for wire in ("int4", "int3", "int2", "int5", "int6"):
    for block in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        f = formats.make_format(wire, block, np.float32)
        w = f.views(np.zeros(f.nbytes(x.size), np.uint8), x.size)
        f.encode(x, w, K.ROUND_NEAREST)
        out = np.empty_like(x)
        f.decode(w, out)
        e = np.linalg.norm((out - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64))
        print(f"{wire:5s} {block:6d}  {e:.4g}  {f.nbytes(x.size) / x.size:.4f}")
