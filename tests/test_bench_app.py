"""The benchmark's app command (python -m equarx_mpi.bench app): a tiny
run at 2 ranks completes and prints its columns, and a bad argument stops
every rank with one message.  No timing is asserted (speed is the
benchmark's to show).

    pytest -q tests/test_bench_app.py
"""
import pytest
from test_bench import bench_run, table

from equarx_mpi.bench import app

TINY = ["app", "-s", "64K", "--matmul", "32", "-w", "1", "-n", "2", "--gap", "0.01"]


def test_app_tiny_run_prints_its_columns():
    rc, out, err = bench_run(TINY + ["-m", "mpi,int8-raw"], timeout=300)
    assert rc == 0, out + err
    names = [name for name, _ in app.COLUMNS]
    header = [ln for ln in out.splitlines() if ln.startswith("#") and ln.split()[1:] == names]
    assert len(header) == 1
    for name in names[2:]:          # every column is explained above the table
        assert any(ln.startswith(f"#   {name}") for ln in out.splitlines()), name
    assert "# rank 0: BLAS " in out and "# environment: " in out
    rows = {r[0]: r for r in table(out)}
    assert set(rows) == {"mpi", "int8-raw"}
    assert rows["mpi"][1] == "exact" and rows["int8-raw"][1] == "ring/int8"
    for r in rows.values():
        assert len(r) == len(app.COLUMNS)
        alone, after, ratio, mm = map(float, r[2:])
        assert alone > 0 and after > 0 and ratio > 0 and mm >= 0


def test_app_blas_threads_option():
    pytest.importorskip("threadpoolctl")
    rc, out, err = bench_run(TINY + ["-m", "mpi", "--blas-threads", "1"], timeout=300)
    assert rc == 0, out + err
    assert "# rank 0: BLAS 1 threads (threadpoolctl" in out


def test_app_bad_argument_stops_every_rank():
    rc, out, err = bench_run(["app", "-m", "nonsense"], timeout=120)
    assert rc != 0
    assert "unknown method" in err
