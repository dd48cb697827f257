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

Structure: the Loader is a front (options, order, resume, stats) over one
feeder that turns a :class:`~precompile.reader.feed.PassPlan` into batches:
:class:`~precompile.reader.cpu_feeder.CpuFeeder` on CPU,
:class:`~precompile.reader.cuda_feeder.CudaFeeder` on CUDA. Its keywords are
grouped into :class:`~precompile.reader.options.Order`,
:class:`~precompile.reader.options.Distribution` and
:class:`~precompile.reader.options.Conversion` (``loader.order``,
``loader.distribution``, ``loader.conversion``).

The Loader measures the time the training loop spends blocked in
``next(loader)``: ``loader.stats`` (per batch and summed over the current or
last pass, and its share of wall time; a new pass starts from zero).
"""
from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
import torch

from ..errors import FormatError, PrecompileError, echo
from ..sample import field_list
from . import augment, gpu, streaming
from .copies import AllCopies, CopySchedule
from .cpu_feeder import CpuFeeder
from .cuda_feeder import CudaFeeder
from .direct import DirectReader
from .feed import Feeder, Finisher, HostPool, PassPlan, converts_for, group_size, stored_norm
from .options import CONVERT_KINDS, Conversion, Distribution, Order, flag, whole
from .sampler import epoch_order, rank_share, shard_ids, split_batches
from .ragged import RaggedFields, check_count_names, is_ragged_annotation
from .resume import Resumable
from .targets import check_targets, loader_targets, replace_with_targets, variable_fields

__all__ = ["CONVERT_KINDS", "HostPool", "Loader", "LoaderStats", "default_threads"]

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


def default_threads(device: torch.device, in_memory: bool = False) -> int:
    """Gather threads that help: only cores that training leaves idle (at most 4; 8 on CUDA in memory).

    On CUDA the training thread mostly launches kernels: every core of this
    rank's share but one (the node's cores over ``LOCAL_WORLD_SIZE``, which
    torchrun sets for each process of a node), at most 4 from mapped files
    and 8 from memory. Measured on an H200 node
    with 16 cores (benchmarks/bench_gpu.py, 224x224 batches of 256): mapped
    files peak at 4 threads (0.27x the pinned copy; 8 threads 0.23x, 15
    threads 0.16x), a gather from memory at 8 (0.36-0.40x; 4 threads 0.28x).
    On CPU, torch's intra-op threads do the training: the cores beyond them.
    Measured on 2 cores: with training on 2 threads, gathering in the calling
    thread (0) won; with training on 1 thread, 1 gather thread won
    (benchmarks/bench_loader.py, bench_mnist.py).
    """
    cpus = os.cpu_count() or 1
    if device.type == "cuda":
        try:
            local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local = 1
        return max(1, min(8 if in_memory else 4, cpus // local - 1))
    return max(0, min(4, cpus - torch.get_num_threads()))


def open_hdf5_build(path_or_dataset: Any, fields: Sequence[str] | None, verify: bool = False,
                    **remote: Any) -> Any:
    """The opened HDF5 build behind ``path_or_dataset`` (an index path or URL, or an opened build); ``verify``:
    every stored byte checked against the index first (``precompile.open(path, verify=True)``); ``remote``:
    ``cache_dir``, ``cache_limit``, ``storage_options`` for a URL."""
    if isinstance(path_or_dataset, (str, os.PathLike)):
        from . import open_dataset

        ds = open_dataset(path_or_dataset, fields=fields, verify=verify,
                          **{k: v for k, v in remote.items() if v is not None})
    else:
        if any(v is not None for v in remote.values()):
            raise ValueError("cache_dir, cache_limit and storage_options are for a URL; pass them to "
                             "precompile.open(url, ...) for a build opened already")
        if verify and hasattr(path_or_dataset, "verify_cached"):   # a build read from a URL
            path_or_dataset.verify_cached()
        elif verify and hasattr(path_or_dataset, "path"):
            from ..formats import check_intact, find_format

            check_intact(find_format(str(path_or_dataset.path)), str(path_or_dataset.path))
        ds = path_or_dataset
        # shard_table first: asking an H5Dataset for `shards` would parse every entry's JSON
        if not (hasattr(ds, "shard_table") or hasattr(ds, "shards")) or not hasattr(ds, "field_specs"):
            raise FormatError(f"Loader needs an HDF5 build (a path or precompile.open(...)), got {type(ds).__name__}")
    out_format = str((getattr(ds, "attrs", None) or {}).get("output_format", "hdf5"))
    if out_format != "hdf5":
        raise FormatError(
            f"{getattr(ds, 'path', ds)}: a {out_format} build (files, not HDF5 shards); the Loader reads HDF5 "
            f"builds only. Read it with precompile.open(path) inside a torch DataLoader, or build with "
            f"output format hdf5")
    return ds


def check_in_memory(in_memory: Any, gpu_budget: Any, device: torch.device) -> tuple[bool | str, Any]:
    """``in_memory`` (False, True, ``"gpu"`` or ``"pinned"``) and ``gpu_budget`` checked against ``device``."""
    number = isinstance(in_memory, (int, float)) and not isinstance(in_memory, bool)   # 1 == True, but no
    if number or in_memory not in (False, True, "gpu", "pinned"):
        raise ValueError(f"in_memory must be False, True, 'gpu' or 'pinned', got {echo(in_memory)}")
    if in_memory == "pinned" and device.type != "cuda":
        raise PrecompileError(f"Loader(in_memory='pinned') lets a CUDA device read page-locked host memory; this "
                              f"Loader's device is {device}: use in_memory=True (host memory) or device='cuda'")
    if in_memory == "gpu" and device.type != "cuda":
        why = "" if torch.cuda.is_available() else f" (this torch {torch.__version__} sees no CUDA device)"
        raise PrecompileError(f"Loader(in_memory='gpu') keeps the data on a CUDA device; this Loader's device is "
                              f"{device}{why}: use in_memory=True (host memory) or device='cuda'")
    if gpu_budget is not None and in_memory != "gpu":
        raise ValueError("gpu_budget applies only with in_memory='gpu'")
    return in_memory, gpu_budget


def copy_schedule(ds: Any, copies: str, include_original: bool, seed: int) -> CopySchedule | AllCopies | None:
    """For ``copies="epoch"`` over an augmented build: each epoch shows every sample once, as the copy
    ``f(build seed, epoch, key)``; ``copies="all"`` with ``include_original=False``: every row but the originals;
    else None (every row)."""
    if copies not in ("epoch", "all"):
        raise ValueError(f"copies must be 'epoch' or 'all', got {echo(copies)}")
    include_original = flag(include_original, "include_original")
    ds_copies = np.asarray(getattr(ds, "copies", np.zeros(0)))
    if not (ds_copies.size and ds_copies.max() > 0):
        return None
    if copies == "epoch":
        attrs = getattr(ds, "attrs", {}) or {}
        return CopySchedule(ds.keys, ds_copies, int(attrs.get("seed", seed)), include_original)
    return None if include_original else AllCopies(ds.keys, ds_copies)


class Loader(Resumable):
    """Iterable of ``{field: tensor}`` batches on ``device``; see the module docstring.

    Parameters: ``path_or_dataset`` an index file or an opened build (a list of them: a
    :class:`~precompile.reader.mix.Mix` of them, see :meth:`__new__`);
    ``shuffle`` True (= ``"full"``), False (sequential), ``"full"`` or
    ``"block"`` (whole chunks, ``block_window`` chunks mixed at a time) or ``"shard"`` (the same over whole
    shards: what a build read from a URL through a cache smaller than it wants);
    ``seed`` with the epoch decides the order and batch steps; ``device``
    ``"auto"`` (CUDA when present), ``"cuda"`` or ``"cpu"``; ``fields`` to
    load (default all); ``drop_last`` drops a short last batch; ``rank`` /
    ``world_size`` / ``uneven`` (``"pad"`` or ``"drop"``) give each DDP rank a
    disjoint equal share (left out under an initialised ``torch.distributed``
    process group, they are the group's: ``repr`` says so; a contradiction is
    an error); ``prefetch`` batches in flight; ``gpu_steps`` seeded
    batch steps (``{"random_flip": {...}}``, ``{"random_crop": {"size": .., "padding": ..}}``
    or :class:`~precompile.reader.gpu.BatchStep` objects) with the build
    steps' names, options and per-kind rules (images, masks, clips, flow, boxes,
    keypoints, instance masks), each on the shapes the step before it made; ``dtype`` (``"float32" | "float16" | "bfloat16"``) converts the
    image/video fields (``convert_fields``) on the device, uint8 scaled to
    [0, 1] then ``(x - mean) / std`` per channel (``mean``/``std`` without ``dtype``: float32; ``mean="stats"`` /
    ``std="stats"``: each field's values stored by ``precompile stats``, in the
    same [0, 1] scale); ``channels_first`` gives
    NCHW views of the 4-d converted fields (without ``dtype``: of the image fields in their stored dtype); ``num_threads`` gather threads (0:
    gather in the training thread, just in time: no thread contention, which
    wins when the machine has no idle core to give; default
    :func:`default_threads`: on CUDA every core of this rank's share but one, at most 4 from mapped files and
    8 from memory; on CPU the cores torch's threads leave idle, at most 4). In a build with augmented
    ``copies``, ``copies="epoch"`` (default) makes each epoch show every sample
    once, as the copy ``f(build seed, epoch, key)`` (a different variant each
    epoch, no augmentation work at training time); ``copies="all"`` reads every
    row; ``include_original=False`` leaves the un-augmented copy 0 out (of either: with ``"all"``, the rows of
    the keys that have other copies).
    ``sort_batches`` (default True) orders the rows inside each shuffled batch
    by their place in the files, so a batch is gathered with one copy per row in
    address order (the batch's members are the sampler's; only their order
    within the batch changes); False keeps the sampler's order.
    ``verify=True`` checks every stored byte against the index before anything
    is read (as ``precompile.open(path, verify=True)``; one read of the whole
    output, see docs/limits.md) and raises FormatError naming what is damaged.
    ``in_memory=True`` copies the loaded fields into process memory when the
    Loader is made (one array per field, the size of the field's data), so a
    batch is one ``np.take`` from private memory: on machines where random reads
    from mapped page cache are slow (measured on the shared 2-core VM: 4-5x
    slower than from process memory, see benchmarks/README.md) this is what
    reaches the in-memory gather; the default maps the files and reads through
    the page cache. ``in_memory="gpu"`` (CUDA only) uploads the loaded fields once
    to the device and gathers every batch there (``index_select``), then the
    steps and conversion: the same batches, no copy over the bus per batch
    (:mod:`precompile.reader.resident`); ``gpu_budget`` caps the upload (a share
    in (0, 1] of the free GPU memory, default 0.5, or a byte count), a set over it
    is an error naming both sizes. ``in_memory="pinned"`` (CUDA only) copies the
    loaded fields once into page-locked host memory that the device reads directly
    (the same feeder: each batch gathered by ``index_select`` on the GPU, its rows
    read over the bus; no gather thread, no staging copy): for sets that fit in
    host memory but not on the device. A ``text`` field is not gathered like the others: each batch
    holds it as a list of ``str`` in batch order (read from the build as UTF-8).
    The Loader reads only the index: where it carries the shards' chunk tables (builds since
    issue 20) no shard is opened to learn where its rows are. ``map_shards="all"`` (default)
    maps every shard file when the Loader is made (an open and an ``mmap`` each, nothing read),
    so the Loader keeps reading its snapshot through any number of rebuilds; ``"lazy"`` maps a
    shard on the first batch that needs it (a shard no batch touches is never opened; like
    ``precompile.open``, it then survives one rebuild, see docs/faults.md).
    ``path_or_dataset`` may be the URL of an HDF5 build's index (``s3://bucket/prefix/images.h5``, any fsspec
    URL): its shards are fetched into the local cache ``cache_dir`` (at most ``cache_limit`` bytes, shared by the
    node's processes) with the store's ``storage_options``, ``fetch_ahead`` bytes ahead of the batches in flight
    in the order the epoch needs them, mapped while batches read them (``map_shards`` defaults to ``"lazy"``);
    the batches are the local build's (:mod:`precompile.reader.streaming`, docs/reference-reader.md).
    Ragged annotation fields (``boxes``, ``box_labels``, ``keypoints``: a row count per sample)
    come as padded tensors (B, Nmax, ...) (NaN, or -1 for labels, past a sample's count) plus
    ``<field>__count`` (B,) int64 (:mod:`precompile.reader.ragged`; docs/annotations.md).
    ``targets="list"`` gives them instead as ``batch["targets"]``, one dict per image as torchvision's
    detection models take them (``boxes``, ``labels``, ``masks`` from an instance mask tied
    to the boxes, ``keypoints``; exactly the image's rows: :mod:`precompile.reader.targets`).
    """

    KIND = "Loader"
    STATE_CHECKS = ("seed", "shuffle", "batch_size", "world_size", "drop_last", "uneven", "block_window", "num_rows")
    STATE_ADDED = ("sort_batches", "copies", "include_original", "layout")
    STATE_HINTS = {"layout": "state_dict was taken over another build or layout: the order of its epochs depends on "
                             "the sample keys, copies, chunks (shuffle='block') and shards (shuffle='shard'), and "
                             "here one of them differs (layout {theirs}, this Loader's {mine}; rebuilt since?): its "
                             "position would be in another order, showing some samples twice and others never"}

    def __new__(cls, path_or_dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Loader([a, b, ...], batch_size, weights=..., ...)``: a list (or tuple) of builds is read as one weighted
        stream, a :class:`~precompile.reader.mix.Mix` (:func:`~precompile.reader.mix.mix_for_loader`)."""
        if isinstance(path_or_dataset, (list, tuple)):
            from .mix import mix_for_loader

            return mix_for_loader(path_or_dataset, args, kwargs, cls.__init__)
        return super().__new__(cls)

    def __init__(self, path_or_dataset: Any, batch_size: int, shuffle: bool | str = True, seed: int = 0,
                 device: str | torch.device = "auto", fields: Sequence[str] | None = None, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, prefetch: int = 2, gpu_steps: Sequence[Any] | None = None,
                 dtype: Any = None, mean: Sequence[float] | float | str | None = None,
                 std: Sequence[float] | float | str | None = None, num_threads: int | None = None,
                 block_window: int = 8, uneven: Literal["pad", "drop"] = "pad", channels_first: bool = False,
                 convert_fields: Sequence[str] | None = None, copies: Literal["epoch", "all"] = "epoch",
                 include_original: bool = True, sort_batches: bool = True, in_memory: bool | str = False,
                 gpu_budget: float | int | None = None, verify: bool = False,
                 map_shards: Literal["all", "lazy"] | None = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, storage_options: dict[str, Any] | None = None,
                 fetch_ahead: int | str | None = None, targets: Literal["list"] | None = None):
        fields, verify = field_list(fields), flag(verify, "verify")
        ds = self.ds = open_hdf5_build(path_or_dataset, fields, verify, cache_dir=cache_dir, cache_limit=cache_limit,
                                       storage_options=storage_options)
        self._owns_ds = isinstance(path_or_dataset, (str, os.PathLike))   # opened here: closed by close()
        remote = getattr(ds, "remote", None)   # a build read from a URL (formats/hdf5_url.py)
        map_shards = map_shards or ("lazy" if remote is not None else "all")
        if map_shards not in ("all", "lazy"):
            raise ValueError(f"map_shards must be 'all' or 'lazy', got {echo(map_shards)}")
        batch_size, prefetch = whole(batch_size, "batch_size"), whole(prefetch, "prefetch")
        if num_threads is not None:
            num_threads = whole(num_threads, "num_threads")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(prefetch) < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.order = Order(shuffle, seed, block_window, sort_batches, drop_last)
        self.distribution = Distribution.resolve(rank, world_size, uneven)
        self.conversion = Conversion(dtype, mean, std, channels_first, convert_fields)
        self.device = gpu.resolve_device(device)
        self.batch_size, self.prefetch = int(batch_size), int(prefetch)
        if num_threads is not None and int(num_threads) < 0:
            raise ValueError(f"num_threads must be >= 0 (0: gather in the calling thread), got {num_threads}")
        wanted = list(fields) if fields is not None else list(ds.fields)
        # text fields (UTF-8 bytes of varying length) are not gathered: each batch gets them as a list of str
        self.text_fields = [f for f in wanted if ds.field_specs.get(f, {}).get("kind") == "text"]
        self.fields = [f for f in wanted if f not in self.text_fields]
        self._text_ds: Any = None
        self.specs = {f: ds.field_specs[f] for f in self.fields}
        coco = getattr(ds, "coco", None)
        if coco and coco.get("mask") == "instance" and "of" not in self.specs.get("mask", {"of": None}):
            # an inputs.coco build from before its instance mask declared its tie (issue 32): tied all the same
            self.specs["mask"] = {**self.specs["mask"], "of": "boxes"}
        ragged = [f for f in self.fields if is_ragged_annotation(self.specs[f])]   # boxes etc.: padded + counts
        check_count_names(wanted, ragged)
        self.ragged = RaggedFields(ds, ragged) if ragged else None
        self.in_memory, self.gpu_budget = check_in_memory(in_memory, gpu_budget, self.device)
        self.num_threads = (default_threads(self.device, self.in_memory is True) if num_threads is None
                            else int(num_threads))
        targets = check_targets(targets)
        #: targets="list": the fields of varying shape (images of several sizes, their masks), each batch's as a
        #: list of tensors of their own sizes (as torchvision's detection models take images), read per sample
        self.listed = variable_fields(self.specs, ragged) if targets is not None else []
        self._listed_ds: Any = None
        self.reader = DirectReader(ds, [f for f in self.fields if f not in ragged and f not in self.listed],
                                   in_memory=self.in_memory is True, lazy=map_shards == "lazy")
        if self.listed:
            self._check_listed(augment.parse_steps(gpu_steps))
        self.dtype, self.convert = converts_for(self.conversion, self.reader.dtypes, self.reader.fields, self.specs,
                                                stored_norm([ds]))
        self.targets, self.target_fields = targets, None   # targets="list": per-image dicts
        if self.targets is not None:
            self.target_fields = loader_targets(self.specs, self.fields)
        self.steps = augment.parse_steps(gpu_steps)
        shapes = {**self.reader.shapes, **{f: tuple(self.specs[f]["shape"]) for f in ragged}}
        gpu.bind_steps(self.steps, self.specs, shapes)   # each step sees the shapes of the one before it
        self._copies = copy_schedule(ds, copies, include_original, self.seed)
        ds_copies = np.asarray(getattr(ds, "copies", np.zeros(0)))
        # which rows an epoch holds, for the state: only an augmented build's depend on copies / include_original
        self._copies_state = ((copies, flag(include_original, "include_original"))
                              if ds_copies.size and ds_copies.max() > 0 else (None, None))
        self._layout_digest: str | None = None

        self.epoch = 0
        self._pos = 0              # batches of self.epoch already handed out (resume point)
        self._resume = False       # _pos came from load_state_dict and no pass has started since
        self._orders: dict[int, list[np.ndarray]] = {}
        self._active: weakref.ref | None = None
        self.stats = LoaderStats()
        self.finisher = Finisher(self.steps, self.convert, self.seed, self.rank, HostPool(), self.ragged)
        self.finisher.describe = self._describe_sample
        self.window = streaming.loader_window(self, fetch_ahead)   # None unless reading a URL's shards from maps
        if self.window is not None:
            self.window.check(self.pass_plan(self.epoch))
        self.feeder: Feeder = self.make_feeder()

    def make_feeder(self, make_ring: Callable[..., Any] | None = None) -> Feeder:
        """This Loader's feeder: on CUDA the pinned ring and side stream, on CPU host buffers.

        ``make_ring`` gives the CUDA feeder on any device, with that ring factory (the
        :class:`~precompile.reader.gpu.CudaRing` signature): a stand-in ring drives the CUDA
        feeder's scheduling without a GPU (``loader.feeder = loader.make_feeder(make_ring=...)``)."""
        if make_ring is None and self.in_memory in ("gpu", "pinned"):
            from .resident import ResidentFeeder

            return ResidentFeeder.for_loader(self, self.device, self.gpu_budget, pinned=self.in_memory == "pinned")
        if make_ring is not None or self.device.type == "cuda":
            return CudaFeeder(self.reader, self.reader.fields, self.finisher, self.device, self.num_threads,
                              self.batch_size, make_ring or gpu.CudaRing)
        return CpuFeeder(self.reader, self.reader.fields, self.finisher, self.finisher.pool, self.num_threads)

    # -- the option groups, as attributes --------------------------------------------------------
    mode = property(lambda self: self.order.mode, doc="``sequential`` | ``full`` | ``block``")
    seed = property(lambda self: self.order.seed)
    block_window = property(lambda self: self.order.block_window)
    sort_batches = property(lambda self: self.order.sort_batches)
    drop_last = property(lambda self: self.order.drop_last)
    rank = property(lambda self: self.distribution.rank)
    world_size = property(lambda self: self.distribution.world_size)
    uneven = property(lambda self: self.distribution.uneven)

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
            groups = shard_ids(self.reader.offsets) if self.mode == "shard" else self.reader.chunk_rows
            order = epoch_order(rows, groups[rows], self.mode, self.seed, e, self.block_window)
            share = rank_share(order, self.rank, self.world_size, self.uneven)
            got = split_batches(share, self.batch_size, self.drop_last)
            if self.sort_batches and self.mode != "sequential":
                # the order inside a batch carries no information for training: gather in file order
                got = [self.reader.order_batch(b) for b in got]
            self._orders = {e: got}  # keep one epoch: orders can be large
        return got

    def __len__(self) -> int:
        return len(self.batch_indices())

    def batch_maps(self, b: int, epoch: int | None = None, field: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Where batch ``b`` of ``epoch`` (default: the current one, the one a pass is iterating) came from:
        the dataset rows of its samples, in batch order (``batch_indices(epoch)[b]``), and (B, 2, 3) float64
        maps, one per sample, from the batch's pixel coordinates back to the stored sample's: the inverse of
        the random ``gpu_steps`` as drawn for that batch (identities without steps). With the build's own map,
        ``self.ds.to_source(rows[j], boxes=..., device_map=maps[j])`` gives a prediction on the batch in the
        source image's pixels. ``field``: the image field the maps follow (default: the one ``to_source``
        uses, where it is loaded). The draws are a function of (seed, epoch, rank, b), so this needs no pass."""
        e = self.epoch if epoch is None else int(epoch)
        batches = self.batch_indices(e)
        if not 0 <= int(b) < len(batches):
            raise IndexError(f"batch {b} out of range: epoch {e} has {len(batches)} batches on this rank")
        rows = batches[int(b)]
        if field is None:
            try:
                field = self.ds._map_field(None)
            except ValueError:
                field = None
            field = field if field in self.fields else None
        params = gpu.step_params(self.steps, self.seed, e, self.rank, int(b), len(rows))
        return rows, gpu.device_maps(self.steps, params, len(rows), field)

    def _describe_sample(self, epoch: int, b: int, j: int) -> str:
        """The build, dataset row and key of sample ``j`` of batch ``b`` of ``epoch`` (what an error names)."""
        from ..errors import echo

        r = int(self.batch_indices(epoch)[b][j])
        return f"{getattr(self.ds, 'url', self.ds.path)}: row {r} ({echo(self.ds.key(r), 120)})"

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: the epoch and the batches of it already handed out."""
        return {"epoch": self.epoch, "batch": self._pos, "seed": self.seed, "shuffle": self.mode,
                "batch_size": self.batch_size, "rank": self.rank, "world_size": self.world_size,
                "drop_last": self.drop_last, "uneven": self.uneven, "block_window": self.block_window,
                "num_rows": int(len(self.reader.chunk_rows)), "sort_batches": self.sort_batches,
                "copies": self._copies_state[0], "include_original": self._copies_state[1],
                "layout": self._layout()}

    def _layout(self) -> str:
        """A digest of what this Loader's epochs' orders depend on besides its options: the sample keys in row
        order, an augmented build's copy numbers and build seed (its copy schedule), and the chunks (``block``) or
        shards (``shard``) the shuffle groups rows by. Computed once (the Loader reads one snapshot)."""
        if self._layout_digest is None:
            import hashlib

            h = hashlib.sha256("\0".join(self.ds.keys).encode("utf-8", "surrogatepass"))
            if self._copies_state[0] is not None:   # an augmented build
                h.update(b"copies" + np.ascontiguousarray(self.ds.copies, dtype=np.int64).tobytes())
                h.update(str((getattr(self.ds, "attrs", None) or {}).get("seed", self.seed)).encode())
            if self.mode == "block":
                h.update(b"chunks" + np.ascontiguousarray(self.reader.chunk_rows, dtype=np.int64).tobytes())
            elif self.mode == "shard":
                h.update(b"shards" + np.ascontiguousarray(self.reader.offsets, dtype=np.int64).tobytes())
            self._layout_digest = h.hexdigest()[:16]
        return self._layout_digest

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """A pass over the rest of the current epoch; starting a new pass closes an unfinished one."""
        self._close_active()  # its threads stop and (CUDA) its copies finish before the ring is reused
        self.reader._check_open()
        gen = self._run()   # the pass starts (and the restored position is used) at the first next()
        self._active = weakref.ref(gen)
        return gen

    def _run(self) -> Iterator[dict[str, torch.Tensor]]:
        """The feeder's batches, with the wait for each measured and the resume point kept.

        The pass reads ``epoch`` and the position when it starts (the first ``next``), not when ``iter`` made it:
        Lightning calls ``iter`` on a restored loader, then ``set_epoch`` on it, then ``next``; the restored
        position must survive until then (:meth:`~precompile.reader.resume.Resumable.set_epoch`)."""
        self._resume = False
        epoch = self.epoch
        plan = self.pass_plan(epoch, self._pos)
        stats = self.stats
        stats.reset()
        if self.window is not None:
            self.window.start(plan)
        feed = self.feeder.feed(plan)
        try:
            while True:
                t0 = time.perf_counter()
                if stats._t0 is None:
                    stats._t0 = t0
                got = next(feed, None)
                if got is None:
                    break
                b, out = got
                if self.window is not None:
                    self.window.advance(b)
                if self.text_fields:
                    out.update(self._texts(self.batch_indices(epoch)[b]))
                if self.listed:
                    out.update(self._listed_rows(self.batch_indices(epoch)[b]))
                if self.target_fields is not None:
                    out = replace_with_targets(out, self.target_fields)
                t1 = time.perf_counter()
                stats.waits.append(t1 - t0)
                stats.wait_s += t1 - t0
                stats.batches += 1
                self._pos = b + 1
                yield out
                stats.elapsed_s = time.perf_counter() - stats._t0
            self.epoch, self._pos = epoch + 1, 0
        finally:
            feed.close()
            if self.window is not None:
                self.window.stop()

    def pass_plan(self, epoch: int, start: int = 0) -> PassPlan:
        """The gather tasks of ``epoch`` from batch ``start`` (what a pass over it runs)."""
        group = group_size(sum(self.reader.row_bytes.values()), self.batch_size)
        if self.window is not None:   # from a URL: a task reads about one shard's rows, not a whole cache's
            group = min(group, self.window.max_group(self.batch_size))
        return PassPlan.make(epoch, self.batch_indices(epoch), start, group, self.prefetch)

    def _texts(self, rows: np.ndarray) -> dict[str, list[str]]:
        """The text fields of batch ``rows``, each a list of str in batch order."""
        if self._text_ds is None:
            from . import open_dataset

            reopen = getattr(self.ds, "reopen", None)   # a build read from a URL: its shards are in the cache
            self._text_ds = reopen(self.text_fields) if reopen else open_dataset(self.ds.path, fields=self.text_fields)
        b = self._text_ds.batch(rows)
        return {f: b[f] for f in self.text_fields}

    def _check_listed(self, steps: Sequence[Any]) -> None:
        """``targets="list"`` over fields of varying shape: they come as stored, so no device step and no
        conversion may be asked of them (a ``ValueError`` naming them)."""
        names = ", ".join(repr(f) for f in self.listed)
        if steps:
            raise ValueError(f"targets='list' gives {names} (a shape that varies between samples) as a list of "
                             f"tensors of their own sizes, as stored; gpu_steps need one size a batch: leave them "
                             f"out, or resize to a fixed size in the recipe")
        c = self.conversion
        if c.dtype is not None or c.channels_first:
            hit = [f for f in self.listed if (f in c.convert_fields if c.convert_fields is not None
                                              else self.specs[f].get("kind") in CONVERT_KINDS)]
            if hit:
                raise ValueError(f"targets='list' gives {', '.join(repr(f) for f in hit)} (a shape that varies "
                                 f"between samples) as a list of tensors as stored; the conversion (dtype, mean/std, "
                                 f"channels_first) applies to fixed-shape fields: convert each image in the model "
                                 f"(torchvision's detection models normalise their inputs), or resize to a fixed "
                                 f"size in the recipe")

    def _listed_rows(self, rows: np.ndarray) -> dict[str, list[torch.Tensor]]:
        """The fields of varying shape of batch ``rows`` (``targets="list"``): each a list of tensors of their own
        sizes, in batch order, on the Loader's device."""
        if self._listed_ds is None:
            from . import open_dataset

            reopen = getattr(self.ds, "reopen", None)   # a build read from a URL: its shards are in the cache
            self._listed_ds = reopen(self.listed) if reopen else open_dataset(self.ds.path, fields=self.listed)
        samples = [self._listed_ds[int(r)] for r in rows]
        return {f: [torch.from_numpy(np.array(s[f])).to(self.device) for s in samples] for f in self.listed}

    def _close_active(self) -> None:
        old = self._active() if self._active is not None else None
        if old is not None:
            old.close()
        self._active = None

    def close(self) -> None:
        """Stop an unfinished pass (its threads and copies end first), then release the shard maps, the files
        the text fields were read from, and the build if this Loader opened it (from a URL: everything it held
        in the cache, its copy of the index included).

        Iterating afterwards is a :class:`~precompile.errors.PrecompileError` ("reader is closed").
        """
        self._close_active()
        if self.window is not None:
            self.window.stop()
        self.reader.close()
        self.feeder.release()
        if self._text_ds is not None:
            self._text_ds.close()
        if self._listed_ds is not None:
            self._listed_ds.close()
        if self._owns_ds:
            getattr(self.ds, "release", self.ds.close)()

    def __repr__(self) -> str:
        return (f"Loader({getattr(self.ds, 'url', self.ds.path)!r}, batch_size={self.batch_size}, shuffle={self.mode!r}, device={self.device}, "
                f"fields={self.fields}, rank={self.rank}/{self.world_size}"
                + (" (from torch.distributed)" if self.distribution.source == "torch.distributed" else "")
                + f", fast={self.reader.fast})")
