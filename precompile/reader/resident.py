"""The GPU-resident mode (``Loader(..., in_memory="gpu")``): the loaded fields uploaded once to the device,
every batch gathered there.

At construction the rows this rank can be asked for (:func:`resident_rows`) are read from the shard maps
in pieces of about ``PIECE_BYTES`` and copied into one device tensor per field (within a budget:
:func:`budget_bytes`; a set that does not fit is a :class:`~precompile.errors.PrecompileError` naming its
size and the budget). A pass then gathers each task's rows with ``index_select`` on the device and hands
them to the same :class:`~precompile.reader.feed.Finisher` as the other feeders (seeded steps, then
conversion), so the batches are the CPU Loader's, exactly. No thread, no host buffer, no copy over the bus
after the upload.

The feeder works on any device: on CPU tensors it is the test hook that checks it against the CPU Loader
(``loader.feeder = ResidentFeeder.for_loader(loader, torch.device("cpu"))``); the Loader itself accepts
``in_memory="gpu"`` only on CUDA.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..errors import PrecompileError
from . import gpu
from .direct import DirectReader
from .feed import Batch, Finisher, PassPlan

#: the upload reads and copies this many bytes of one field at a time (host memory it needs at once)
PIECE_BYTES = 64 << 20
#: the default budget: this share of the device's free memory when the Loader is made
DEFAULT_SHARE = 0.5


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def budget_bytes(device: torch.device, budget: float | int | None) -> int:
    """The upload's budget in bytes: ``None`` = ``DEFAULT_SHARE`` of the free memory, a float in (0, 1] that
    share of it, an int that many bytes. The free memory is CUDA's (``mem_get_info``); a CPU device (the test
    hook) has no free-memory figure, so only an int budget (or None: unlimited) applies there."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or budget <= 0 or (isinstance(budget, float) and budget > 1)):
        raise ValueError(f"gpu_budget must be a share of free GPU memory in (0, 1] or a byte count >= 1, "
                         f"got {budget!r}")
    if isinstance(budget, int):
        return int(budget)
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * (DEFAULT_SHARE if budget is None else budget))


def resident_rows(loader: Any) -> np.ndarray:
    """The rows this rank can be asked for, sorted: its share when that share is the same every epoch
    (sequential order, every row once: a DDP rank then holds only its own share), else every row (a
    shuffled order deals each rank other rows every epoch, and the batches must be the CPU Loader's)."""
    n = len(loader.reader.chunk_rows)
    if loader.world_size > 1 and loader.mode == "sequential" and loader._copies is None:
        return np.unique(np.concatenate(loader.batch_indices(0)))
    return np.arange(n, dtype=np.int64)


def upload(reader: DirectReader, fields: Sequence[str], rows: np.ndarray, device: torch.device,
           budget: int) -> dict[str, torch.Tensor]:
    """One device tensor per field holding ``rows`` (in that order), read from the maps piece by piece."""
    need = sum(int(rows.size) * reader.row_bytes[f] for f in fields)
    if need > budget:
        raise PrecompileError(
            f"Loader(in_memory='gpu'): the loaded fields {list(fields)} of {rows.size} rows need {_size(need)} "
            f"on {device}, over the budget of {_size(budget)} (gpu_budget; by default {DEFAULT_SHARE:g} of the "
            f"free GPU memory); load fewer fields, raise gpu_budget, or use in_memory=True (host memory)")
    out: dict[str, torch.Tensor] = {}
    for f in fields:
        shape, dtype = reader.shapes[f], reader.dtypes[f]
        t = torch.empty((rows.size, *shape), dtype=gpu.numpy_to_torch_dtype(dtype), device=device)
        step = max(1, PIECE_BYTES // max(1, reader.row_bytes[f]))
        if reader.streaming is not None:   # from a URL: a piece reads a shard or two, whatever the cache holds
            step = min(step, reader.streaming.shard_rows())
        buf = np.empty((min(step, rows.size), *shape), dtype)
        for lo in range(0, rows.size, step):
            part = rows[lo:lo + step]
            with reader.plan(part) as plan:
                reader.gather(f, plan, buf[:part.size])
            t[lo:lo + part.size].copy_(torch.from_numpy(buf[:part.size]))
        out[f] = t
    return out


class ResidentFeeder:
    """Batches gathered on ``device`` from the fields uploaded there (the Feeder protocol)."""

    def __init__(self, reader: DirectReader, fields: Sequence[str], finisher: Finisher, device: torch.device,
                 rows: np.ndarray, budget: int):
        self.finisher, self.device, self.fields = finisher, device, list(fields)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.dense = bool(self.rows.size == len(reader.chunk_rows) and
                          (self.rows.size == 0 or self.rows[-1] == self.rows.size - 1))
        self.tensors = upload(reader, self.fields, self.rows, device, budget)
        if reader.streaming is not None:   # a build read from a URL: its shards are not read again
            reader.streaming.release_unused()

    @classmethod
    def for_loader(cls, loader: Any, device: torch.device, budget: float | int | None = None) -> ResidentFeeder:
        """The resident feeder of ``loader`` on ``device`` (any device: CPU tensors in tests)."""
        return cls(loader.reader, loader.reader.fields, loader.finisher, device, resident_rows(loader),
                   budget_bytes(device, budget))

    @property
    def nbytes(self) -> int:
        """Device bytes the uploaded fields take."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def positions(self, rows: np.ndarray) -> torch.Tensor:
        """Where dataset rows ``rows`` sit in the uploaded tensors, as an index tensor on the device."""
        if self.dense:
            pos = rows
        else:
            pos = np.searchsorted(self.rows, rows)
            if rows.size and (pos.max() >= self.rows.size or not np.array_equal(self.rows[pos], rows)):
                raise PrecompileError("Loader(in_memory='gpu'): a batch asks for rows this rank did not upload")
        return torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)).to(self.device, non_blocking=True)

    def gather(self, plan: PassPlan, k: int) -> list[Batch]:
        rows = plan.rows(k)
        pos = self.positions(rows)
        batch: Batch = {f: torch.index_select(t, 0, pos) for f, t in self.tensors.items()}
        batch.update(self.finisher.ragged_rows(rows))
        return self.finisher.finish_group(batch, plan.sizes(k), plan.epoch, plan.tasks[k][0])

    def feed(self, plan: PassPlan) -> Iterator[tuple[int, Batch]]:
        """``(batch number, batch)`` for every batch of ``plan``, in order (device work is queued on the
        current stream, so the consumer's kernels order after it)."""
        for k, (lo, _) in enumerate(plan.tasks):
            for i, out in enumerate(self.gather(plan, k)):
                yield lo + i, out

    def release(self) -> None:
        """Drop the uploaded tensors (the device memory returns to torch's cache)."""
        self.tensors = {}
