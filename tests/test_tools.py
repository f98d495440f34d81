"""The tools layer: ``python -m equarx_mpi.bench``, ``... tune`` and
``... cluster``.  Their command registries and each command's own --help,
the shared helpers (bench/common.py: the one home of size, rate and
latency parsing), the method table's words against the code that runs,
and that the serial commands never initialize MPI.  The allreduce
command's runs: tests/test_bench.py; the cluster runner: test_cluster.py.

Serial: python -m pytest tests/test_tools.py   (one small mpirun: bench shm)
"""
import argparse
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jobs import ENV, MPIRUN, run_job

from equarx_mpi.bench import common
from equarx_mpi.bench.methods import METHODS, PIECES, parse_methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_NAMES = ("shmbench", "tolbench", "kernelbench", "tunepredict", "benchoverlap",
             "costmodel_builtin")


# --- sizes, rates, latencies: bench/common.py -----------------------------

@pytest.mark.parametrize("text, nbytes", [
    ("4K", 4096), ("4k", 4096), ("4KB", 4096), ("4KiB", 4096), ("4 KiB", 4096),
    ("1.5M", 3 << 19), ("1mb", 1 << 20), ("512kb", 512 << 10), ("64k", 64 << 10),
    ("65536", 65536), ("100b", 100), ("2G", 2 << 30), ("0", 0), (".5K", 512)])
def test_parse_size(text, nbytes):
    assert common.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["1mbit", "big", "-1", "", "4ib", "0.3K", "1.5", "4KK",
                                  "1T", "lots"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        common.parse_size(text)


def test_human_sizes_parse_back():
    for n in (1, 100, 1024, 4096, 3 << 19, 64 << 20, 1 << 30):
        assert common.parse_size(common.human(n)) == n
    assert common.human(4096) == "4 KiB" and common.human(100) == "100 B"


@pytest.mark.parametrize("text, bits", [
    ("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8),
    ("500kbit", 5 * 10**5), ("125mbps", 10**9), ("10000bit", 10**4)])
def test_parse_rate(text, bits):
    assert common.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["none", "None", "off"])
def test_parse_rate_none(text):
    assert common.parse_rate(text) is None


@pytest.mark.parametrize("text", ["1g", "fast", "1 gbit", "-1gbit", "1gib", "100bit", ""])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="rate"):
        common.parse_rate(text)


def test_parse_latency():
    assert common.parse_latency("20us") == pytest.approx(20e-6)
    assert common.parse_latency("1.5ms") == pytest.approx(1.5e-3)
    assert common.parse_latency("1s") == 1.0
    for bad in ("20", "us", "-1ms", "fast"):
        with pytest.raises(ValueError, match="latency"):
            common.parse_latency(bad)


def test_argparse_types_show_the_parsers_messages(capsys):
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=common.arg_type(common.parse_size))
    p.add_argument("--sizes", type=common.arg_type(common.comma_list(common.parse_size)))
    assert p.parse_args(["--sizes", "4K, 1M"]).sizes == [4096, 1 << 20]
    for args, message in ((["--size", "big"], "bad size 'big'"),
                          (["--sizes", "4K,1Q"], "bad size '1Q'"),
                          (["--sizes", ","], "expected a comma-separated list")):
        with pytest.raises(SystemExit):
            p.parse_args(args)
        assert message in capsys.readouterr().err, args


def test_size_sweep():
    assert common.sizes(4, 64, 4) == [4, 16, 64]
    assert common.sizes(4096, 4095, 2) == []
    with pytest.raises(ValueError):
        common.sizes(4, 64, 1)


def test_parse_methods():
    assert parse_methods("mpi, int8,") == ["mpi", "int8"]
    for bad in ("mpi,nope", ""):
        with pytest.raises(ValueError, match="unknown method"):
            parse_methods(bad)


# --- the method table's words against the code ------------------------------

def test_method_words_state_the_code_defaults():
    from equarx_mpi.call.options import DEFAULTS
    from equarx_mpi.collectives import pieces
    from equarx_mpi.wire.formats import default_block
    margin = f"{round((DEFAULTS['lossy_margin'] - 1) * 100)}% faster"
    assert margin in METHODS["int8"].about
    assert "floor" in METHODS["int8-nocheck"].about
    for name, wire in (("int4", "int4"), ("int4-aff", "int4-affine")):
        assert METHODS[name].options["block_size"] == default_block(wire)
        assert f"block {default_block(wire)} " in METHODS[name].about
    assert margin in METHODS["auto"].about
    assert f"about {common.human(pieces.PIECE_TARGET_BYTES)}" in PIECES
    assert f"at most {pieces.MAX_AUTO_CHUNKS} per shard" in PIECES
    # "every size" is said exactly of the methods without a size floor
    for name, m in METHODS.items():
        if m.options and m.options.get("algorithm") in ("ring", "two_shot", "rabenseifner",
                                                        "hierarchical"):
            assert ("every size" in m.about) == (m.options.get("min_quantized_bytes") == 0), name


def _choose(name, nodes, rpn, nbytes):
    from equarx_mpi.call import options, policy
    from equarx_mpi.model import costmodel, profiles
    from equarx_mpi.names import Layout
    o = options.resolve({"block_size": 256, **METHODS[name].options})
    m = costmodel.Model(profiles.builtin(), nodes, rpn, o["wire"], o["block_size"])
    return policy.choose(o, "Allreduce", "sum", np.dtype(np.float32), nbytes, nodes * rpn,
                         Layout(nodes, rpn, True), m)[0]


def test_methods_run_what_their_words_say():
    """The method each name takes, on one node of 2 ranks and on 2 nodes of
    2, below and above where the named algorithms' floor (lossy_margin)
    lies with the built-in profile."""
    one, net = (1, 2), (2, 2)
    small, big = 1 << 20, 64 << 20           # one node: below and above 24 MiB
    tiny = 128 << 10                          # across nodes: below 256 KiB
    for name in ("bf16", "fp32", "int8-raw", "int8-c1", "int4", "fp8", "int8-aff",
                 "int4-aff"):
        assert {_choose(name, *lay, n) for lay in (one, net) for n in (tiny, big)} == \
            {"ring"}, name
    for name in ("int8", "int8-nocheck"):
        assert [_choose(name, *one, n) for n in (small, big)] == ["mpi", "ring"], name
        assert [_choose(name, *net, n) for n in (tiny, small)] == ["mpi", "ring"], name
    assert {_choose("int8-2shot", *lay, n) for lay in (one, net) for n in (tiny, big)} == \
        {"two_shot"}
    assert _choose("int8-hier", *one, tiny) == "ring"
    assert _choose("int8-hier", *net, tiny) == "hierarchical"
    assert (_choose("shm", *one, small), _choose("shm", *net, small)) == ("shm", "mpi")
    assert _choose("mpi-lib", *one, big) == "mpi"
    assert {_choose("auto-exact", *one, n) for n in (tiny, big)} <= {"mpi", "shm"}
    assert _choose("auto-exact", *net, big) == "mpi"


def test_chunks_one_is_the_default_on_one_node():
    from equarx_mpi.call import options
    from equarx_mpi.collectives import pieces
    c1, raw = (options.resolve(METHODS[m].options) for m in ("int8-c1", "int8-raw"))
    assert pieces.chunks(c1, True, 1 << 30) == pieces.chunks(raw, True, 1 << 30) == 1
    assert pieces.chunks(raw, False, 1 << 30) == pieces.MAX_AUTO_CHUNKS


def test_examples_take_their_methods_from_the_bench():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        ex = importlib.import_module("methods")
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert set(ex.METHODS) == set(ex.BENCH_NAME)
    for name, (bench, feedback) in ex.BENCH_NAME.items():
        want = METHODS[bench].options
        got = ex.METHODS[name]
        assert got == (None if want is None else
                       dict(want, **({"feedback": True} if feedback else {}))), name
    # spelt differently: int8 (the bench's int8-raw) and the feedback variants
    assert {n for n, (b, _) in ex.BENCH_NAME.items() if n != b} == \
        {"int8", "int4+ef", "fp8+ef", "int4-rot+ef", "int3+ef", "int2+ef"}
    assert ex.BENCH_NAME["int8"] == ("int8-raw", False)


# --- the registries and each command's --help -----------------------------

def _help(capsys, main, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_bench_commands_have_their_own_help(capsys):
    from equarx_mpi.bench.__main__ import COMMANDS, main
    assert list(COMMANDS) == ["allreduce", "shm", "tolerance", "calls", "torch", "app",
                             "kernels", "quality", "coldstart"]
    top = _help(capsys, main, ["--help"])
    assert top.startswith("usage: mpirun -n P python -m equarx_mpi.bench [allreduce]")
    assert all(f"\n  {name} " in top for name in COMMANDS)
    assert _help(capsys, main, ["allreduce", "--help"]) == top
    torch_help = _help(capsys, main, ["torch", "--help"])      # under mpirun, as calls
    assert torch_help.startswith("usage: mpirun -n P python -m equarx_mpi.bench torch ")
    assert "gloo-bf16" in torch_help and "equarx-exact" in torch_help
    for name in ("shm", "tolerance", "kernels", "quality"):
        text = _help(capsys, main, [name, "--help"])
        assert text.startswith(f"usage: python -m equarx_mpi.bench {name} "), text[:80]
        assert f"python -m equarx_mpi.bench {name}" in text.split("\n\n", 1)[1], name
    texts = [top] + [_help(capsys, main, [n, "--help"]) for n in ("shm", "tolerance",
                                                                  "kernels")]
    assert not [w for w in OLD_NAMES for t in texts if w in t]
    tol = texts[2]
    assert "--kinds K,K" in tol and "gaussian" in tol and "field" in tol
    with pytest.raises(SystemExit, match="unknown command 'tolbench'"):
        main(["tolbench"])


def test_tune_commands_have_their_own_help(capsys):
    from equarx_mpi.tune.__main__ import COMMANDS, main
    assert list(COMMANDS) == ["measure", "predict", "check", "builtin"]
    top = _help(capsys, main, ["--help"])
    assert top.startswith("usage: mpirun -n P python -m equarx_mpi.tune [measure]")
    assert all(f"\n  {name} " in top for name in COMMANDS)
    for name in ("predict", "check", "builtin"):
        text = _help(capsys, main, [name, "--help"])
        assert text.startswith(f"usage: python -m equarx_mpi.tune {name} "), text[:80]
        assert not [w for w in OLD_NAMES if w in text]
    with pytest.raises(SystemExit, match="unknown command 'predcit'"):
        main(["predcit"])


def test_tolerance_rejects_unknown_kinds(capsys):
    from equarx_mpi.bench import tolerance
    with pytest.raises(SystemExit):
        tolerance.main(["--kinds", "gaussian,feild"])
    assert "--kinds 'gaussian,feild': choose from gaussian, field" in capsys.readouterr().err


def test_kernels_reruns_itself_by_its_new_name(monkeypatch):
    """--isa avx2 measures numba in a child process: the same command."""
    from equarx_mpi.bench import kernels
    seen = []
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    monkeypatch.setattr(kernels.subprocess, "run",
                        lambda cmd, env: seen.append((cmd, env)) or
                        subprocess.CompletedProcess(cmd, 0))
    assert kernels.main(["--isa", "avx2", "-n", "16"]) == 0
    (cmd, env), = seen
    assert cmd == [sys.executable, "-m", "equarx_mpi.bench", "kernels", "--isa", "avx2",
                   "-n", "16"]
    assert env["NUMBA_CPU_NAME"] == "haswell"


# --- the serial commands never initialize MPI ----------------------------

# Runs ``python -m equarx_mpi.<argv[1]> <argv[2:]>`` as runpy does for -m,
# then fails if mpi4py.MPI was imported on the way.
NO_MPI = """
import runpy, sys
sys.argv = ["equarx_mpi." + sys.argv[1]] + sys.argv[2:]
code = 0
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
if "mpi4py.MPI" in sys.modules:
    sys.exit("mpi4py.MPI was imported")
sys.exit(code)
"""


def no_mpi(*argv, timeout=300):
    p = subprocess.run([sys.executable, "-c", NO_MPI, *argv], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_tune_predict_never_initializes_mpi():
    out = no_mpi("tune", "predict", "--ranks", "16,64", "--ranks-per-node", "1,8",
                 "--sizes", "1M,16M", "--rate", "10gbit", "--latency", "20us", "--wire", "int8")
    table = out.split("# the best wire")[0]
    rows = [line.split() for line in table.splitlines() if line and not line.startswith("#")]
    assert len(rows) == 8, out                  # 2 ranks x 2 layouts x 2 sizes
    for r in rows:
        assert r[2] == "10Gb/s" and r[-3] in ("mpi", "ring", "two_shot", "rabenseifner",
                                              "hierarchical")
        assert float(r[-1]) >= 1.0              # auto is never slower than mpi, by the model
    assert [r[3:5] for r in rows[:2]] == [["1", "MiB"], ["16", "MiB"]]


def test_serial_helps_never_initialize_mpi():
    for argv in (("tune", "--help"), ("tune", "check", "--help"),
                 ("bench", "kernels", "--help"), ("bench", "quality", "--help"),
                 ("cluster", "--help")):
        assert "usage: " in no_mpi(*argv), argv


def test_tune_check_models_what_each_row_ran(tmp_path):
    """int8 below its floor ran MPI and is checked against the model's MPI;
    columns the model has no method for (other wires, auto-exact, unknown
    names) are left out; auto is compared with the best single method."""
    def row(method, nbytes, path, ms):
        return dict(method=method, bytes=nbytes, path=path, time_us=dict(avg=ms * 1e3))
    small, big = 1 << 20, 8 << 20
    rows = [row("mpi", small, "exact", 0.5), row("int8", small, "exact", 0.6),
            row("int8-raw", small, "ring/int8", 0.4), row("auto", small, "ring/int8", 0.45),
            row("auto-exact", small, "shm", 0.3), row("fp8", small, "ring/fp8", 0.3),
            row("int8-c1", small, "ring/int8", 0.4), row("future", small, "ring/int3", 0.1),
            row("mpi", big, "exact", 5.0), row("int8", big, "ring/int8", 3.0),
            row("int8-raw", big, "ring/int8", 3.1), row("auto", big, "ring/int8", 3.2)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(ranks=2, block=256, rows=rows)))
    out = no_mpi("tune", "check", str(path))
    lines = [ln.split() for ln in out.splitlines() if ln and not ln.startswith("#")]
    model = {(int(float(t[0])), t[2]): float(t[5]) for t in lines if t[2] != "auto"}
    assert set(model) == {(1, "mpi"), (1, "int8"), (1, "int8-raw"), (8, "mpi"), (8, "int8"),
                          (8, "int8-raw")}, out
    assert model[1, "int8"] == model[1, "mpi"] != model[1, "int8-raw"]
    assert model[8, "int8"] == model[8, "int8-raw"] != model[8, "mpi"]
    autos = [t for t in lines if t[2] == "auto"]
    assert len(autos) == 2 and "best single: int8-raw" in " ".join(autos[0]), out
    assert "sizes within 5%" in out


def test_tune_builtin_writes_a_loadable_profile(tmp_path):
    from equarx_mpi.model import profiles
    prof = profiles.builtin()
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "builtin.json"
    a.write_text(json.dumps(dict(prof, machine=dict(command="mpirun -n 2 ...", ranks=2))))
    b.write_text(json.dumps(dict(prof, copy=prof["copy"] * 2)))
    no_mpi("tune", "builtin", str(a), str(b), "--output", str(out))
    written = json.loads(out.read_text())
    assert written["copy"] == prof["copy"] * 2
    assert written["source"] == "builtin" and "machine" not in written
    assert written["generated"]["from"][0].startswith("mpirun -n 2 ...  (2 ranks")
    profiles.check(written)


# --- one run under mpirun: a command other than the default --------------

def test_bench_shm_runs_at_two_ranks():
    cmd = [MPIRUN, "-n", "2", sys.executable, "-m", "equarx_mpi.bench", "shm", "-b", "4K",
           "-e", "16K", "-w", "1", "-n", "1", "--max-iters", "2", "--budget", "0.01"]
    code, out, err = run_job(cmd, 300, ENV)
    assert code == 0, out + err
    assert out.startswith("# bench shm allreduce: 2 ranks"), out
    rows = [ln.split() for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert [r[0] for r in rows] == ["4096", "16384"], out
