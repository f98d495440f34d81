"""The emulated cluster runner: parsing and generated commands everywhere,
plus one real 2-host run that needs root and iproute2.

Serial (not under mpirun): python -m pytest tests/test_cluster.py
"""
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from equarx_mpi import cluster as C

# --- parsing ---------------------------------------------------------------
# Sizes and rates are parsed by equarx_mpi.bench.common (tests/test_tools.py);
# here: that the runner's options go through them, with their messages.

def test_options_use_the_shared_parsers(capsys):
    ns = C.parse_args(["run", "--burst", "1.5mb", "--rate", "125mbps", "--latency", "5ms"])
    assert (ns.cluster.burst, ns.cluster.rate, ns.cluster.latency) == (3 << 19, 10**9, "5ms")
    for opt, bad, message in (("--burst", "1mbit", "bad size '1mbit'"),
                              ("--rate", "1g", "bad rate '1g'"),
                              ("--latency", "20", "bad latency '20'")):
        with pytest.raises(SystemExit):
            C.parse_args(["run", opt, bad])
        assert message in capsys.readouterr().err, opt


def test_parse_latency():
    assert C.parse_latency("20ms") == "20ms"
    assert C.parse_latency("1s") == "1s"
    with pytest.raises(ValueError, match="latency"):
        C.parse_latency("20")


def test_format_rate():
    assert C.format_rate(10**9) == "1 Gbit/s"
    assert C.format_rate(10**8) == "100 Mbit/s"
    assert C.format_rate(None) == "unlimited"


def test_parse_args_bench():
    ns = C.parse_args(["run", "--hosts", "3", "--ranks-per-host", "2", "--rate", "100mbit",
                       "--", "-b", "1M", "-n", "5"])
    assert ns.command == [sys.executable, "-m", "equarx_mpi.bench", "-b", "1M", "-n", "5"]
    c = ns.cluster
    assert (c.hosts, c.ranks_per_host, c.size, c.rate) == (3, 2, 6, 10**8)
    assert (c.burst, c.latency) == (1 << 20, "20ms")
    # a bench command goes through as it is
    ns = C.parse_args(["run", "--", "shm", "-e", "64M"])
    assert ns.command == [sys.executable, "-m", "equarx_mpi.bench", "shm", "-e", "64M"]


def test_parse_args_defaults_and_no_args():
    ns = C.parse_args(["run"])
    assert ns.command == [sys.executable, "-m", "equarx_mpi.bench"]
    assert (ns.cluster.hosts, ns.cluster.rate) == (2, 10**9)


def test_parse_args_exec():
    ns = C.parse_args(["run", "--rate", "none", "--exec", "--", "job.py", "-x", "1"])
    assert ns.command == [sys.executable, "job.py", "-x", "1"]
    assert ns.cluster.rate is None
    ns = C.parse_args(["run", "--exec", "--", "hostname"])
    assert ns.command == ["hostname"]


@pytest.mark.parametrize("argv", [
    ["run", "--rate", "fast"], ["run", "--hosts", "0"], ["run", "--ranks-per-host", "0"],
    ["run", "--exec"], ["run", "--hosts", "300"], ["frobnicate"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        C.parse_args(argv)
    assert e.value.code == 2


def test_parse_args_messages(capsys):
    with pytest.raises(SystemExit):
        C.parse_args(["run", "--rate", "fast"])
    assert "bad rate 'fast'" in capsys.readouterr().err


def test_parse_args_mpirun_args():
    ns = C.parse_args(["run", "--mpirun-arg", "--mca coll_tuned_priority 90",
                       "--mpirun-arg=--verbose"])
    assert ns.mpirun_args == ["--mca", "coll_tuned_priority", "90", "--verbose"]


def test_parse_args_cleanup():
    assert C.parse_args(["cleanup"]).all is False
    assert C.parse_args(["cleanup", "--all"]).all is True


# --- generated commands ----------------------------------------------------

def cluster(**kw):
    kw.setdefault("rate", 10**9)
    return C.Cluster(pid=4242, **kw)


def test_names_and_addresses():
    c = cluster(hosts=3)
    assert c.tag == "eqxc4242"
    assert c.host_ns == ["eqxc4242-h0", "eqxc4242-h1", "eqxc4242-h2"]
    assert c.bridge_ns == "eqxc4242-br"
    assert c.addrs == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    # Interface names must fit Linux's 15 characters.
    assert all(len(n) <= 15 for n in c.ports + ["eth0", "br0"])
    assert len(set(c.hostnames)) == 3


def test_setup_commands_stay_in_our_namespaces():
    c = cluster(hosts=2)
    ours = set(c.host_ns) | {c.bridge_ns}
    for cmd in C.setup_commands(c):
        # Either creates one of our namespaces or runs inside one (-n NS):
        # nothing may touch the root namespace.
        if cmd[:3] == ["ip", "netns", "add"]:
            assert cmd[3] in ours
        else:
            assert cmd[1] == "-n" and cmd[2] in ours, cmd
        if "veth" in cmd:
            assert cmd[-2:] == ["netns", cmd[-2:][1]] and cmd[-1] in c.host_ns


def test_setup_commands_shape_both_directions():
    c = cluster(hosts=2, rate=10**9, burst=1 << 20, latency="20ms")
    tbf = [cmd for cmd in C.setup_commands(c) if cmd[0] == "tc"]
    assert len(tbf) == 4
    for ns, port in zip(c.host_ns, c.ports):
        tail = ["root", "tbf", "rate", "1000000000bit", "burst", str(1 << 20),
                "latency", "20ms"]
        assert ["tc", "-n", ns, "qdisc", "add", "dev", "eth0"] + tail in tbf
        assert ["tc", "-n", c.bridge_ns, "qdisc", "add", "dev", port] + tail in tbf


def test_setup_commands_unshaped():
    assert not [cmd for cmd in C.setup_commands(cluster(hosts=2, rate=None)) if cmd[0] == "tc"]


def test_mpirun_command():
    c = cluster(hosts=2, ranks_per_host=3)
    argv = C.mpirun_command(c, "/tmp/agent.sh", ["python", "job.py"], "/v/bin/mpirun",
                            extra=["--verbose"])
    assert argv[:6] == ["ip", "netns", "exec", "eqxc4242-h0", "unshare", "--uts"]
    i = argv.index("/v/bin/mpirun")
    assert argv[i - 1] == c.hostnames[0]
    assert argv[argv.index("-n") + 1] == "6"
    assert argv[argv.index("--host") + 1] == "10.213.0.1:3,10.213.0.2:3"
    assert argv[argv.index("--bind-to") + 1] == "none"
    joined = " ".join(argv)
    assert "--mca btl_tcp_if_include 10.213.0.0/24" in joined
    assert "--prtemca oob_tcp_if_include 10.213.0.0/24" in joined
    assert "--prtemca plm_ssh_agent /tmp/agent.sh" in joined
    assert "--mca coll ^han" in joined
    assert argv[-3:] == ["--verbose", "python", "job.py"]
    assert "coll" not in C.mpirun_command(cluster(hosts=2, coll=""), "a", ["x"])


def test_launch_env():
    env = C.launch_env({"PATH": "/usr/bin", "PYTHONPATH": "/x"})
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == "/x"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"


def test_agent_script(tmp_path):
    """Run the generated agent with a fake ``ip`` that records its argv."""
    c = cluster(hosts=2)
    agent = tmp_path / "agent.sh"
    agent.write_text(C.agent_script(c))
    agent.chmod(0o700)
    fake = tmp_path / "ip"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o700)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    # prterun passes ssh-style options first, then the host, then the words.
    out = subprocess.run([str(agent), "-x", "10.213.0.2", "PATH=/a;", "prted", "--x y"],
                         env=env, capture_output=True, text=True, check=True).stdout
    words = out.splitlines()
    assert words[:5] == ["netns", "exec", "eqxc4242-h1", "unshare", "--uts"]
    assert words[-2:] == ["eqx-h1", "PATH=/a; prted --x y"]
    bad = subprocess.run([str(agent), "10.9.9.9", "true"], env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 255 and "unknown host" in bad.stderr


# --- a real run ------------------------------------------------------------

def _missing_requirements():
    try:
        C.check_requirements()
    except RuntimeError as e:
        return str(e)
    return None


JOB = textwrap.dedent("""
    import socket, sys, time
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    x = np.full(1 << 20, comm.rank + 1, np.float32)     # 4 MiB
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    sum_ok = comm.allreduce(bool((y == comm.size * (comm.size + 1) // 2).all()), op=MPI.LAND)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.connect(("10.213.0.1", 9))     # UDP connect: picks our address, sends nothing
    where = comm.gather((socket.gethostname(), u.getsockname()[0]), root=0)
    comm.Barrier()
    t = time.perf_counter()
    if comm.rank == 0:
        comm.Send(x, 1)
    elif comm.rank == 1:
        comm.Recv(y, 0)
    comm.Barrier()
    dt = time.perf_counter() - t
    if comm.rank == 0:
        for rank, (host, addr) in enumerate(where):
            print(f"rank {rank} host {host} addr {addr}")
        print("sum_ok", sum_ok)
        print(f"send_s {dt:.4f}")
    ok = comm.allreduce(bool(comm.rank != 1 or (y == 1).all()), op=MPI.LAND)
    if comm.rank == 0:
        print("recv_ok", ok)
""")


@pytest.mark.timeout(120)
@pytest.mark.skipif(_missing_requirements() is not None,
                    reason=f"emulated cluster unavailable: {_missing_requirements()}")
def test_two_host_run(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    cmd = [sys.executable, "-m", "equarx_mpi.cluster", "run", "--hosts", "2",
           "--rate", "100mbit", "--exec", "--", str(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tag = f"{C.PREFIX}{proc.pid}"
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = C.list_namespaces(tag + "-")
        C.teardown(tag)     # never leave anything behind, even on failure
    assert proc.returncode == 0, out
    assert left == [], f"teardown left namespaces {left}"
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(tag + "-")]
    assert "rank 0 host eqx-h0 addr 10.213.0.1" in out, out
    assert "rank 1 host eqx-h1 addr 10.213.0.2" in out, out
    assert "sum_ok True" in out and "recv_ok True" in out, out
    # 4 MiB at 100 Mbit/s is 0.34 s; the 1 MiB bucket lets about 0.08 s of it
    # through at once.  Unshaped it takes a few ms.
    send_s = float(re.search(r"send_s (\S+)", out).group(1))
    assert 0.2 < send_s < 2.0, out
