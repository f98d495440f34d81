"""The DP example's step with no communication (its `local` method's hook,
which returns the rank's own bucket): the compute every method of examples/torch_dp_train.py
pays, by how many ranks share the machine's cores.  16 samples per rank a
step (the example's global batch 64 over 4 ranks) whatever the rank count.

    mpirun -n {1,2,4} python docs/results/torch-dp-compute-floor.py
"""
import os
import sys
import time

import numpy as np
import threadpoolctl
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import equarx_mpi.torch  # noqa: F401 - registers "equarx"

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from torch_dp_train import local_hook, make_model  # noqa: E402

torch.set_num_threads(1)     # one thread a rank, as the example runs
threadpoolctl.threadpool_limits(1)
comm = MPI.COMM_WORLD
dist.init_process_group("equarx")


model = DDP(make_model())
model.register_comm_hook(None, local_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
parts = {"forward+backward": [], "optimizer": [], "step": []}
for it in range(22):
    comm.Barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    if it >= 2:
        for k, v in zip(parts, (t1 - t0, t2 - t1, t2 - t0)):
            parts[k].append(v)
slowest = {k: comm.allreduce(float(np.median(v)), op=MPI.MAX) for k, v in parts.items()}
if comm.rank == 0:
    print(f"{comm.size} rank(s) on {os.cpu_count()} cores: " + ", ".join(
        f"{k} {1e3 * v:.1f} ms" for k, v in slowest.items())
        + " (median of 20 steps, slowest rank)")
dist.destroy_process_group()
