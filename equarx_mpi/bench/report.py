"""The text of ``python -m equarx_mpi.bench``'s allreduce sweep: the
summary above the table (what the library buys at the largest size, and
what one machine can and cannot show), the column legend, one row per size
and method, and the lines after the table (among them auto against the
fastest single method at each size)."""
import os
import sys
import textwrap

import numpy as np

from equarx_mpi.bench.common import human

LEGEND = """\
# columns (one row per message size and method):
#   size(B), count, type   message per rank: count values of type (the same on every rank)
#   path      what ran: "exact" = the exact MPI collective (mpi, or a library method
#             below its size threshold); "shm" = the exact shared-window sum;
#             else algorithm/wire format, e.g. ring/int8
#   avg(us) min(us) max(us)   time per call: each rank's median over the timed calls,
#             then the average, minimum and maximum of those over ranks
#   algbw     size(B) / avg time [GB/s], from the uncompressed bytes
#   busbw     algbw * 2(P-1)/P [GB/s] (the nccl-tests convention for AllReduce)
#   speedup   mpi's avg time / this method's avg time: > 1 = faster than mpi
#   rel_err   ||out - exact|| / ||exact||, L2 over the message; exact = float64 sum of the inputs
#   anom_err  ||out - exact|| / ||exact - mean(exact)||: the error against the signal (the
#             anomaly); about rel_err for zero-mean data, far larger when the data has an offset
#   max_err   max |out - exact|
#   #wrong    ranks whose result bits differ from rank 0's (0 = all ranks agree)"""

COLUMNS = (("size(B)", 12), ("count", 11), ("type", 8), ("method", 12), ("path", 13),
           ("avg(us)", 11), ("min(us)", 11), ("max(us)", 11), ("algbw(GB/s)", 11),
           ("busbw(GB/s)", 11), ("speedup", 8), ("rel_err", 9), ("anom_err", 9),
           ("max_err", 9), ("#wrong", 6))


def format_row(r):
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    t = r["time_us"]
    cells = (r["bytes"], r["count"], r["dtype"], r["method"], r["path"],
             f"{t['avg']:.1f}", f"{t['min']:.1f}", f"{t['max']:.1f}",
             f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
             num(r["speedup_vs_mpi"], ".2f"), num(r["rel_err"], ".2e"),
             num(r["anom_err"], ".2e"), f"{r['max_err']:.2e}", r["wrong"])
    return " " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS))[1:]


def footer(rows, methods, say):
    for m in methods:
        bw = np.mean([r["busbw_GBps"] for r in rows if r["method"] == m])
        say(f"# avg busbw {m:12s} {bw:.3f} GB/s")
    last = max(r["bytes"] for r in rows)
    at_last = {r["method"]: r for r in rows if r["bytes"] == last}
    if "int8" in at_last:
        for base in ("mpi", "bf16"):
            if base in at_last:
                ratio = at_last[base]["time_us"]["avg"] / at_last["int8"]["time_us"]["avg"]
                say(f"# speedup of int8 ({at_last['int8']['path']}) over {base} at "
                    f"{human(last)}: {ratio:.2f}x")
    auto_summary(rows, methods, say)
    say(f"# wrong results: {sum(r['wrong'] for r in rows)}")


def auto_summary(rows, methods, say):
    """auto's time against the fastest single method at each size: among
    the library's methods (which pay the same per-call checks), and among
    every column (with mpi4py's own, which pays none)."""
    # int8 and wrap change method with the size: not single methods
    singles = [m for m in methods if not m.startswith("auto") and m not in ("int8", "wrap")]
    if "auto" not in methods or not singles:
        return
    lib = [m for m in singles if m != "mpi"]
    for name, pool in (("library methods", lib), ("every column", singles)):
        if not pool:
            continue
        cells = []
        for size in sorted({r["bytes"] for r in rows}):
            at = {r["method"]: r for r in rows if r["bytes"] == size}
            t = {m: r["time_us"]["avg"] for m, r in at.items()}
            best = min(pool, key=t.get)
            same = " = its path" if best != "mpi" and at["auto"]["path"] == at[best]["path"] \
                else ""
            cells.append(f"{human(size)} {t['auto'] / t[best] - 1:+.1%} ({best}{same})")
        say(f"# auto vs the fastest of {name} ({', '.join(pool)}): " + ", ".join(cells))


#: the int8 ring's columns, the first that ran the ring at the size wins
INT8_RING = ("int8", "int8-raw", "int8-c1", "int8-nocheck", "wrap", "auto")
#: the emulated cluster's command for the same comparison (docs/CLUSTER.md)
CLUSTER_ARGS = "run --hosts 4 --rate 1gbit -- -b 64K -e 64M -m mpi,bf16,int8"


def _pct(e):
    # below 1e-5 relative: the rounding of the result's own type, not a method's error
    return "exact" if e is not None and e < 1e-5 else "-" if e is None else f"{100 * e:.3g}%"


def cluster_command():
    """The emulated cluster's command line, runnable as printed."""
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    return f"{'' if root else 'sudo '}{sys.executable} -m equarx_mpi.cluster {CLUSTER_ARGS}"


def _para(text, say):
    say(textwrap.fill(" ".join(text.split()), 96, initial_indent="#   ",
                      subsequent_indent="#   "))


def summary(rows, P, cores, one_node, say):
    """The first lines a newcomer reads, from the rows of the largest size:
    the int8 ring against the bf16 ring (EQuARX's comparison) and against
    MPI, speed and error; on one node, what shared memory can and cannot
    show, and the emulated cluster's command."""
    at = {r["method"]: r for r in rows}
    size = human(rows[0]["bytes"])
    ring8 = next((at[m] for m in INT8_RING if m in at and at[m]["path"] == "ring/int8"), None)
    bf16 = next((r for r in rows if r["path"] == "ring/bf16"), None)
    mpi = at.get("mpi")
    say(f"# summary at {size} per rank, the largest size (it ran first; the table below "
        f"has every size):")
    if ring8 is None or (bf16 is None and mpi is None):
        _para(f"no int8 ring against bf16 or mpi at {size}: -m mpi,bf16,int8-raw compares "
              f"them (int8 alone is exact MPI where the ring does not pay)", say)
    else:
        t8 = ring8["time_us"]["avg"]
        for base, words in ((bf16, "bf16 ring (EQuARX's comparison)"),
                            (mpi, "MPI's own Allreduce")):
            if base is not None:
                say(f"#   int8 ring vs {words}, columns {ring8['method']}, "
                    f"{base['method']}: {base['time_us']['avg'] / t8:.2f}x the speed; "
                    f"error {_pct(ring8['rel_err'])} vs {_pct(base['rel_err'])}")
    if not one_node:
        return
    ahead = ring8 is not None and mpi is not None and \
        mpi["time_us"]["avg"] > ring8["time_us"]["avg"]
    _para(f"On one machine ({P} ranks, {cores} core{'s' * (cores != 1)}) the ranks exchange "
          f"through shared memory: with no network, fewer bytes buy far less than on a wire, and "
          f"int8 gets "
          + ("ahead of MPI only on large messages like this one" if ahead else
             "ahead of MPI, if at all, only on messages of tens of MiB")
          + "; MPI wins the small ones (speedup column)."
          + (" With more ranks than cores, every step of a ring also waits for a core."
             if P > cores else ""), say)
    _para("On a network the bytes are the cost. The emulated cluster shows that on this "
          "machine (as root; 4 hosts, each with its own 1 Gbit/s link; docs/CLUSTER.md):", say)
    say(f"#     {cluster_command()}")
