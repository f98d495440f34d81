"""The figure of ``python -m equarx_mpi.bench --plot FILE.png`` (needs matplotlib).

Three panels against the message size per rank: time per call, speedup over
exact MPI, and the error against the exact sum.  Bars span the slowest to
the fastest rank; the sizes where a library method took the exact MPI path
(its size threshold) are shaded.
"""
import math

import numpy as np

from equarx_mpi.bench.common import human

INSTALL = "--plot needs matplotlib: pip install equarx_mpi[plot]"


def missing():
    """None when matplotlib can draw here, else the message to show."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception as e:     # not installed, or an install that cannot import
        return f"{INSTALL} (importing it failed: {type(e).__name__}: {e})"
    return None


def exact_spans(rows, method):
    """Byte ranges (lo, hi) around the sizes where ``method`` ran exact MPI,
    cut halfway (geometrically) to the neighbouring sizes."""
    rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["bytes"])
    b = [r["bytes"] for r in rs]
    edges = ([b[0] / 2 ** 0.5] if b else []) + [math.sqrt(x * y) for x, y in zip(b, b[1:])] \
        + ([b[-1] * 2 ** 0.5] if b else [])
    spans = []
    for i, r in enumerate(rs):
        if r["path"] != "exact":
            continue
        if spans and spans[-1][1] == edges[i]:
            spans[-1] = (spans[-1][0], edges[i + 1])
        else:
            spans.append((edges[i], edges[i + 1]))
    return spans


def shaded_method(rows, library):
    """The library method whose exact-MPI sizes get shaded: int8 when it ran
    exact MPI at some size, else the first such one of ``library``."""
    fell_back = [m for m in library if any(r["method"] == m and r["path"] == "exact"
                                           for r in rows)]
    return "int8" if "int8" in fell_back else (fell_back[0] if fell_back else None)


def _series(rows, m):
    return sorted((r for r in rows if r["method"] == m), key=lambda r: r["bytes"])


def plot(rows, methods, library, path, title):
    """Draw ``rows`` (the bench's) of ``methods`` into ``path``; ``library``:
    the methods that run QuantizedComm (may fall back to exact MPI)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.lines
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, (at, asp, aerr) = plt.subplots(1, 3, figsize=(16, 5), sharex=True)
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    base = {r["bytes"]: r for r in rows if r["method"] == "mpi"}
    offset = any(r["anom_err"] and r["rel_err"] and r["anom_err"] > 2 * r["rel_err"]
                 for r in rows)
    for m in methods:
        rs = _series(rows, m)
        b = np.array([r["bytes"] for r in rs], float)
        t = np.array([[r["time_us"][k] / 1e3 for k in ("avg", "min", "max")] for r in rs])
        kw = dict(color=colors[m], marker="o", ms=4, capsize=3, label=m)
        at.errorbar(b, t[:, 0], yerr=[t[:, 0] - t[:, 1], t[:, 2] - t[:, 0]], **kw)
        if base and m != "mpi":
            mb = np.array([base[r["bytes"]]["time_us"]["avg"] / 1e3 for r in rs])
            sp = mb / t[:, 0]
            asp.errorbar(b, sp, yerr=[sp - mb / t[:, 2], mb / t[:, 1] - sp], **kw)
        rel = np.array([r["rel_err"] or np.nan for r in rs], float)
        aerr.plot(b, rel, color=colors[m], marker="o", ms=4, label=m)
        if offset:
            anom = np.array([r["anom_err"] or np.nan for r in rs], float)
            aerr.plot(b, anom, color=colors[m], marker="s", ms=4, ls="--")
    shade = shaded_method(rows, library)
    for a in (at, asp, aerr):
        for i, (lo, hi) in enumerate(exact_spans(rows, shade) if shade else []):
            a.axvspan(lo, hi, color="0.85", zorder=0,
                      label=f"sizes where {shade} ran exact MPI" if i == 0 and a is at else None)
        a.set_xscale("log", base=2)
        sz = sorted({r["bytes"] for r in rows})
        step = max(1, math.ceil(len(sz) / 8))
        a.set_xticks(sz[::step], [human(s) for s in sz[::step]], rotation=30)
        a.set_xticks([], minor=True)
        a.set_xlabel("message per rank")
        a.grid(True, which="major", alpha=0.3)
    at.set_yscale("log")
    lo, hi = at.get_ylim()     # plain numbers; label minor ticks only on a short range
    at.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    at.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if hi / lo < 30 else ""))
    at.set_ylabel("time per call [ms]")
    at.set_title("time (avg over ranks; bars: fastest to slowest rank)", fontsize=10)
    if base:
        asp.axhline(1.0, color="k", lw=0.8)
        asp.set_yscale("log", base=2)      # 2x faster and 2x slower equally far from 1
        asp.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    asp.set_ylabel("speedup over mpi (> 1 = faster)")
    asp.set_title("speedup = mpi avg time / method avg time", fontsize=10)
    if not base:
        asp.text(0.5, 0.5, "no 'mpi' method in this run", transform=asp.transAxes,
                 ha="center")
    aerr.set_yscale("log")
    aerr.set_ylabel("relative L2 error")
    aerr.set_title("error against the exact float64 sum", fontsize=10)
    handles, labels = at.get_legend_handles_labels()
    styles = [("-", "o", "rel_err = |out-exact| / |exact|")]
    if offset:
        styles.append(("--", "s", "anom_err = |out-exact| / |exact-mean(exact)|"))
    handles += [matplotlib.lines.Line2D([], [], color="0.3", ls=ls, marker=mk, ms=4)
                for ls, mk, _ in styles]
    labels += [t for *_, t in styles]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False,
               fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
