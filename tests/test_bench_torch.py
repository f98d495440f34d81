"""``python -m equarx_mpi.bench torch``: runs at 2 ranks with tiny sizes
(serial pytest, its own mpirun under a time limit) and says what ran; no
timing is asserted.  Skips only where torch is missing and EQUARX_MPI_TORCH
is not 1 (run_tests.sh sets it).

    pytest -q tests/test_bench_torch.py
"""
import json

from mpi_helpers import need_torch

need_torch()
from test_bench import bench_run, table  # noqa: E402

from equarx_mpi.bench import torchdist  # noqa: E402


def test_torch_command_two_ranks(tmp_path):
    out = tmp_path / "torch.json"
    rc, stdout, stderr = bench_run(["torch", "-s", "32,4K", "-r", "2", "--json", str(out)],
                                   timeout=300)
    assert rc == 0, stdout + stderr
    cols = [name for name, _ in torchdist.COLUMNS]
    header = [ln for ln in stdout.splitlines() if ln.startswith("# size(B)")]
    assert len(header) == 1 and header[0].split()[1:] == cols
    rows = [dict(zip(cols, c)) for c in table(stdout)]
    assert [(r["size(B)"], r["method"]) for r in rows] == \
        [(s, m) for s in ("32", "4096") for m in torchdist.METHODS]
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and len(doc["rows"]) == len(rows)
    for r, j in zip(rows, doc["rows"]):
        assert r["method"] == j["method"] and j["median_us"] > 0
        # 2 ranks on one node, small messages: every equarx call is MPI's own
        assert r["path"] == ("-" if r["method"].startswith("gloo") else "mpi"), r
        # exact methods: float32 sums of two values, exact to float32 rounding
        limit = 1e-2 if r["method"] == "gloo-bf16" else 1e-6
        assert 0 <= j["rel_err"] <= limit, r
        assert abs(j["x_gloo"] - doc["rows"][0 if j["bytes"] == 32 else 4]["median_us"]
                   / j["median_us"]) < 1e-9
    verdict = [ln for ln in stdout.splitlines() if ln.startswith("# target: equarx-exact")]
    assert len(verdict) == 1 and verdict[0].split()[-3] in ("PASS", "MISS"), verdict


def test_torch_command_bad_arguments_stop_every_rank():
    rc, stdout, stderr = bench_run(["torch", "-s", "6"], timeout=90)
    assert rc != 0 and "multiple of 4 B" in stderr, stderr
    rc, stdout, stderr = bench_run(["torch", "-m", "nccl"], timeout=90)
    assert rc != 0 and "choose from" in stderr, stderr
