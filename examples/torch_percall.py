"""Per-call cost of a small exact all_reduce through torch.distributed: the
"equarx" backend against gloo on the same ranks, interleaved.

    mpirun -n 2 python examples/torch_percall.py [--values 8] [--calls 2000] [--rounds 15] [--no-check]

Each round times ``--calls`` blocking ``dist.all_reduce`` calls of
``--values`` float32 on each group in turn (equarx first in even rounds,
gloo first in odd ones), after a barrier; rank 0 prints the median over
rounds of the time per call of each, and their ratio.  One BLAS/torch
thread per rank.  The call of "equarx" is exact here (a few bytes: MPI's
own collective, after the agreement of its arguments; ``--no-check``: also
a group with check=False, which skips the agreement).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import equarx_mpi.torch  # registers the backend


def per_call(x, group, calls):
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x, group=group)
    return (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=8, help="float32 values per call")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--no-check", action="store_true",
                    help="also time an 'equarx' group made with check=False (no agreement)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("equarx")
    gloo = dist.new_group(backend="gloo")
    x = torch.zeros(a.values)
    groups = {"equarx": dist.group.WORLD, "gloo": gloo}
    if a.no_check:
        groups["unchecked"] = dist.new_group(backend="equarx",
                                             pg_options=equarx_mpi.torch.Options(check=False))
    for g in groups.values():                       # warm up both
        per_call(x, g, a.calls // 10 + 1)
    times = {name: [] for name in groups}
    for r in range(a.rounds):
        for name in (list(groups) if r % 2 == 0 else list(groups)[::-1]):  # interleaved
            times[name].append(per_call(x, groups[name], a.calls))
    if dist.get_rank() == 0:
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"# all_reduce of {a.values} float32, {dist.get_world_size()} ranks, "
              f"{a.rounds} interleaved rounds of {a.calls} calls; medians [us per call]")
        for name, m in med.items():
            print(f"{name:8s} {m * 1e6:8.2f}   (rounds: {min(times[name]) * 1e6:.2f}-"
                  f"{max(times[name]) * 1e6:.2f})")
        for name in med:
            if name != "gloo":
                print(f"{name} / gloo: {med[name] / med['gloo']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
