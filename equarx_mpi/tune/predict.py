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
from equarx_mpi.names import Layout, between_nodes
from equarx_mpi.wire import formats
from equarx_mpi.wire.formats import default_block

#: the quantized schedules, as options lists them (collectives/registry.py)
LOSSY = tuple(a for a in options.ALGORITHMS if a not in ("auto", "shm", "mpi"))
#: the wires ``predict`` shows by default, the 16-bit one last: every wire but fp32
#: (which saves nothing), in the order of the published tables (docs/results/predict-*.txt)
WIRES = tuple(sorted((w for w in formats.WIRES if w != "fp32"),
                     key=lambda w: formats.REGISTRY[w].bits == 16))


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


def _wires(text):
    """A comma list of wires, or "all" (WIRES)."""
    out = []
    for w in comma_list(str)(text):
        if w == "all":
            out += [x for x in WIRES if x not in out]
        elif w not in formats.WIRES:
            raise ValueError(f"no wire {w!r}: one of {formats.WIRES} or 'all'")
        elif w not in out:
            out.append(w)
    return out


def cluster_hw(profile, nodes, rpn, rate_bits, latency, wire="int8", threads=1, memory=None,
               w=1.0):
    """The physical parameters of a cluster that was not measured: nodes of
    ``rpn`` ranks, one core each (``threads`` cores each, its kernels over
    that many threads: costmodel.Hw.threaded), kernels and copies as
    measured alone on the profile's machine, messages inside a node as
    measured between 2 ranks, links of ``rate_bits`` bit/s with ``latency``
    seconds per message, and a barrier of 2 latencies per doubling of the
    ranks.  ``memory``: seconds per byte of the node's copy, which its
    ranks share (default: the profile's machine's, costmodel.node_copy);
    ``w``: wire bytes per value (the kernels' memory traffic)."""
    base = costmodel.Hw(profile, 1, 2, wire, "float32")
    P = nodes * rpn
    hw = base.changed(nodes=nodes, rpn=rpn, share=1.0, copy=profile["copy"], net_alpha=latency,
                      net_beta=8.0 / rate_bits, sync=2 * latency * costmodel.lg(P))
    mem = costmodel.node_copy(profile) if memory is None else memory
    return hw.threaded(profile, wire, threads, mem * rpn, 4, w)


def ideal_mpi(profile, nodes, rpn, rate_bits, latency, nbytes):
    """{algorithm: seconds} of an ideal exact Allreduce of nbytes per rank
    (costmodel.mpi_parts: ring, recursive doubling, Rabenseifner)."""
    hw = cluster_hw(profile, nodes, rpn, rate_bits, latency)
    return costmodel.mpi_parts(hw, nbytes, nodes * rpn)


def predict_times(profile, nodes, rpn, rate_bits, latency, nbytes, wire="int8", block=256,
                  threads=1, memory=None):
    """{method: seconds} for a float32 SUM Allreduce of nbytes per rank:
    "mpi" and every quantized schedule on this wire (hierarchical across
    nodes of more than one rank), the library's kernels over ``threads``
    threads per rank (MPI's sums on one)."""
    m = costmodel.Model(profile, nodes, rpn, wire, block)
    w = m.wire_bytes(4)
    hw = cluster_hw(profile, nodes, rpn, rate_bits, latency, wire, threads, memory, w)
    out = {}
    for method in ("mpi",) + LOSSY:
        if method == "hierarchical" and (rpn == 1 or nodes == 1):
            continue
        out[method] = hw.seconds(method, nbytes / 4, 4, w, m.pieces(method, nbytes),
                                 between_nodes(wire))
    return out


def _fastest(cands, t, err, accuracy):
    """policy.near_fastest among ``cands`` within ``accuracy`` (None: any),
    or None."""
    fits = [c for c in cands if accuracy is None or err(c) <= accuracy]
    return policy.near_fastest(fits, t, err) if fits else None


def predict(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune predict",
                                description="The model's Allreduce times and speedups over "
                                "an ideal MPI for clusters that were not measured, per wire, "
                                "then the best wire and method for each.  Serial.",
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
                   help="largest relative error of the methods picked (default: any)")
    p.add_argument("--within", type=float, default=0.01,
                   help="the summary's second best: error at most this (default 0.01)")
    p.add_argument("--wire", type=arg_type(_wires), default="all", metavar="W,W",
                   help=f"wires, or all (default all: {','.join(WIRES)})")
    p.add_argument("--threads", type=ints, default="1", metavar="T,T",
                   help="kernel threads per rank, one core each (default 1)")
    p.add_argument("--memory", type=float, default=None, metavar="GB/s",
                   help="a node's memory copy rate, which its ranks' threads share (default: "
                   "the profile's machine's, every rank copying)")
    p.add_argument("--profile", help="profile file (default: as QuantizedComm finds it)")
    a = p.parse_args(argv)
    profile, source = _profile(a.profile)
    mem = costmodel.node_copy(profile) if a.memory is None else 1e-9 / a.memory
    k = profile["kernels"]["int8"]["float32"]
    measured = sorted(profile["kernels"])
    print(f"# equarx_mpi cost model predictions (profile: {source}); float32 SUM Allreduce\n"
          f"# assumptions: one core per rank, ranks placed node by node, one full-duplex link "
          f"per node; {a.latency * 1e6:g} us per message between nodes (MPI and Python "
          f"included), the same for MPI and the library;\n# kernels as measured on one core "
          f"(int8 hop {1e-9 / k['hop']:.2f}, decode {1e-9 / k['decode']:.2f} G values/s; "
          f"wires other than {', '.join(measured)}: int8's times costmodel.SLOWER), copies and "
          f"MPI's sums "
          f"{1e-9 / profile['copy']:.1f} GB/s per rank;\n{_threads_note(profile, a.threads, mem)}"
          f"# mpi = an ideal exact Allreduce at the link rate: the best of a ring, recursive "
          f"doubling and Rabenseifner (halving + doubling, distance 1 first), its algorithm "
          f"after it;\n# best = the fastest quantized method within the accuracy (the most "
          f"accurate within {policy.NEAR_TIE - 1:.0%} of it); auto = policy.choose (mpi unless "
          f"a quantized method is {options.DEFAULTS['lossy_margin'] - 1:.0%} faster); "
          f"accuracy {a.accuracy}")
    configs = [(P, rpn, T, rate, n) for T in a.threads for rpn in a.ranks_per_node
               for rate in a.rate for P in a.ranks if P % rpn == 0 and P // rpn >= 2
               for n in a.sizes]
    found = {}      # config -> {(wire, method): (seconds, error)}
    for wire in a.wire:
        block = default_block(wire)
        m1 = costmodel.Model(profile, 1, 2, wire, block)
        print(f"\n# wire {wire}, block {block}: {m1.wire_bytes(4):.4g} bytes per value")
        print(f"#{'ranks':>6} {'rpn':>4} {'link':>8} {'size':>9} {'mpi':>9} {'(algorithm)':12} "
              f"{'ring':>9} {'two_shot':>9} {'rabenseifner':>12} {'hierarchical':>12} "
              f"{'best':>12} {'error':>6} {'speedup':>7} {'auto':>12} {'error':>6} "
              f"{'speedup':>7}")
        for P, rpn, T, rate, n in configs:
            _group(configs, (P, rpn, T, rate, n))
            t = predict_times(profile, P // rpn, rpn, rate, a.latency, n, wire, block, T, mem)
            parts = ideal_mpi(profile, P // rpn, rpn, rate, a.latency, n)
            m = costmodel.Model(profile, P // rpn, rpn, wire, block)
            lossy = [x for x in LOSSY if x in t]
            for x in lossy:
                found.setdefault((P, rpn, T, rate, n), {})[wire, x] = (t[x], m.error(x))
            best = _fastest(lossy, t.get, m.error, a.accuracy)
            pick = _auto(t, m, wire, block, a.accuracy, P, rpn, n)
            cell = lambda x, k=9: f"{t[x] * 1e3:{k}.2f}" if x in t else f"{'-':>{k}}"  # noqa
            three = lambda x: (f"{x:>12} {m.error(x):6.2%} "    # noqa: E731
                               f"{t['mpi'] / t[x]:7.2f}") if x else f"{'-':>12} {'':6} {'':7}"
            print(f" {P:6d} {rpn:4d} {rate / 1e9:5g}Gb/s {human(n):>9} {cell('mpi')} "
                  f"{min(parts, key=parts.get):12} {cell('ring')} {cell('two_shot')} "
                  f"{cell('rabenseifner', 12)} {cell('hierarchical', 12)} "
                  f"{three(best)} {three(pick)}")
    _summary(a, profile, configs, found)
    return 0


def _group(configs, config):
    """A comment line before each thread count's rows where there are
    several (the rows keep their columns)."""
    T = config[2]
    if len({c[2] for c in configs}) > 1 and next(c for c in configs if c[2] == T) == config:
        print(f"# {T} kernel thread(s) per rank")


def _threads_note(profile, threads, mem):
    """predict's header line on kernel threads: where the speedups come
    from (costmodel.thread_speedup) and the memory cap."""
    got = sorted(profile.get("threads") or {})
    rates = costmodel.thread_rates(profile, "int8")
    T = max(threads)
    ups = ", ".join(f"{name} {costmodel.thread_speedup(rates, name, T):.2f}x"
                    for name in ("encode", "hop", "decode", "many"))
    return (f"# kernel threads per rank: {','.join(map(str, threads))} (MPI's sums on one); "
            f"speedups {'measured by tune for ' + ', '.join(got) if got else 'not measured'}"
            f" in this profile, else Amdahl's law with parallel fraction "
            f"{costmodel.ASSUMED_PARALLEL} (int8 at {T} threads: {ups});\n# no part under "
            f"{costmodel.MIN_PART} values, no kernel faster than its memory traffic at the "
            f"node's copy rate, {1e-9 / mem:.1f} GB/s, shared by its ranks;\n")


def _summary(a, profile, configs, found):
    """The best wire and method for each cluster, with any error and
    within ``a.within``."""
    print(f"\n# the best wire and method per cluster, among {', '.join(a.wire)}: any error, "
          f"and error at most {a.within:.2%}; speedup over the ideal mpi")
    print(f"#{'ranks':>6} {'rpn':>4} {'link':>8} {'size':>9} {'mpi':>9} {'(algorithm)':12} "
          f"{'best: wire':>12} {'method':>12} {'ms':>8} {'error':>6} {'speedup':>7} "
          f"{'within: wire':>12} {'method':>12} {'ms':>8} {'error':>6} {'speedup':>7}")
    for P, rpn, T, rate, n in configs:
        _group(configs, (P, rpn, T, rate, n))
        parts = ideal_mpi(profile, P // rpn, rpn, rate, a.latency, n)
        mpi = min(parts.values())
        got = found[P, rpn, T, rate, n]
        t, err = (lambda c: got[c][0]), (lambda c: got[c][1])
        row = f" {P:6d} {rpn:4d} {rate / 1e9:5g}Gb/s {human(n):>9} {mpi * 1e3:9.2f} " \
              f"{min(parts, key=parts.get):12}"
        for acc in (None, a.within):
            c = _fastest(list(got), t, err, acc)
            row += (f" {c[0]:>12} {c[1]:>12} {t(c) * 1e3:8.2f} {err(c):6.2%} "
                    f"{mpi / t(c):7.2f}" if c else f" {'-':>12} {'-':>12} {'':8} {'':6} {'':7}")
        print(row)


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
    p.add_argument("--threads", type=_positive, default=1,
                   help="kernel threads per rank the run used (option threads; default 1)")
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
        model = costmodel.Model(profile, nodes, rpn, "int8", run.get("block", 256),
                                threads=a.threads)
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
