"""equarx_mpi: block-quantized AllReduce for mpi4py (EQuARX on MPI).

    from equarx_mpi import QuantizedComm
    with QuantizedComm(MPI.COMM_WORLD) as qc:
        qc.Allreduce(MPI.IN_PLACE, grads)
"""
from .comm import QuantizedComm, allreduce, QUANTIZED_DTYPES

__version__ = "0.1.0"
__all__ = ["QuantizedComm", "allreduce", "QUANTIZED_DTYPES", "__version__"]
