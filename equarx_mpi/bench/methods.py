"""The AllReduce methods by name: the one table of them.

``python -m equarx_mpi.bench -m NAME,...`` runs them, ``python -m
equarx_mpi.tune check`` maps a benchmark's columns to the cost model's
methods with it, and the examples (examples/methods.py) take their
options from it.  Each name maps to what it runs, in words, and the
QuantizedComm options (None: mpi4py's own exact ``comm.Allreduce``;
``wrapped``: the options of ``equarx_mpi.wrap(comm)`` instead).  A
QuantizedComm is built only for the methods a run asks for, so a line may
name options this version does not have yet.  A leaf: imports nothing.

The words state the library's defaults as numbers (tests/test_tools.py
checks them against the code): the lossy margin (call/options.py
DEFAULTS), the wires' own blocks
(formats.default_block) and the pieces of a shard
(collectives/pieces.py).
"""
from typing import NamedTuple, Optional


class Method(NamedTuple):
    about: str              # what runs, in words (the --help and the run's header)
    options: Optional[dict]  # QuantizedComm options; None: mpi4py's comm.Allreduce
    wrapped: bool = False   # through equarx_mpi.wrap(comm, **options), the drop-in


#: every size: no floor below which the library takes exact MPI
EVERY = dict(min_quantized_bytes=0)
RING = dict(algorithm="ring", **EVERY)

METHODS = {
    "mpi": Method("mpi4py's comm.Allreduce, exact (16-bit types: MPI sums float32 copies)",
                  None),
    "mpi-lib": Method("algorithm='mpi': MPI's Allreduce through the library (its argument "
                      "agreement and error bound)", dict(algorithm="mpi")),
    "wrap": Method("equarx_mpi.wrap(comm).Allreduce with the defaults, the drop-in: "
                   "algorithm='auto' without the shared window, so exact MPI (its own "
                   "bits) unless a quantized method is predicted lossy_margin times "
                   "faster", {}, wrapped=True),
    "bf16": Method("ring, bfloat16 on the wire (uncompressed 16 bits), at every size",
                   dict(RING, wire="bf16")),
    "fp32": Method("ring, float32 on the wire (uncompressed), at every size",
                   dict(RING, wire="fp32")),
    "int8": Method("int8 ring as algorithm='ring' runs it by default: exact MPI where the "
                   "cost model does not predict it 25% faster (lossy_margin)",
                   dict(wire="int8", algorithm="ring")),
    "int8-c1": Method("int8 ring at every size, chunks=1: one piece per shard (on one node "
                      "that is the default, so the same as int8-raw)",
                      dict(RING, wire="int8", chunks=1)),
    "int8-raw": Method("int8 ring at every size (never exact MPI)", dict(RING, wire="int8")),
    "int8-2shot": Method("int8 two-shot at every size: each shard to its owner, reduced "
                         "there at full precision, then all-gathered",
                         dict(EVERY, wire="int8", algorithm="two_shot")),
    "rabenseifner": Method("int8 recursive halving / doubling (Rabenseifner) at every size: "
                           "2 log2 P steps, each partial sum quantized once by its sender",
                           dict(EVERY, wire="int8", algorithm="rabenseifner")),
    "int4-rab": Method("int4 recursive halving / doubling at every size, block 64 (int4's "
                       "own, whatever --block says)",
                       dict(EVERY, wire="int4", block_size=64, algorithm="rabenseifner")),
    "int8-hier": Method("int8 hierarchical at every size: exact in each node through a "
                        "shared window, two-shot between nodes; on one node (or nodes of "
                        "unequal size) the int8 ring",
                        dict(EVERY, wire="int8", algorithm="hierarchical")),
    "shm": Method("algorithm='shm': exact sum through a shared window on one node; across "
                  "nodes MPI's", dict(algorithm="shm")),
    "int8-nocheck": Method("as int8 (the same floor), without the per-call argument "
                           "agreement (check=False)",
                           dict(wire="int8", algorithm="ring", check=False)),
    "int4": Method("int4 ring at every size, block 64 (int4's own, whatever --block says)",
                   dict(RING, wire="int4", block_size=64)),
    "int4-rot": Method("int4 ring at every size, block 64, rotated (rotate=True: a "
                       "randomized Hadamard rotation per block before quantizing)",
                       dict(RING, wire="int4", block_size=64, rotate=True)),
    "int8-rot": Method("int8 ring at every size, rotated (rotate=True)",
                       dict(RING, wire="int8", rotate=True)),
    "int8-rot-meas": Method("int8 ring at every size, rotated, measured_bounds=True (each "
                            "quantization's error rotated back and bounded)",
                            dict(RING, wire="int8", rotate=True, measured_bounds=True)),
    "int8-meas": Method("int8 ring at every size, measured_bounds=True",
                        dict(RING, wire="int8", measured_bounds=True)),
    "int4-rot-2s": Method("int4 two-shot at every size, block 64, rotated (rotate=True)",
                             dict(EVERY, wire="int4", block_size=64, rotate=True,
                                  algorithm="two_shot")),
    "int5-rot": Method("int5 two-shot at every size, block 64, rotated (rotate=True)",
                       dict(EVERY, wire="int5", block_size=64, rotate=True, algorithm="two_shot")),
    "int6-rot": Method("int6 two-shot at every size, block 64, rotated (rotate=True)",
                       dict(EVERY, wire="int6", block_size=64, rotate=True, algorithm="two_shot")),
    "int3": Method("int3 two-shot at every size, block 64 (its own, whatever --block says)",
                   dict(EVERY, wire="int3", block_size=64, algorithm="two_shot")),
    "int2": Method("int2 (ternary) two-shot at every size, block 64 (its own, whatever "
                   "--block says)", dict(EVERY, wire="int2", block_size=64,
                                         algorithm="two_shot")),
    "fp8": Method("fp8 (e4m3) ring at every size", dict(RING, wire="fp8")),
    "int8-aff": Method("int8-affine ring at every size (codes between each block's minimum "
                       "and maximum)", dict(RING, wire="int8-affine")),
    "int4-aff": Method("int4-affine ring at every size, block 128 (its own, whatever --block "
                       "says)", dict(RING, wire="int4-affine", block_size=128)),
    "auto": Method("algorithm='auto' (the library default): per call the cost model's "
                   "fastest of MPI, shm (one node), the int8 ring, two-shot and "
                   "hierarchical (nodes of several ranks each); lossy only if "
                   "predicted 25% faster than exact (lossy_margin)", dict(algorithm="auto")),
    "auto-exact": Method("algorithm='auto', accuracy='exact': the faster of MPI and shm "
                         "(one node) as the cost model predicts",
                         dict(algorithm="auto", accuracy="exact")),
}
DEFAULT_METHODS = "mpi,bf16,fp32,int8,int8-c1"
#: said once under the table: how the quantized schedules cut a shard
PIECES = ("The rings and two-shot send each shard as one piece on one node, and across "
          "nodes in pieces of about 256 KiB (at most 8 per shard) that pipeline.")


def parse_methods(text):
    """The names in a comma-separated ``text``, or ValueError naming the
    unknown ones."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return names
