"""equarx_mpi: block-quantized AllReduce for mpi4py (EQuARX on MPI).

    from mpi4py import MPI
    from equarx_mpi import QuantizedComm
    with QuantizedComm(MPI.COMM_WORLD) as qc:
        qc.Allreduce(MPI.IN_PLACE, grads)

The MPI-facing names load on first use, so ``python -m equarx_mpi.cluster``
(a launcher) does not initialize MPI itself.
"""
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"
__all__ = ["QuantizedComm", "CallInfo", "Stats", "ErrorFeedback", "allreduce", "wrap", "warmup",
           "waitall", "testall", "startall", "abort_on_exception", "QUANTIZED_DTYPES",
           "__version__"]
_WHERE = {"QuantizedComm": "comm", "CallInfo": "call.records", "Stats": "call.records",
          "ErrorFeedback": "feedback", "allreduce": "helper",
          "wrap": "wrapping", "warmup": "warmup", "waitall": "call.nonblocking",
          "testall": "call.nonblocking", "startall": "call.nonblocking",
          "abort_on_exception": "call.agree", "QUANTIZED_DTYPES": "names"}


if TYPE_CHECKING:      # what __getattr__ gives, for a type checker
    from equarx_mpi.call.agree import abort_on_exception
    from equarx_mpi.call.nonblocking import startall, testall, waitall
    from equarx_mpi.call.records import CallInfo, Stats
    from equarx_mpi.comm import QuantizedComm
    from equarx_mpi.feedback import ErrorFeedback
    from equarx_mpi.helper import allreduce
    from equarx_mpi.names import QUANTIZED_DTYPES
    from equarx_mpi.warmup import warmup
    from equarx_mpi.wrapping import wrap


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value     # importing a submodule may have set the name
        return value
    raise AttributeError(f"module 'equarx_mpi' has no attribute {name!r}")

