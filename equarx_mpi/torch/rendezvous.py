"""Rendezvous over MPI, and the MPI communicator of each group.

``init_process_group`` with neither ``store`` nor ``init_method`` takes
torch's ``env://`` rendezvous, which wants RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT in the environment; mpirun sets none of them.  Once
``equarx_mpi.torch`` is imported, an ``env://`` rendezvous that lacks any of
them takes them from MPI instead (whatever the backend: gloo under mpirun
works the same way): rank and world size are MPI.COMM_WORLD's, rank 0
opens a TCPStore on MASTER_ADDR:MASTER_PORT where set, else on a free port
of its own address (127.0.0.1 when every rank shares its node), and sends
the address to the others over MPI.  torch's other backends (gloo) use that
store, so ``dist.new_group(backend="gloo")`` works beside "equarx"; across
nodes, where GLOO_SOCKET_IFNAME is unset, it is set to the interface each
rank reaches rank 0 through (gloo would take its host name's address).  When
the four variables are all set (torchrun), torch's own handler runs as
before.  Nothing happens at import: the collective calls are made inside
``init_process_group``, which every rank calls.
"""
import datetime
import fcntl
import importlib
import os
import socket
import struct
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist
from mpi4py import MPI

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: how long a rank tries to reach rank 0's store before giving up
CONNECT_SECONDS = 60


def install():
    """Route ``env://`` through ``_env_or_mpi`` (once per process)."""
    # the module (torch.distributed.rendezvous is also the name of a function)
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if getattr(handlers.get("env"), "_equarx", False):
        return
    original = handlers["env"]

    def env_or_mpi(url, timeout=datetime.timedelta(minutes=30), **kwargs):
        query = dict(parse_qsl(urlparse(url).query))
        given = {"RANK": "rank" in query, "WORLD_SIZE": "world_size" in query}
        if all(given.get(v) or os.environ.get(v) for v in _ENV):
            return original(url, timeout=timeout, **kwargs)
        return _mpi_rendezvous(query, timeout)

    env_or_mpi._equarx = True
    handlers["env"] = env_or_mpi


def _mpi_rendezvous(query, timeout):
    """(store, rank, world size) of MPI.COMM_WORLD, as torch's handlers
    yield them; the same error on every rank if any fails."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    err = None
    for name, mine in (("rank", rank), ("world_size", size)):
        value = query.get(name) or os.environ.get(name.upper())
        if value not in (None, "-1") and int(value) != mine:
            err = (f"equarx: {name} {value} was given, but MPI says {mine}: "
                   f"under mpirun leave rank and world_size to MPI")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = comm.allreduce(node.Get_size(), MPI.MIN) == size
    node.Free()
    host = port = store = None
    if rank == 0 and err is None:
        try:
            host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_node else _my_address())
            store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT", 0)), size,
                                  is_master=True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except Exception as e:          # noqa: BLE001 - every rank raises it below
            err = f"equarx: rank 0 could not open the rendezvous store: {e}"
    errors = comm.allgather(err)
    host, port = comm.bcast((host, port))
    _raise_first(errors)
    if rank != 0:
        try:
            store = dist.TCPStore(host, port, size, is_master=False, wait_for_workers=False,
                                  timeout=min(timeout, datetime.timedelta(seconds=CONNECT_SECONDS)))
        except Exception as e:          # noqa: BLE001 - every rank raises it below
            err = (f"equarx: rank {rank} could not reach rank 0's store at {host}:{port} "
                   f"({e}); set MASTER_ADDR to an address of rank 0's host the others reach")
    _raise_first(comm.allgather(err))
    store.set_timeout(timeout)
    if not one_node and not os.environ.get("GLOO_SOCKET_IFNAME"):
        # gloo picks its interface from the host name (127.0.0.1 on many
        # hosts, which other hosts cannot reach): give it the one this rank
        # reaches rank 0's store through
        name = _interface_towards(host)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    yield store, rank, size
    raise RuntimeError("equarx: the MPI rendezvous cannot be repeated")


def _raise_first(errors):
    bad = [e for e in errors if e is not None]
    if bad:
        raise RuntimeError(bad[0])


def _my_address():
    """This host's IPv4 address for other hosts: GLOO_SOCKET_IFNAME's, else
    the one its name resolves to, else its first interface's but lo's."""
    names = [os.environ["GLOO_SOCKET_IFNAME"].split(",")[0]] \
        if os.environ.get("GLOO_SOCKET_IFNAME") else []
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    names += [n for _, n in socket.if_nameindex() if n != "lo"]
    for name in names:
        addr = _interface_address(name)
        if addr is not None and not addr.startswith("127."):
            return addr
    raise RuntimeError("no address of this host found: set MASTER_ADDR")


def _interface_towards(addr):
    """The name of the interface this host sends to ``addr`` through, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))        # UDP: nothing is sent
            local = s.getsockname()[0]
    except OSError:
        return None
    if local.startswith("127."):
        return None
    return next((n for _, n in socket.if_nameindex() if _interface_address(n) == local), None)


def _interface_address(name):
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,        # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def group_comm(ranks, group_rank, group_size):
    """A new MPI communicator of the group whose ranks in the default group
    are ``ranks`` (empty: the default group itself); only its members call
    this (torch creates a group on its members alone)."""
    world = MPI.COMM_WORLD
    if not ranks:
        if (group_rank, group_size) != (world.Get_rank(), world.Get_size()):
            raise RuntimeError(
                f"equarx: torch's rank {group_rank} of {group_size} is not MPI's "
                f"{world.Get_rank()} of {world.Get_size()}: start the job with mpirun and let "
                f"the rendezvous take rank and world size from MPI")
        return world.Dup()
    if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != \
            (world.Get_rank(), world.Get_size()):
        raise RuntimeError("equarx: the default group's ranks are not MPI.COMM_WORLD's")
    group = world.Get_group().Incl(list(ranks))
    try:
        return world.Create_group(group)
    finally:
        group.Free()
