"""Failure behaviour: a job with a failing rank must end, not hang.

Serial pytest; each case starts its own small mpirun with a time limit.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest
from jobs import MPIRUN, run_job

LIMIT = 90

PRELUDE = """
import os, sys, time
import numpy as np
from mpi4py import MPI
from equarx_mpi import QuantizedComm
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
qc = QuantizedComm(comm, min_quantized_bytes=0)
x = np.ones(200000, np.float32)
qc.allreduce(x)
"""

CASES = {
    "user code raises between calls": (
        "if rank == 1:\n    raise RuntimeError('boom in user code')\nqc.allreduce(x)\n",
        "boom in user code"),
    "the library fails inside the ring": (
        "if rank == 1:\n"
        "    def broken(*a):\n        raise MemoryError('boom in kernel')\n"
        "    import equarx_mpi.wire.formats as F\n"
        "    F.Int8Block.decode_reduce_encode = broken\n"
        "qc.allreduce(x)\n",
        "failed inside a collective"),
    "a rank dies mid-call": (
        "if rank == 1:\n    os.kill(os.getpid(), 9)\nqc.allreduce(x)\n",
        ""),
}
# torch's init_process_group wraps sys.excepthook in one that buffers stderr
# until the hooks inside return: the traceback must still be printed
try:
    import torch  # noqa: F401
    TORCH = True
except ImportError:
    TORCH = os.environ.get("EQUARX_MPI_TORCH") == "1"     # then this case fails loudly
if TORCH:
    CASES["user code raises after torch's init_process_group"] = (
        "import torch.distributed as dist\nimport equarx_mpi.torch\n"
        "dist.init_process_group('equarx')\n"
        "if rank == 1:\n    raise RuntimeError('boom under torch')\ndist.barrier()\n",
        "RuntimeError: boom under torch")


@pytest.fixture(scope="module")
def env():
    e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    return e


@pytest.mark.parametrize("case", sorted(CASES))
def test_job_ends_instead_of_hanging(case, env, tmp_path):
    body, text = CASES[case]
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + "print('rank', rank, 'finished')\n")
    t0 = time.monotonic()
    code, out, _ = run_job([MPIRUN, "-n", "3", sys.executable, str(script)], LIMIT, env,
                           stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - t0
    assert code != 0, out
    assert text in out, out[-3000:]
    assert "rank 0 finished" not in out
    print(f"{case}: ended in {elapsed:.1f}s with exit {code}")
