"""The cost model with kernel threads (option ``threads``, issue 22 part 4):
speedups from the profile or the documented assumption, capped by the
threads and by memory traffic, more threads never slower, one thread the
model of before, and ``tune predict --threads``.  Serial:

    python -m pytest -q tests/test_costmodel_threads.py
"""
import copy
import os

import pytest

from equarx_mpi.model import costmodel, profiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = costmodel.KERNELS
METHODS = ("ring", "two_shot", "rabenseifner", "hierarchical", "shm", "mpi")


def _profile(threads=None, cores=64):
    """The built-in profile on a node of ``cores`` cores, with these
    measured speedups ({wire: {"T": {kernel: x}}}) or none."""
    p = profiles.builtin()
    p["cores"] = cores
    if threads is not None:
        p["threads"] = threads
    return profiles.check(p)


NOISY = {"int8": {"2": {"encode": 0.6, "decode": 1.9, "decode_reduce": 2.5, "hop": 1.4},
                  "4": {"encode": 3.9, "decode": 1.2, "decode_reduce": 3.0, "hop": 5.0},
                  "8": {"encode": 2.0, "decode": 7.9, "hop": 6.0}}}


# --- the speedup ------------------------------------------------------------------
def test_assumed_speedup_is_amdahl_with_the_documented_fraction():
    f = costmodel.ASSUMED_PARALLEL
    for T in (2, 3, 8, 64):
        assert costmodel.thread_speedup({}, "hop", T) == pytest.approx(1 / ((1 - f) + f / T))
    assert costmodel.thread_speedup({}, "hop", 2) == pytest.approx(5 / 3)
    assert costmodel.thread_speedup({}, "hop", 8) == pytest.approx(10 / 3)


def test_measured_speedups_are_used_and_extrapolated_by_amdahl():
    rates = costmodel.thread_rates(_profile({"int8": {"2": {"hop": 1.8, "encode": 1.5,
                                                            "decode_reduce": 1.9}}}), "int8")
    assert costmodel.thread_speedup(rates, "hop", 2) == 1.8
    f = (1 - 1 / 1.8) / (1 - 1 / 2)
    assert costmodel.thread_speedup(rates, "hop", 8) == pytest.approx(1 / ((1 - f) + f / 8))
    # "many" (two-shot's reduce) takes decode_reduce's; a kernel not measured
    # falls back to the assumption
    assert costmodel.thread_speedup(rates, "many", 2) == 1.9
    assert costmodel.thread_speedup(rates, "decode", 2) == pytest.approx(5 / 3)
    # another wire without its own measurements takes int8's, as its kernel times do
    assert costmodel.thread_rates(_profile({"int8": {"2": {"hop": 1.8}}}), "fp8") == {
        2: {"hop": 1.8}}


def test_speedup_is_capped_by_the_threads_and_at_least_one():
    rates = {2: {"hop": 3.5, "encode": 0.4}, 4: {"hop": 9.0}}
    assert costmodel.thread_speedup(rates, "hop", 2) == 2.0      # superlinear: capped at T
    assert costmodel.thread_speedup(rates, "hop", 4) == 4.0
    assert costmodel.thread_speedup(rates, "encode", 2) == 1.0   # a slowdown counts as none
    assert costmodel.thread_speedup(rates, "encode", 16) == 1.0  # and is not extrapolated up
    for T in range(1, 40):
        for name in KERNELS:
            assert 1.0 <= costmodel.thread_speedup(rates, name, T) <= T


@pytest.mark.parametrize("threads", [None, NOISY])
def test_more_threads_never_predict_slower_kernels(threads):
    p = _profile(threads)
    for rpn in (1, 8):
        for values in (None, 1 << 10, 1 << 16, 1 << 20, 1 << 24):
            for name in KERNELS:
                ks = [costmodel.Model(p, 16, rpn, "int8", 256, threads=T).hw("float32").k(
                    name, values) for T in range(1, 17)]
                assert all(b <= a for a, b in zip(ks, ks[1:])), (rpn, values, name, ks)
                assert ks[0] == p["kernels"]["int8"]["float32"][name] * \
                    costmodel.Model(p, 16, rpn, "int8", 256).hw("float32").share


@pytest.mark.parametrize("threads", [None, NOISY])
def test_more_threads_never_predict_slower_methods(threads):
    p = _profile(threads)
    for nodes, rpn in ((16, 1), (4, 8), (1, 8)):
        for n in (64 << 10, 1 << 20, 16 << 20, 256 << 20):
            for method in METHODS:
                if method == "hierarchical" and (nodes == 1 or rpn == 1):
                    continue
                ts = [costmodel.Model(p, nodes, rpn, "int8", 256, threads=T).time(method, n, 4)
                      for T in (1, 2, 4, 8)]
                # (a last bit of rounding aside)
                assert all(b <= a * (1 + 1e-12) for a, b in zip(ts, ts[1:])), \
                    (nodes, rpn, n, method, ts)
    # and they do help where the kernels matter: one rank per node, pieces
    # of several parts (4 ranks x 256 MiB)
    one, eight = (costmodel.Model(p, 4, 1, "int8", 256, threads=T).time("ring", 256 << 20, 4)
                  for T in (1, 8))
    assert eight < one


def test_memory_traffic_caps_the_kernels():
    """No kernel faster than its bytes at the node's copy rate shared by
    its ranks, however well the threads were measured to scale."""
    perfect = {"int8": {"64": {k: 64.0 for k in ("encode", "decode", "decode_reduce", "hop")}}}
    p = _profile(perfect)
    mem = costmodel.node_copy(p)
    assert mem == min([p["copy"]] + [lay["copy"] / lay["rpn"] for lay in p["layouts"].values()
                                     if lay["nodes"] == 1])
    for rpn in (1, 4):
        m = costmodel.Model(p, 8, rpn, "int8", 256, threads=64 // rpn)
        hw, w = m.hw("float32"), m.wire_bytes(4)
        for name, (a, b) in costmodel.TRAFFIC.items():
            floor = (4 * a + w * b) / 2 * mem * rpn
            one = hw.kern[name] * hw.share
            # the floor, or one thread's time where the floor is above it
            assert hw.k(name) == pytest.approx(min(floor, one), rel=1e-12)
            if rpn == 1:
                assert hw.k(name) < one / 2


def test_threads_capped_by_cores_and_small_pieces_get_fewer():
    p = _profile(cores=2)
    assert costmodel.Model(p, 4, 1, "int8", 256, threads=8).threads == 2
    assert costmodel.Model(p, 4, 2, "int8", 256, threads=8).threads == 1
    hw = costmodel.Model(_profile(), 4, 1, "int8", 256, threads=8).hw("float32")
    one = hw.kern["hop"] * hw.share
    # a part is at least MIN_PART values (wire/threaded.py): below two, one thread
    assert hw.k("hop", 2 * costmodel.MIN_PART - 1) == one
    assert hw.k("hop", 2 * costmodel.MIN_PART) < one
    assert hw.k("hop", 4 * costmodel.MIN_PART) < hw.k("hop", 2 * costmodel.MIN_PART)


# --- one thread: the model of before ------------------------------------------------
def test_one_thread_predicts_exactly_as_before():
    for p in (_profile(cores=2), _profile(NOISY)):
        for nodes, rpn in ((1, 2), (1, 8), (4, 1), (2, 2), (64, 8)):
            a = costmodel.Model(p, nodes, rpn, "int8", 256)
            b = costmodel.Model(p, nodes, rpn, "int8", 256, threads=1)
            assert a.threads == b.threads == 1
            for method in METHODS:
                if method == "hierarchical" and (nodes == 1 or rpn == 1):
                    continue
                for n in (4 << 10, 1 << 20, 64 << 20):
                    assert a.time(method, n, 4) == b.time(method, n, 4)
            hw = b.hw("float32")
            for name in KERNELS:
                assert hw.k(name) == hw.kern[name] * hw.share
                assert hw.k(name, 1 << 20) == hw.kern[name] * hw.share


def test_predict_with_one_thread_prints_the_published_table(capsys):
    """docs/results/predict-all-wires.txt was made before threads entered
    the model: the same command prints the same rows."""
    from equarx_mpi.tune import predict
    path = os.path.join(ROOT, "docs", "results", "predict-all-wires.txt")
    with open(path) as f:
        text = f.read()
    cmd = text.splitlines()[0].split("equarx_mpi.tune predict", 1)[1].split()
    old = os.environ.get(profiles.ENV)
    os.environ[profiles.ENV] = "builtin"
    try:
        assert predict.predict(cmd) == 0
    finally:
        if old is None:
            del os.environ[profiles.ENV]
        else:
            os.environ[profiles.ENV] = old
    published, now = _by_wire(text), _by_wire(capsys.readouterr().out)
    # wires registered since (int3, int2) add sections, and may win the
    # closing "best wire" table; each published wire's section holds
    assert len(published) == 6 and {w: now.get(w) for w in published} == published


def _by_wire(text):
    """wire -> the table rows under its "# wire NAME, ..." header (the
    closing table of the best wires left out)."""
    out, wire = {}, None
    for line in text.splitlines():
        if line.startswith("# wire "):
            wire = line.split()[2].rstrip(",")
            out[wire] = []
        elif line.startswith("# the best wire"):
            wire = None
        elif line.strip() and not line.startswith("#") and wire is not None:
            out[wire].append(line)
    return out


# --- the profile ------------------------------------------------------------------
def test_profiles_without_thread_rates_still_work_and_with_them_merge():
    old = profiles.builtin()
    assert "threads" not in old                      # the built-in has none (yet)
    profiles.check(old)
    top = {"version": profiles.VERSION, "cores": 2, "copy": old["copy"], "kernels": {},
           "layouts": {}, "threads": {"int8": {"2": {"hop": 1.8}}}}
    merged = profiles.merge(old, profiles.check(top))
    assert merged["threads"] == {"int8": {"2": {"hop": 1.8}}}
    again = profiles.merge(merged, dict(top, threads={"int8": {"4": {"hop": 3.0}},
                                                      "fp8": {"2": {"hop": 1.5}}}))
    assert again["threads"] == {"int8": {"2": {"hop": 1.8}, "4": {"hop": 3.0}},
                                "fp8": {"2": {"hop": 1.5}}}
    for bad in ({"int8": {"1": {"hop": 1.0}}}, {"int8": {"x": {"hop": 1.0}}},
                {"int8": {"2": {"hop": -1.0}}}, {"int8": {"2": [1.0]}}):
        p = copy.deepcopy(old)
        p["threads"] = bad
        with pytest.raises(ValueError, match="threads"):
            profiles.check(p)


def test_a_layout_measured_at_threads_is_corrected_at_them():
    """tune records the threads a layout's methods ran with; the model's
    correction divides the measurement by the physical time at those
    threads, so on that layout the model returns the measurement."""
    p = _profile(cores=2)
    lay = p["layouts"]["2x1"]
    lay["threads"] = 2
    m = costmodel.Model(p, 2, 1, "int8", 256, threads=2)
    for n, t in zip(lay["sizes"], lay["times"]["ring"]):
        assert m.physical("ring", n, 4) * m.correction("ring", n) == pytest.approx(t)


# --- tune predict --threads ---------------------------------------------------------
def test_predict_threads_prints_the_rows(capsys):
    from equarx_mpi.tune import predict
    assert predict.predict(["--ranks", "16,64", "--ranks-per-node", "1", "--sizes", "1M,16M",
                            "--rate", "10gbit,100gbit", "--threads", "1,8",
                            "--wire", "int8"]) == 0
    out = capsys.readouterr().out
    assert "# kernel threads per rank: 1,8" in out and "Amdahl" in out
    table, summary = out.split("# the best wire")
    groups = table.split("# 8 kernel thread(s) per rank")
    assert len(groups) == 2 and "# 1 kernel thread(s) per rank" in groups[0]
    one, eight = ([r.split() for r in g.splitlines() if r.strip() and not r.startswith("#")]
                  for g in groups)
    assert len(one) == len(eight) == 8              # 2 ranks x 2 rates x 2 sizes
    for a, b in zip(one, eight):
        assert a[:6] == b[:6]                       # the same cluster, the same MPI
        assert float(b[8]) <= float(a[8])           # rabenseifner no slower
        assert b[2] in ("10Gb/s", "100Gb/s")
    # 16 MiB at 16 ranks: pieces below two parts (threaded.MIN_PART), no gain
    fast = [(a, b) for a, b in zip(one, eight) if a[2] == "100Gb/s" and a[3:5] == ["16", "MiB"]]
    assert fast and all(float(b[8]) <= float(a[8]) for a, b in fast)
    assert summary.count("kernel thread(s) per rank") == 2
