"""Smoke run of the benchmark at 2 ranks with tiny sizes (serial pytest; it
starts its own mpirun).  Fails if any result differs between ranks or the
error columns are missing."""
import json
import os
import subprocess
import sys

import pytest

from equarx_mpi import bench

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


def test_bench_two_ranks_tiny_sizes(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    p = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "equarx_mpi.bench",
                        "-b", "4K", "-e", "256K", "-f", "8", "-w", "1", "-n", "2",
                        "-m", ",".join(bench.METHODS), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    header = [l for l in p.stdout.splitlines() if l.startswith("#") and "size(B)" in l]
    assert header and all(c in header[0] for c in ("rel_err", "max_err", "#wrong", "busbw"))
    assert "# wrong results: 0" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == set(bench.METHODS)
    assert len(rows) == 3 * len(bench.METHODS)
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["rel_err"] >= 0 and r["max_err"] >= 0
        limit = {"mpi": 1e-6, "fp32": 1e-6, "bf16": 0.01}.get(r["method"], 0.02)
        assert r["rel_err"] <= limit, r
        assert r["time_us"]["min"] <= r["time_us"]["avg"] <= r["time_us"]["max"]


def test_size_parsing():
    assert bench.parse_size("4K") == 4096 and bench.parse_size("1.5M") == 3 << 19
    assert bench.sizes(4, 64, 4) == [4, 16, 64]
    with pytest.raises(Exception):
        bench.parse_size("lots")
