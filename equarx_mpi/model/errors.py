"""The error model: the relative L2 error each method adds to a SUM of
standard-normal values, the one place every caller asks (costmodel
re-exports it; policy filters ``accuracy`` with it).

A method's error is E1, the error of ONE quantization of standard-normal
float32 values (per wire and block size), times sqrt(the sum of the
variances it quantizes / the result's): a partial sum of s inputs has
variance s, its block scale and so its quantization error grow by
sqrt(s), and the errors of different quantizations are independent.
Each schedule declares that sum as its ``variance(P)`` (in its module,
collectives/registry.py lists them):

- ring: every value is requantized at P-1 hops holding partial sums of 1,
  2, ..., P-1 inputs, and the owner quantizes the whole sum:
  (1 + ... + P-1 + P) / P = (P + 1) / 2;
- two-shot: P-1 senders quantize one input each, the owner the sum:
  (P - 1 + P) / P = 2 - 1/P;
- rabenseifner: at halving step k (k = 1 .. log2 P', P' the largest power
  of two <= P) each value is sent by P'/2^k ranks, each holding a partial
  sum of 2^(k-1) inputs: P'/2 per step, then the owner quantizes the sum,
  and a folded rank's input (P > P') is quantized once more on its way to
  its partner: 1 + log2(P')/2 + (P - P')/P.  It grows with log2 P, not
  flat as two-shot's: at 1024 ranks sqrt(6) E1 against two-shot's
  sqrt(2) E1 (simulated with the library's formats within 2% at 2-128
  ranks: ``python tests/test_costmodel_schedules.py`` prints the table;
  docs/results/predict-rabenseifner-error.txt);
- hierarchical: exact on each node, the schedule between nodes
  (names.between_nodes) of the node count.
"""
import math

from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.collectives.terms import pow2_floor  # noqa: F401 (costmodel's)
from equarx_mpi.names import EXACT, between_nodes
from equarx_mpi.wire import formats

#: Relative L2 error of ONE quantization of standard-normal float32 values,
#: per wire and block size: each wire's own (formats.REGISTRY, its e1)
E1 = {name: w.e1 for name, w in formats.REGISTRY.items()}

#: Stochastic rounding's error over nearest's, per quantization: a value at
#: fraction f of a step rounds off by f or 1 - f with probabilities 1 - f
#: and f, variance f(1 - f) steps^2, which is 1/6 over uniform f against
#: nearest's 1/12 (measured 1.41x, tests/test_mpi_stochastic.py)
STOCHASTIC = math.sqrt(2)


def error(method, wire, block, P, nodes, rounding="nearest"):
    """Relative L2 error of ``method``'s Allreduce on standard-normal data
    (0 for the exact methods) with SUM's codes rounded by ``rounding``.
    Used for the halves too, as an upper bound."""
    if method in EXACT or P == 1:
        return 0.0
    sched = SCHEDULES.get(method)
    if sched is None:
        raise ValueError(f"no method {method!r}")
    if sched.nested:
        return error(between_nodes(wire), wire, block, nodes, nodes, rounding)
    e1 = E1[wire][block] * (STOCHASTIC if rounding == "stochastic" else 1.0)
    return e1 * math.sqrt(sched.variance(P))
