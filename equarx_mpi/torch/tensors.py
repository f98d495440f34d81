"""Tensors as the library sees them: numpy views of CPU tensors, the
reductions torch names and MPI's for them, and the local checks that turn a
bad argument into an error value (agree.py makes it every rank's error).

A tensor is handed to MPI or to QuantizedComm as a numpy view of its own
memory (``Tensor.numpy()`` shares it), never a copy, where it is contiguous;
a non-contiguous tensor, a view with gaps, or one with torch's lazy
conjugate/negative bit goes through a contiguous copy that is written back
afterwards (``stage``), as gloo does.  bfloat16, which numpy lacks, is viewed
through its int16 bits as ``ml_dtypes.bfloat16``, the type the library
reduces (in float32 on its exact path).  Data that is only moved (broadcast,
gathers, all-to-all, send) travels as bytes, so every dtype torch has moves.
"""
import numpy as np
import torch
from mpi4py import MPI
from torch.distributed import ReduceOp

from equarx_mpi.names import BFLOAT16

#: torch dtypes the reductions take, and numpy's type for each
REDUCIBLE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: BFLOAT16, torch.int8: np.int8, torch.uint8: np.uint8,
             torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
             torch.bool: np.bool_}
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_R = ReduceOp.RedOpType
#: torch's reduction -> (name in messages, MPI's op); AVG is a SUM divided by
#: the group's size afterwards (MPI has no AVG)
OPS = {_R.SUM: ("SUM", MPI.SUM), _R.AVG: ("AVG", MPI.SUM), _R.PRODUCT: ("PRODUCT", MPI.PROD),
       _R.MIN: ("MIN", MPI.MIN), _R.MAX: ("MAX", MPI.MAX), _R.BAND: ("BAND", MPI.BAND),
       _R.BOR: ("BOR", MPI.BOR), _R.BXOR: ("BXOR", MPI.BXOR)}
AVG = _R.AVG
_BITWISE = (_R.BAND, _R.BOR, _R.BXOR)
#: bool's reductions, as gloo does them: a sum or maximum is an OR, a
#: product or minimum an AND (MPI defines only logical ops on bool)
_LOGICAL = {_R.SUM: MPI.LOR, _R.MAX: MPI.LOR, _R.BOR: MPI.LOR, _R.MIN: MPI.LAND,
            _R.PRODUCT: MPI.LAND, _R.BAND: MPI.LAND, _R.BXOR: MPI.LXOR}
SUPPORTED_OPS = ", ".join(name for name, _ in OPS.values())


def mpi_op(op, dtype):
    """MPI's op for torch's reduction ``op`` of ``dtype`` tensors."""
    return _LOGICAL[op] if dtype == torch.bool else OPS[op][1]


def red_op(opts):
    """The RedOpType of an options object, a ReduceOp or a RedOpType (the
    forms torch passes a process group's methods)."""
    op = getattr(opts, "reduceOp", opts)
    return getattr(op, "op", op)


def check(what, tensors, out=False):
    """The error value of passing ``tensors`` to ``what``, or None: each
    must be a dense CPU tensor; ``out``: written to, so no two of its
    elements may share memory (an expand()ed view)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return TypeError(f"equarx: {what} takes torch tensors, not {type(t).__name__}")
        if t.device.type != "cpu":
            return TypeError(f"equarx: {what}: the equarx backend takes CPU tensors, got one on "
                             f"{t.device} (move it with .cpu() first)")
        if t.layout != torch.strided:
            return TypeError(f"equarx: {what}: only dense (strided) tensors, not {t.layout}")
        if out and torch._debug_has_internal_overlap(t) == 1:
            return ValueError(f"equarx: {what}: an output tensor has elements sharing memory "
                              f"(an expand()ed view?): pass one with its own memory")
    return None


def check_reduce(what, tensors, op, out=True):
    """check(), and that ``op`` reduces these tensors' dtype."""
    err = check(what, tensors, out)
    if err is not None or op is None:
        return err
    if op not in OPS:
        return ValueError(f"equarx: {what}: {op} is not supported ({SUPPORTED_OPS} are)")
    for t in tensors:
        if t.dtype not in REDUCIBLE and not t.is_complex():
            return TypeError(f"equarx: {what}: cannot reduce {t.dtype} tensors (float32, float64, "
                             f"float16, bfloat16, their complex types, the signed integers, "
                             f"uint8 and bool reduce)")
        if t.is_complex():
            if op not in (_R.SUM, AVG):
                return TypeError(f"equarx: {what}: complex tensors reduce with SUM and AVG "
                                 f"only, not {OPS[op][0]}")
            continue
        floating = t.dtype in _FLOATS
        if op == AVG and t.dtype == torch.bool:
            return TypeError(f"equarx: {what}: AVG of bool tensors")
        if op in _BITWISE and floating:
            return TypeError(f"equarx: {what}: {OPS[op][0]} needs integer tensors, not {t.dtype}")
    return None


def listed(x):
    """A tensor or a sequence of them, as a list."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def fields(tensors):
    """The agreed (name, value) pairs of a list of tensors: dtypes and sizes."""
    out = [("number of tensors", len(tensors))]
    for t in tensors:
        out += [("dtype", str(t.dtype)), ("element count", t.numel())]
    return out


def check_p2p(what, tensors, peer, size, tag, tag_ub):
    """The error value of a send or receive of ``tensors`` with rank
    ``peer`` (None: any) of a group of ``size``, or None."""
    err = check(what, tensors, out=what == "recv")
    if err is None and peer is not None and not 0 <= peer < size:
        err = ValueError(f"equarx: {what}: rank {peer} is not in this group of {size}")
    if err is None and not 0 <= tag <= tag_ub:
        err = ValueError(f"equarx: {what}: tag {tag} is outside MPI's 0..TAG_UB")
    if err is None and len(tensors) != 1:
        err = ValueError(f"equarx: {what} takes one tensor, not {len(tensors)}")
    return err


def same_kind(what, tensors, like):
    """The error value if some tensor's dtype or element count differs
    from ``like``'s (the input of a gather, say), else None."""
    for t in tensors:
        if t.dtype != like.dtype:
            return TypeError(f"equarx: {what}: tensors of {t.dtype} and {like.dtype} mixed")
        if t.numel() != like.numel():
            return ValueError(f"equarx: {what}: {t.numel()} elements where {like.numel()} "
                              f"were expected")
    return None


def contiguous(t):
    """t itself if MPI can read its memory as it is, else a contiguous copy."""
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t
    return t.resolve_conj().resolve_neg().contiguous()


class stage:
    """``with stage(t) as c:`` c is t, or a contiguous copy of t that is
    written back into t on leaving (``read=False``: not filled first)."""

    def __init__(self, t, read=True):
        self.t = t
        if t.is_contiguous() and not t.is_conj() and not t.is_neg():
            self.c = t
        elif read:
            self.c = t.resolve_conj().resolve_neg().contiguous()
        else:
            self.c = torch.empty(t.shape, dtype=t.dtype)

    def __enter__(self):
        return self.c

    def __exit__(self, exc_type, *rest):
        if exc_type is None and self.c is not self.t:
            with torch.no_grad():
                self.t.copy_(self.c)


def array(c):
    """The numpy view (1-d) of contiguous tensor c, in the library's type
    (a complex tensor: its real and imaginary parts, interleaved)."""
    if c.is_complex():
        c = torch.view_as_real(c)
    flat = c.detach().reshape(-1)
    if c.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(BFLOAT16)
    return flat.numpy()


def raw(c):
    """The bytes of contiguous tensor c, as a numpy uint8 view."""
    return c.detach().reshape(-1).view(torch.uint8).numpy()


def from_bytes(buf, like):
    """A tensor of like's dtype and shape over the uint8 array ``buf``."""
    if buf.size == 0:       # (torch cannot view an empty byte array as another type)
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.from_numpy(buf).view(like.dtype).reshape(like.shape)


# --- checks that depend on the group's size P ----------------------------------------
def bad_root(P, what, root):
    """The error value of a root that is not a rank of a group of P."""
    if 0 <= root < P:
        return None
    return ValueError(f"equarx: {what}: root {root} is not a rank of this group of {P}")


def per_rank(P, what, lists, mine, out):
    """The root's error, or None, for gather's output lists or scatter's
    input lists: one tensor per rank, each of the kind of ``mine``'s."""
    err = check(what, [t for lst in lists for t in lst], out=out)
    for lst, t in zip(lists, mine):
        err = err or (None if len(lst) == P else ValueError(
            f"equarx: {what}: {len(lst)} {'output' if out else 'input'} tensors, not the "
            f"group's {P}"))
        err = err or same_kind(what, lst, t)
    return err


def splits(P, t, sizes, name):
    """(rows per rank, error value) of all_to_all_single's split of t
    along dim 0 over P ranks."""
    if t.dim() == 0:
        return [0] * P, ValueError(f"equarx: all_to_all_single: a 0-d {name}")
    if not sizes:
        if t.shape[0] % P:
            return [0] * P, ValueError(f"equarx: all_to_all_single: the {name}'s "
                                       f"{t.shape[0]} rows do not split evenly over {P} ranks")
        return [t.shape[0] // P] * P, None
    sizes = [int(s) for s in sizes]
    if len(sizes) != P or sum(sizes) != t.shape[0] or min(sizes) < 0:
        return [0] * P, ValueError(f"equarx: all_to_all_single: {name} split sizes "
                                   f"{sizes} do not split {t.shape[0]} rows over {P} ranks")
    return sizes, None
