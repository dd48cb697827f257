"""The CUDA feeder: gather threads fill a ring of pinned slots; copies, steps and conversion run on a side stream.

Task ``k`` of a pass fills slot ``k % plan.slots`` of the ring
(:class:`~precompile.reader.gpu.CudaRing`, made once per Loader on the first
pass: its slot count and size are fixed by the Loader's options). A gather
thread first waits for the slot's previous copy to leave host memory
(``wait_free``); the consumer's thread launches each gathered task (copy to
the device, then the seeded steps and conversion, all on the side stream) and
hands out its batches once the consumer's stream has waited on the launch's
event (``deliver``). The feeder keeps task ``k - slots`` launched before task
``k`` is gathered, so a slot is never refilled before its copy was launched.

``make_ring`` builds the ring (default :class:`~precompile.reader.gpu.CudaRing`);
a stand-in with the same methods drives this scheduling without a GPU.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

import torch

from . import gpu
from .direct import DirectReader
from .feed import Batch, Finisher, PassPlan, RowSplitter, gather_pool


class CudaFeeder:
    """Batches gathered into a pinned ring and copied, finished and delivered on ``device``.

    The ring holds ``plan.slots`` slots of ``plan.group * batch_size`` rows: both are fixed for a
    Loader (they follow from its batch size, fields and ``prefetch``), so one ring serves every pass."""

    def __init__(self, reader: DirectReader, fields: Sequence[str], finisher: Finisher, device: torch.device,
                 num_threads: int, batch_size: int, make_ring: Callable[..., Any] = gpu.CudaRing):
        self.reader, self.fields, self.finisher, self.batch_size = reader, list(fields), finisher, batch_size
        self.device, self.num_threads, self.make_ring = device, num_threads, make_ring
        self.ring: Any = None

    def gather(self, plan: PassPlan, k: int, slot: int, split: RowSplitter) -> tuple[int, Batch]:
        """Task ``k``'s rows into ``slot`` (by ``split``'s threads) once its last copy is done; returns the
        row count and the padded annotation fields (host tensors, outside the ring: their size varies)."""
        self.ring.wait_free(slot)
        rows = plan.rows(k)
        split.gather(rows, self.ring.host(slot, rows.size))
        return rows.size, self.finisher.ragged_rows(rows)

    def launch(self, plan: PassPlan, k: int, got: tuple[int, Batch]) -> tuple[list[Batch], Any]:
        """Copy task ``k``'s rows to the device and finish its batches there (side stream)."""
        lo, sizes = plan.tasks[k][0], plan.sizes(k)
        n, ragged = got
        return self.ring.launch(k % plan.slots, n,
                                lambda d: self.finisher.finish_group({**d, **ragged}, sizes, plan.epoch, lo))

    def feed(self, plan: PassPlan) -> Iterator[tuple[int, Batch]]:
        """``(batch number, batch)`` for every batch of ``plan``, in order; closing it stops the threads
        and waits for the side stream."""
        if self.ring is None:
            self.ring = self.make_ring(self.device, plan.slots, plan.group * self.batch_size,
                                       self.reader.shapes, self.reader.dtypes)
        ring, tasks = self.ring, plan.tasks
        pool = gather_pool(self.num_threads, self.device)
        split = RowSplitter(self.reader, self.fields, self.num_threads, self.device)
        pending: deque[tuple[int, Future]] = deque()     # submitted tasks, in order
        launched: deque[tuple[int, Any]] = deque()       # tasks copied/launched, in order
        nxt = 0

        def submit_until(limit: int) -> None:
            # task k refills slot k % slots; callers keep task k - slots already launched, so the
            # gather thread finds that launch's event and waits for its copy before overwriting the slot
            nonlocal nxt
            while nxt < min(limit, len(tasks)):
                pending.append((nxt, pool.submit(self.gather, plan, nxt, nxt % plan.slots, split)))
                nxt += 1

        def launch_next() -> None:
            k, fut = pending.popleft()
            launched.append((k, self.launch(plan, k, fut.result())))

        try:
            submit_until(plan.ahead + 1)
            for k in range(len(tasks)):
                if not launched:
                    launch_next()
                j, (outs, done) = launched.popleft()
                # keep the bus busy: launch the later tasks that are already gathered
                while pending and pending[0][1].done():
                    launch_next()
                assert j == k
                submit_until(k + plan.ahead + 1)
                lo = tasks[k][0]
                for i, out in enumerate(outs):
                    yield lo + i, ring.deliver(out, done)
        finally:
            for _, f in pending:
                f.cancel()
            pool.shutdown(wait=True)
            split.close()
            ring.synchronize()

    def release(self) -> None:
        """Drop the ring (pinned slots, stream, events); a later pass makes a new one."""
        self.ring = None
