"""equarx_mpi.wrap as a communicator: the same handle and class, the
communicators made from it, its requests after free(), a wrapped
constant's free(), pickling and handles (mpi4py's object model).

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_wrap_comm.py
"""
import pickle

import numpy as np
from mpi4py import MPI
from mpi_helpers import WORLD, everywhere, raises_everywhere
from test_mpi_wrap import RANK, P, bits, data, mpi, mpi2

import equarx_mpi

# --- it is the communicator -------------------------------------------------------

@mpi
def test_is_the_same_communicator(w):
    ok = (isinstance(w, MPI.Intracomm) and w == WORLD and WORLD.Compare(w) == MPI.IDENT
          and w.Get_rank() == RANK and w.size == P)
    d, s = w.Dup(), w.Split(RANK % 2, RANK)
    ok &= type(d) is type(w) and type(s) is type(w) and d.Compare(w) == MPI.CONGRUENT
    x = data()
    d.Allreduce(x, out := np.empty_like(x))
    ok &= d.last_call is not None and w.Split(MPI.UNDEFINED) == MPI.COMM_NULL
    s.Free()
    d.Free()
    cart = equarx_mpi.wrap(WORLD.Create_cart([P]))
    ok &= isinstance(cart, MPI.Cartcomm) and cart.Get_coords(RANK) == [RANK]
    cart.Free()
    everywhere(ok and bits(out) == bits(w.allreduce(x)), "wrapped communicators")


@mpi
def test_topologies_made_from_it_are_wrapped(w):
    from equarx_mpi.wrapping import _Wrapped
    x = data()
    ref = w.allreduce(x)
    left, right = (RANK - 1) % P, (RANK + 1) % P
    cart = w.Create_cart([P], periods=[True])
    idup, req = w.Idup_with_info(MPI.INFO_NULL)
    req.Wait()
    made = {"cart": (cart, MPI.Cartcomm), "sub": (cart.Sub([True]), MPI.Cartcomm),
            "graph": (w.Create_graph(list(range(1, P + 1)), [(i + 1) % P for i in range(P)]),
                      MPI.Graphcomm),
            "adjacent": (w.Create_dist_graph_adjacent([left], [right]), MPI.Distgraphcomm),
            "dist": (w.Create_dist_graph([RANK], [1], [right]), MPI.Distgraphcomm),
            "idup": (idup, MPI.Intracomm)}
    ok = {}
    for name, (c, cls) in made.items():
        ok[name] = (isinstance(c, _Wrapped) and isinstance(c, cls)
                    and bits(c.allreduce(x)) == bits(ref)
                    and c.last_call.method == w.last_call.method)
    ok["topology"] = (cart.Get_coords(RANK) == [RANK] and cart.Shift(0, 1) == (left, right)
                      and made["sub"][0].Get_topo() == cart.Get_topo()
                      and cart.neighbor_allgather(RANK) == [left, right]
                      and made["adjacent"][0].neighbor_allgather(RANK) == [left])
    for c, _ in made.values():
        c.Free()
    everywhere(all(ok.values()), f"communicators made from a wrapped one: {ok}")


@mpi
def test_persistent_requests_after_free(w):
    x = data()
    out = np.empty_like(x)
    d = w.Dup()
    p = d.Allreduce_init(x, out)        # quantized: the library's request
    m = d.Allreduce_init(x, np.empty_like(x), MPI.MAX)      # MPI's own
    kinds = (P == 1 or not isinstance(p, MPI.Prequest)) and isinstance(m, MPI.Prequest)
    for r in (p, m):
        r.Start()
        r.Wait()
    d.Free()
    raises_everywhere(ValueError, p.Start, "has been freed")
    raises_everywhere(ValueError, m.Start, "has been freed")    # (Open MPI would crash)
    p.Free()
    m.Free()
    v = equarx_mpi.wrap(WORLD, min_quantized_bytes=0)
    p = v.Allreduce_init(x, out)
    v.free()
    raises_everywhere(ValueError, p.Start, "has been freed")
    p.Free()
    everywhere(kinds, "both kinds of persistent request")


@mpi2
def test_other_calls_match_plain_peers(w):
    # odd ranks use the plain communicator: the wrapped one is the same handle
    c = WORLD if RANK % 2 else w
    buf = np.arange(10.0) if RANK == 0 else np.zeros(10)
    c.Bcast(buf, root=0)
    right, left = (RANK + 1) % P, (RANK - 1) % P
    got = np.empty(4, np.int64)
    MPI.Request.Waitall([c.Isend(np.full(4, RANK), right, tag=3),
                         c.Irecv(got, left, tag=3)])
    gathered = np.empty(P, np.float32)
    c.Allgather(np.float32(RANK) * np.ones(1, np.float32), gathered)     # delegated
    names = c.allgather(RANK)
    everywhere((buf == np.arange(10.0)).all() and (got == left).all()
               and (gathered == np.arange(P)).all() and names == list(range(P)),
               "wrapped and plain communicators talk to each other")


@mpi
def test_free_of_a_wrapped_constant_is_safe():
    # mpi4py's free() leaves MPI.COMM_WORLD be; wrap(MPI.COMM_WORLD) alike
    v = equarx_mpi.wrap(WORLD, min_quantized_bytes=0)
    x = data()
    v.Allreduce(x, np.empty_like(x))
    for _ in range(3):
        v.free()
    ok = {"kept": bool(v) and v == WORLD, "works": bits(v.allreduce(x)) == bits(v.allreduce(x))}
    ok["stats go on"] = v.stats.calls == 3 and v.last_call is not None
    clone = type(v)(v)              # as MPI.Intracomm(MPI.COMM_WORLD): freed to null
    ok["clone keeps options"] = clone._eq_opts == v._eq_opts
    clone.free()
    dup = v.Dup()
    dup.free()
    ok["others freed"] = not clone and not dup and bool(v)
    v.free()
    everywhere(all(ok.values()), f"free() of a wrapped COMM_WORLD: {ok}")


@mpi
def test_pickled_by_name_as_mpi4py_does(monkeypatch):
    v = equarx_mpi.wrap(WORLD, min_quantized_bytes=0)
    back = pickle.loads(pickle.dumps(v))        # a wrapped COMM_WORLD, same options
    ok = {"new": type(back) is type(v) and back == WORLD and back._eq_opts == v._eq_opts}
    monkeypatch.setattr(MPI, "COMM_WORLD", v)   # a code that replaced it: itself
    ok["itself"] = pickle.loads(pickle.dumps(v)) is v
    monkeypatch.undo()
    d = v.Dup()
    try:
        pickle.dumps(d)
        ok["dup refused"] = False
    except ValueError as e:     # as mpi4py: only predefined handles travel
        ok["dup refused"] = "cannot serialize" in str(e)
    ok["class"] = pickle.loads(pickle.dumps(type(v))) is type(v)
    d.Free()
    back.free()
    v.free()
    everywhere(all(ok.values()), f"pickling wrapped communicators: {ok}")


@mpi
def test_made_from_a_handle_of_the_class_asked(w):
    d = w.Dup()
    cart = w.Create_cart([P])
    ok = {}
    for name, c in (("world", w), ("dup", d), ("cart", cart)):
        made = (type(c).fromhandle(c.handle), type(c).f2py(c.py2f()), type(c).fromint(c.toint()))
        ok[name] = all(type(m) is type(c) and m == c for m in made)
    ok["null"] = type(w).fromhandle(MPI.COMM_NULL.handle) == MPI.COMM_NULL
    ok["plain"] = type(MPI.Intracomm.fromhandle(w.handle)) is MPI.Intracomm
    cart.Free()
    d.Free()
    everywhere(all(ok.values()), f"fromhandle/f2py/fromint: {ok}")
