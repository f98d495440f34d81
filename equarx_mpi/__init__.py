"""equarx_mpi: block-quantized AllReduce for mpi4py (EQuARX on MPI).

    from mpi4py import MPI
    from equarx_mpi import QuantizedComm
    with QuantizedComm(MPI.COMM_WORLD) as qc:
        qc.Allreduce(MPI.IN_PLACE, grads)

The MPI-facing names load on first use, so ``python -m equarx_mpi.cluster``
(a launcher) does not initialize MPI itself.
"""
__version__ = "0.1.0"
__all__ = ["QuantizedComm", "allreduce", "abort_on_exception", "QUANTIZED_DTYPES",
           "__version__"]


def __getattr__(name):
    if name in __all__:
        from . import comm
        return getattr(comm, name)
    raise AttributeError(f"module 'equarx_mpi' has no attribute {name!r}")
