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

``in_memory="pinned"`` (CUDA only) is the same feeder over host memory: the fields are copied once into
page-locked host memory, and that memory is handed to the device as a CUDA tensor over the same addresses
(unified virtual addressing: page-locked memory is mapped into the device's address space; the tensor is made
through ``__cuda_array_interface__``, no copy). ``index_select`` then runs on the GPU and reads each batch's
rows straight over the bus: for sets that fit in host memory but not in the device's, with no gather thread
and no staging copy (on an H200 node 50.7 GB/s against 55.0 for a pinned contiguous copy).
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import os

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


#: the most of the machine's available memory a pinned set may take
HOST_SHARE = 0.8


def host_budget_bytes() -> int:
    """Bytes a pinned set may take: ``HOST_SHARE`` of the memory the system reports available (page-locked
    memory cannot be swapped or reclaimed); unlimited where the system does not say."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * HOST_SHARE)
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class _HostMemory:
    """``__cuda_array_interface__`` over a page-locked CPU tensor's bytes; holds the tensor, so the device
    tensor made from it (which holds this object) keeps the memory alive."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "data": (host.data_ptr(), False), "version": 3, "strides": None}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` over the bytes of the page-locked CPU tensor ``host`` (same shape and dtype,
    no copy): device kernels read it over the bus. An empty tensor is a plain empty device tensor."""
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    if not host.is_pinned():
        raise PrecompileError("Loader(in_memory='pinned'): the host copy is not page-locked")
    flat = torch.as_tensor(_HostMemory(host), device=device)
    if flat.device != device or flat.data_ptr() != host.data_ptr():
        raise PrecompileError(f"Loader(in_memory='pinned'): page-locked memory did not map onto {device} "
                              f"(got {flat.device}); use in_memory=True or 'gpu'")
    return flat.view(host.dtype).view(host.shape)


def resident_rows(loader: Any) -> np.ndarray:
    """The rows this rank can be asked for, sorted: its share when that share is the same every epoch
    (sequential order, every row once: a DDP rank then holds only its own share), else every row (a
    shuffled order deals each rank other rows every epoch, and the batches must be the CPU Loader's)."""
    n = len(loader.reader.chunk_rows)
    if loader.world_size > 1 and loader.mode == "sequential" and loader._copies is None:
        return np.unique(np.concatenate(loader.batch_indices(0)))
    return np.arange(n, dtype=np.int64)


def upload(reader: DirectReader, fields: Sequence[str], rows: np.ndarray, device: torch.device,
           budget: int, pinned: bool = False) -> dict[str, torch.Tensor]:
    """One device tensor per field holding ``rows`` (in that order), read from the maps piece by piece.
    ``pinned``: the rows go into page-locked host memory and the tensors are its device aliases
    (:func:`device_alias`); ``budget`` is then host memory (:func:`host_budget_bytes`)."""
    need = sum(int(rows.size) * reader.row_bytes[f] for f in fields)
    if pinned and need > budget:
        raise PrecompileError(
            f"Loader(in_memory='pinned'): the loaded fields {list(fields)} of {rows.size} rows need {_size(need)} "
            f"of page-locked host memory, over {HOST_SHARE:g} of the memory available ({_size(budget)}); load "
            f"fewer fields, or read from the mapped files (in_memory=False)")
    if not pinned and need > budget:
        raise PrecompileError(
            f"Loader(in_memory='gpu'): the loaded fields {list(fields)} of {rows.size} rows need {_size(need)} "
            f"on {device}, over the budget of {_size(budget)} (gpu_budget; by default {DEFAULT_SHARE:g} of the "
            f"free GPU memory); load fewer fields, raise gpu_budget, or use in_memory=True (host memory)")
    out: dict[str, torch.Tensor] = {}
    for f in fields:
        shape, dtype = reader.shapes[f], reader.dtypes[f]
        step = max(1, PIECE_BYTES // max(1, reader.row_bytes[f]))
        if reader.streaming is not None:   # from a URL: a piece reads a shard or two, whatever the cache holds
            step = min(step, reader.streaming.shard_rows())
        if pinned:   # gathered straight into the page-locked array (for this device's context): no staging copy
            with torch.cuda.device(device):
                t = torch.empty((rows.size, *shape), dtype=gpu.numpy_to_torch_dtype(dtype), pin_memory=True)
            host = t.numpy()
        else:
            t = torch.empty((rows.size, *shape), dtype=gpu.numpy_to_torch_dtype(dtype), device=device)
            host = np.empty((min(step, rows.size), *shape), dtype)
        for lo in range(0, rows.size, step):
            part = rows[lo:lo + step]
            dst = host[lo:lo + part.size] if pinned else host[:part.size]
            with reader.plan(part) as plan:
                reader.gather(f, plan, dst)
            if not pinned:
                t[lo:lo + part.size].copy_(torch.from_numpy(dst))
        out[f] = device_alias(t, device) if pinned else t
    return out


class ResidentFeeder:
    """Batches gathered on ``device`` from the fields uploaded there (the Feeder protocol)."""

    def __init__(self, reader: DirectReader, fields: Sequence[str], finisher: Finisher, device: torch.device,
                 rows: np.ndarray, budget: int, pinned: bool = False):
        self.finisher, self.device, self.fields = finisher, device, list(fields)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.dense = bool(self.rows.size == len(reader.chunk_rows) and
                          (self.rows.size == 0 or self.rows[-1] == self.rows.size - 1))
        self.pinned = pinned
        self.tensors = upload(reader, self.fields, self.rows, device, budget, pinned)
        if reader.streaming is not None:   # a build read from a URL: its shards are not read again
            reader.streaming.release_unused()

    @classmethod
    def for_loader(cls, loader: Any, device: torch.device, budget: float | int | None = None,
                   pinned: bool = False) -> ResidentFeeder:
        """The resident feeder of ``loader`` on ``device`` (any device: CPU tensors in tests); ``pinned``: the
        fields in page-locked host memory, read by the device over the bus (CUDA only)."""
        return cls(loader.reader, loader.reader.fields, loader.finisher, device, resident_rows(loader),
                   host_budget_bytes() if pinned else budget_bytes(device, budget), pinned)

    @property
    def nbytes(self) -> int:
        """Bytes the uploaded fields take (device memory, or page-locked host memory when ``pinned``)."""
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
