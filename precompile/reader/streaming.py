"""Reading a build from a URL: shards mapped while batches need them, fetched ahead in the order a pass needs them.

A build opened from a URL (:mod:`precompile.formats.hdf5_url`) has its shards in the local cache
(:mod:`precompile.storage.shard_cache`), where they may be evicted whenever no process pins them. Two pieces sit on the
:class:`~precompile.reader.direct.DirectReader` over such a build:

- :class:`StreamingSlots`: the reader's slots (one per shard, in one reserved address range) mapped on the first
  batch that needs them, the shard pinned in the cache while mapped. Every plan (``reader.plan(rows)``) counts as a
  use of the slots it reads until its ``with`` block ends; a slot is unmapped (an anonymous ``PROT_NONE`` map over
  it) only when no gather uses it, and only then unpinned: a file is never evicted while mapped, so the cache
  limit counts every byte on disk. When the cache has no room for a shard a gather needs (or another process is
  downloading it), the reader first lets go of what no gather reads now: its unused slots and its window's
  prefetched shards (:meth:`ShardWindow.drop_idle`), before it waits for other processes.
- :class:`ShardWindow`: one Loader pass. The pass's gather tasks are known in advance (the
  :class:`~precompile.reader.feed.PassPlan`), so fetch threads (:data:`FETCH_THREADS`) fetch the shards of the
  tasks in flight and then of the next tasks, in first-use order, up to ``fetch_ahead`` bytes beyond them; a fetch
  never waits, and takes no room while a read anywhere on the node waits for room. Each
  time the consumer reaches a new task (a few numpy operations in its thread: no thread of its own to wake),
  prefetched shards that no task within reach needs are let go, and so are mapped slots, but for the most recently
  used that fit in what ``fetch_ahead`` leaves. The Loader checks at construction (and at the start of every pass)
  that the shards the tasks in flight read at once fit in ``cache_limit``; it cuts gather tasks to about one
  shard's rows (:meth:`ShardWindow.max_group`).

Nothing here changes which rows a batch holds: the same seed gives the same batches as the local build.
Imports neither torch nor h5py.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from ..errors import CacheError, FormatError, PrecompileError
from ..storage.files import human
from ..storage.shard_cache import Room, parse_size
from .rows import BatchPlan

log = logging.getLogger("precompile.reader")

#: shards fetched at once by a Loader's window
FETCH_THREADS = 4
# how the window's fetches ask for room: never waiting, and taking none while a read on the node waits for some
_PREFETCH = Room(prefetch=True)
#: fetch_ahead when none is given: this share of cache_limit, at most DEFAULT_AHEAD_MAX bytes
DEFAULT_AHEAD_SHARE = 0.25
DEFAULT_AHEAD_MAX = 1 << 30


class StreamingSlots:
    """The slots of a :class:`~precompile.reader.direct.DirectReader` whose shards come from a URL."""

    def __init__(self, reader: Any, shard_of_slot: Sequence[int]):
        self.reader, self.source, self.region = reader, reader.source, reader.region
        self.shard_of_slot = np.asarray(shard_of_slot, dtype=np.int64)
        self.slot_of_shard = np.full(len(reader.offsets) - 1, -1, dtype=np.int64)
        self.slot_of_shard[self.shard_of_slot] = np.arange(len(self.shard_of_slot))
        self.uses = np.zeros(len(self.shard_of_slot), dtype=np.int64)
        self.last = np.zeros(len(self.shard_of_slot), dtype=np.int64)   # when each slot was last planned
        self._tick = 0
        self.window: ShardWindow | None = None   # a Loader's, whose prefetched shards go first when room is short
        self._room = Room(let_go=self._let_go)
        # a reader dropped without close() lets go of its shards too (pins would outlive it otherwise)
        self._finalizer = weakref.finalize(reader, _unpin_mapped, self.source, self.region.mapped, self.shard_of_slot)

    @classmethod
    def for_reader(cls, reader: Any, order: Sequence[int]) -> "StreamingSlots":
        """Slots in ``order`` (the shards the region reserved); with ``map_shards="all"`` every one mapped now."""
        slots = cls(reader, order)
        if not reader.lazy and len(order):
            src = reader.source
            total = int(sum(src.size(s) for s in order))
            if total + src.index_bytes > src.cache.limit:
                raise CacheError(f"{src.url}: map_shards='all' holds every shard in the cache, {human(total)}, "
                                 f"{src.with_index()}; cache_limit is {human(src.cache.limit)}: raise cache_limit "
                                 f"above {human(total + src.index_bytes)}, or use map_shards='lazy'")
            slots.plan(np.asarray(reader.offsets[np.asarray(order)], dtype=np.int64)).__exit__()
        return slots

    def shard_rows(self) -> int:
        """Rows of the smallest shard that has any (a run of that many rows reads at most two shards)."""
        counts = np.diff(self.reader.offsets)
        return int(counts[counts > 0].min()) if counts.any() else 1

    def mapped_shards(self) -> np.ndarray:
        return self.shard_of_slot[self.region.mapped] if self.region is not None else np.zeros(0, np.int64)

    def plan(self, idx: np.ndarray) -> Any:
        """The reader's plan of rows ``idx`` with its shards mapped; they stay mapped until the plan's ``with``
        block ends (``plan.release``)."""
        r = self.reader
        slots = r._row_slot[idx]
        used = np.flatnonzero(np.bincount(slots[slots >= 0], minlength=len(self.uses)))
        with r._lock:
            r._check_open()
            self.uses[used] += 1
            self._tick += 1
            self.last[used] = self._tick
            missing = used[~self.region.mapped[used]]
        try:
            for i in missing.tolist():
                self._map(i)
        except BaseException:
            self._done(used)
            raise
        plan = BatchPlan(r, idx)
        plan.release = lambda: self._done(used)
        return plan

    def _done(self, used: np.ndarray) -> None:
        with self.reader._lock:
            self.uses[used] -= 1

    def _map(self, i: int) -> None:
        """Map slot ``i`` (its shard fetched and pinned first); no-op if another thread mapped it meanwhile."""
        r, s = self.reader, int(self.shard_of_slot[i])
        self.source.pin(s, room=self._room)
        with r._lock:
            if r._closed or self.region.mapped[i]:
                self.source.unpin(s)
                r._check_open()
                return
            try:
                self.region.map_slot(i)
            except BaseException:
                self.source.unpin(s)
                if not os.path.exists(self.region.paths[i]):   # pinned, so never evicted: removed by hand
                    raise FormatError(self.source.lost(s)) from None
                raise
            r._unmapped -= 1

    def _let_go(self) -> bool:
        """The cache has no room for a shard a gather needs: let go of the shards fetched ahead and of the mapped
        slots that no gather reads now (True when there were any)."""
        dropped = self.window is not None and self.window.drop_idle()
        return self.release_unused() or dropped

    def unmap(self, shards: Sequence[int]) -> bool:
        """Unmap (and unpin) the slots of ``shards`` that are mapped and that no gather uses now (True when there
        were any)."""
        r = self.reader
        gone = []
        with r._lock:
            if r._closed:
                return False
            for s in shards:
                i = int(self.slot_of_shard[int(s)])
                if i >= 0 and self.region.mapped[i] and not self.uses[i]:
                    self.region.unmap_slot(i)
                    r._unmapped += 1
                    gone.append(int(s))
        for s in gone:
            self.source.unpin(s)
        return bool(gone)

    def release_unused(self) -> bool:
        """Unmap every slot no gather uses now (True when there were any)."""
        return self.unmap(self.mapped_shards().tolist())

    def in_use(self, shards: Sequence[int]) -> np.ndarray:
        """Which of ``shards`` a gather reads now."""
        i = self.slot_of_shard[np.asarray(shards, dtype=np.int64)]
        with self.reader._lock:
            return (i >= 0) & (self.uses[np.maximum(i, 0)] > 0)

    def close(self) -> None:
        """Unpin every mapped shard (the reader drops the whole range; call with the reader's lock held)."""
        self._finalizer()
        self.region = None


def _unpin_mapped(source: Any, mapped: np.ndarray, shard_of_slot: np.ndarray) -> None:
    for s in shard_of_slot[mapped].tolist():
        source.unpin(int(s))
    mapped[:] = False


def default_fetch_ahead(limit: int) -> int:
    return int(min(DEFAULT_AHEAD_MAX, limit * DEFAULT_AHEAD_SHARE))


class ShardWindow:
    """One Loader's shards from a URL, pass by pass (see the module docstring).

    ``fetch_ahead``: bytes of shards fetched (and pinned) beyond the shards the gather tasks in flight need
    (``PassPlan.ahead`` tasks beyond the one consumed), which are fetched first; 0 fetches nothing in the
    background (each shard is fetched by the gather that first needs it)."""

    def __init__(self, slots: StreamingSlots, fetch_ahead: int):
        self.slots, self.source = slots, slots.source
        self.sizes = np.array([self.source.size(s) for s in range(len(slots.slot_of_shard))], dtype=np.int64)
        self.fetch_ahead = int(fetch_ahead)
        self.live = np.diff(slots.reader.offsets) > 0   # shards that hold rows
        slots.window = self
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._pins: set[int] = set()   # prefetched shards this pass holds (pinned, not yet mapped by a gather)

    # -- what a pass needs -------------------------------------------------------------------------
    def _pairs(self, plan: Any) -> tuple[np.ndarray, np.ndarray]:
        """The shards each task of ``plan`` reads, flat: (where each task's start in ``shard``, plus the end; shard)."""
        offsets = self.slots.reader.offsets
        per = [np.unique(np.searchsorted(offsets, plan.rows(k), side="right") - 1) for k in range(len(plan.tasks))]
        start = np.concatenate([[0], np.cumsum([len(p) for p in per])]).astype(np.int64)
        shard = np.concatenate(per).astype(np.int64) if per else np.zeros(0, np.int64)
        return start, shard

    def need(self, plan: Any, pairs: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, int]:
        """The most bytes of shards that the tasks in flight at once read, and the first task where it happens."""
        start, shard = pairs or self._pairs(plan)
        best, at = 0, 0
        for k in range(len(plan.tasks)):
            sel = np.unique(shard[start[k]:start[min(k + plan.ahead + 1, len(plan.tasks))]])
            b = int(self.sizes[sel].sum())
            if b > best:
                best, at = b, k
        return best, at

    advice = "raise cache_limit, or lower prefetch or batch_size"

    def max_group(self, batch_size: int) -> int:
        """Batches per gather task such that a task holds about one shard's rows (the median shard's)."""
        counts = np.diff(self.slots.reader.offsets)
        return max(1, int(np.median(counts[counts > 0])) // max(1, batch_size)) if counts.any() else 1

    def check(self, plan: Any, pairs: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """CacheError when the shards of the tasks in flight at once, beside the index the reader holds, cannot fit
        in the cache."""
        best, at = self.need(plan, pairs)
        src = self.source
        if best + src.index_bytes > src.cache.limit:
            raise CacheError(f"{src.url}: the batches in flight at once (from batch {plan.tasks[at][0]} of epoch "
                             f"{plan.epoch}: {plan.ahead + 1} gather task(s) of {plan.group} batch(es)) read "
                             f"{human(best)} of shards, {src.with_index()}: more than cache_limit "
                             f"{human(src.cache.limit)}: {self.advice}")

    # -- a pass --------------------------------------------------------------------------------------
    def start(self, plan: Any) -> None:
        """Follow ``plan`` (the pass about to run) until :meth:`stop`: fetch what its first tasks need."""
        self.stop()
        pairs = self._pairs(plan)
        self.check(plan, pairs)
        self._start, self._shard = pairs
        self._ahead, self._first, self._group = plan.ahead, plan.tasks[0][0] if plan.tasks else 0, plan.group
        self._pos, self._pins, self._busy, self._failed, self._queue = 0, set(), set(), set(), []
        self._settled = False
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="precompile-fetch")
        self._refresh(0)

    def advance(self, batch: int) -> None:
        """The consumer has batch ``batch`` of the pass: let go of what is out of reach, fetch what is in it
        (a few numpy operations in the consumer's thread, on the first batch of each task)."""
        if self._pool is None:
            return
        k = (batch - self._first) // self._group
        if k > self._pos and not self._settled:
            self._pos = k
            self._refresh(k)

    def stop(self) -> None:
        """End the pass: downloads in progress are abandoned, prefetched shards let go (mapped slots stay
        mapped until the next pass's window moves past them, or the Loader closes)."""
        if self._pool is None:
            return
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
        with self._lock:
            drop, self._pins, self._busy = list(self._pins), set(), set()
        for s in drop:
            self.source.unpin(s)

    def _refresh(self, pos: int) -> None:
        must, extra = self._wanted(pos)
        self._let_go(must, extra)
        mapped = set(self.slots.mapped_shards().tolist())
        with self._lock:   # (fetch_ahead=0: no fetching here at all; each gather fetches what it reads)
            self._queue = [s for s in [*must.tolist(), *extra.tolist()] if s not in mapped] if self.fetch_ahead else []
            # every shard within reach and none to fetch: nothing changes until the pass ends (a build that
            # fits within reach, as with a full shuffle), so the next tasks skip this
            self._settled = not self._queue and len(must) + len(extra) == int(np.count_nonzero(self.live))
            self._pump()

    def _wanted(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """Shards of the tasks in flight from task ``pos`` (in first-use order), and those of later tasks that
        fit in ``fetch_ahead`` bytes."""
        n = len(self._start) - 1
        if pos >= n:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        lo, mid = int(self._start[pos]), int(self._start[min(n, pos + self._ahead + 1)])
        must = _first_seen(self._shard[lo:mid])
        if not self.fetch_ahead:
            return must, np.zeros(0, np.int64)
        hi, extra = mid, np.zeros(0, np.int64)
        while hi < len(self._shard):   # widen the look-ahead until fetch_ahead bytes of new shards are in it
            hi = min(len(self._shard), hi + max(1024, hi - lo))
            seen = _first_seen(self._shard[mid:hi])
            extra = seen[~np.isin(seen, must)]
            if self.sizes[extra].sum() >= self.fetch_ahead:
                break
        keep = np.cumsum(self.sizes[extra]) <= self.fetch_ahead
        return must, extra[keep]

    def _let_go(self, must: np.ndarray, extra: np.ndarray) -> None:
        """Unpin prefetched shards that no task within reach needs; unmap the slots no task within reach needs,
        but the most recently used while they fit in what ``fetch_ahead`` leaves (a shard read again soon, as
        in the next epoch of a small build, is then not mapped again)."""
        keep = set(must.tolist()) | set(extra.tolist())
        room = self.fetch_ahead - int(self.sizes[extra].sum())
        slots = self.slots
        out = sorted((s for s in slots.mapped_shards().tolist() if s not in keep),
                     key=lambda s: -int(slots.last[slots.slot_of_shard[s]]))
        drop = []
        for s in out:
            if self.sizes[s] <= room:
                room -= int(self.sizes[s])
            else:
                drop.append(s)
        slots.unmap(drop)
        with self._lock:
            drop = [s for s in self._pins if s not in keep]
            self._pins.difference_update(drop)
        for s in drop:
            self.source.unpin(s)

    def drop_idle(self) -> bool:
        """A gather needs room: let go of the prefetched shards that no gather reads now (fetched again, if
        evicted meanwhile, when the consumer moves on); True when there were any."""
        with self._lock:
            pins = list(self._pins)
        idle = [s for s, used in zip(pins, self.slots.in_use(pins).tolist()) if not used]
        with self._lock:
            idle = [s for s in idle if s in self._pins]
            self._pins.difference_update(idle)
        for s in idle:
            self.source.unpin(s)
        return bool(idle)

    def _pump(self) -> None:
        """Start fetching the first queued shards not yet pinned (at most FETCH_THREADS at once; call with the
        lock held)."""
        while self._queue and len(self._busy) < FETCH_THREADS and not self._stop.is_set():
            s = self._queue.pop(0)
            if s not in self._pins and s not in self._busy and s not in self._failed:
                try:
                    self._pool.submit(self._fetch_one, s)
                except RuntimeError:   # the pass is ending (the pool shuts down)
                    return
                self._busy.add(s)

    def _fetch_one(self, s: int) -> None:
        """Fetch and pin shard ``s`` (without waiting for room or for another process's download, and taking no
        room while a read on the node waits for room: it is tried again when the consumer moves on), then the
        next queued one."""
        try:
            got = self.source.pin(s, wait=False, cancel=self._stop, room=_PREFETCH)
        except PrecompileError as e:   # the gather that needs it fetches it again and raises the error there
            log.debug("prefetch of shard %d failed: %s", s, e)
            got = None
            with self._lock:
                self._failed.add(s)
        except Exception as e:  # noqa: BLE001  (a cancelled download, a store error: the gather will say)
            log.debug("prefetch of shard %d stopped: %s", s, e)
            got = None
        with self._lock:
            self._busy.discard(s)
            if got is not None and self._stop.is_set():
                self.source.unpin(s)
            elif got is not None:
                self._pins.add(s)
                self._pump()


def _first_seen(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a`` in the order they first appear."""
    if not a.size:
        return a
    uniq, first = np.unique(a, return_index=True)
    return uniq[np.argsort(first, kind="stable")]


def loader_window(loader: Any, fetch_ahead: int | str | None) -> ShardWindow | None:
    """The window of a Loader that maps a URL's shards lazily (None otherwise), checked against the cache for
    the Loader's current epoch; ``fetch_ahead`` bytes (0: none; None: :func:`default_fetch_ahead`)."""
    slots = loader.reader.streaming
    if getattr(loader.ds, "remote", None) is None:
        if fetch_ahead is not None:
            raise ValueError("fetch_ahead applies to a build read from a URL (precompile.Loader('s3://...', ...))")
        return None
    if slots is None or not loader.reader.lazy or loader.in_memory in ("gpu", "pinned"):
        return None   # in memory already, or every shard mapped for the Loader's life
    limit = slots.source.cache.limit
    ahead = default_fetch_ahead(limit) if fetch_ahead is None else (
        0 if fetch_ahead == 0 else parse_size(fetch_ahead, "fetch_ahead"))
    w = ShardWindow(slots, ahead)
    if loader.mode == "full":
        w.advice = (f"a full shuffle reads from nearly every shard in every batch: set cache_limit above the build's "
                    f"size, {human(int(w.sizes.sum()) + slots.source.index_bytes)} with its index, or use "
                    f"shuffle='shard' (or 'block'), or in_memory=True")
    return w
