"""The "equarx" torch.distributed backend against gloo, side by side in one
job: every collective and dtype on the same inputs through both (exact
paths bit for bit where gloo adds in the same order, at 1 and 2 ranks,
else within the summation bound; quantized calls within their certified
bound, identical on every rank), async work and futures, subgroups,
send/recv, and bad input raising the same error on every rank.

    mpirun -n 2 python -m pytest --with-mpi -q tests/test_mpi_torch.py

Skips (at collection) only where torch is missing and EQUARX_MPI_TORCH is
not 1; run_tests.sh sets it, so there a missing torch fails.
"""

import numpy as np
import pytest
from mpi_helpers import WORLD, equarx_and_gloo, everywhere, raises_everywhere, torch_suite

torch, dist, eqt, R, P = torch_suite()
pytestmark = pytest.mark.mpi
Op = dist.ReduceOp
#: torch 2.10 renamed these (the old names warn); the group serves both
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


gloo = pytest.fixture(equarx_and_gloo, scope="module", autouse=True, name="gloo")


def inputs(dtype, n, op=Op.SUM, seed=0):
    """This rank's input: seeded by rank; products stay near 1, integers
    small enough for no sum or product to overflow at 4 ranks."""
    g = torch.Generator().manual_seed(1000 * seed + R)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        if op == Op.PRODUCT:
            x = 1 + 0.25 * x.clamp(-2, 2)
        return x.to(dtype)
    # int8 sums of 4 ranks stay under 128 (gloo and MPI disagree on overflow)
    lo, hi = (((-2, 3) if dtype != torch.uint8 else (0, 3)) if op == Op.PRODUCT else
              (0, 30 if dtype == torch.int8 else 50))
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def same_on_every_rank(t, comm=WORLD):
    mine = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return len(set(comm.allgather(mine))) == 1


def close_to(ours, ref, x, op, part=slice(None)):
    """ours equals gloo's ref bit for bit where both add in one order (at
    most 2 ranks; MIN, MAX, integers always), else within both sums'
    rounding: 2 P u sum|x_i| (a product: 2 P u |ref|); ``part``: the
    slice of x that ours reduces.  Collective."""
    scale = np.sum(np.abs(WORLD.allgather(x.double().numpy())), axis=0)[part]
    if P <= 2 or not ours.dtype.is_floating_point or op in (Op.MIN, Op.MAX):
        return torch.equal(ours, ref)
    u = torch.finfo(ours.dtype).eps
    if op == Op.PRODUCT:
        scale = ref.double().abs()
    else:
        scale = torch.from_numpy(scale) / (P if op == Op.AVG else 1)
    return bool(((ours.double() - ref.double()).abs() <= 2 * P * u * scale + 1e-300).all())


def test_init_from_mpi(gloo):
    everywhere(dist.get_backend() == "equarx", "the default group's backend")
    everywhere((dist.get_rank(), dist.get_world_size()) == (R, P), "rank and size from MPI")
    everywhere(isinstance(dist.group.WORLD, eqt.ProcessGroupEquarx), "the group's class")
    t = torch.tensor([float(R)])
    dist.all_reduce(t, group=gloo)          # gloo reached the others through the store
    everywhere(t.item() == P * (P - 1) / 2, "gloo beside it")


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool], ids=str)
@pytest.mark.parametrize("op", [Op.SUM, Op.AVG, Op.MIN, Op.MAX, Op.PRODUCT], ids=str)
def test_all_reduce_matches_gloo(gloo, dtype, op):
    if op == Op.AVG and dtype == torch.bool:
        raises_everywhere(TypeError, lambda: dist.all_reduce(inputs(dtype, 5), op=op),
                          match="AVG of bool")
        return
    x = inputs(dtype, 1000, op)
    ours, ref = x.clone(), x.clone()
    dist.all_reduce(ours, op=op)
    if op == Op.AVG and not dtype.is_floating_point:
        # gloo has no integer AVG: NCCL's, the sum divided toward zero
        dist.all_reduce(ref, group=gloo)
        ref = torch.div(ref, P, rounding_mode="trunc")
    else:
        dist.all_reduce(ref, op=op, group=gloo)
    everywhere(close_to(ours, ref, x, op), f"{op} of {dtype} against gloo")
    everywhere(same_on_every_rank(ours), "identical bits on every rank")
    everywhere(eqt.qcomm().last_call.wire is None, "a small call is exact")


def test_all_reduce_coalesced(gloo):
    xs = [inputs(torch.float32, n, seed=11) for n in (3, 1, 40)]
    ours, ref = [x.clone() for x in xs], [x.clone() for x in xs]
    dist.all_reduce_coalesced(ours)
    for t in ref:
        dist.all_reduce(t, group=gloo)
    everywhere(all(close_to(o, r, x, Op.SUM) for o, r, x in zip(ours, ref, xs)),
               "all_reduce_coalesced against gloo's all_reduce")


def test_bitwise_ops_match_gloo(gloo):
    for op in (Op.BAND, Op.BOR, Op.BXOR):
        x = torch.randint(0, 1 << 30, (64,), generator=torch.Generator().manual_seed(R))
        ours, ref = x.clone(), x.clone()
        dist.all_reduce(ours, op=op)
        dist.all_reduce(ref, op=op, group=gloo)
        everywhere(torch.equal(ours, ref), f"{op} against gloo")


@pytest.fixture(scope="module")
def int8(gloo):
    """An "equarx" group of every rank quantizing every float sum (ring, int8)."""
    return dist.new_group(backend="equarx", pg_options=eqt.Options(
        algorithm="ring", min_quantized_bytes=0))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", [Op.SUM, Op.AVG], ids=str)
def test_all_reduce_quantized_within_bound(int8, dtype, op):
    x = inputs(dtype, 3000, seed=2)
    exact = np.sum(WORLD.allgather(x.double().numpy()), axis=0) / (P if op == Op.AVG else 1)
    y = x.clone()
    dist.all_reduce(y, op=op, group=int8)
    qc = eqt.qcomm(int8)
    bound = qc.last_error_bound / (P if op == Op.AVG else 1)
    # the division of AVG rounds once more, and a 16-bit result stores rounded
    slack = 2 * torch.finfo(dtype).eps * np.abs(exact) if op == Op.AVG else 0
    err = np.abs(y.double().numpy() - exact)
    everywhere(qc.last_call.wire == ("int8" if P > 1 else None), "travelled int8")
    everywhere(bool(np.all(err <= bound + slack)), "within the certified bound")
    everywhere(same_on_every_rank(y), "identical bits on every rank")


def test_unchecked_group(gloo):
    """check=False: no agreement (MPI's own semantics and cost); an error
    every rank makes is still raised by each."""
    g = dist.new_group(backend="equarx", pg_options=eqt.Options(check=False))
    x = inputs(torch.float32, 100, seed=12)
    ours, ref = x.clone(), x.clone()
    dist.all_reduce(ours, group=g)
    dist.all_reduce(ref, group=gloo)
    everywhere(close_to(ours, ref, x, Op.SUM), "all_reduce without agreement")
    raises_everywhere(TypeError, lambda: dist.all_reduce(torch.empty(2, device="meta"), group=g),
                      match="CPU tensors")


def test_exact_context_and_options(int8, gloo):
    x = inputs(torch.float32, 3000, seed=3)
    y, ref = x.clone(), x.clone()
    with eqt.exact():
        dist.all_reduce(y, group=int8)
    dist.all_reduce(ref, group=gloo)
    everywhere(eqt.qcomm(int8).last_call.wire is None, "exact() keeps the call exact")
    everywhere(close_to(y, ref, x, Op.SUM), "and equal to gloo's")
    opts = eqt.options(int8)
    everywhere(opts["algorithm"] == "ring" and opts["min_quantized_bytes"] == 0, "options")
    raises_everywhere(ValueError, lambda: eqt.options(int8, wire="int1"))
    raises_everywhere(TypeError, lambda: eqt.qcomm(gloo), match="not an 'equarx'")


@pytest.mark.parametrize("quantized", [False, True], ids=["exact", "int8"])
def test_reduce_scatter_tensor(gloo, int8, quantized):
    m = 700
    x = inputs(torch.float32, m * P, seed=4)
    ours, ref = torch.empty(m), torch.empty(m)
    group = int8 if quantized else None
    REDUCE_SCATTER_SINGLE(ours, x, group=group)
    REDUCE_SCATTER_SINGLE(ref, x, group=gloo)
    qc = eqt.qcomm(group)
    if quantized:
        exact = np.sum(WORLD.allgather(x.double().numpy()), axis=0)[R * m:(R + 1) * m]
        ok = np.all(np.abs(ours.double().numpy() - exact) <= qc.last_error_bound)
        everywhere(ok and qc.last_call.wire == ("int8" if P > 1 else None), "quantized halves")
    else:
        everywhere(close_to(ours, ref, x, Op.SUM, slice(R * m, (R + 1) * m)),
                   "reduce_scatter_tensor against gloo")
    # the list form, and a non-contiguous output
    outs = torch.empty(m, 2)[:, 0]
    dist.reduce_scatter(outs, list(x.chunk(P)), group=group)
    everywhere(torch.equal(outs, ours), "reduce_scatter (lists) as the tensor form")


MOVED = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.complex64]


@pytest.mark.parametrize("dtype", MOVED, ids=str)
def test_data_movement_matches_gloo(gloo, dtype):
    x = (inputs(torch.float32, 6, seed=5) + 1j * R).to(dtype) if dtype.is_complex \
        else inputs(dtype, 6, seed=5)
    root = P - 1
    # gloo gathers no complex tensors: only ours, against what each rank sent
    for group in (None,) if dtype.is_complex else (None, gloo):
        got = {}
        b = x.clone()
        dist.broadcast(b, src=root, group=group)
        got["broadcast"] = b
        outs = [torch.zeros_like(x) for _ in range(P)]
        dist.all_gather(outs, x, group=group)
        got["all_gather"] = torch.stack(outs)
        o = torch.zeros(P * 6, dtype=dtype)
        ALL_GATHER_SINGLE(o, x, group=group)
        got["all_gather_into_tensor"] = o
        gl = [torch.zeros_like(x) for _ in range(P)] if R == root else None
        dist.gather(x, gl, dst=root, group=group)
        got["gather"] = torch.stack(gl) if R == root else x
        s = torch.zeros(3, dtype=dtype)
        dist.scatter(s, list(torch.cat([x] * P).chunk(2 * P))[:P] if R == root else None,
                     src=root, group=group)
        got["scatter"] = s
        a2a = [torch.zeros(2, dtype=dtype) for _ in range(P)]
        dist.all_to_all(a2a, [x[j % 3 * 2:][:2] for j in range(P)], group=group)
        got["all_to_all"] = torch.cat(a2a)
        rows = torch.arange(2 * P * 3).reshape(2 * P, 3).to(dtype)
        single = torch.zeros_like(rows)
        dist.all_to_all_single(single, rows, group=group)
        got["all_to_all_single"] = single
        if group is None:
            ours = got
    if dtype.is_complex:
        every = torch.stack(WORLD.allgather(x))
        got = {"broadcast": every[root], "all_gather": every,
               "all_gather_into_tensor": every.reshape(-1)}
    for name, t in got.items():
        everywhere(torch.equal(ours[name], t), f"{name} of {dtype} against gloo")
    # uneven pieces, which gloo's all_to_all refuses: rank j's piece for rank
    # r holds 1 + (r + j) % 3 elements of its input
    ins = [x[:1 + (R + j) % 3] for j in range(P)]
    outs = [torch.zeros(1 + (j + R) % 3, dtype=dtype) for j in range(P)]
    dist.all_to_all(outs, ins)
    every = WORLD.allgather(x)
    everywhere(all(torch.equal(o, every[j][:o.numel()]) for j, o in enumerate(outs)),
               "all_to_all of uneven pieces")


def test_reduce_matches_gloo(gloo):
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        x = inputs(dtype, 50, seed=6)
        ours, ref = x.clone(), x.clone()
        dist.reduce(ours, dst=0, group=None)
        dist.reduce(ref, dst=0, group=gloo)
        near = close_to(ours, ref, x, Op.SUM)
        everywhere(near if R == 0 else torch.equal(ours, x), f"reduce of {dtype}")


def test_views_noncontiguous_and_0d():
    """A view is reduced and written where it lies, the rest of its base
    untouched.  (gloo in torch 2.13 reads and writes a non-contiguous
    tensor as if contiguous from its first element: here the reference is
    computed from every rank's base instead.)"""
    base = inputs(torch.int32, 24, seed=7).reshape(4, 6).float()    # exact sums
    bases = WORLD.allgather(base)
    for make in (lambda b: b[:, 1], lambda b: b.t(), lambda b: b[1, 2], lambda b: b[:0],
                 lambda b: b[::2, ::3]):
        ours, want = base.clone(), base.clone()
        dist.all_reduce(make(ours))
        make(want).copy_(sum(make(b) for b in bases))
        everywhere(torch.equal(ours, want), "all_reduce of a view writes the view only")
        ours, want = base.clone(), base.clone()
        dist.broadcast(make(ours), src=0)
        make(want).copy_(make(bases[0]))
        everywhere(torch.equal(ours, want), "broadcast into a view")
    outs = [torch.zeros(6, 2)[:, 1] for _ in range(P)]
    dist.all_gather(outs, base[0])
    everywhere(all(torch.equal(o, b[0]) for o, b in zip(outs, bases)),
               "all_gather into non-contiguous outputs")
    g = torch.ones((), requires_grad=True)
    dist.all_reduce(g.detach())
    everywhere(g.item() == P, "a 0-d tensor that requires grad")


def test_async_work_and_futures(gloo):
    xs = [inputs(torch.float32, n, seed=8 + i) for i, n in enumerate((10, 1 << 16, 3))]
    ours = [x.clone() for x in xs]
    works = [dist.all_reduce(t, async_op=True) for t in ours]
    fut = works[1].get_future().then(lambda f: f.value()[0] * 2)
    # a callback that starts a call of the group, attached once the work has
    # completed on every rank: it runs here, at the same point everywhere
    works[0].wait()
    later = torch.ones(4)
    chained = works[0].get_future().then(
        lambda f: dist.all_reduce(later, async_op=True).get_future().wait()[0])
    # a blocking call after them runs after them (program order)
    b = ours[2]
    dist.broadcast(b, src=0)
    refs = [x.clone() for x in xs]
    for t in refs:
        dist.all_reduce(t, group=gloo)
    dist.broadcast(refs[2], src=0, group=gloo)
    for w in works:
        w.wait()
    everywhere(all(w.is_completed() and w.is_success() for w in works), "works complete")
    everywhere(all(close_to(o, r, x, Op.SUM) for o, r, x in zip(ours, refs, xs)),
               "async all_reduce results")
    everywhere(torch.equal(fut.wait(), ours[1] * 2), "a chained future")
    everywhere(torch.equal(chained.wait(), torch.full((4,), float(P))),
               "a call made by a callback")
    w = ALL_GATHER_SINGLE(torch.empty(P), torch.tensor([float(R)]), async_op=True)
    everywhere(torch.equal(w.get_future().wait()[0], torch.arange(P, dtype=torch.float32)),
               "an async gather's future holds its output")


def test_subgroups(gloo):
    members = list(range(0, P, 2))              # even ranks (rank 0 alone at 1-2 ranks)
    sub = dist.new_group(members, backend="equarx")
    sub_gloo = dist.new_group(members, backend="gloo")
    if R in members:
        x = inputs(torch.float32, 100, seed=9)
        ours, ref = x.clone(), x.clone()
        dist.all_reduce(ours, group=sub)
        dist.all_reduce(ref, group=sub_gloo)
        ok = torch.equal(ours, ref) and eqt.qcomm(sub).last_call.call == "Allreduce" \
            and dist.get_world_size(sub) == len(members)
    else:
        ok = sub == dist.GroupMember.NON_GROUP_MEMBER
    everywhere(ok, "a subgroup on the even ranks")


@pytest.mark.mpi(min_size=2)
def test_send_recv():
    nxt, prv = (R + 1) % P, (R - 1) % P
    x = torch.full((5,), float(R))
    got = torch.empty(10)[::2]                  # a non-contiguous receive
    reqs = [dist.isend(x, nxt), dist.irecv(got, prv)]
    reqs[1].get_future().wait()
    for r in reqs:
        r.wait()
    everywhere(torch.equal(got, torch.full((5,), float(prv))), "isend/irecv around a ring")
    y = torch.empty(3)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x[:3], nxt),
                                     dist.P2POp(dist.irecv, y, prv)]):
        w.wait()
    everywhere(torch.equal(y, torch.full((3,), float(prv))), "batch_isend_irecv")
    if R == 0:
        srcs, ok = set(), True
        for _ in range(P - 1):
            t = torch.empty(1)
            src = dist.recv(t, tag=7)
            srcs.add(src)
            ok = ok and t.item() == 10.0 * src
        ok = ok and srcs == set(range(1, P))
    else:
        dist.send(torch.tensor([10.0 * R]), 0, tag=7)
        ok = True
    everywhere(ok, "recv from any source names the sender")


def test_bad_input_same_error_everywhere(gloo):
    raises_everywhere(TypeError, lambda: dist.all_reduce(
        torch.empty(3, device="meta") if R == 0 else torch.ones(3)), match="CPU tensors")
    raises_everywhere(TypeError, lambda: dist.all_reduce(torch.ones(3), op=Op.BAND),
                      match="BAND needs integer")
    # (what torch checks before the backend, such as MAX of a complex tensor,
    # it raises on the ranks that passed it alone)
    if P > 1:
        raises_everywhere(ValueError, lambda: dist.all_reduce(torch.ones(10 + 2 * (R == 0))),
                          match="element count differs")
        raises_everywhere(TypeError, lambda: dist.broadcast(
            torch.ones(4, dtype=torch.float32 if R else torch.float64), src=0),
            match="dtype differs")
        raises_everywhere(ValueError, lambda: dist.all_reduce(torch.ones(3)) if R == 0
                          else dist.broadcast(torch.ones(3), src=0), match="different calls")
        raises_everywhere(ValueError, lambda: dist.all_to_all_single(
            torch.empty(P), torch.empty(P), [2, 0] + [1] * (P - 2) if R == 0 else [1] * P,
            [1] * P), match="expects [2, 0] elements from rank(s) [0, 1]")
    raises_everywhere(ValueError, lambda: ALL_GATHER_SINGLE(
        torch.empty(P + 1), torch.ones(1)), match="must hold")
    raises_everywhere(ValueError, lambda: dist.all_reduce(
        torch.zeros(1).expand(4)), match="sharing memory")
    x = torch.ones(8)
    dist.all_reduce(x)          # the group still works
    everywhere(torch.equal(x, torch.full((8,), float(P))), "a call after the errors")
