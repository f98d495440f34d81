"""``equarx_mpi.allreduce``: one call for scripts, with the QuantizedComm
cached on the communicator itself."""
from typing import Any, Optional

import numpy as np
from mpi4py import MPI
from numpy.typing import ArrayLike

from equarx_mpi.call import options
from equarx_mpi.call.agree import agree
from equarx_mpi.comm import QuantizedComm

_keyval = None


def _drop_cached(comm, keyval, cached):
    for qc in cached.values():
        qc.free()


def allreduce(x: ArrayLike, comm: Optional[MPI.Comm] = None, op: MPI.Op = MPI.SUM,
              **opts: Any) -> np.ndarray:
    """op over the ranks of ``comm`` (default COMM_WORLD) of array x, as a new
    array.  The QuantizedComm for (comm, options) is created on first use and
    cached on ``comm`` itself (an MPI attribute), freed with ``comm``.

    Collective.  The ranks first agree on the options (one tiny Allreduce on
    ``comm``): different or misspelled options on some ranks raise the same
    error on every rank instead of leaving them in different collectives."""
    global _keyval
    comm = MPI.COMM_WORLD if comm is None else comm
    # local facts, alike on every rank: raised before anything is sent (the
    # options agreement below would fail on an inter-communicator)
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"equarx_mpi.allreduce: comm must be an mpi4py MPI.Comm, not "
                        f"{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("equarx_mpi.allreduce: comm is MPI.COMM_NULL")
    if comm.Is_inter():
        raise TypeError("equarx_mpi.allreduce needs an intra-communicator; "
                        "got an inter-communicator")
    key: Any     # None for bad options: agree() raises them
    try:
        key, err = tuple(sorted(options.resolve(opts).items())), None
    except (TypeError, ValueError) as e:
        key, err = None, e
    agree(comm, "equarx_mpi.allreduce", [("options", str(key))], err)
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_drop_cached)
    cached: Any = comm.Get_attr(_keyval)
    if cached is None:
        cached = {}
        comm.Set_attr(_keyval, cached)
    qc = cached.get(key)
    if qc is None:
        qc = cached[key] = QuantizedComm(comm, **dict(key))
    return qc.allreduce(x, op)
