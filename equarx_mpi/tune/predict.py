"""The cost model's answers: ``python -m equarx_mpi.tune predict`` (clusters
that were not measured) and ``... tune check`` (against a benchmark run);
and ``... tune builtin A.json B.json`` (for maintainers: the built-in
profile, costmodel_builtin.py, from measured ones).  Serial; no MPI job."""
import argparse
import json
import sys

from equarx_mpi.bench.allreduce import METHODS, human, parse_size
from equarx_mpi.call.policy import LOSSY_MARGIN, near_fastest
from equarx_mpi.cluster import parse_rate
from equarx_mpi.model import costmodel, profiles

LOSSY = ("ring", "two_shot", "hierarchical")


def _profile(path):
    if path is None:
        return profiles.find_profile()
    return profiles.merge(profiles.builtin(), profiles.load(path)), path


def _latency(text):
    t = text.strip().lower()
    for unit, k in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(unit):
            return float(t[:-len(unit)]) * k
    raise argparse.ArgumentTypeError(f"not a latency: {text!r} (e.g. 20us)")


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


def predict(argv):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune predict",
                                description="The model's Allreduce times and speedups over "
                                "MPI for clusters that were not measured.")
    p.add_argument("--ranks", default="16,64,256,1024")
    p.add_argument("--rate", default="10gbit,100gbit", help="link rates per node")
    p.add_argument("--ranks-per-node", default="1,8")
    p.add_argument("--sizes", default="1M,16M,256M", help="message per rank")
    p.add_argument("--latency", type=_latency, default=_latency("20us"),
                   help="per message between nodes, MPI and Python included (default 20us)")
    p.add_argument("--accuracy", type=float, default=None,
                   help="largest relative error of the method picked (default: any)")
    p.add_argument("--wire", default="int8")
    p.add_argument("--profile", help="profile file (default: as QuantizedComm finds it)")
    a = p.parse_args(argv)
    profile, source = _profile(a.profile)
    ranks = [int(x) for x in a.ranks.split(",")]
    rates = [parse_rate(x) for x in a.rate.split(",")]
    rpns = [int(x) for x in a.ranks_per_node.split(",")]
    sizes = [parse_size(x) for x in a.sizes.split(",")]
    k = profile["kernels"]["int8"]["float32"]
    print(f"# equarx_mpi cost model predictions (profile: {source}); float32 SUM Allreduce, "
          f"{a.wire} wire\n# assumptions: one core per rank; kernels as measured on one core "
          f"(hop {1e-9 / k['hop']:.2f}, decode {1e-9 / k['decode']:.2f} G values/s), copies "
          f"{1e-9 / profile['copy']:.1f} GB/s per rank; {a.latency * 1e6:g} us per message "
          f"between nodes, one link per node;\n# mpi = an ideal exact ring or recursive "
          f"doubling at the link rate (the better); accuracy {a.accuracy}")
    print("# columns: ranks, ranks/node, link, size/rank, time [ms] per method, auto's pick "
          "(mpi unless a quantized method is 5% faster), its error, speedup over mpi")
    print(f"#{'ranks':>6} {'rpn':>4} {'link':>8} {'size':>9} {'mpi':>9} {'ring':>9} "
          f"{'two_shot':>9} {'hier':>9} {'auto':>13} {'error':>6} {'speedup':>8}")
    for rpn in rpns:
        for rate in rates:
            for P in ranks:
                if P % rpn or P // rpn < 2:
                    continue
                for n in sizes:
                    t = predict_times(profile, P // rpn, rpn, rate, a.latency, n, a.wire)
                    m = costmodel.Model(profile, P // rpn, rpn, a.wire,
                                        costmodel.formats.default_block(a.wire))
                    ok = [x for x in LOSSY if x in t
                          and (a.accuracy is None or m.error(x) <= a.accuracy)]
                    best = near_fastest(ok, t.get, m.error) if ok else "mpi"
                    if t[best] * LOSSY_MARGIN > t["mpi"]:
                        best = "mpi"
                    cell = lambda x: f"{t[x] * 1e3:9.2f}" if x in t else f"{'-':>9}"  # noqa
                    print(f" {P:6d} {rpn:4d} {rate / 1e9:5g}Gb/s {human(n):>9} {cell('mpi')} "
                          f"{cell('ring')} {cell('two_shot')} {cell('hierarchical')} "
                          f"{best:>13} {m.error(best):6.2%} {t['mpi'] / t[best]:8.2f}")
    return 0


def _bench_method(name):
    """The model's method for a benchmark column ("auto" for auto), or None."""
    opts = METHODS[name][1]
    if opts is None:
        return "mpi"
    if opts.get("wire", "int8") != "int8" or opts.get("chunks") is not None:
        return None
    return opts.get("algorithm", "auto")


def check(argv):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune check",
                                description="The model's predictions against a benchmark's "
                                "JSON (python -m equarx_mpi.bench --json), and auto against "
                                "the best single method.")
    p.add_argument("bench_json", nargs="+")
    p.add_argument("--layout", default=None, help="NxL (default: 1 node of the run's ranks)")
    p.add_argument("--profile", help="profile file (default: as QuantizedComm finds it)")
    a = p.parse_args(argv)
    profile, source = _profile(a.profile)
    errs, gaps = {}, []
    for path in a.bench_json:
        with open(path) as f:
            run = json.load(f)
        nodes, rpn = ((int(x) for x in a.layout.split("x")) if a.layout else (1, run["ranks"]))
        model = costmodel.Model(profile, nodes, rpn, "int8", 256)
        print(f"# {path}: {nodes}x{rpn}, profile {source}")
        print(f"#{'size':>9} {'method':>12} {'path':>14} {'measured':>10} {'model':>10} "
              f"{'error':>7} {'physical':>10} {'error':>7}")
        by_size = {}
        for r in run["rows"]:
            by_size.setdefault(r["bytes"], []).append(r)
        for n, rows in sorted(by_size.items()):
            single = {}
            for r in rows:
                m = _bench_method(r["method"])
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
            if single and any(_bench_method(r["method"]) == "auto" for r in rows):
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


def builtin(argv):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune builtin",
                                description="Merge measured profiles (later ones win) into "
                                "equarx_mpi/costmodel_builtin.py.")
    p.add_argument("profiles", nargs="+")
    a = p.parse_args(argv)
    merged = profiles.load(a.profiles[0])
    for path in a.profiles[1:]:
        merged = profiles.merge(merged, profiles.load(path))
    merged.update(source="builtin", key="builtin")
    merged.pop("machine", None)
    machines = [profiles.load(path).get("machine", {}) for path in a.profiles]
    head = "".join(f"#   {m.get('command', '?')}  ({m.get('ranks', '?')} ranks, "
                   f"{m.get('date', '?')}, load {m.get('load_before', '?')})\n"
                   for m in machines)
    path = costmodel.__file__.replace("costmodel.py", "costmodel_builtin.py")
    with open(path, "w") as f:
        f.write('"""The built-in profile: what algorithm="auto" decides with when this\n'
                'machine has none (docs/TUNING.md).  Generated by\n'
                f'``python -m equarx_mpi.tune builtin {chr(10).join(a.profiles)}``\n'
                'from profiles measured on the project\'s 2-core machine '
                f'({machines[0].get("cpu", "?")}):\n"""\n{head}'
                f"PROFILE = {json.dumps(merged, indent=1)}\n"
                .replace(": null", ": None").replace(": true", ": True")
                .replace(": false", ": False"))
    print(f"wrote {path}")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    return {"predict": predict, "check": check, "builtin": builtin}[argv[0]](argv[1:])
