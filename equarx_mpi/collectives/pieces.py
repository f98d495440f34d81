"""How a shard is cut into pieces, each its own message, for every
quantized schedule (ring.py, two_shot.py, and the cost model's count of
them): whole blocks per piece, the format's bytes then the error bound's
trailer (bound.TRAILER)."""
import sys

import numpy as np

from equarx_mpi.bounds.bound import TRAILER

#: Automatic pipelining across nodes: about this many input bytes per piece,
#: at most MAX_AUTO_CHUNKS pieces per shard.  On one node a shard goes as one
#: piece: the "transfer" is a memory copy by the same cores, nothing to hide
#: the kernels behind.  Measured, see docs/PERFORMANCE.md "Defaults".
PIECE_TARGET_BYTES = 256 << 10
MAX_AUTO_CHUNKS = 8


def chunks(opts, one_node, biggest_shard_bytes):
    """Pieces per shard: the ``chunks`` option, else one on one node and
    about PIECE_TARGET_BYTES each across nodes."""
    if opts["chunks"] is not None:
        return opts["chunks"]
    if one_node:
        return 1
    return max(1, min(MAX_AUTO_CHUNKS, biggest_shard_bytes // PIECE_TARGET_BYTES))


class Piece:
    """Elements [lo, hi) of the caller's array, and the workspace bytes
    (``buf``: the message, its trailer last), kernel views (``w``) and
    trailer (``t``, three float64) that carry them."""
    __slots__ = ("lo", "hi", "buf", "w", "t")

    def __init__(self, lo, hi, buf, w):
        self.lo, self.hi, self.buf, self.w = lo, hi, buf, w
        self.t = buf[buf.size - TRAILER:].view(np.float64)


def message_bytes(fmt, n):
    """Bytes of the message carrying n values: the format's, then the trailer."""
    return fmt.nbytes(n) + TRAILER


def blocks_per_message(fmt, block, max_piece_bytes):
    """The most whole blocks one message of at most max_piece_bytes holds
    (at least one: options.py checks that one block fits)."""
    return max(1, (max_piece_bytes - TRAILER) // fmt.nbytes(block))


def split_blocks(length, block, pieces):
    """[0, length) cut into at most ``pieces`` runs of whole blocks (the last
    may end in a short block), as (lo, hi) pairs; none for length 0."""
    nb = -(-length // block)
    c = max(1, min(pieces, nb))
    edges = [min(i * nb // c * block, length) for i in range(c + 1)]
    return [(edges[i], edges[i + 1]) for i in range(c) if edges[i + 1] > edges[i]]


def cut(fmt, shards, chunks, block, max_piece_bytes):
    """The global (lo, hi) of every piece of every shard ((offset, length)
    pairs): ``chunks`` pieces, more if a piece would exceed max_piece_bytes."""
    most = blocks_per_message(fmt, block, max_piece_bytes)
    cuts = []
    for off, length in shards:
        blocks = -(-length // block)
        want = max(chunks, -(-blocks // most))
        cuts.append([(off + lo, off + hi) for lo, hi in split_blocks(length, block, want)])
    return cuts


def runs(sizes, count, most):
    """Consecutive runs [a, b) of slots of these byte sizes: ``count`` of
    them balanced by number, split further where one would exceed ``most``
    bytes (one slot alone never does: pieces.cut keeps it under)."""
    n = len(sizes)
    g = max(1, min(count, n))
    out = []
    for k in range(g if n else 0):
        a, b = k * n // g, (k + 1) * n // g
        start, total = a, 0
        for j in range(a, b):
            if j > start and total + sizes[j] > most:
                out.append((start, j))
                start, total = j, 0
            total += sizes[j]
        out.append((start, b))
    return out


class Msg:
    """One message: consecutive slots ``slots`` ((atom id, Piece) pairs)
    whose bytes ``buf`` are contiguous in the workspace."""
    __slots__ = ("buf", "slots")

    def __init__(self, buf, slots):
        self.buf, self.slots = buf, slots


def block_ranges(p, blocks, B):
    """The global (lo, hi) of blocks ``blocks`` of piece p."""
    return [(p.lo + int(k) * B, min(p.lo + (int(k) + 1) * B, p.hi)) for k in blocks]


def waitall(requests):
    """MPI_Waitall.  mpi4py is imported here, when a schedule runs: the
    cost model and the policy read the schedules' declarations
    (terms.Schedule) without starting MPI."""
    from mpi4py import MPI
    MPI.Request.Waitall(requests)


def fail(comm, exc):
    """A schedule failed on this rank.  Peers are inside it waiting for our
    messages: a local exception here cannot be turned into a collective
    one, so end the job loudly."""
    sys.stderr.write(f"equarx_mpi: rank {comm.Get_rank()} failed inside a "
                     f"collective, aborting the job: {exc!r}\n")
    sys.stderr.flush()
    comm.Abort(1)
