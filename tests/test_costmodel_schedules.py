"""The cost model's schedules (serial): Rabenseifner's terms (log2 P
latency, the ring's bytes and hops, the fold at non-powers of two), the
ideal MPI (the best of ring, recursive doubling and Rabenseifner), every
wire on every schedule, ``tune predict``'s tables, and Rabenseifner's error
against a simulation with the library's formats.

    pytest -q tests/test_costmodel_schedules.py
    python tests/test_costmodel_schedules.py    # the simulated error table
"""
import math

import numpy as np
import pytest

from equarx_mpi import names
from equarx_mpi.call import policy
from equarx_mpi.collectives import rabenseifner, terms
from equarx_mpi.model import costmodel, physical, profiles

SIZES = [1 << k for k in range(6, 33)] + [3 << 20, 5000, 123457]
SCHEDULES = ("ring", "two_shot", "rabenseifner")


def model(nodes, rpn, wire="int8", block=256, profile=None):
    return costmodel.Model(profile or profiles.builtin(), nodes, rpn, wire, block)


# --- the schedules' terms --------------------------------------------------------
def _bare(nodes, rpn, alpha=20e-6, rate=10e9, kernels=True):
    """A cluster that was not measured (tune predict's), latency ``alpha``
    per message, kernels optionally free."""
    from equarx_mpi.tune.predict import cluster_hw
    hw = cluster_hw(profiles.builtin(), nodes, rpn, rate, alpha)
    if not kernels:
        hw = costmodel._variant(hw, kern={k: 0.0 for k in costmodel.KERNELS})
    return hw


def _phys(method, hw, nbytes, w=1.0, chunks=1):
    return costmodel._physical(method, hw, nbytes / 4, 4, w, chunks)


def test_rabenseifner_latency_grows_as_log2_p():
    """Latency alone (no bytes, no kernels): 2 log2 P steps, against the
    ring's 2(P-1); the same count of messages per step as the ring's
    pieces."""
    for P in (2, 4, 16, 64, 256, 1024):
        hw = _bare(P, 1, alpha=1e-5, rate=1e30, kernels=False)
        lgP = P.bit_length() - 1
        assert _phys("rabenseifner", hw, 1 << 20) == pytest.approx(2 * lgP * 1e-5, rel=1e-9)
        assert _phys("rabenseifner", hw, 1 << 20, chunks=3) == pytest.approx(
            3 * 2 * lgP * 1e-5, rel=1e-9)
        assert _phys("ring", hw, 1 << 20) == pytest.approx(2 * (P - 1) * 1e-5, rel=1e-9)
        # ideal MPI's Rabenseifner: the same steps
        assert costmodel.mpi_parts(hw, 1 << 20, P)["rabenseifner"] == pytest.approx(
            2 * lgP * 1e-5 + (1 << 20) * hw.copy, rel=1e-9)


def test_rabenseifner_bandwidth_is_the_rings():
    """Bytes alone: the reduce-scatter moves (1 - 1/P) of the encoded
    message, halving each step, the all-gather the same: the ring's
    2(P - 1)/P."""
    for P in (2, 8, 128, 1024):
        hw = _bare(P, 1, alpha=0.0, kernels=False)
        n, w = 1 << 24, 1.0 / 3.9
        want = 2 * (1 - 1 / P) * n / 4 * w * hw.net_beta
        assert _phys("rabenseifner", hw, n, w) == pytest.approx(want, rel=1e-9)
        assert _phys("ring", hw, n, w) == pytest.approx(want, rel=1e-9)


def test_rabenseifner_kernels_are_the_rings_hops():
    """Kernels alone (no network cost): an encode of half the message, a
    hop per value received while halving (1 - 1/P' of them), a decode of
    the whole; one piece: nothing overlaps."""
    hw = _bare(64, 1, alpha=0.0, rate=1e30)
    v = (1 << 22) / 4
    want = v * (hw.k("encode") / 2 + (1 - 1 / 64) * hw.k("hop") + hw.k("decode"))
    assert _phys("rabenseifner", hw, 1 << 22) == pytest.approx(want, rel=1e-9)


def test_the_fold_adds_cost_at_non_powers_of_two():
    for P in (3, 5, 6, 12, 100, 1000, 1023):
        Pp = costmodel.pow2_floor(P)
        assert Pp < P < 2 * Pp
        lat = _bare(P, 1, alpha=1e-5, rate=1e30, kernels=False)
        # 2 more latency steps than P', the same as at 2P' - 1
        lgPp = Pp.bit_length() - 1
        assert _phys("rabenseifner", lat, 1 << 20) == pytest.approx((2 * lgPp + 2) * 1e-5,
                                                                    rel=1e-9)
        for n in (1 << 16, 1 << 20, 1 << 26):
            t, tp = (_phys("rabenseifner", _bare(Q, 1), n) for Q in (P, Pp))
            assert t > tp, (P, n)
            m, mp = (costmodel.mpi_parts(_bare(Q, 1), n, Q) for Q in (P, Pp))
            assert m["rabenseifner"] > mp["rabenseifner"] and m["doubling"] > mp["doubling"]
        assert costmodel.error("rabenseifner", "int8", 256, P, 1) > costmodel.error(
            "rabenseifner", "int8", 256, Pp, 1)


def test_ideal_mpi_is_the_best_of_its_three_parts():
    """Never above any part, equal to the best, and each part is the best
    somewhere: doubling for small messages, Rabenseifner at 1024 ranks and
    1 MiB (about 2 ms at 10 Gbit/s, the issue's estimate; the ring and
    doubling take 9-43 ms there), the ring where the fold's two whole
    messages cost more than P's few extra steps."""
    won = set()
    for nodes, rpn in ((3, 1), (16, 1), (1024, 1), (1000, 1), (128, 8), (2, 8), (1, 8)):
        hw = _bare(nodes, rpn)
        for n in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28):
            parts = costmodel.mpi_parts(hw, n, nodes * rpn)
            best = min(parts, key=parts.get)
            won.add(best)
            t = physical._mpi(hw, n, nodes * rpn)
            assert t == parts[best] and all(t <= x for x in parts.values())
            assert _phys("mpi", hw, n, 0.0) == t
    assert won == {"ring", "doubling", "rabenseifner"}
    parts = costmodel.mpi_parts(_bare(1024, 1), 1 << 20, 1024)
    assert min(parts, key=parts.get) == "rabenseifner"
    assert 1.9e-3 < parts["rabenseifner"] < 2.4e-3 < 9e-3 < parts["doubling"] < parts["ring"]


def test_mpi_rabenseifner_keeps_its_large_steps_on_the_node():
    """MPI pairs ranks at distance 1 first: with 8 ranks per node the
    halves of n/2 .. n/8 are copies on the node and the link carries
    (1 - 1/N) n per phase; the library's order (rabenseifner.FAR_FIRST)
    puts the large steps on the link, shared by the node's 8 ranks."""
    hw = _bare(128, 8, alpha=0.0, kernels=False)
    hw = costmodel._variant(hw, alpha=0.0, beta=0.0, copy=0.0)
    n = 1 << 24
    assert costmodel.mpi_parts(hw, n, 1024)["rabenseifner"] == pytest.approx(
        2 * (1 - 1 / 128) * n * hw.net_beta, rel=1e-9)
    far = _phys("rabenseifner", hw, n, 4.0)
    assert far == pytest.approx(2 * 8 * (1 - 1 / 128) * n * hw.net_beta, rel=1e-9) \
        if rabenseifner.FAR_FIRST else far == pytest.approx(
            2 * (1 - 1 / 128) * n * hw.net_beta, rel=1e-9)
    # a node size that is not a power of two: the partners counted
    assert terms.crossing(costmodel._variant(hw, rpn=6), 4) == 2     # ranks 2, 3
    assert terms.crossing(costmodel._variant(hw, rpn=6), 8) == 6


def test_the_model_pairs_rabenseifner_as_the_schedule_does():
    """rabenseifner.FAR_FIRST (its cost's order) follows its Route: rank 0's
    partners, step by step, at 8 ranks."""
    from equarx_mpi.wire import formats
    fmt = formats.make_format("int8", 256, np.dtype(np.float32))
    P = 8
    route = rabenseifner.Route("allreduce", fmt, [(i * 256, 256) for i in range(P)], 0, 1, 256,
                               1 << 20, lambda nbytes: np.zeros(nbytes, np.uint8))
    assert [partner for partner, _, _ in route.steps] == [
        d for d, _ in terms.halving(P, rabenseifner.FAR_FIRST)]


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8", "int8-affine", "int4-affine",
                                  "bf16", "fp32", "int3", "int2", "int5", "int6"])
def test_every_wire_on_every_schedule_has_a_prediction(wire):
    """Every wire on every schedule: a finite, positive time on measured
    and unmeasured layouts and in tune predict, bytes per value from the
    wire's format, a finite error."""
    from equarx_mpi.tune.predict import predict_times
    from equarx_mpi.wire import formats
    block = formats.default_block(wire)
    fmt = formats.make_format(wire, block, np.dtype(np.float32))
    for nodes, rpn in ((1, 2), (4, 1), (2, 4), (128, 8), (1000, 1)):
        m = model(nodes, rpn, wire, block)
        assert m.wire_bytes(4) == fmt.nbytes(1 << 16) / (1 << 16)
        methods = SCHEDULES + (("hierarchical",) if nodes > 1 else ())
        for meth in methods:
            for n in (1 << 12, 1 << 20, 3 << 24):
                t = m.time(meth, n, 4)
                assert 0 < t < math.inf, (wire, meth, nodes, rpn, n)
            assert 0 < m.error(meth) < math.inf, (wire, meth)
        t = predict_times(profiles.builtin(), max(nodes, 2), rpn, 10e9, 20e-6, 1 << 20, wire,
                          block)
        assert set(t) == {"mpi"} | set(SCHEDULES) | ({"hierarchical"} if rpn > 1 else set())
        assert all(0 < x < math.inf for x in t.values()), (wire, t)


def test_a_wire_the_profile_did_not_measure_runs_at_int8s_times_slower():
    p = profiles.builtin()
    int8 = p["kernels"]["int8"]["float32"]
    for wire, (e, d, dr, hop) in costmodel.SLOWER.items():
        k = model(2, 1, wire).hw("float32").kern
        assert k == pytest.approx(dict(encode=int8["encode"] * e, decode=int8["decode"] * d,
                                       decode_reduce=int8["decode_reduce"] * dr,
                                       many=int8["many"] * dr, hop=int8["hop"] * hop))
    assert model(2, 1, "bf16").hw("float64").kern == p["kernels"]["int8"]["float64"]
    # a profile that measured the wire: its own
    p["kernels"]["fp8"] = {"float32": dict(int8, hop=1e-9)}
    assert model(2, 1, "fp8", profile=p).hw("float32").kern["hop"] == 1e-9


def test_fewer_wire_bytes_are_faster_where_the_link_binds():
    from equarx_mpi.tune.predict import predict_times
    ts = {w: predict_times(profiles.builtin(), 64, 1, 10e9, 20e-6, 64 << 20, w,
                           2 ** 6 if w == "int4" else 256)["rabenseifner"]
          for w in ("int4", "int8", "bf16", "fp32")}
    assert ts["int4"] < ts["int8"] < ts["bf16"] < ts["fp32"], ts


def test_rabenseifner_is_corrected_as_the_ring_until_measured():
    m = model(1, 8)
    for n in SIZES:
        assert m.correction("rabenseifner", n) == m.correction("ring", n)
    p = profiles.builtin()
    lay = p["layouts"]["1x8"]
    lay["times"]["rabenseifner"] = [2 * t for t in lay["times"]["ring"]]
    m2 = model(1, 8, profile=p)
    r = [m2.correction("rabenseifner", n) / m.correction("ring", n) for n in lay["sizes"]]
    # its own measurement, twice the ring's, over its own physical time
    phys = [m.physical("ring", n, 4) / m.physical("rabenseifner", n, 4) for n in lay["sizes"]]
    assert r == pytest.approx([2 * x for x in phys], rel=1e-9)


def test_predict_shows_every_wire_and_rabenseifner(capsys):
    from equarx_mpi.tune import predict
    assert predict.predict(["--ranks", "16,1024", "--ranks-per-node", "1,8", "--sizes",
                            "1M,16M", "--rate", "10gbit"]) == 0
    out = capsys.readouterr().out
    tables = out.split("# the best wire")[0].split("\n# wire ")[1:]
    assert [t.split(",")[0] for t in tables] == list(predict.WIRES)
    for t in tables:
        assert "rabens" in t.splitlines()[1]
        rows = [r.split() for r in t.splitlines()[1:] if r and not r.startswith("#")]
        assert len(rows) == 8, t            # 2 ranks x 2 layouts x 2 sizes
        for r in rows:
            # a time in every schedule's column (hierarchical only at 8 per node)
            assert all(float(x) > 0 for x in r[7:10]) and (r[10] == "-") == (r[1] == "1")
    summary = out.split("# the best wire and method")[1].splitlines()[1:]
    rows = [r.split() for r in summary if r and not r.startswith("#")]
    assert len(rows) == 8
    for r in rows:
        assert r[7] in predict.WIRES and r[-5] in predict.WIRES and float(r[-1]) > 0
        assert float(r[-2].rstrip("%")) <= 1.0                  # the second: within 1%
        assert float(r[9]) <= float(r[-3]) * policy.NEAR_TIE    # the first: any error


# --- the error model against a simulation ----------------------------------------
def _quantize(fmt, x):
    n = x.size
    w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    fmt.encode(np.ascontiguousarray(x, np.float32), w, names.ROUNDING["sum"])
    y = np.empty(n, np.float32)
    fmt.decode(w, y)
    return y


def simulate_rabenseifner(fmt, xs):
    """The quantized Rabenseifner on inputs xs, as numbers (not as bits:
    tests/reference.py has the schedule's own simulation): P - P' ranks
    send their input quantized to a partner; at each halving step a rank
    quantizes the half it sends (its partial sum), the receiver adds it to
    its own; each owner quantizes its finished shard once."""
    P, n = len(xs), xs[0].size
    Pp = costmodel.pow2_floor(P)
    part = [x.astype(np.float32) for x in xs[:Pp]]
    for e in range(Pp, P):
        part[e - Pp] = part[e - Pp] + _quantize(fmt, xs[e])
    lo, hi, d = [0] * Pp, [n] * Pp, Pp // 2
    while d:
        new = [p.copy() for p in part]
        for r in range(Pp):
            mid = (lo[r] + hi[r]) // 2
            a, b = (lo[r], mid) if r < r ^ d else (mid, hi[r])
            new[r][a:b] = part[r][a:b] + _quantize(fmt, part[r ^ d][a:b])
            lo[r], hi[r] = a, b
        part, d = new, d // 2
    out = np.empty(n, np.float32)
    for r in range(Pp):
        out[lo[r]:hi[r]] = _quantize(fmt, part[r][lo[r]:hi[r]])
    return out


def rabenseifner_error(wire, block, P, n=1 << 15, seed=0):
    from equarx_mpi.wire import formats
    fmt = formats.make_format(wire, block, np.dtype(np.float32))
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(P)]
    exact = np.sum(np.array(xs, np.float64), axis=0)
    return float(np.linalg.norm(simulate_rabenseifner(fmt, xs) - exact) / np.linalg.norm(exact))


@pytest.mark.parametrize("wire,block", [("int8", 256), ("fp8", 256), ("int8-affine", 256)])
def test_rabenseifner_error_is_as_simulated(wire, block):
    """1 + log2(P')/2 + (P - P')/P quantizations' worth, growing with
    log2 P: at 16 ranks 1.73 E1, 24% above two-shot's 1.39 E1 (the
    issue's estimate, sqrt(2 - 1/P) as two-shot, is not what the halving
    steps quantize)."""
    for P in (2, 3, 4, 6, 8, 16):
        got = rabenseifner_error(wire, block, P)
        want = costmodel.error("rabenseifner", wire, block, P, 1)
        assert abs(got / want - 1) < 0.04, (wire, P, got, want)
    assert rabenseifner_error(wire, block, 16) > 1.15 * costmodel.error(
        "two_shot", wire, block, 16, 1)


def _error_table(Ps=(2, 3, 4, 6, 8, 12, 16, 32, 64, 128)):
    print("# Rabenseifner's relative L2 error on standard-normal float32, simulated with the "
          "library's formats\n# (simulate_rabenseifner, 2^15 values "
          "per rank, seed 0), over one quantization's E1,\n# against the model "
          "(costmodel.error) and two-shot's sqrt(2 - 1/P)")
    print(f"#{'wire':>12} {'block':>5} {'P':>4} {'simulated':>9} {'model':>7} {'two-shot':>8}"
          f" {'error':>7}")
    for wire, block in (("int8", 256), ("fp8", 256), ("int4", 64), ("int8-affine", 256),
                        ("bf16", 256)):
        e1 = costmodel.E1[wire][block]
        for P in Ps:
            got = rabenseifner_error(wire, block, P)
            print(f" {wire:>12} {block:5d} {P:4d} {got / e1:9.3f} "
                  f"{costmodel.error('rabenseifner', wire, block, P, 1) / e1:7.3f} "
                  f"{math.sqrt(2 - 1 / P):8.3f} {got:7.3%}")


if __name__ == "__main__":
    _error_table()


def test_one_declaration_per_schedule_feeds_every_list():
    """collectives/registry.py is the one list: the options, the engine's
    kernels, the runner, the cost and error models all read it, and they
    read it without starting MPI (tune predict runs outside mpirun)."""
    import subprocess
    import sys

    from equarx_mpi.call import options
    from equarx_mpi.collectives import engine, registry
    names_ = list(registry.SCHEDULES)
    assert options.ALGORITHMS == ("auto", *names_, "shm", "mpi")
    assert {a for a, _ in engine.NEEDS} == {n for n, s in registry.SCHEDULES.items() if s.run}
    m = model(2, 4, "int8", 256)
    for name, s in registry.SCHEDULES.items():
        assert (s.variance is None) == s.nested and s.kinds, name
        assert 0 < m.time(name, 1 << 20, 4) < math.inf and 0 < m.error(name) < 1, name
    code = ("import sys, equarx_mpi.model.costmodel, equarx_mpi.call.policy; "
            "sys.exit('mpi4py.MPI' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
