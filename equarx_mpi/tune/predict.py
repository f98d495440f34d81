"""The cost model's answers, serial (no MPI job): ``python -m
equarx_mpi.tune predict`` (clusters that were not measured) and ``...
tune check`` (against a benchmark run)."""
import argparse
import json

import numpy as np

from equarx_mpi.bench.common import (
    arg_type,
    comma_list,
    human,
    parse_latency,
    parse_rate,
    parse_size,
)
from equarx_mpi.bench.methods import METHODS
from equarx_mpi.call import options, policy
from equarx_mpi.model import costmodel, profiles
from equarx_mpi.names import Layout
from equarx_mpi.wire.formats import default_block

LOSSY = ("ring", "two_shot", "hierarchical")


def _profile(path):
    if path is None:
        return profiles.find_profile()
    return profiles.merge(profiles.builtin(), profiles.load(path)), path


def _link_rate(text):
    """A link rate in bits/s (common.parse_rate), never "none"."""
    bits = parse_rate(text)
    if bits is None:
        raise ValueError(f"a link needs a rate, not {text!r}")
    return bits


def _positive(text):
    n = int(text)
    if n < 1:
        raise ValueError(f"need a positive count, got {text!r}")
    return n


def cluster_hw(profile, nodes, rpn, rate_bits, latency, wire="int8"):
    """The physical parameters of a cluster that was not measured: nodes of
    ``rpn`` ranks, one core each, kernels and copies as measured alone on the
    profile's machine, messages inside a node as measured between 2 ranks,
    links of ``rate_bits`` bit/s with ``latency`` seconds per message, and a
    barrier of 2 latencies per doubling of the ranks."""
    base = costmodel.Hw(profile, 1, 2, wire, "float32")
    P = nodes * rpn
    return costmodel._variant(base, nodes=nodes, rpn=rpn, share=1.0,
                              copy=profile["copy"], net_alpha=latency,
                              net_beta=8.0 / rate_bits, sync=2 * latency * costmodel.lg(P))


def predict_times(profile, nodes, rpn, rate_bits, latency, nbytes, wire="int8", block=256):
    """{method: seconds} for a float32 SUM Allreduce of nbytes per rank."""
    hw = cluster_hw(profile, nodes, rpn, rate_bits, latency, wire)
    m = costmodel.Model(profile, nodes, rpn, wire, block)
    w = m.wire_bytes(4)
    out = {}
    for method in ("mpi",) + LOSSY:
        if method == "hierarchical" and (rpn == 1 or nodes == 1):
            continue
        if method == "two_shot" and wire not in ("int8", "bf16", "fp32"):
            continue
        out[method] = costmodel._physical(method, hw, nbytes / 4, 4, w, m.pieces(method, nbytes))
    return out


def predict(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune predict",
                                description="The model's Allreduce times and speedups over "
                                "MPI for clusters that were not measured.  Serial.",
                                epilog="sizes: K/M/G = 1024, 1024**2, 1024**3 bytes; rates: "
                                "tc's units (10gbit, 125mbps); latencies: us, ms or s")
    ints = arg_type(comma_list(_positive))
    p.add_argument("--ranks", type=ints, default="16,64,256,1024", metavar="P,P",
                   help="ranks in all (default 16,64,256,1024)")
    p.add_argument("--rate", type=arg_type(comma_list(_link_rate)), default="10gbit,100gbit",
                   metavar="R,R", help="link rate per node (default 10gbit,100gbit)")
    p.add_argument("--ranks-per-node", type=ints, default="1,8", metavar="L,L",
                   help="default 1,8")
    p.add_argument("--sizes", type=arg_type(comma_list(parse_size)), default="1M,16M,256M",
                   metavar="S,S", help="message per rank (default 1M,16M,256M)")
    p.add_argument("--latency", type=arg_type(parse_latency), default="20us",
                   help="per message between nodes, MPI and Python included (default 20us)")
    p.add_argument("--accuracy", type=float, default=None,
                   help="largest relative error of the method picked (default: any)")
    p.add_argument("--wire", default="int8", help="default int8")
    p.add_argument("--profile", help="profile file (default: as QuantizedComm finds it)")
    a = p.parse_args(argv)
    profile, source = _profile(a.profile)
    block = default_block(a.wire)
    k = profile["kernels"]["int8"]["float32"]
    print(f"# equarx_mpi cost model predictions (profile: {source}); float32 SUM Allreduce, "
          f"{a.wire} wire, block {block}\n# assumptions: one core per rank; kernels as "
          f"measured on one core (int8 hop {1e-9 / k['hop']:.2f}, decode "
          f"{1e-9 / k['decode']:.2f} G values/s), copies {1e-9 / profile['copy']:.1f} GB/s "
          f"per rank; {a.latency * 1e6:g} us per message between nodes, one link per node;\n"
          f"# mpi = an ideal exact ring or recursive doubling at the link rate (the better); "
          f"accuracy {a.accuracy}")
    print("# columns: ranks, ranks/node, link, size/rank, time [ms] per method, auto's pick "
          f"(mpi unless a quantized method is {options.DEFAULTS['lossy_margin'] - 1:.0%} faster), "
          "its error, "
          "speedup over mpi")
    print(f"#{'ranks':>6} {'rpn':>4} {'link':>8} {'size':>9} {'mpi':>9} {'ring':>9} "
          f"{'two_shot':>9} {'hier':>9} {'auto':>13} {'error':>6} {'speedup':>8}")
    for rpn in a.ranks_per_node:
        for rate in a.rate:
            for P in a.ranks:
                if P % rpn or P // rpn < 2:
                    continue
                for n in a.sizes:
                    t = predict_times(profile, P // rpn, rpn, rate, a.latency, n, a.wire, block)
                    m = costmodel.Model(profile, P // rpn, rpn, a.wire, block)
                    best = _auto(t, m, a.wire, block, a.accuracy, P, rpn, n)
                    cell = lambda x: f"{t[x] * 1e3:9.2f}" if x in t else f"{'-':>9}"  # noqa
                    print(f" {P:6d} {rpn:4d} {rate / 1e9:5g}Gb/s {human(n):>9} {cell('mpi')} "
                          f"{cell('ring')} {cell('two_shot')} {cell('hierarchical')} "
                          f"{best:>13} {m.error(best):6.2%} {t['mpi'] / t[best]:8.2f}")
    return 0


class _Predicted:
    """The cost model's face to policy.choose (time, error) on times
    predicted for a cluster that was not measured."""

    def __init__(self, times, model):
        self.times, self.model = times, model
        self.measured_from = model.measured_from

    def time(self, method, nbytes, itemsize, dtype_name="float32"):
        return self.times[method]

    def error(self, method, rounding="nearest"):
        return self.model.error(method, rounding)


def _auto(times, model, wire, block, accuracy, P, rpn, nbytes):
    """What algorithm="auto" picks for a float32 SUM Allreduce with these
    predicted times: policy.choose itself, with the library's defaults."""
    opts = dict(options.DEFAULTS, algorithm="auto", wire=wire, block_size=block,
                accuracy=accuracy, lossy_ops=("sum",))
    return policy.choose(opts, "Allreduce", "sum", np.dtype(np.float32), nbytes, P,
                         Layout(P // rpn, rpn, True), _Predicted(times, model))[0]


def model_method(row):
    """The cost model's method for a benchmark row (bench --json), from what
    the row ran (its path): "mpi", "shm", "ring", "two_shot",
    "hierarchical", or "auto" for the auto column; None where the model has
    no such method (another wire, pinned chunks, no argument agreement,
    auto-exact, a name this version does not know)."""
    method = METHODS.get(row["method"])
    if method is None:
        return None
    opts = method.options
    if opts is None:
        return "mpi"
    if opts.get("algorithm") == "auto":
        return "auto" if opts.get("accuracy") is None else None
    if opts.get("wire", "int8") != "int8" or "chunks" in opts or opts.get("check") is False:
        return None
    if row["path"] in ("exact", "shm"):
        return {"exact": "mpi", "shm": "shm"}[row["path"]]
    algorithm, _, wire = row["path"].partition("/")
    return algorithm if wire == "int8" else None


def check(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune check",
                                description="The model's predictions against a benchmark's "
                                "JSON (python -m equarx_mpi.bench --json), and auto against "
                                "the best single method.  Each row is checked against the "
                                "method it ran (its path: int8 below its floor is MPI).  "
                                "Serial.")
    p.add_argument("bench_json", nargs="+")
    p.add_argument("--layout", default=None, help="NxL (default: 1 node of the run's ranks)")
    p.add_argument("--profile", help="profile file (default: as QuantizedComm finds it)")
    a = p.parse_args(argv)
    if a.layout is not None:
        try:
            nodes, rpn = (int(x) for x in a.layout.lower().split("x"))
        except ValueError:
            p.error(f"--layout {a.layout!r}: expected NxL, e.g. 4x1")
    profile, source = _profile(a.profile)
    errs, gaps = {}, []
    for path in a.bench_json:
        with open(path) as f:
            run = json.load(f)
        if "rows" not in run:
            p.error(f"{path}: no rows (an allreduce run's --json; --overlap runs have none)")
        if a.layout is None:
            nodes, rpn = 1, run["ranks"]
        model = costmodel.Model(profile, nodes, rpn, "int8", run.get("block", 256))
        print(f"# {path}: {nodes}x{rpn}, profile {source}")
        print(f"#{'size':>9} {'method':>12} {'path':>14} {'measured':>10} {'model':>10} "
              f"{'error':>7} {'physical':>10} {'error':>7}")
        by_size = {}
        for r in run["rows"]:
            by_size.setdefault(r["bytes"], []).append(r)
        for n, rows in sorted(by_size.items()):
            single, auto = {}, None
            for r in rows:
                m = model_method(r)
                t = r["time_us"]["avg"] * 1e-6
                if m is None:
                    continue
                if m == "auto":
                    auto = (t, r["path"])
                    continue
                single[r["method"]] = t
                pred = model.time(m, n, 4)
                phys = model.physical(m, n, 4)
                errs.setdefault(m, []).append(pred / t - 1)
                print(f" {human(n):>9} {r['method']:>12} {r['path']:>14} {t * 1e3:10.3f} "
                      f"{pred * 1e3:10.3f} {pred / t - 1:+7.1%} {phys * 1e3:10.3f} "
                      f"{phys / t - 1:+7.1%}")
            if single and auto is not None:
                best = min(single, key=single.get)
                gap = auto[0] / single[best] - 1
                gaps.append(gap)
                print(f" {human(n):>9} {'auto':>12} {auto[1]:>14} {auto[0] * 1e3:10.3f}   "
                      f"best single: {best} {single[best] * 1e3:.3f} ms; auto {gap:+.1%}")
    for m, e in sorted(errs.items()):
        e = sorted(abs(x) for x in e)
        print(f"# model error {m:12s} median {e[len(e) // 2]:.1%}, max {e[-1]:.1%} "
              f"({len(e)} points)")
    if gaps:
        print(f"# auto vs best single method: worst {max(gaps):+.1%}, "
              f"{sum(g <= 0.05 for g in gaps)}/{len(gaps)} sizes within 5%")
    return 0
