"""Per-input build progress, gathered in the parent from wherever shard tasks run.

A shard task calls its *sink* once per input it finishes (built or failed): the
sink is a small picklable object, chosen by where the task runs:

- ``-j1``: a direct call in the parent;
- forked workers (:mod:`precompile.compiler.forkpool`): a message on the worker's own result pipe;
- loky workers: a ``multiprocessing.Manager`` queue that a parent thread drains (the manager process
  exits with the build, as the workers do);
- dask: the worker's ``log_event`` on a topic the parent's client subscribes to
  (works on any cluster, local or remote).

The parent tops each shard up to its input count when the shard's result arrives
(events still in flight for it are then ignored), so the bar always ends exact.
Shards skipped as up to date are the bar's ``initial`` count, which tqdm leaves
out of the rate: the rate is of inputs actually built.
"""
from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Optional


class Progress:
    """A tqdm bar fed per input by shard tasks; thread-safe."""

    def __init__(self, total: int, done: int, desc: str, shard_sizes: dict[int, int]):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="input", desc=desc, dynamic_ncols=True)
        self.sizes = shard_sizes
        self.counted: dict[int, int] = {}
        self.finished: set[int] = set()
        self.lock = threading.Lock()
        self._manager: Any = None
        self._queue: Any = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._client: Any = None
        self.topic = f"precompile-progress-{uuid.uuid4().hex}"

    def add(self, shard: int, n: int = 1) -> None:
        with self.lock:
            if shard in self.finished:
                return
            room = self.sizes.get(shard, 0) - self.counted.get(shard, 0)
            n = max(0, min(n, room))
            if n:
                self.counted[shard] = self.counted.get(shard, 0) + n
                self.bar.update(n)

    def shard_done(self, shard: int) -> None:
        """The shard's result arrived: count whatever of it was not reported yet."""
        self.add(shard, self.sizes.get(shard, 0))
        with self.lock:
            self.finished.add(shard)

    # -- sinks -------------------------------------------------------------------------------
    def local_sink(self) -> "LocalSink":
        return LocalSink(self)

    def queue_sink(self) -> "QueueSink":
        import multiprocessing

        if self._manager is None:
            from multiprocessing.managers import SyncManager

            self._manager = SyncManager(ctx=multiprocessing.get_context())
            self._manager.start(_manager_init, (os.getpid(),))   # as multiprocessing.Manager(), but ends with the build
            self._queue = self._manager.Queue()
            self._thread = threading.Thread(target=self._drain, name="precompile-progress", daemon=True)
            self._thread.start()
        return QueueSink(self._queue)

    def dask_sink(self, client: Any) -> "DaskSink":
        self._client = client
        client.subscribe_topic(self.topic, lambda ev: self.add(*ev[1]))
        return DaskSink(self.topic)

    def _drain(self) -> None:
        import queue

        while not self._stop.is_set():
            try:
                shard, n = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            except (EOFError, OSError, BrokenPipeError):  # the manager is gone
                return
            self.add(shard, n)

    def close(self) -> None:
        import queue

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            while True:  # events already queued (every put finished before its shard's result came back)
                try:
                    shard, n = self._queue.get_nowait()
                except (queue.Empty, EOFError, OSError):
                    break
                self.add(shard, n)
        if self._manager is not None:
            self._manager.shutdown()
        if self._client is not None:
            try:
                self._client.unsubscribe_topic(self.topic)
            except Exception:  # the client may be closed already
                pass
        self.bar.close()


def _manager_init(parent: int) -> None:
    """In the queue's manager process: exit when the build's process (``parent``) dies (nothing else would
    end it)."""
    from .forkpool import watch_parent

    watch_parent(parent)


class LocalSink:
    def __init__(self, progress: Progress):
        self.progress = progress

    def __call__(self, shard: int, n: int = 1) -> None:
        self.progress.add(shard, n)


class QueueSink:
    def __init__(self, queue: Any):
        self.queue = queue

    def __call__(self, shard: int, n: int = 1) -> None:
        try:
            self.queue.put((shard, n))
        except (EOFError, OSError, BrokenPipeError):  # the parent's bar is gone: progress is best effort
            pass


class DaskSink:
    def __init__(self, topic: str):
        self.topic = topic

    def __call__(self, shard: int, n: int = 1) -> None:
        try:
            from distributed import get_worker

            get_worker().log_event(self.topic, (shard, n))
        except (ImportError, ValueError):  # not on a dask worker
            pass
