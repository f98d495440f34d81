"""equarx_mpi inside torch.distributed (docs/TORCH.md).

    import torch.distributed as dist
    import equarx_mpi.torch                  # registers the backend "equarx"
    dist.init_process_group("equarx")        # under mpirun: nothing else needed
    dist.all_reduce(t)                       # float SUM/AVG: quantized where it pays
    model = DistributedDataParallel(model)   # its buckets too

    # any process group (gloo too): the buckets through a QuantizedComm
    model.register_comm_hook(equarx_mpi.torch.HookState(), equarx_mpi.torch.allreduce_hook)

Importing it registers the backend and lets an ``env://`` rendezvous
missing its variables take them from MPI (rendezvous.py); it sends no
message.  The core library never imports torch; this package needs
torch >= 2.2 (``pip install "equarx_mpi[torch]"``).

Layout: ``tensors.py`` (views, dtypes, ops, local checks), ``work.py``
(Work, futures, the queue), ``calls.py`` (what each collective runs, the
group's QuantizedComm), ``group.py`` (the process group, agreeing through
the library's call/agree.py), ``rendezvous.py`` (store and
communicators), ``hook.py`` (the DDP communication hook).
"""
try:
    import torch  # noqa: F401
    import torch.distributed as dist
except ImportError as e:        # pragma: no cover - the module's one precondition
    raise ImportError("equarx_mpi.torch needs PyTorch >= 2.2: "
                      "pip install 'equarx_mpi[torch]'") from e
import contextlib
from typing import Any, Iterator, Optional

from equarx_mpi.comm import QuantizedComm
from equarx_mpi.torch import rendezvous
from equarx_mpi.torch.group import EXACT_DEPTH, ProcessGroupEquarx
from equarx_mpi.torch.hook import HookState, allreduce_hook

__all__ = ["BACKEND", "Options", "options", "exact", "qcomm", "HookState", "allreduce_hook",
           "ProcessGroupEquarx"]

#: the backend's name for init_process_group and new_group
BACKEND = "equarx"


class Options(dict):
    """QuantizedComm's options for one group, as ``pg_options``:
    ``dist.new_group(ranks, backend="equarx", pg_options=Options(wire="int4"))``."""


def _create(dist_opts, pg_options):
    """torch's creator of an "equarx" group (extended API): every member
    of the new group calls it, in the same order."""
    if pg_options is not None and not isinstance(pg_options, dict):
        raise TypeError(f"equarx: pg_options must be equarx_mpi.torch.Options(...), not "
                        f"{type(pg_options).__name__}")
    comm = rendezvous.group_comm(list(dist_opts.global_ranks_in_group), dist_opts.group_rank,
                                 dist_opts.group_size)
    return ProcessGroupEquarx(comm, pg_options or {}, getattr(dist_opts, "timeout", None))


def _group(group):
    """The equarx group ``group`` stands for (None: the default group)."""
    pg = dist.group.WORLD if group is None else group
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("equarx: this rank is not a member of that process group")
    if pg is None:
        raise RuntimeError("equarx: no default process group: call "
                           "dist.init_process_group('equarx') first")
    if not isinstance(pg, ProcessGroupEquarx):
        raise TypeError(f"equarx: this group is not an 'equarx' process group (its backend: "
                        f"{dist.get_backend(pg)})")
    return pg


def qcomm(group: Optional[dist.ProcessGroup] = None) -> QuantizedComm:
    """The QuantizedComm behind ``group``'s all_reduce and reduce_scatter
    (None: the default group): its ``last_call``, ``stats``,
    ``last_error_bound``, ``crossover()``."""
    return _group(group).qcomm


def options(group: Optional[dist.ProcessGroup] = None, **opts: Any) -> "dict[str, Any]":
    """``group``'s QuantizedComm options (None: the default group).  With
    keywords, collective over the group: they update its options, every
    later call uses them (calls already queued finish first); bad ones
    raise the same error on every rank.  Returns the resolved options."""
    pg = _group(group)
    return pg.set_options(**opts) if opts else dict(pg.qcomm.options)


@contextlib.contextmanager
def exact(group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
    """``with equarx_mpi.torch.exact(): ...``: every call made inside is
    exact, whatever the options, on ``group`` (None: every equarx group and
    HookState).  Local: every rank enters it around the same calls."""
    pg = None if group is None else _group(group)
    if pg is None:
        EXACT_DEPTH[0] += 1
    else:
        pg.exact_depth += 1
    try:
        yield
    finally:
        if pg is None:
            EXACT_DEPTH[0] -= 1
        else:
            pg.exact_depth -= 1


def _register():
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    rendezvous.install()


_register()
