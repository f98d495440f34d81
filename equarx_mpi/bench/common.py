"""Small helpers every tool shares (``python -m equarx_mpi.bench``, ``...
tune``, ``... cluster``): the one home of size, rate and latency parsing,
of human sizes and of the size sweep.

A leaf: it imports no module of the package and not mpi4py (only
``mpi_library`` and ``node_cores`` do, when called; ``run_command``, the command registry
of ``python -m equarx_mpi.bench`` and ``... tune``, imports the module of
the command it runs), so ``tune predict`` and the cluster launcher never
initialize MPI.

Units:
  sizes      bytes, binary: an integer or decimal number, then optionally
             K, M or G (1024, 1024**2, 1024**3), spelt K, KB or KiB in any
             case, or B for bytes: 4K = 4KiB = 4096, 1.5M = 1572864,
             1mb = 1048576, 65536.  The result must be a whole number of
             bytes, at least 0.
  rates      bits per second, tc's units: bit (bits/s) or bps (bytes/s)
             after k, m, g or t (decimal, 1000): 1gbit, 100mbit, 125mbps;
             "none" (or "off", "0"): no limit.
  latencies  us, ms or s after a number: 20us, 1.5ms, 1s.
"""
import argparse
import importlib
import os
import re
import sys

_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)(i?b)?")
_SIZE_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)")
_RATE_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_LATENCY = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)")
_LATENCY_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_size(text):
    """``'4K'`` -> 4096 bytes; units in the module docstring.  ValueError
    (naming the text) for anything else."""
    t = str(text).strip().lower()
    m = _SIZE.fullmatch(t)
    # "ib" needs a unit before it: "4kib" is a size, "4ib" is not
    if not m or (m.group(3) == "ib" and not m.group(2)):
        raise ValueError(f"bad size {text!r}: expected e.g. 4K, 1.5M, 64KiB or 65536 "
                         f"(K, M, G: 1024, 1024**2, 1024**3 bytes)")
    value = float(m.group(1)) * _SIZE_UNIT[m.group(2)]
    if value != int(value):
        raise ValueError(f"bad size {text!r}: {value:g} is not a whole number of bytes")
    return int(value)


def parse_rate(text):
    """``'1gbit'`` -> 1000000000 (bits/s); ``'none'`` -> None.

    tc's own units: ``bit`` is bits/s, ``bps`` bytes/s, k/m/g/t decimal;
    at least 8kbit (tc's smallest)."""
    t = str(text).strip().lower()
    if t in ("none", "off", "0"):
        return None
    m = _RATE.fullmatch(t)
    if not m:
        raise ValueError(f"bad rate {text!r}: expected e.g. 1gbit, 100mbit, 125mbps or none")
    bits = float(m.group(1)) * _RATE_UNIT[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit")
    return int(bits)


def parse_latency(text):
    """``'20us'`` -> 2e-05 seconds (us, ms or s)."""
    m = _LATENCY.fullmatch(str(text).strip().lower())
    if not m:
        raise ValueError(f"bad latency {text!r}: expected e.g. 20us, 1.5ms or 1s")
    return float(m.group(1)) * _LATENCY_UNIT[m.group(2)]


def arg_type(parse):
    """``parse`` as an argparse type: its ValueError's message becomes
    argparse's (not "invalid parse_size value")."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def comma_list(parse):
    """A parser of comma-separated values, each through ``parse``; at least one."""
    def convert(text):
        out = [parse(t.strip()) for t in str(text).split(",") if t.strip()]
        if not out:
            raise ValueError(f"expected a comma-separated list, got {text!r}")
        return out
    convert.__name__ = f"list of {parse.__name__}"
    return convert


def human(nbytes):
    """4096 -> '4 KiB'; below 1 KiB, '100 B'."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= k:
            return f"{nbytes / k:g} {unit}"
    return f"{nbytes} B"


def sizes(begin, end, factor):
    """begin, begin*factor, ... up to end (begin >= 1, factor >= 2)."""
    if begin < 1 or factor < 2:
        raise ValueError(f"sizes: need begin >= 1 and factor >= 2, got {begin}, {factor}")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s *= factor
    return out


def mpi_library():
    """First line of MPI's library version, without the C string's NUL.
    Imports (and so initializes) MPI: for tools that run under mpirun."""
    from mpi4py import MPI
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def node_cores(comm):
    """(whether all of comm's ranks share one node, the cores the ranks of
    this rank's node may run on).  The cores are the union of those ranks'
    affinities: mpirun may bind each rank to one core.  Collective; imports
    MPI, like ``mpi_library``."""
    from mpi4py import MPI
    try:
        mine = sorted(os.sched_getaffinity(0))
    except AttributeError:          # not Linux: the machine's count
        mine = list(range(os.cpu_count() or 1))
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = len(set().union(*map(set, local.allgather(mine))))
        return local.Get_size() == comm.Get_size(), cores
    finally:
        local.Free()


def announce(comm, what, extra=""):
    """Print the benchmark's first line on rank 0 (what, the ranks, the
    cores of their node, ``extra``, MPI's library); return ``say``, which
    prints on rank 0 only, flushed line by line so that a newcomer sees each
    line as it is made, and the cores.  Collective."""
    say = (lambda *s: print(*s, flush=True)) if comm.Get_rank() == 0 else (lambda *s: None)
    P, cores = comm.Get_size(), node_cores(comm)[1]
    say(f"# equarx_mpi {what}: {P} rank{'s' * (P != 1)} on {cores} core{'s' * (cores != 1)}, "
        f"{extra}{mpi_library()}")
    return say, cores


def parse_checked(parser, argv, check):
    """parser's arguments from argv, or parser.error(why) (exit 2) when
    check(arguments) says why they cannot run."""
    a = parser.parse_args(argv)
    err = check(a)
    if err:
        parser.error(err)
    return a


def table(say, legend, columns, sizes, one_size, format_row):
    """Say the legend and the column heads ((name, width) pairs), then the
    rows of one_size(nbytes) for each size as they come; returns them all."""
    say(legend)
    say("#" + " ".join(f"{name:>{w}}" for name, w in columns)[1:])
    rows = []
    for nbytes in sizes:
        got = one_size(nbytes)
        for r in got:
            say(format_row(r))
        rows += got
    return rows


def save_rows(path, ranks, cores, rows, **about):
    """Write a benchmark's rows as JSON, with the ranks, their cores,
    ``about``, MPI's library and the command line."""
    import json
    with open(path, "w") as f:
        json.dump({"ranks": ranks, "cores": cores, **about, "mpi": mpi_library(),
                   "argv": sys.argv[1:], "rows": rows}, f, indent=1)


def run_command(prog, commands, default, argv=None):
    """``python -m PACKAGE [COMMAND] ARGS``, as ``python -m mpi4py.bench``:
    ``commands`` maps a name to (module, function, one line for --help).
    Without a name (no arguments, or an option first) ARGS go to
    ``default``, whose function also gets ``commands=``, the list of all of
    them for its --help.  A module is imported only when its command runs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = default
    if argv and argv[0] in commands:
        name, argv = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        raise SystemExit(f"{prog}: unknown command {argv[0]!r}; choose from "
                         f"{', '.join(commands)} (or see --help)")
    module, function, _ = commands[name]
    run = getattr(importlib.import_module(module), function)
    if name != default:
        return run(argv)
    lines = [f"commands ({prog} COMMAND --help shows each one's options):"]
    width = max(map(len, commands)) + 2
    for cmd, (*_, about) in commands.items():
        first, *rest = about.split("\n")
        lines += [f"  {cmd:{width}s}{first}"] + [" " * (width + 2) + line for line in rest]
    return run(argv, commands="\n".join(lines))
