"""The text of ``python -m equarx_mpi.bench``'s allreduce sweep: the column
legend, one row per size and method, and the summary lines after the table
(among them auto against the fastest single method at each size)."""
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
    singles = [m for m in methods if not m.startswith("auto") and m != "int8"]
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
