"""Assertions for tests under mpirun: a check that fails on one rank must
fail on every rank (else the others wait in the next collective).  And
what the AllReduce suites share: every rank's inputs built on every rank
from one seed, the exact float64 sum, the communicators a case runs on."""
import os
from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def everywhere(ok, what, comm=WORLD):
    """Assert ok on every rank, reporting which ranks failed."""
    bad = [r for r, v in enumerate(comm.allgather(bool(ok))) if not v]
    assert not bad, f"{what} failed on ranks {bad}"


def same_on_all_ranks(arr, comm=WORLD):
    ref = comm.bcast(arr.tobytes() if comm.Get_rank() == 0 else None)
    everywhere(arr.tobytes() == ref, "bitwise identical on all ranks", comm=comm)


def inputs(P, n, dtype, seed, scale=1.0, offset=0.0):
    """P ranks' inputs, offset + scale N(0, 1), the same on every rank."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        return [(offset + scale * rng.standard_normal(n)).astype(dtype) for _ in range(P)]


def exact_sum(xs):
    return np.sum([x.astype(np.float64) for x in xs], axis=0)


def sum_slack(xs):
    """What the float64 reference sum itself may be off by."""
    return len(xs) * 2.0 ** -52 * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)


COMMS = ("world", "self", "dup", "split")


@contextmanager
def make_comm(kind):
    """COMM_WORLD, COMM_SELF, a Dup of WORLD or a Split of it in two
    (ranks of the same parity, in reversed order); freed after."""
    w = WORLD
    c = {"world": lambda: w, "self": lambda: MPI.COMM_SELF, "dup": w.Dup,
         "split": lambda: w.Split(w.Get_rank() % 2, -w.Get_rank())}[kind]()
    try:
        yield c
    finally:
        if kind in ("dup", "split"):
            c.Free()


def case_id(v):
    """A parametrized value in a test id: a dtype by its name."""
    return np.dtype(v).name if isinstance(v, (type, np.dtype)) else None


def allreduce_as(form, comm, *args):
    """comm's Allreduce(*args) as a "blocking", "nonblocking" (Iallreduce,
    waited for) or "persistent" call (Allreduce_init, started once, waited
    for and freed)."""
    if form == "blocking":
        comm.Allreduce(*args)
    elif form == "nonblocking":
        comm.Iallreduce(*args).Wait()
    else:
        assert form == "persistent", form
        req = comm.Allreduce_init(*args)
        req.Start()
        req.Wait()
        req.Free()


def raises_everywhere(exc_type, fn, match=None, comm=WORLD):
    """fn() must raise exc_type on every rank, with the same message."""
    try:
        fn()
        got = None
    except Exception as e:          # noqa: BLE001 - compared below
        got = (type(e).__name__, str(e))
    everyone = comm.allgather(got)
    assert all(g is not None and g[0] == exc_type.__name__ for g in everyone), everyone
    assert len({g[1] for g in everyone}) == 1, f"messages differ: {everyone}"
    if match:
        assert match in everyone[0][1], everyone[0][1]
    return everyone[0][1]


def rank0_draws(prop, run_case, comm=WORLD):
    """A hypothesis test under mpirun: rank 0 runs ``prop``, which must
    broadcast each drawn case before running it; the other ranks run the
    cases that arrive (``run_case(case)``) until None.  Only rank 0 draws:
    hypothesis' choices may depend on time (health checks, shrinking), so
    ranks drawing alike would diverge.  Returns rank 0's failure in words,
    or None, on every rank."""
    if comm.Get_rank() == 0:
        try:
            prop()
            failure = None
        except Exception as e:              # noqa: BLE001 - every rank learns it
            failure = f"{type(e).__name__}: {e}"
        finally:
            comm.bcast(None)
    else:
        while (c := comm.bcast(None)) is not None:
            run_case(c)
        failure = None
    return comm.bcast(failure)


def need_torch():
    """Import torch for a test module: skip the module where torch is
    missing, unless EQUARX_MPI_TORCH=1 (run_tests.sh sets it after
    installing torch), where a missing torch fails instead."""
    try:
        import torch
    except ImportError:
        if os.environ.get("EQUARX_MPI_TORCH") == "1":
            raise
        pytest.skip("torch is not installed (pip install 'equarx_mpi[torch]')",
                    allow_module_level=True)
    return torch


def torch_suite():
    """The start of a torch suite: (torch, torch.distributed,
    equarx_mpi.torch, this rank, the size), the module skipped as
    need_torch says."""
    torch = need_torch()
    import torch.distributed as dist

    import equarx_mpi.torch as eqt
    return torch, dist, eqt, WORLD.Get_rank(), WORLD.Get_size()


def equarx_and_gloo():
    """For the torch modules' fixture: the default group on "equarx" (made
    here unless another module did), and a gloo group of the same ranks
    beside it, sharing its store; one torch thread per rank."""
    import torch
    import torch.distributed as dist

    import equarx_mpi.torch  # noqa: F401 (registers the backend)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("equarx")
    return dist.new_group(backend="gloo")
