"""The tensor-parallel prefill and heat-ensemble examples at tiny sizes.

    mpirun -n 2 python -m pytest --with-mpi tests/test_examples_a.py

Every rank checks its own results; checks are combined across ranks before
asserting (see ``everywhere``), so a failure on one rank fails everywhere.
"""
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import heat_ensemble as heat  # noqa: E402
import tp_prefill as tp  # noqa: E402

mpi2 = pytest.mark.mpi(min_size=2)

# Measured at these sizes (seeded, so reproducible), 2 / 3 / 4 / 8 ranks:
# int8 prefill output vs exact 1.23% / 1.45% / 1.52% / 2.03% relative L2
# (bf16: 0.28-0.50%); limits 1.5x that, room for wire-format changes.
TP_INT8_REL_L2 = {2: 0.019, 3: 0.022, 4: 0.023, 8: 0.03}
# Heat ensemble, int8, anomaly mode, float64 and float32 alike: mean error
# relative to the anomaly 0.32-0.45%, variance 0.86-1.54% at 2-8 ranks; plain
# int8 on the 300 K fields: 350-420% and 330-590% (the offset trap).
HEAT_ANOMALY_MEAN = 0.01
HEAT_ANOMALY_VAR = 0.04


def everywhere(comm, ok, what):
    bad = [r for r, v in enumerate(comm.allgather(bool(ok))) if not v]
    assert not bad, f"{what} failed on ranks {bad}"


def small_tp(P):
    heads = 8 if 8 % P == 0 else 2 * P
    return tp.Config(layers=2, hidden=16 * heads, heads=heads, head_dim=None,
                     mlp=64 * heads, tokens=64, seed=3)


@mpi2
def test_tp_exact_equals_single_process():
    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    cfg = small_tp(P)
    out = tp.forward(cfg, tp.prompt(cfg), tp.shard_weights(cfg, rank, P),
                     lambda buf: comm.Allreduce(MPI.IN_PLACE, buf), P)
    rel = tp.rel_l2(out, tp.serial_forward(cfg))
    everywhere(comm, rel < 1e-5, f"exact TP forward vs single process (rel L2 {rel:.2e})")


@mpi2
def test_tp_int8_close_and_identical():
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    res = tp.run(comm, small_tp(P), ["mpi", "int8"], repeat=1)
    rows = {r["method"]: r for r in res["rows"]}
    limit = TP_INT8_REL_L2.get(P, 0.035)
    everywhere(comm, res["serial_check_rel_l2"] < 1e-5, "serial check inside run()")
    everywhere(comm, 0 < rows["int8"]["rel_l2"] < limit,
               f"int8 prefill rel L2 {rows['int8']['rel_l2']:.3g} within (0, {limit})")
    everywhere(comm, rows["int8"]["same_on_ranks"], "int8 output identical on all ranks")
    r = rows["int8"]
    expect = 1 / ((1 - rows["mpi"]["fraction"]) + rows["mpi"]["fraction"] / r["speedup_allreduce"])
    everywhere(comm, abs(r["speedup_e2e_est"] - expect) < 1e-12, "Amdahl estimate")


def test_tp_rejects_heads_not_divisible():
    assert tp.Config(2, 64, 8, None, 256, 16).check(3) is not None
    assert tp.Config(2, 64, 8, None, 256, 16).check(4) is None


def heat_cfg():
    return heat.Config(grid=64, members=2, steps=40, every=10, seed=5)


@mpi2
def test_heat_exact_mean_equals_serial():
    comm = MPI.COMM_WORLD
    cfg = heat_cfg()
    M = comm.Get_size() * cfg.members
    res = heat.run(comm, cfg, ["mpi"], ("plain",), np.dtype(np.float64))
    fields = [heat.simulate_member(cfg, g) for g in range(M)]       # every member, serially
    mean = np.mean(fields, axis=0)
    var = np.mean([(u - mean) ** 2 for u in fields], axis=0)
    # run() reports errors against its own exact reduction; recompute that
    # reduction here and compare it with the serial ensemble.
    mine = fields[comm.Get_rank() * cfg.members:(comm.Get_rank() + 1) * cfg.members]
    mean_x, var_x = heat.exact_stats(comm, mine, M)
    everywhere(comm, heat.rel_l2(mean_x, mean) < 1e-13, "exact ensemble mean vs serial")
    everywhere(comm, heat.rel_l2(var_x, var) < 1e-10, "exact ensemble variance vs serial")
    row = res["rows"][0]
    everywhere(comm, row["mean_rel_l2"] < 1e-15 and row["var_rel_l2"] < 1e-6,
               "mpi plain statistics vs exact")
    everywhere(comm, res["exact_mean_anomaly_max"] > 0.01, "sources heat the field")


@mpi2
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_heat_int8_anomaly_beats_plain(dtype):
    comm = MPI.COMM_WORLD
    res = heat.run(comm, heat_cfg(), ["mpi", "int8"], ("plain", "anomaly"), np.dtype(dtype))
    rows = {(r["method"], r["mode"]): r for r in res["rows"]}
    plain, anom = rows["int8", "plain"], rows["int8", "anomaly"]
    everywhere(comm, 0 < anom["anomaly_rel_l2"] < HEAT_ANOMALY_MEAN,
               f"int8 anomaly-mode mean error {anom['anomaly_rel_l2']:.3g}")
    everywhere(comm, anom["var_rel_l2"] < HEAT_ANOMALY_VAR,
               f"int8 anomaly-mode variance error {anom['var_rel_l2']:.3g}")
    everywhere(comm, plain["anomaly_rel_l2"] > 100 * anom["anomaly_rel_l2"]
               and plain["var_rel_l2"] > 10 * anom["var_rel_l2"],
               "plain int8 on 300 K fields is worse than anomaly mode")
    everywhere(comm, anom["mean_bound"] is None or anom["mean_max_abs"] <= anom["mean_bound"],
               "measured error within the library's bound, where reported")
