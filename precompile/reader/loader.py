"""The Loader: batches straight from a build's bytes to the training device.

::

    loader = precompile.Loader("build/images.h5", batch_size=256, shuffle="block", device="cuda",
                               dtype="float16", mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225],
                               gpu_steps=[{"random_flip": {}}, {"random_crop": {"size": 56, "padding": 4}}])
    for epoch in range(10):
        loader.set_epoch(epoch)
        for batch in loader:            # {"image": (256, 56, 56, 3) float16 on cuda, "label": (256,) int64}
            ...
    print(loader.stats.summary())       # how much of each step was spent waiting for data

Pipeline: the sampler gives this rank's order for ``(seed, epoch)``; gather
threads (``num_threads``) fill batches from the memory-mapped shard files
(:mod:`precompile.reader.direct`), ``prefetch`` batches ahead. On CUDA they
fill a ring of pinned buffers allocated once; the copies to the device, the
float conversion/normalisation and the seeded batch steps run on a side
stream (:mod:`precompile.reader.gpu`) while the current batch trains. On CPU
the threads also convert, and each batch owns fresh tensors (safe to keep).
The same seed gives the same batches on both devices.

The Loader measures the time the training loop spends blocked in
``next(loader)``: ``loader.stats`` (per batch and summed over the current or
last pass, and its share of wall time; a new pass starts from zero).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch

from ..errors import FormatError
from . import gpu
from .copies import CopySchedule
from .direct import DirectReader
from .sampler import epoch_order, normalize_mode, rank_share, split_batches

CONVERT_KINDS = ("image", "video")
# A gather task covers about GROUP_BYTES of stored rows (whole batches, at least one, at most
# MAX_GROUP): small batches are gathered, converted and split together, so the Python work per
# batch (and, with a gather thread, the GIL hand-overs with the training thread) shrinks.
# Measured on MNIST-sized batches (64 x 792 B) while training on 2 cores, epoch time against a
# pure-compute bound: 256 KiB 1.21-1.24x, 1 MiB 1.13x, 32 batches 1.02-1.05x, 64 batches 0.97-1.09x.
GROUP_BYTES = 4 << 20
MAX_GROUP = 64


@dataclass
class LoaderStats:
    """Time the consumer spent waiting for data in one pass: per batch (``waits``) and summed.

    The Loader resets it when a pass starts, so after a pass it describes that pass only.
    """

    batches: int = 0
    wait_s: float = 0.0
    elapsed_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    _t0: float | None = None

    @property
    def wait_share(self) -> float:
        """Fraction of wall time (first request to last delivery) spent waiting for batches."""
        return self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_wait_ms(self) -> float:
        return 1e3 * self.wait_s / self.batches if self.batches else 0.0

    def reset(self) -> None:
        self.batches, self.wait_s, self.elapsed_s, self.waits, self._t0 = 0, 0.0, 0.0, [], None

    def summary(self) -> str:
        med = 1e3 * float(np.median(self.waits)) if self.waits else 0.0
        return (f"{self.batches} batches, waited {self.wait_s:.3f} s of {self.elapsed_s:.3f} s "
                f"({100 * self.wait_share:.1f}%), mean {self.mean_wait_ms:.3f} ms/batch, median {med:.3f} ms")


class _Deferred:
    """A future that runs its call in the thread that asks for the result (``num_threads=0``)."""

    def __init__(self, fn: Any, args: tuple):
        self.fn, self.args, self._done, self._value = fn, args, False, None

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        if not self._done:
            self._value, self._done = self.fn(*self.args), True
        return self._value

    def cancel(self) -> bool:
        return True


class HostPool:
    """Host buffers for CPU batches, reused once every tensor made from one is gone.

    ``torch.from_numpy`` keeps its ndarray alive until the last tensor or view on it
    dies, so the ndarray's reference count says when the consumer has let go of a
    batch; a batch still held (kept in a list, say) is never overwritten. Fresh
    buffers cost page faults on every batch (measured: ~55 us per MNIST batch of 64).
    """

    def __init__(self, limit: int = 8):
        self.limit = limit
        self._lock = threading.Lock()
        self._bufs: dict[tuple, list[np.ndarray]] = {}

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            bufs = self._bufs.setdefault(key, [])
            for i in range(len(bufs)):
                if sys.getrefcount(bufs[i]) == 2:  # the list and getrefcount's argument: no tensor uses it
                    return bufs[i]
            a = np.empty(shape, dtype)
            if len(bufs) < self.limit:
                bufs.append(a)
            return a


def default_threads(device: torch.device) -> int:
    """Gather threads that help: only cores that training leaves idle (at most 4).

    On CUDA the training thread mostly launches kernels: every core but one.
    On CPU, torch's intra-op threads do the training: the cores beyond them.
    Measured on 2 cores: with training on 2 threads, gathering in the calling
    thread (0) won; with training on 1 thread, 1 gather thread won
    (benchmarks/bench_loader.py, bench_mnist.py).
    """
    cpus = os.cpu_count() or 1
    if device.type == "cuda":
        return max(1, min(4, cpus - 1))
    return max(0, min(4, cpus - torch.get_num_threads()))


class _InlinePool:
    def submit(self, fn: Any, *args: Any) -> _Deferred:
        return _Deferred(fn, args)

    def shutdown(self, wait: bool = True) -> None:
        pass


class Loader:
    """Iterable of ``{field: tensor}`` batches on ``device``; see the module docstring.

    Parameters: ``path_or_dataset`` an index file or an opened build;
    ``shuffle`` True (= ``"full"``), False (sequential), ``"full"`` or
    ``"block"`` (whole chunks, ``block_window`` chunks mixed at a time);
    ``seed`` with the epoch decides the order and batch steps; ``device``
    ``"auto"`` (CUDA when present), ``"cuda"`` or ``"cpu"``; ``fields`` to
    load (default all); ``drop_last`` drops a short last batch; ``rank`` /
    ``world_size`` / ``uneven`` (``"pad"`` or ``"drop"``) give each DDP rank a
    disjoint equal share; ``prefetch`` batches in flight; ``gpu_steps`` seeded
    batch steps (``{"random_flip": {...}}``, ``{"random_crop": {"size": .., "padding": ..}}``
    or :class:`~precompile.reader.gpu.BatchStep` objects) with the build
    steps' names, options and per-kind rules (images, masks, clips, flow); ``dtype`` (``"float32" | "float16" | "bfloat16"``) converts the
    image/video fields (``convert_fields``) on the device, uint8 scaled to
    [0, 1] then ``(x - mean) / std`` per channel (``mean="stats"`` /
    ``std="stats"``: each field's values stored by ``precompile stats``, in the
    same [0, 1] scale); ``channels_first`` gives
    NCHW views of 4-d converted fields; ``num_threads`` gather threads (0:
    gather in the training thread, just in time: no thread contention, which
    wins when the machine has no idle core to give; default
    :func:`default_threads`, the cores beyond two, at most 4). In a build with augmented
    ``copies``, ``copies="epoch"`` (default) makes each epoch show every sample
    once, as the copy ``f(build seed, epoch, key)`` (a different variant each
    epoch, no augmentation work at training time); ``copies="all"`` reads every
    row; ``include_original=False`` leaves the un-augmented copy 0 out.
    ``sort_batches`` (default True) orders the rows inside each shuffled batch
    by their place in the files, so a batch is gathered with one copy per row in
    address order (the batch's members are the sampler's; only their order
    within the batch changes); False keeps the sampler's order.
    ``in_memory=True`` copies the loaded fields into process memory when the
    Loader is made (one array per field, the size of the field's data), so a
    batch is one ``np.take`` from private memory: on machines where random reads
    from mapped page cache are slow (measured on the shared 2-core VM: 4-5x
    slower than from process memory, see benchmarks/README.md) this is what
    reaches the in-memory gather; the default maps the files and reads through
    the page cache.
    """

    def __init__(self, path_or_dataset: Any, batch_size: int, shuffle: bool | str = True, seed: int = 0,
                 device: str | torch.device = "auto", fields: Sequence[str] | None = None, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1, prefetch: int = 2, gpu_steps: Sequence[Any] | None = None,
                 dtype: Any = None, mean: Sequence[float] | float | str | None = None,
                 std: Sequence[float] | float | str | None = None, num_threads: int | None = None,
                 block_window: int = 8, uneven: Literal["pad", "drop"] = "pad", channels_first: bool = False,
                 convert_fields: Sequence[str] | None = None, copies: Literal["epoch", "all"] = "epoch",
                 include_original: bool = True, sort_batches: bool = True, in_memory: bool = False):
        if isinstance(path_or_dataset, (str, os.PathLike)):
            from . import open_dataset

            ds = open_dataset(path_or_dataset, fields=fields)
        else:
            ds = path_or_dataset
            if not hasattr(ds, "shards") or not hasattr(ds, "field_specs"):
                raise FormatError(f"Loader needs an HDF5 build (a path or precompile.open(...)), got {type(ds).__name__}")
        out_format = str((getattr(ds, "attrs", None) or {}).get("output_format", "hdf5"))
        if out_format != "hdf5":
            raise FormatError(
                f"{getattr(ds, 'path', ds)}: a {out_format} build (files, not HDF5 shards); the Loader reads HDF5 "
                f"builds only. Read it with precompile.open(path) inside a torch DataLoader, or build with "
                f"output format hdf5")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if int(prefetch) < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if uneven not in ("pad", "drop"):
            raise ValueError(f"uneven must be 'pad' or 'drop', got {uneven!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) (got rank={rank}, world_size={world_size})")
        if int(block_window) < 1:
            raise ValueError(f"block_window must be >= 1 chunk, got {block_window}")
        self.ds = ds
        self.device = gpu.resolve_device(device)
        self.batch_size = int(batch_size)
        self.mode = normalize_mode(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank, self.world_size, self.uneven = int(rank), int(world_size), uneven
        self.prefetch = int(prefetch)
        self.block_window = int(block_window)
        self.sort_batches = bool(sort_batches)
        self.num_threads = default_threads(self.device) if num_threads is None else int(num_threads)
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: gather in the calling thread), got {num_threads}")
        self.fields = list(fields) if fields is not None else list(ds.fields)
        self.reader = DirectReader(ds, self.fields, in_memory=bool(in_memory))
        self.specs = {f: ds.field_specs[f] for f in self.fields}

        self.dtype = gpu.torch_dtype(dtype)
        if self.dtype is None and (mean is not None or std is not None):
            raise ValueError("mean/std need a float dtype (e.g. dtype='float32')")
        if convert_fields is None:
            convert_fields = [f for f in self.fields if self.specs[f].get("kind") in CONVERT_KINDS]
        for f in convert_fields:
            if f not in self.fields:
                raise ValueError(f"convert_fields: {f!r} is not loaded (loaded: {', '.join(self.fields)})")
        self.convert: dict[str, gpu.Convert] = {}
        for name, v in (("mean", mean), ("std", std)):
            if isinstance(v, str) and v != "stats":
                raise ValueError(f"{name} must be numbers or 'stats' (from `precompile stats`), got {v!r}")
        if self.dtype is not None:
            for f in convert_fields:
                scale = 1 / 255 if self.reader.dtypes[f] == np.uint8 else 1.0
                m, s = mean, std
                if m == "stats" or s == "stats":  # per-channel values stored by `precompile stats`
                    from ..tools.stats import loader_norm

                    sm, ss = loader_norm(ds, f, scale)
                    m, s = (sm if m == "stats" else m), (ss if s == "stats" else s)
                self.convert[f] = gpu.Convert(self.dtype, m, s, channels_first, scale)
        self.steps = gpu.parse_steps(gpu_steps)
        for s in self.steps:
            s.bind(self.specs, self.reader.shapes)

        if copies not in ("epoch", "all"):
            raise ValueError(f"copies must be 'epoch' or 'all', got {copies!r}")
        self._copies: CopySchedule | None = None
        ds_copies = np.asarray(getattr(ds, "copies", np.zeros(0)))
        if copies == "epoch" and ds_copies.size and ds_copies.max() > 0:
            # augmented builds: each epoch shows every sample once, as the copy f(build seed, epoch, key)
            attrs = getattr(ds, "attrs", {}) or {}
            self._copies = CopySchedule(ds.keys, ds_copies, int(attrs.get("seed", self.seed)), include_original)

        self.epoch = 0
        self._pos = 0              # batches of self.epoch already handed out (resume point)
        self._resume = False       # _pos came from load_state_dict and no pass has started since
        self._orders: dict[int, list[np.ndarray]] = {}
        self._ring: gpu.CudaRing | None = None
        self._use_ring = self.device.type == "cuda"   # pinned ring + side stream (tests drive it with a fake ring)
        self._make_ring = gpu.CudaRing
        self._active: weakref.ref | None = None
        self.stats = LoaderStats()
        self._pool = HostPool()

    # -- order ----------------------------------------------------------------------------------
    def _epoch_rows(self, epoch: int) -> np.ndarray:
        """Row indices that make up ``epoch``: one copy per sample key in an augmented build
        (the same rows as ``precompile.reader.copies.epoch_view``), else every row."""
        if self._copies is not None:
            return self._copies.rows(epoch)
        return np.arange(len(self.reader.chunk_rows), dtype=np.int64)

    def batch_indices(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches (row indices) for ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else int(epoch)
        got = self._orders.get(e)
        if got is None:
            rows = np.asarray(self._epoch_rows(e), dtype=np.int64)
            order = epoch_order(rows, self.reader.chunk_rows[rows], self.mode, self.seed, e, self.block_window)
            share = rank_share(order, self.rank, self.world_size, self.uneven)
            got = split_batches(share, self.batch_size, self.drop_last)
            if self.sort_batches and self.mode != "sequential":
                # the order inside a batch carries no information for training: gather in file order
                got = [self.reader.order_batch(b) for b in got]
            self._orders = {e: got}  # keep one epoch: orders can be large
        return got

    def __len__(self) -> int:
        return len(self.batch_indices())

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch on the next iteration.

        Right after :meth:`load_state_dict` (before a pass starts), setting the restored epoch keeps
        the restored position, so the usual ``for e in range(start, n): set_epoch(e); for b in loader``
        loop resumes mid-epoch instead of replaying it.
        """
        if int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._resume and int(epoch) == self.epoch:
            return
        self.epoch, self._pos, self._resume = int(epoch), 0, False

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: the epoch and the batches of it already handed out."""
        return {"epoch": self.epoch, "batch": self._pos, "seed": self.seed, "shuffle": self.mode,
                "batch_size": self.batch_size, "rank": self.rank, "world_size": self.world_size,
                "drop_last": self.drop_last, "uneven": self.uneven, "block_window": self.block_window,
                "num_rows": int(len(self.reader.chunk_rows))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken: the next iteration yields the remaining batches."""
        for k in ("seed", "shuffle", "batch_size", "world_size", "drop_last", "uneven", "block_window", "num_rows"):
            mine = self.state_dict()[k]
            if k in state and state[k] != mine:
                raise ValueError(f"state_dict was taken with {k}={state[k]!r}, this Loader has {k}={mine!r}")
        epoch, pos = int(state["epoch"]), int(state["batch"])
        if epoch < 0:
            raise ValueError(f"state_dict epoch must be >= 0, got {epoch}")
        nb = len(self.batch_indices(epoch))
        if not 0 <= pos <= nb:
            raise ValueError(f"state_dict batch must be in [0, {nb}] (epoch {epoch} has {nb} batches), got {pos}")
        self.epoch, self._pos, self._resume = epoch, pos, True

    # -- iteration --------------------------------------------------------------------------------
    def _alloc(self, n: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        arrs = {f: self._pool.get((n, *self.reader.shapes[f]), self.reader.dtypes[f]) for f in self.fields}
        return {f: torch.from_numpy(a) for f, a in arrs.items()}, arrs

    def _finish(self, batch: dict[str, torch.Tensor], epoch: int, b: int) -> dict[str, torch.Tensor]:
        """Batch steps then conversion, for batch ``b`` (on the batch's device)."""
        if self.steps:
            n = next(iter(batch.values())).shape[0]
            params = gpu.step_params(self.steps, self.seed, epoch, self.rank, b, n)
            batch = gpu.run_steps(batch, self.steps, params)
        for f, conv in self.convert.items():
            x = batch[f]
            out = None
            if x.device.type == "cpu" and conv.dtype == torch.float32:
                out = torch.from_numpy(self._pool.get(tuple(x.shape), np.float32))
            batch[f] = conv(x, out=out)
        return batch

    def _finish_group(self, group: dict[str, torch.Tensor], sizes: list[int], epoch: int,
                      first: int) -> list[dict[str, torch.Tensor]]:
        """Split a task's rows into its batches and finish them (conversion once per task when no steps)."""
        if len(sizes) == 1:
            return [self._finish(group, epoch, first)]
        if not self.steps:
            group = self._finish(group, epoch, first)
        parts = {f: torch.split(t, sizes) for f, t in group.items()}
        out = [{f: parts[f][i] for f in group} for i in range(len(sizes))]
        if self.steps:
            out = [self._finish(bt, epoch, first + i) for i, bt in enumerate(out)]
        return out

    def _group_size(self) -> int:
        """Batches per gather task: small batches are gathered together (fewer, larger copies; less overhead)."""
        row = sum(self.reader.row_bytes.values())
        return int(min(MAX_GROUP, max(1, GROUP_BYTES // max(1, row * self.batch_size))))

    def _gather_cpu(self, batches: list[np.ndarray], lo: int, hi: int, epoch: int) -> list[dict[str, torch.Tensor]]:
        idx = batches[lo] if hi - lo == 1 else np.concatenate(batches[lo:hi])
        plan = self.reader.plan(idx)
        ts, arrs = self._alloc(plan.size)
        for f in self.fields:
            self.reader.gather(f, plan, arrs[f])
        return self._finish_group(ts, [len(x) for x in batches[lo:hi]], epoch, lo)

    def _gather_ring(self, batches: list[np.ndarray], lo: int, hi: int, slot: int) -> int:
        ring = self._ring
        ring.wait_free(slot)
        idx = batches[lo] if hi - lo == 1 else np.concatenate(batches[lo:hi])
        plan = self.reader.plan(idx)
        host = ring.host(slot, plan.size)
        for f in self.fields:
            self.reader.gather(f, plan, host[f])
        return plan.size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """A pass over the rest of the current epoch; starting a new pass closes an unfinished one."""
        self._close_active()  # its threads stop and (CUDA) its copies finish before the ring is reused
        self.reader._check_open()
        self._resume = False
        gen = self._run()
        self._active = weakref.ref(gen)
        return gen

    def _run(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, start = self.epoch, self._pos
        batches = self.batch_indices(epoch)
        group = self._group_size()
        tasks = [(lo, min(lo + group, len(batches))) for lo in range(start, len(batches), group)]
        ahead = max(1, -(-self.prefetch // group))      # tasks in flight beyond the one being consumed
        nslots = ahead + 2
        ring_mode = self._use_ring
        if ring_mode and self._ring is None:  # nslots and group are fixed for this Loader: one ring
            self._ring = self._make_ring(self.device, nslots, group * self.batch_size, self.reader.shapes,
                                         self.reader.dtypes)
        pool = (ThreadPoolExecutor(max_workers=self.num_threads, thread_name_prefix="precompile-gather",
                                   **gpu.thread_init(self.device))
                if self.num_threads > 0 else _InlinePool())
        pending: deque[tuple[int, Future]] = deque()     # submitted tasks, in order
        launched: deque[tuple[int, Any]] = deque()       # ring: tasks copied/launched, in order
        nxt = 0
        stats = self.stats
        stats.reset()

        def submit_until(limit: int) -> None:
            # ring: task k refills slot k % nslots; callers keep task k - nslots already launched, so the
            # gather thread finds that launch's event and waits for its copy before overwriting the slot
            nonlocal nxt
            while nxt < min(limit, len(tasks)):
                lo, hi = tasks[nxt]
                if ring_mode:
                    fut = pool.submit(self._gather_ring, batches, lo, hi, nxt % nslots)
                else:
                    fut = pool.submit(self._gather_cpu, batches, lo, hi, epoch)
                pending.append((nxt, fut))
                nxt += 1

        def launch() -> None:
            k, fut = pending.popleft()
            n = fut.result()
            lo, hi = tasks[k]
            sizes = [len(x) for x in batches[lo:hi]]
            launched.append((k, self._ring.launch(k % nslots, n,
                                                  lambda d: self._finish_group(d, sizes, epoch, lo))))

        try:
            submit_until(ahead + 1)
            for k in range(len(tasks)):
                t0 = time.perf_counter()
                if stats._t0 is None:
                    stats._t0 = t0
                if ring_mode:
                    if not launched:
                        launch()
                    j, (outs, done) = launched.popleft()
                    # keep the bus busy: launch the later tasks that are already gathered
                    while pending and pending[0][1].done():
                        launch()
                else:
                    j, fut = pending.popleft()
                    outs, done = fut.result(), None
                assert j == k
                submit_until(k + ahead + 1)
                lo = tasks[k][0]
                for i, out in enumerate(outs):
                    if i:
                        t0 = time.perf_counter()
                    if ring_mode:
                        out = self._ring.deliver(out, done)
                    t1 = time.perf_counter()
                    stats.waits.append(t1 - t0)
                    stats.wait_s += t1 - t0
                    stats.batches += 1
                    self._pos = lo + i + 1
                    yield out
                    stats.elapsed_s = time.perf_counter() - stats._t0
            self.epoch, self._pos = epoch + 1, 0
        finally:
            for _, f in pending:
                f.cancel()
            pool.shutdown(wait=True)
            if ring_mode and self._ring is not None:
                self._ring.synchronize()

    def _close_active(self) -> None:
        old = self._active() if self._active is not None else None
        if old is not None:
            old.close()
        self._active = None

    def close(self) -> None:
        """Stop an unfinished pass (its threads and copies end first), then release the shard maps.

        Iterating afterwards is a :class:`~precompile.errors.PrecompileError` ("reader is closed").
        """
        self._close_active()
        self.reader.close()
        self._ring = None

    def __repr__(self) -> str:
        return (f"Loader({self.ds.path!r}, batch_size={self.batch_size}, shuffle={self.mode!r}, device={self.device}, "
                f"fields={self.fields}, rank={self.rank}/{self.world_size}, fast={self.reader.fast})")
