"""The seam between the Loader and its feeders, and what both feeders share.

- :class:`PassPlan`: one pass over an epoch's batches cut into gather tasks of
  whole batches (:func:`group_size` of them, about ``GROUP_BYTES`` of stored
  rows), with how many tasks run ahead of the one being consumed.
- :class:`Feeder`: what a feeder does with a plan: ``feed(plan)`` yields
  ``(batch number, batch)`` in order and, when closed, stops its threads (and
  its device work) before returning; ``release()`` drops what it holds.
  :class:`~precompile.reader.cpu_feeder.CpuFeeder` and
  :class:`~precompile.reader.cuda_feeder.CudaFeeder` are the two.
- :class:`Finisher`: a gathered task's rows split into its batches, then each
  batch's seeded steps and conversion (on whatever device the rows are on).
- :class:`HostPool`: host buffers reused once the consumer lets go of them.
- :func:`gather_pool`: the gather threads (or none: gather in the calling thread).
- :class:`RowSplitter`: one task's rows cut into contiguous ranges, gathered by
  several threads into their slices of the same buffers, so a task is not
  gathered by one thread while the others wait (``prefetch=1``, large batches).
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from . import fused, gpu
from .direct import DirectReader
from .mapping import page_aligned_empty
from ..errors import FormatError
from .ragged import AnnotationError, RaggedFields
from .options import Conversion

# A gather task covers about GROUP_BYTES of stored rows (whole batches, at least one, at most
# MAX_GROUP): small batches are gathered, converted and split together, so the Python work per
# batch (and, with a gather thread, the GIL hand-overs with the training thread) shrinks.
# Measured on MNIST-sized batches (64 x 792 B) while training on 2 cores, epoch time against a
# pure-compute bound: 256 KiB 1.21-1.24x, 1 MiB 1.13x, 32 batches 1.02-1.05x, 64 batches 0.97-1.09x.
GROUP_BYTES = 4 << 20
MAX_GROUP = 64
# A task is split across threads in parts of at least SPLIT_BYTES of stored rows: a hand-over to another
# thread costs tens of microseconds, about what copying 256 KiB costs, so smaller parts would lose.
SPLIT_BYTES = 1 << 20

Batch = dict[str, torch.Tensor]


def group_size(row_bytes: int, batch_size: int) -> int:
    """Batches per gather task: small batches are gathered together (fewer, larger copies; less overhead)."""
    return int(min(MAX_GROUP, max(1, GROUP_BYTES // max(1, row_bytes * batch_size))))


@dataclass(frozen=True)
class PassPlan:
    """The rest of one epoch's pass: ``batches`` (row indices), from batch ``tasks[0][0]``, as gather
    tasks ``[lo, hi)`` of ``group`` batches; ``ahead`` tasks are in flight beyond the one consumed."""

    epoch: int
    batches: list[np.ndarray]
    tasks: list[tuple[int, int]]
    group: int
    ahead: int

    @classmethod
    def make(cls, epoch: int, batches: list[np.ndarray], start: int, group: int, prefetch: int) -> PassPlan:
        tasks = [(lo, min(lo + group, len(batches))) for lo in range(start, len(batches), group)]
        return cls(epoch, batches, tasks, group, max(1, -(-prefetch // group)))

    @property
    def slots(self) -> int:
        """Buffers a ring needs: the tasks in flight, the one consumed and the one launched before it."""
        return self.ahead + 2

    def rows(self, k: int) -> np.ndarray:
        lo, hi = self.tasks[k]
        return self.batches[lo] if hi - lo == 1 else np.concatenate(self.batches[lo:hi])

    def sizes(self, k: int) -> list[int]:
        lo, hi = self.tasks[k]
        return [len(x) for x in self.batches[lo:hi]]


class Feeder(Protocol):
    def feed(self, plan: PassPlan) -> Iterator[tuple[int, Batch]]: ...

    def release(self) -> None: ...


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
            a = page_aligned_empty(shape, dtype)   # rows copied page to page (see page_aligned_empty)
            if len(bufs) < self.limit:
                bufs.append(a)
            return a

    def held(self, shape: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
        """The buffers kept for ``(shape, dtype)`` (the ones :meth:`get` may hand out again)."""
        with self._lock:
            return list(self._bufs.get((tuple(shape), np.dtype(dtype).str), []))


def converts_for(conv: Conversion, dtypes: dict[str, np.dtype], fields: Sequence[str], specs: dict[str, dict],
                 norm: Callable[[str, float], tuple[list[float], list[float]]]) -> tuple[torch.dtype | None,
                                                                                     dict[str, gpu.Convert]]:
    """The torch dtype and one :class:`~precompile.reader.gpu.Convert` per converted field, for the loaded
    ``fields`` of stored ``dtypes``; ``norm(field, scale)``: the per-channel (mean, std) that ``"stats"`` stands
    for (:func:`stored_norm`: one build's, or a mix's)."""
    dtype = gpu.torch_dtype(conv.dtype)   # float32 when mean/std are given without a dtype (Conversion)
    chosen = conv.fields_of(fields, specs)
    conv.check_norm()
    out: dict[str, gpu.Convert] = {}
    if dtype is None and conv.channels_first:   # no conversion asked for: NCHW views of the stored bytes
        return dtype, {f: gpu.Convert(None, channels_first=True) for f in chosen}
    if dtype is not None:
        for f in chosen:
            scale = 1 / 255 if dtypes[f] == np.uint8 else 1.0
            m, s = conv.mean, conv.std
            if m == "stats" or s == "stats":  # per-channel values stored by `precompile stats`
                sm, ss = norm(f, scale)
                m, s = (sm if m == "stats" else m), (ss if s == "stats" else s)
            out[f] = gpu.Convert(dtype, m, s, conv.channels_first, scale)
    return dtype, out


def stored_norm(builds: Sequence[Any], shares: Sequence[Any] | None = None
                ) -> Callable[[str, float], tuple[list[float], list[float]]]:
    """``norm`` for :func:`converts_for`: the per-channel (mean, std) ``precompile stats`` stored for a field
    of one build, or, given several with their ``shares`` of the stream, of the stream that mixes them."""
    def norm(field: str, scale: float) -> tuple[list[float], list[float]]:
        from ..tools.stats import loader_norm, mixture_norm

        parts = [loader_norm(ds, field, scale) for ds in builds]
        return parts[0] if shares is None else mixture_norm(parts, shares)
    return norm


class Finisher:
    """Seeded batch steps, then conversion, for batch ``b`` of an epoch (on the batch's device).

    A step's parameters are a function of ``(seed, epoch, rank, b)`` only, so both feeders
    (and every grouping of batches into tasks) give the same batches."""

    def __init__(self, steps: Sequence[gpu.BatchStep], convert: dict[str, gpu.Convert], seed: int, rank: int,
                 pool: HostPool, ragged: RaggedFields | None = None):
        self.steps, self.convert, self.seed, self.rank, self.pool = list(steps), convert, seed, rank, pool
        self.ragged = ragged   # annotation fields: padded on the host, moved to the batch's device last
        # resized crop -> flip -> jitter -> float32 on one uint8 image: one or two Triton kernels where a batch
        # can take them (fused.FusedChain.usable), the eager steps otherwise; fused_batches counts the former
        self.fused = fused.FusedChain.of(self.steps, convert) if self.steps else None
        self.fused_batches = 0
        #: ``describe(epoch, b, j)``: the build, dataset row and key of sample ``j`` of batch ``b`` (the Loader
        #: sets it), named by the error a device step raises on that sample's stored annotations
        self.describe: Callable[[int, int, int], str] | None = None

    def ragged_rows(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The padded annotation fields and counts of dataset rows ``rows`` (host tensors; {} if none)."""
        return self.ragged.batch(rows) if self.ragged is not None else {}

    def finish(self, batch: Batch, epoch: int, b: int) -> Batch:
        done = None   # the field the fused kernels converted
        if self.steps:
            n = next(iter(batch.values())).shape[0]
            params = gpu.step_params(self.steps, self.seed, epoch, self.rank, b, n)
            try:
                if self.fused is not None and self.fused.usable(batch):
                    done = self._fused(batch, params)
                if done is None:
                    batch = gpu.run_steps(batch, self.steps, params)
            except AnnotationError as e:
                where = f"sample {e.sample} of batch {b} of epoch {epoch}"
                if self.describe is None:
                    raise ValueError(f"{where}: {e.text}") from None
                raise FormatError(f"{self.describe(epoch, b, e.sample)}, {where}: {e.text}") from None
        for f, conv in self.convert.items():
            if f == done:
                continue
            x = batch[f]
            out = None
            if x.device.type == "cpu" and conv.dtype == torch.float32:
                out = torch.from_numpy(self.pool.get(tuple(x.shape), np.float32))
            batch[f] = conv(x, out=out)
        if self.ragged is not None:
            dev = next((t.device for f, t in batch.items() if f not in self.ragged.keys()), torch.device("cpu"))
            for f in self.ragged.keys():
                batch[f] = batch[f].to(dev)
        return batch

    def _fused(self, batch: Batch, params: list[dict]) -> str | None:
        """The fused kernels on ``batch`` (its field replaced by the converted result, boxes and keypoints moved
        by the steps' code): the field, or None when the kernels failed (a GPU Triton cannot compile for, a
        broken install): a warning says so once and this Finisher runs the eager steps from then on."""
        chain = self.fused
        try:
            out = chain.run(batch[chain.field], params)
        except Exception as e:   # launch and compile errors: the inputs are untouched, the eager steps can run
            import warnings

            from ..errors import clip

            self.fused = None
            warnings.warn(f"the fused device kernels failed ({type(e).__name__}: {clip(str(e))}); the eager device "
                          f"steps run instead (PRECOMPILE_FUSED=0 chooses them from the start)", RuntimeWarning,
                          stacklevel=2)
            return None
        batch[chain.field] = out
        if chain.notes:   # boxes, keypoints: the steps' own moves
            gpu.run_steps(batch, self.steps, params, pixels=False)
        self.fused_batches += 1
        return chain.field

    def finish_group(self, group: Batch, sizes: list[int], epoch: int, first: int) -> list[Batch]:
        """Split a task's rows into its batches and finish them (conversion once per task when no steps)."""
        if len(sizes) == 1:
            return [self.finish(group, epoch, first)]
        widths = self.ragged.widths(group, sizes) if self.ragged is not None else []   # host counts: no sync
        if not self.steps:
            group = self.finish(group, epoch, first)
        parts = {f: torch.split(t, sizes) for f, t in group.items()}
        out = [{f: parts[f][i] for f in group} for i in range(len(sizes))]
        if self.ragged is not None:
            out = [self.ragged.trim(b, w) for b, w in zip(out, widths)]
        if self.steps:
            out = [self.finish(bt, epoch, first + i) for i, bt in enumerate(out)]
        return out


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


class _InlinePool:
    def submit(self, fn: Any, *args: Any) -> _Deferred:
        return _Deferred(fn, args)

    def shutdown(self, wait: bool = True) -> None:
        pass


#: whether a task's owner gathers the parts of it that no split thread has started yet itself, instead of
#: waiting for them (benchmarks/bench_threads.py turns it off for its "before" contenders)
STEAL_PARTS = True


class RowSplitter:
    """Gathers a task's rows with up to ``threads`` threads: the calling thread takes the first range, a pool
    of its own the others (never the gather pool: a task waiting on parts queued behind other tasks could wait
    forever). The rows of each range land in their own slice of ``out``, so the result is the same bytes as one
    gather, whatever the split."""

    def __init__(self, reader: DirectReader, fields: Sequence[str], threads: int, device: torch.device):
        self.reader, self.fields, self.threads = reader, list(fields), max(1, threads)
        self._pool = (ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="precompile-split",
                                         **gpu.thread_init(device)) if self.threads > 1 else None)

    def parts(self, n: int, row_bytes: int) -> int:
        """Ranges for ``n`` rows of ``row_bytes`` each: one per SPLIT_BYTES, at most one per thread."""
        return int(max(1, min(self.threads, n, (n * row_bytes) // SPLIT_BYTES)))

    def _gather(self, rows: np.ndarray, out: dict[str, np.ndarray], lo: int, hi: int) -> None:
        with self.reader.plan(rows[lo:hi]) as plan:   # (from a URL: its shards stay mapped until the with ends)
            for f in self.fields:
                self.reader.gather(f, plan, out[f][lo:hi])

    def gather(self, rows: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill ``out[f][:len(rows)]`` for every field with ``rows`` (global row indices, gather order)."""
        n = int(rows.size)
        row_bytes = sum(out[f][0].nbytes for f in self.fields) if n else 0
        k = self.parts(n, row_bytes) if self._pool is not None else 1
        if k == 1:
            self._gather(rows, out, 0, n)
            return
        bounds = [n * i // k for i in range(k + 1)]
        futs = [self._pool.submit(self._gather, rows, out, bounds[i], bounds[i + 1]) for i in range(1, k)]
        try:
            self._gather(rows, out, bounds[0], bounds[1])
            for i in range(k - 1, 0, -1):   # parts no split thread has started (busy with another task's): here
                if STEAL_PARTS and futs[i - 1].cancel():
                    self._gather(rows, out, bounds[i], bounds[i + 1])
        finally:
            for fut in futs:
                if not fut.cancelled():
                    fut.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def gather_pool(num_threads: int, device: torch.device) -> ThreadPoolExecutor | _InlinePool:
    """``num_threads`` gather threads on ``device``, or (0) tasks run when their result is asked for."""
    if num_threads > 0:
        return ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="precompile-gather",
                                  **gpu.thread_init(device))
    return _InlinePool()
