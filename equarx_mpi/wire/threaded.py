"""A wire format whose kernels run over T threads inside one rank (option
``threads``): each piece is cut at block boundaries into up to T parts,
one per thread, each run by the same kernel on its own copy of the format
(own scratch buffers).

Every kernel works block by block and stochastic rounding is keyed by a
value's index in the message (streams.py), so the bytes and results are
the same whatever T: the threads only share the work.  The kernels release
the GIL (kernels/common.py CACHE: nogil), so the parts really run at once.
A part is at least MIN_PART values: below that, handing it to a thread
costs more than it saves.  The error-bounded mode's "mixed" wire (pieces
of varying length) and the uncompressed wires' many-input reduction run on
one thread.
"""
import threading

import numpy as np

#: the fewest values a thread gets (4 MiB of float32): below, a handoff costs
#: more than it saves (docs/PERFORMANCE.md "Threads inside a rank")
MIN_PART = 1 << 20


class _Worker:
    """One thread that runs a job when told: a pair of locks, about 5 us a
    round trip here, where concurrent.futures' pool took 84 us."""

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = self._result = None
        threading.Thread(target=self._loop, daemon=True, name="equarx_mpi-kernels").start()

    def _loop(self):
        while True:
            self._go.acquire()
            try:
                self._result = True, self._job()
            except BaseException as exc:      # handed to the caller by wait()
                self._result = False, exc
            self._job = None
            self._done.release()

    def start(self, job):
        self._job = job
        self._go.release()

    def wait(self):
        self._done.acquire()
        ok, value = self._result
        self._result = None
        if not ok:
            raise value
        return value


class Threaded:
    """The format ``make()`` makes, its kernels run over ``threads`` threads.
    Everything but the kernels (views, sizes, bounds) is the first copy's."""

    def __init__(self, make, threads, min_part=None):
        if threads < 2:
            raise ValueError(f"Threaded: {threads} threads (one needs no wrapper)")
        self._fmts = [make() for _ in range(threads)]
        self._fmt = self._fmts[0]
        self.threads = threads
        self._min = MIN_PART if min_part is None else min_part
        self._workers = None          # started by the first call that is cut
        self._skipped = np.empty(0, np.int64)

    def __getattr__(self, name):
        return getattr(self._fmt, name)

    def begin_call(self, seed, rank, own, own_offset):
        for f in self._fmts:
            f.begin_call(seed, rank, own, own_offset)

    def _cuts(self, n):
        """[(lo, hi)] block-aligned parts of an n-value piece."""
        B = self._fmt.block
        nb = -(-n // B)
        T = min(self.threads, nb, n // self._min)
        return [(nb * i // T * B, min(nb * (i + 1) // T * B, n)) for i in range(T)]

    def _run(self, n, job):
        """job(format copy, lo, hi) on every part; their results in order."""
        cuts = self._cuts(n)         # two or more: _whole keeps the rest on one thread
        if self._workers is None:
            self._workers = [_Worker() for _ in range(self.threads - 1)]
        busy = list(zip(self._workers, self._fmts[1:], cuts[1:]))
        for w, f, (lo, hi) in busy:
            w.start(lambda f=f, lo=lo, hi=hi: job(f, lo, hi))
        try:
            first = job(self._fmt, *cuts[0])
        finally:
            # every part ends before the buffers are reused, even on error
            rest, errors = [], []
            for w, _, _ in busy:
                try:
                    rest.append(w.wait())
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
        return [first] + rest, cuts

    def _merged(self, skips, cuts):
        """The parts' skipped block indices, as indices of the piece."""
        total = sum(s.size for s in skips)
        if self._skipped.size < total:
            self._skipped = np.empty(max(total, 64), np.int64)
        out, at, B = self._skipped, 0, self._fmt.block
        for s, (lo, _) in zip(skips, cuts):
            out[at:at + s.size] = s + lo // B
            at += s.size
        return out[:total]

    def _whole(self, n):
        """Whether an n-value piece stays on one thread (no cutting, no
        wrapper cost)."""
        return n < 2 * self._min or self._fmt.block * 2 > n

    def encode(self, src, w, rmode, at=None):
        if self._whole(src.size):
            return self._fmt.encode(src, w, rmode, at)
        at = src if at is None else at
        part = self._fmt.part
        self._run(src.size, lambda f, lo, hi: f.encode(src[lo:hi], part(w, lo, hi), rmode,
                                                       at[lo:hi]))

    def decode(self, w, out):
        if self._whole(out.size):
            return self._fmt.decode(w, out)
        part = self._fmt.part
        return self._merged(*self._run(out.size, lambda f, lo, hi: f.decode(
            part(w, lo, hi), out[lo:hi])))

    def decode_reduce(self, own, w, out, op):
        if self._whole(out.size):
            return self._fmt.decode_reduce(own, w, out, op)
        part = self._fmt.part
        return self._merged(*self._run(out.size, lambda f, lo, hi: f.decode_reduce(
            own[lo:hi], part(w, lo, hi), out[lo:hi], op)))

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        if self._whole(own.size):
            return self._fmt.decode_reduce_encode(own, wi, wo, op, rmode, at)
        at = own if at is None else at
        part = self._fmt.part
        self._run(own.size, lambda f, lo, hi: f.decode_reduce_encode(
            own[lo:hi], part(wi, lo, hi), part(wo, lo, hi), op, rmode, at[lo:hi]))

    def decode_reduce_many(self, own, pos, ws, out, op):
        if self._whole(own.size) or self._fmt.part_stack(ws, 0, 0) is None:
            return self._fmt.decode_reduce_many(own, pos, ws, out, op)
        stack = self._fmt.part_stack
        return self._merged(*self._run(out.size, lambda f, lo, hi: f.decode_reduce_many(
            own[lo:hi], pos, stack(ws, lo, hi), out[lo:hi], op)))

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        if self._whole(own.size) or self._fmt.part_stack(ws, 0, 0) is None:
            self._fmt.decode_reduce_encode_many(own, pos, ws, wo, op, rmode)
            return
        stack, part = self._fmt.part_stack, self._fmt.part
        self._run(own.size, lambda f, lo, hi: f.decode_reduce_encode_many(
            own[lo:hi], pos, stack(ws, lo, hi), part(wo, lo, hi), op, rmode))
