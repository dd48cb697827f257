"""The CPU feeder: gather threads fill recycled host buffers and convert there; batches are the Loader's output.

Each gather task (whole batches, :class:`~precompile.reader.feed.PassPlan`)
is planned against the shard files, gathered into buffers from a
:class:`~precompile.reader.feed.HostPool` (reused only once the consumer has
dropped every tensor made from them, so a batch that is kept stays intact),
split into its batches and finished (steps, conversion) in the gather thread.
A large task's rows are gathered by several threads (:class:`~precompile.reader.feed.RowSplitter`).
``plan.ahead`` tasks run ahead of the one being consumed.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Iterator, Sequence

import torch

from .direct import DirectReader
from .feed import Batch, Finisher, HostPool, PassPlan, RowSplitter, gather_pool


class CpuFeeder:
    """Batches gathered, converted and delivered on the CPU by ``num_threads`` threads (0: in the caller)."""

    def __init__(self, reader: DirectReader, fields: Sequence[str], finisher: Finisher, pool: HostPool,
                 num_threads: int):
        self.reader, self.fields, self.finisher, self.pool = reader, list(fields), finisher, pool
        self.num_threads = num_threads

    def gather(self, plan: PassPlan, k: int, split: RowSplitter | None = None) -> list[Batch]:
        """Task ``k`` of ``plan``: its rows gathered into host buffers (by ``split``'s threads), split into
        finished batches."""
        rows = plan.rows(k)
        arrs = {f: self.pool.get((rows.size, *self.reader.shapes[f]), self.reader.dtypes[f]) for f in self.fields}
        (split or RowSplitter(self.reader, self.fields, 1, torch.device("cpu"))).gather(rows, arrs)
        batch = {f: torch.from_numpy(a) for f, a in arrs.items()}
        batch.update(self.finisher.ragged_rows(rows))
        return self.finisher.finish_group(batch, plan.sizes(k), plan.epoch, plan.tasks[k][0])

    def feed(self, plan: PassPlan) -> Iterator[tuple[int, Batch]]:
        """``(batch number, batch)`` for every batch of ``plan``, in order; closing it stops the threads."""
        tasks = plan.tasks
        pool = gather_pool(self.num_threads, torch.device("cpu"))
        split = RowSplitter(self.reader, self.fields, self.num_threads, torch.device("cpu"))
        pending: deque[tuple[int, Future]] = deque()     # submitted tasks, in order
        nxt = 0

        def submit_until(limit: int) -> None:
            nonlocal nxt
            while nxt < min(limit, len(tasks)):
                pending.append((nxt, pool.submit(self.gather, plan, nxt, split)))
                nxt += 1

        try:
            submit_until(plan.ahead + 1)
            for k in range(len(tasks)):
                j, fut = pending.popleft()
                outs = fut.result()
                assert j == k
                submit_until(k + plan.ahead + 1)
                lo = tasks[k][0]
                for i, out in enumerate(outs):
                    yield lo + i, out
        finally:
            for _, f in pending:
                f.cancel()
            pool.shutdown(wait=True)
            split.close()

    def release(self) -> None:
        """Nothing to drop: host buffers go with the batches that use them."""
