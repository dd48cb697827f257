"""Mix: several builds, any formats, read as one weighted stream of batches.

::

    mix = precompile.Mix(["build/a.h5", "build/b.json"], weights=[0.7, 0.3], batch_size=256,
                         stop="first_exhausted", seed=0)
    for epoch in range(10):
        mix.set_epoch(epoch)
        for batch in mix:      # {"image": (256, ...), "label": (256,), "__source": (256,) int64, "__row": (256,)}
            ...

Design: a sampler over ``(source, row)`` pairs fed to one reader per source;
nothing of the Loader's gather is forked. An HDF5 build is read by the
Loader's own :class:`~precompile.reader.direct.DirectReader` (memory-mapped
shards), a folder build (png/bmp/wav: a JSON index) by its dataset's
``batch``; each batch's rows of a source are read in one call and put in their
places in the batch.

One epoch of the mix, for ``(seed, epoch)``:

1. **How many samples of each source.** The weights, normalised to ``p``, and
   ``stop`` give the epoch's length ``N``: ``"first_exhausted"`` the largest
   ``N`` with ``N * p[i] <= len(source i)`` for every source (the epoch ends
   when the first source runs out: no sample twice; ``cycle=[...]`` leaves
   the sources marked True out of that minimum: they are read again as
   needed); ``"all_exhausted"`` the
   smallest ``N`` with ``N * p[i] >= len(source i)`` (every source seen whole
   at least once: the others cycle, some of their samples twice); an int: that
   many samples. Then each source gets exactly ``floor(N * p[i])`` samples, the
   rest handed out one each by the largest remainder (ties to the lower index),
   computed with exact fractions (a weight is the decimal it is written as:
   0.3 is 3/10): the counts are the same every epoch and sum to ``N``, no
   random drift.
2. **Which rows.** Each source is an endless stream of passes over its rows
   (each pass a permutation seeded by ``(seed, source, pass)``; in file order
   without ``shuffle``); epoch ``e`` takes the stream's samples
   ``[e * c[i], (e + 1) * c[i])``. A source that is not exhausted in an
   epoch goes on where it stopped in the next, so over the epochs every row
   comes up equally often (to one pass). Where an epoch runs from the end of
   one pass into the next, the next pass puts first the rows that end did not
   give (:meth:`Mix._pass`): a source of at most ``c[i] <= len`` samples an
   epoch shows no row twice in it.
3. **In which order.** The source of each of the ``N`` places: a seeded
   permutation of ``c[0]`` zeros, ``c[1]`` ones, ...; without ``shuffle``, the
   sources interleaved evenly (the ``k``-th sample of source ``i`` at
   ``(k + 0.5) / c[i]``). Source ``i``'s rows fill its places in stream order.
4. **Ranks.** The global order is cut into ``world_size`` disjoint, equal,
   contiguous shares exactly as the Loader cuts its own
   (:func:`~precompile.reader.sampler.rank_share`), then into batches. With
   ``sort_batches`` (default, shuffled mixes) each batch's samples are put in
   order of source, then of their place in the files, so that each source's
   rows are read in one call straight into their slice of the batch (the
   Loader's ``sort_batches``: the same members, another order).

The draws come from :func:`precompile.seeding.rng_for`; nothing depends on the
thread count, so the same seed gives the same batches with any ``num_threads``,
and ``state_dict`` / ``load_state_dict`` resume mid-epoch with exactly the
remaining batches. On CPU the batches are read as the Loader's CPU feeder reads
them (:class:`_MixFeeder`, a :class:`~precompile.reader.cpu_feeder.CpuFeeder`):
tasks of whole batches (:func:`~precompile.reader.feed.group_size`: about 4 MiB
of stored rows) read into reused host buffers
(:class:`~precompile.reader.feed.HostPool`: a buffer is reused only once every
tensor made from it is gone), converted once a task where there are no steps,
then cut into batches; on CUDA each batch is read into its own host arrays.

5. **Conversion and device steps** are the Loader's own code: its option group
   (:class:`~precompile.reader.options.Conversion`), its ``converts_for`` and
   its :class:`~precompile.reader.feed.Finisher`. Batch ``b`` of this rank's
   epoch ``e`` draws its steps' parameters as the Loader's batch ``b`` does,
   from ``(seed, e, rank, b, step)`` (:func:`~precompile.reader.gpu.step_params`),
   sample ``j`` taking the ``j``-th draw: the draw key of a mixed batch is its
   place in the rank's epoch, never a thread's, so threads and resume keep the
   bytes. The ragged annotation fields (boxes, box_labels, keypoints) are held
   in memory per build and padded per batch as the Loader pads them; the steps
   move them on the host.
"""
from __future__ import annotations

import math
import os
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch

from ..errors import FormatError, PrecompileError
from ..sample import field_list
from ..seeding import rng_for
from . import augment, gpu
from .cpu_feeder import CpuFeeder
from .feed import Batch, Finisher, HostPool, PassPlan, converts_for, group_size, stored_norm
from .options import Conversion, Distribution, flag, whole
from .ragged import RaggedFields, check_count_names, count_name, is_ragged_annotation, pad_rows
from .resume import Resumable
from .rows import fixed_shape
from .sampler import rank_share, split_batches

__all__ = ["Mix", "mix_counts"]

STOPS = ("first_exhausted", "all_exhausted")
MAX_EPOCH = 2 ** 28   #: samples in one epoch of a mix at most (its order: 24 bytes a sample in memory)
SOURCE, ROW = "__source", "__row"
#: a read task's runs of one source's samples shorter than this (stored bytes, on average) are read one call per
#: source and put in their places: a gather call costs ~40-90 us, about what copying 256-500 KiB costs
RUN_BYTES = 256 << 10


def check_weights(weights: Sequence[float] | None, sizes: Sequence[int]) -> list[Fraction]:
    """The weights as exact fractions summing to 1; None: proportional to the sources' sizes."""
    if weights is None:
        total = sum(sizes)
        if total == 0:
            raise ValueError("Mix: every source is empty")
        return [Fraction(int(n), total) for n in sizes]
    import numbers

    # (a string was iterated: weights="12" read as [1, 2]; "2" and True were taken as numbers)
    bad = isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__iter__") or any(
        isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real) for w in weights)
    if bad:
        raise ValueError(f"Mix: weights must be a list of numbers, one per source, got {str(weights)[:200]}")
    ws = [float(w) for w in weights]
    if len(ws) != len(sizes):
        raise ValueError(f"Mix: {len(ws)} weights for {len(sizes)} sources")
    for i, w in enumerate(ws):
        if not math.isfinite(w):
            raise ValueError(f"Mix: weight {i} is {w}; weights must be finite numbers >= 0")
        if w < 0:
            raise ValueError(f"Mix: weight {i} is {w}; weights must be >= 0")
    # each weight as the decimal it is written as (0.3 is 3/10, not the binary float a hair under it), so that
    # weights like [0.3, 0.7] give the counts their arithmetic does
    fr = [Fraction(repr(w)) for w in ws]
    total = sum(fr)
    if total == 0:
        raise ValueError(f"Mix: the weights sum to 0 ({ws}); give at least one source a weight > 0")
    for i, (p, n) in enumerate(zip(fr, sizes)):
        if p > 0 and n == 0:
            raise ValueError(f"Mix: source {i} is empty but has weight {ws[i]}")
    return [p / total for p in fr]


def mix_counts(p: Sequence[Fraction], sizes: Sequence[int], stop: str | int,
               cycle: Sequence[bool] | None = None) -> list[int]:
    """Samples of each source in one epoch: ``N`` from ``stop``, apportioned by the largest remainder.
    ``cycle`` (with ``"first_exhausted"``): the sources that never end the epoch (they are read again as needed)."""
    active = [i for i, q in enumerate(p) if q > 0]
    if isinstance(stop, str):
        if stop == "first_exhausted":
            ending = [i for i in active if not (cycle and cycle[i])]
            if not ending:
                raise ValueError("Mix: every source with a weight > 0 has cycle=True, so none ends the epoch; let "
                                 "one run out (cycle=False) or give stop=<samples per epoch>")
            n = min(math.floor(Fraction(sizes[i]) / p[i]) for i in ending)
        elif stop == "all_exhausted":
            n = max(math.ceil(Fraction(sizes[i]) / p[i]) for i in active)
        else:
            raise ValueError(f"Mix: stop must be 'first_exhausted', 'all_exhausted' or a number of samples per "
                             f"epoch, got {stop!r}")
    else:
        n = stop
    if n > MAX_EPOCH:
        raise ValueError(f"Mix: stop={stop!r} with these weights makes an epoch of {n:,} samples (more than "
                         f"{MAX_EPOCH:,}: its order is held in memory, 24 bytes a sample); give a build with a "
                         f"small weight more weight, or stop=<samples per epoch>")
    quota = [n * q for q in p]
    counts = [math.floor(x) for x in quota]
    rest = n - sum(counts)
    by_remainder = sorted(range(len(p)), key=lambda i: (-(quota[i] - counts[i]), i))
    for i in by_remainder[:rest]:
        counts[i] += 1
    return counts


def _check_cycle(cycle: Any, stop: str | int, n: int) -> list[bool] | None:
    if cycle is None:
        return None
    if isinstance(cycle, (str, bytes)) or not hasattr(cycle, "__len__") or len(cycle) != n or any(
            not isinstance(c, (bool, np.bool_)) for c in cycle):
        raise ValueError(f"Mix: cycle must be one True/False per source ({n}), got {str(cycle)[:200]}")
    if stop != "first_exhausted":
        raise ValueError(f"Mix: cycle applies to stop='first_exhausted' (the sources that never end the epoch); "
                         f"with stop={stop!r} every source but the last to run out is read again as needed")
    return [bool(c) for c in cycle]


def _check_stop(stop: Any) -> str | int:
    if isinstance(stop, str):
        if stop not in STOPS:
            raise ValueError(f"Mix: stop must be 'first_exhausted', 'all_exhausted' or a number of samples per "
                             f"epoch, got {stop!r}")
        return stop
    if isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or int(stop) < 1:
        raise ValueError(f"Mix: stop must be 'first_exhausted', 'all_exhausted' or a number of samples per "
                         f"epoch >= 1, got {stop!r}")
    return int(stop)


class _Source:
    """One build of the mix: its dataset and how its rows are read (``read(rows) -> {field: array}``)."""

    def __init__(self, src: Any, fields: Sequence[str] | None, verify: bool):
        from . import open_dataset

        self.owned = isinstance(src, (str, os.PathLike))
        if self.owned:
            if "://" in str(src):
                raise PrecompileError(f"Mix: {src}: a build read from a URL; Mix reads local builds (open it with "
                                      f"precompile.Loader(url, ...) alone, or copy it to a local disk)")
            self.ds = open_dataset(src, fields=fields, verify=verify)
        else:
            if not (hasattr(src, "field_specs") and hasattr(src, "batch") and hasattr(src, "__len__")):
                raise TypeError(f"Mix: a source must be a build's index path or a build opened with "
                                f"precompile.open, got {type(src).__name__} {str(src)[:100]}")
            self.ds = src
            if getattr(src, "remote", None) is not None:
                raise PrecompileError(f"Mix: {src.url}: a build read from a URL; Mix reads local builds")
            if verify:   # as precompile.open(path, verify=True) would have
                from ..formats import check_intact, find_format

                check_intact(find_format(str(src.path)), str(src.path))
        self.name = str(getattr(self.ds, "path", src))
        self.n = len(self.ds)
        self.reader: Any = None
        self.ragged: RaggedFields | None = None
        self.batch_ds = self.ds   # what a folder build's rows are read from (the loaded fixed-shape fields only)
        self.memory: dict[str, np.ndarray] | None = None   # a folder build's fields with in_memory=True

    def open_reader(self, fields: list[str], ragged: list[str], in_memory: bool = False) -> None:
        """Read the fixed-shape ``fields`` (HDF5: the Loader's DirectReader; a folder build: its ``batch``) and
        hold the ragged annotation fields ``ragged`` in memory (HDF5: the Loader's RaggedFields; a folder build:
        each sample's rows read once, :class:`_FolderRagged`). ``in_memory``: the fixed-shape fields copied into
        process memory once (HDF5: the DirectReader's ``in_memory``; a folder build: one array per field)."""
        out_format = str((getattr(self.ds, "attrs", None) or {}).get("output_format", "hdf5"))
        hdf5 = out_format == "hdf5" and (hasattr(self.ds, "shard_table") or hasattr(self.ds, "shards"))
        if hdf5:
            from .direct import DirectReader

            self.reader = DirectReader(self.ds, fields, in_memory=in_memory)
        else:
            if list(self.ds.fields) != list(fields):   # its batch reads every field it was opened with: only these
                from . import open_dataset

                self.batch_ds = open_dataset(self.ds.path, fields=fields) if fields else None
            if in_memory and self.batch_ds is not None:
                self.memory = dict(self.batch_ds.batch(np.arange(self.n)))
        if ragged:
            self.ragged = RaggedFields(self.ds, ragged) if hdf5 else _FolderRagged(self.ds, ragged)
        self.fields = fields

    def gather_key(self, rows: np.ndarray) -> np.ndarray:
        """A sort key of ``rows`` that puts them in the order they are read fastest (address order)."""
        return self.reader.gather_rank[rows] if self.reader is not None else np.asarray(rows, dtype=np.int64)

    def read_into(self, rows: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` (``{field: (len(rows), ...)}``, C-contiguous) with ``rows`` in the given order."""
        if self.reader is not None:
            with self.reader.plan(rows) as plan:
                for f in self.fields:
                    self.reader.gather(f, plan, out[f])
            return
        if self.memory is not None:
            for f in self.fields:
                np.take(self.memory[f], rows, axis=0, out=out[f])
            return
        if self.batch_ds is None:
            return
        b = self.batch_ds.batch(rows)
        for f in self.fields:
            out[f][...] = b[f]

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.batch_ds is not None and self.batch_ds is not self.ds:
            self.batch_ds.close()
        self.memory = None
        if self.owned:
            self.ds.close()


def mix_for_loader(sources: Sequence[Any], args: tuple, kwargs: dict[str, Any], loader_init: Any) -> "Mix":
    """``Loader([a, b, ...], ...)``: the Loader's arguments (positional ones in the order of ``loader_init``, the
    Loader's ``__init__``) read as a :class:`Mix`'s. The Loader's options a Mix has are passed on with their
    meaning (``shuffle=True``/``"full"``: True); one it has not (``block_window``, ``copies``, ``targets``,
    ``map_shards``, ...) is a ``ValueError`` naming ``precompile.Mix``."""
    import inspect

    names = [p for p in inspect.signature(loader_init).parameters if p not in ("self", "path_or_dataset")]
    if len(args) > len(names):
        raise TypeError(f"Loader() takes at most {len(names) + 1} positional arguments ({len(args) + 1} given)")
    given = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in given:
            raise TypeError(f"Loader() got multiple values for argument {k!r}")
        given[k] = v
    head = "Loader([...]): a list of builds is read as one precompile.Mix"
    if "shuffle" in given:
        sh = given["shuffle"]
        if sh is not False and sh is not True and sh != "full":
            raise ValueError(f"{head}, which shuffles fully (shuffle=True or 'full') or not at all (False), got "
                             f"shuffle={sh!r}")
        given["shuffle"] = sh is True or sh == "full"
    mine = set(inspect.signature(Mix.__init__).parameters) - {"self", "sources"}
    for k in given:
        if k not in mine and k in names:
            raise ValueError(f"{head}, which has no {k} (an option of the Loader of one build); leave it out, or "
                             f"make one Loader per build")
    return Mix(list(sources), **given)


class _FolderRagged:
    """The ragged annotation fields of a folder build (png/bmp: in its JSON index), every sample's rows read
    once into memory (as :class:`~precompile.reader.ragged.RaggedFields` holds an HDF5 build's)."""

    def __init__(self, ds: Any, fields: Sequence[str]):
        from . import open_dataset

        only = open_dataset(ds.path, fields=list(fields))
        try:
            self.data = {f: [] for f in fields}
            for i in range(len(only)):
                sample = only[i]
                for f in fields:
                    self.data[f].append(np.asarray(sample[f]))
        finally:
            only.close()

    def rows(self, name: str, i: int) -> np.ndarray:
        return self.data[name][i]


class _RaggedKeys:
    """The batch keys of a Mix's ragged fields, for the Loader's Finisher (which moves them with the steps on the
    host, then to the batch's device), and how a task's padded rows are cut to each batch's own width (the
    Loader's :class:`~precompile.reader.ragged.RaggedFields` rule, the same code)."""

    def __init__(self, fields: Sequence[str]):
        self.fields = list(fields)

    def keys(self) -> list[str]:
        return [k for f in self.fields for k in (f, count_name(f))]

    widths = RaggedFields.widths
    trim = RaggedFields.trim


class _MixFeeder(CpuFeeder):
    """The Loader's CPU feeder (its threads, its tasks ahead, its :class:`~precompile.reader.feed.HostPool`,
    its :meth:`~precompile.reader.feed.Finisher.finish_group`) over a Mix's tasks: a task's batches are read,
    each source's rows of a batch in one call, into one set of reused host buffers, then converted once (no
    steps) and split into batches, as a Loader's gather task is."""

    def __init__(self, mix: "Mix", src: np.ndarray, row: np.ndarray):
        super().__init__(None, [], mix.finisher, mix.finisher.pool, mix.num_threads)   # type: ignore[arg-type]
        self.mix, self.src, self.row = mix, src, row

    def gather(self, plan: PassPlan, k: int, split: Any = None) -> list[Batch]:
        at = plan.rows(k)   # places in the epoch's order, batch after batch
        batch = self.mix.read_task(self.src[at], self.row[at], plan.sizes(k), self.pool)
        return self.finisher.finish_group(batch, plan.sizes(k), plan.epoch, plan.tasks[k][0])


class Mix(Resumable):
    """Batches of several builds mixed by weight; see the module docstring (and docs/reference-reader.md).

    ``sources``: index paths (or builds opened with ``precompile.open``), any output format, with the same
    loaded fields (kind, shape, dtype and class names equal; a fixed shape each, or the ragged boxes,
    box_labels and keypoints, padded per batch plus ``<field>__count`` as the Loader's). ``weights``: one number >= 0
    per source (normalised; default: proportional to the sources' sizes, so each sample once per epoch).
    ``stop``: ``"first_exhausted"`` (default), ``"all_exhausted"`` or a number of samples per epoch.
    ``cycle`` (with ``"first_exhausted"``): one bool per source, True for a source that never ends the epoch
    (read again as needed: oversampled); the first of the others to run out ends it.
    ``shuffle`` (True: seeded orders; False: file order, sources interleaved evenly), ``seed``, ``batch_size``,
    ``drop_last``, ``rank`` / ``world_size`` / ``uneven`` (as the Loader's, from ``torch.distributed`` when left
    out under an initialised process group), ``device`` (``"auto"``, ``"cpu"``, ``"cuda"``), ``fields``,
    ``num_threads`` (batches read ahead by that many threads; 0: in the calling thread), ``prefetch`` (batches
    in flight), ``sort_batches`` (default True, as the Loader's: a shuffled batch's samples ordered by source,
    then by their place in the files; the same members), ``verify``. ``dtype``, ``mean``, ``std``,
    ``channels_first``, ``convert_fields``, ``gpu_steps``: the Loader's conversion and device steps, by its own code
    (:class:`~precompile.reader.options.Conversion`, :func:`~precompile.reader.feed.converts_for`, the
    :class:`~precompile.reader.feed.Finisher`); ``"stats"``: the mixed stream's, from each build's stored stats
    weighted by its share of an epoch (:func:`precompile.tools.stats.mixture_norm`). ``in_memory=True``: each
    build's loaded fields copied into process memory once (the same batches). Each batch holds the fields as tensors
    plus ``__source`` (int64: the index in ``sources`` of each sample's build) and ``__row`` (int64: its row in
    that build).
    """

    KIND = "Mix"
    STATE_CHECKS = ("seed", "shuffle", "batch_size", "world_size", "drop_last", "uneven", "stop", "sizes", "counts",
                    "sort_batches")
    STATE_ADDED = ("layout",)
    STATE_HINTS = {"layout": "state_dict was taken over other builds: a Mix's rows are each build's rows by number, "
                             "and here the builds' sample keys (in row order, build by build) differ (layout "
                             "{theirs}, this Mix's {mine}; rebuilt since, or the builds in another order?): its "
                             "position would read other samples than the rest of its epoch"}

    def __init__(self, sources: Sequence[Any], batch_size: int, weights: Sequence[float] | None = None,
                 stop: str | int = "first_exhausted", cycle: Sequence[bool] | None = None,
                 shuffle: bool = True, seed: int = 0,
                 device: str | torch.device = "auto", fields: Sequence[str] | None = None, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, uneven: Literal["pad", "drop"] = "pad",
                 num_threads: int | None = None, prefetch: int = 2, sort_batches: bool = True,
                 verify: bool = False, gpu_steps: Sequence[Any] | None = None, dtype: Any = None,
                 mean: Sequence[float] | float | str | None = None, std: Sequence[float] | float | str | None = None,
                 channels_first: bool = False, convert_fields: Sequence[str] | None = None,
                 in_memory: bool = False):
        if isinstance(sources, (str, os.PathLike)) or len(sources) < 1:
            raise ValueError("Mix: sources must be a list of builds (index paths or opened builds)")
        fields = field_list(fields)
        batch_size, prefetch, seed = whole(batch_size, "batch_size"), whole(prefetch, "prefetch"), whole(seed, "seed")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if shuffle not in (True, False):
            raise ValueError(f"Mix: shuffle must be True or False, got {shuffle!r}")
        if in_memory in ("gpu", "pinned"):
            raise ValueError(f"Mix: in_memory={in_memory!r} is the Loader's for one build (its rows gathered on the "
                             f"device); a Mix holds its builds in host memory: in_memory=True")
        if (isinstance(in_memory, (int, float)) and not isinstance(in_memory, bool)) or in_memory not in (False, True):
            raise ValueError(f"in_memory must be False or True, got {in_memory!r}")
        self.in_memory = bool(in_memory)
        self.stop = _check_stop(stop)
        self.cycle = _check_cycle(cycle, self.stop, len(sources))
        self.batch_size, self.prefetch, self.seed = int(batch_size), int(prefetch), int(seed)
        self.shuffle, self.drop_last = bool(shuffle), flag(drop_last, "drop_last")
        self.sort_batches, verify = flag(sort_batches, "sort_batches"), flag(verify, "verify")
        self.distribution = Distribution.resolve(rank, world_size, uneven)
        self.device = gpu.resolve_device(device)
        num_threads = whole(num_threads, "num_threads") if num_threads is not None else None
        if num_threads is not None and num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: read in the calling thread), got {num_threads}")
        self.num_threads = min(4, max(0, (os.cpu_count() or 1) - 1)) if num_threads is None else int(num_threads)
        self.sources: list[_Source] = []
        try:
            for s in sources:
                self.sources.append(_Source(s, fields, verify))
            self.sizes = [s.n for s in self.sources]
            self.weights = check_weights(weights, self.sizes)
            self.fields = self._agreed_fields(fields)
            self.counts = mix_counts(self.weights, self.sizes, self.stop, self.cycle)
            self.specs = {f: self.sources[0].ds.field_specs[f] for f in self.fields}
            # boxes, box_labels, keypoints: padded per batch plus <field>__count, as the Loader's
            self.ragged = [f for f in self.fields if is_ragged_annotation(self.specs[f])]
            check_count_names(self.fields, self.ragged)
            self.fixed = [f for f in self.fields if f not in self.ragged]
            for s in self.sources:
                s.open_reader(self.fixed, self.ragged, self.in_memory)
            self.shapes = {f: fixed_shape(self.specs[f]) for f in self.fixed}
            # the Loader's conversion and device steps, the same code: its option group, its Converts, its steps
            self.conversion = Conversion(dtype, mean, std, channels_first, convert_fields)
            dtypes = {f: np.dtype(self.specs[f]["dtype"]) for f in self.fixed}
            self.dtype, self.convert = converts_for(self.conversion, dtypes, self.fixed, self.specs,
                                                    self._stats_norm())
            self.steps = augment.parse_steps(gpu_steps)
            gpu.bind_steps(self.steps, self.specs, {**self.shapes, **{f: tuple(self.specs[f]["shape"])
                                                                     for f in self.ragged}})
        except BaseException:
            self.close()
            raise
        self.finisher = Finisher(self.steps, self.convert, self.seed, self.rank, HostPool(),
                                 _RaggedKeys(self.ragged) if self.ragged else None)
        self.epoch, self._pos, self._resume = 0, 0, False
        self._layout_digest: str | None = None
        self._orders: dict[int, tuple[np.ndarray, np.ndarray, list[np.ndarray]]] = {}
        self._active: weakref.ref | None = None
        self._pass_cache: dict[int, dict[int, np.ndarray]] = {}

    rank = property(lambda self: self.distribution.rank)
    world_size = property(lambda self: self.distribution.world_size)
    uneven = property(lambda self: self.distribution.uneven)

    # -- fields -----------------------------------------------------------------------------------
    def _agreed_fields(self, fields: Sequence[str] | None) -> list[str]:
        """The loaded fields, the same in every source (else an error naming the field and the builds)."""
        first = self.sources[0]
        wanted = list(fields) if fields is not None else list(first.ds.field_specs)
        for s in self.sources:
            specs = s.ds.field_specs
            for f in wanted:
                if f not in specs:
                    raise FormatError(f"Mix: field {f!r} is in {first.name} but not in {s.name} (its fields: "
                                      f"{', '.join(specs)}); mix builds with the same fields, or pass fields=[...]")
            if fields is None:
                extra = [f for f in specs if f not in wanted]
                if extra:
                    raise FormatError(f"Mix: field {extra[0]!r} is in {s.name} but not in {first.name}; mix builds "
                                      f"with the same fields, or pass fields=[...]")
        for f in wanted:
            a = first.ds.field_specs[f]
            kind = a.get("kind")
            ragged = is_ragged_annotation(a)
            if kind == "text":
                raise FormatError(f"Mix: field {f!r} of {first.name} is a text field (a varying size per "
                                  f"sample); Mix reads fixed-shape fields and the ragged boxes, box_labels and "
                                  f"keypoints: leave it out with fields=[...]")
            if ragged:
                inner = tuple((a.get("shape") or ())[1:])
                for s in self.sources[1:]:
                    b = s.ds.field_specs[f]
                    for what, x, y in (("kind", kind, b.get("kind")), ("dtype", a.get("dtype"), b.get("dtype")),
                                       ("rows of shape", inner, tuple((b.get("shape") or ())[1:])),
                                       ("tie (of)", a.get("of"), b.get("of"))):
                        if x != y or not is_ragged_annotation(b):
                            raise FormatError(f"Mix: field {f!r} has {what} {x} in {first.name} but {y} in "
                                              f"{s.name}; the mixed builds must agree")
                continue
            if fixed_shape(a) is None:
                raise FormatError(f"Mix: field {f!r} of {first.name} has shape {tuple(a.get('shape') or ())} with "
                                  f"unknown dimensions; Mix reads fixed-shape fields (resize/crop to one size in "
                                  f"the recipe)")
            for s in self.sources[1:]:
                b = s.ds.field_specs[f]
                for what in ("kind", "dtype"):
                    if a.get(what) != b.get(what):
                        raise FormatError(f"Mix: field {f!r} has {what} {a.get(what)} in {first.name} but "
                                          f"{b.get(what)} in {s.name}; the mixed builds must agree")
                if fixed_shape(a) != fixed_shape(b):
                    raise FormatError(f"Mix: field {f!r} has shape {tuple(a.get('shape') or ())} in {first.name} "
                                      f"but {tuple(b.get('shape') or ())} in {s.name}; the mixed builds must agree "
                                      f"(resize/crop them to one size in their recipes)")
        for f in wanted:   # a label's (or a box's label's) id must mean one class in every build
            if first.ds.field_specs[f].get("kind") in ("label", "box_labels"):
                for s in self.sources[1:]:
                    na, nb = list(first.ds.label_names or []), list(s.ds.label_names or [])
                    if na and nb and na != nb:
                        raise FormatError(f"Mix: field {f!r} has class names {str(na)[:120]} in {first.name} but "
                                          f"{str(nb)[:120]} in {s.name}: the same id would mean two classes")
        return wanted

    def _stats_norm(self) -> Any:
        """What ``mean="stats"`` / ``std="stats"`` stand for: the stored stats of the one build read, or of the
        stream that mixes the builds read (each build's share: its samples per epoch over the epoch's)."""
        active = [i for i, c in enumerate(self.counts) if c > 0]
        builds = [self.sources[i].ds for i in active]
        if len(active) == 1:
            return stored_norm(builds)
        total = sum(self.counts)
        return stored_norm(builds, [Fraction(self.counts[i], total) for i in active])

    # -- order ------------------------------------------------------------------------------------
    def _raw_pass(self, i: int, k: int) -> np.ndarray:
        return rng_for(self.seed, "mix/source", i, int(k)).permutation(self.sizes[i])

    def _pass(self, i: int, k: int) -> np.ndarray:
        """Pass ``k`` over source ``i``'s rows, for a source of at most its size per epoch: the seeded
        permutation, except that where an epoch runs from the end of pass ``k - 1`` into pass ``k``, the rows
        that epoch takes from pass ``k`` are its first rows that the end of pass ``k - 1`` did not give (the
        others keep their order, after them): no row twice in an epoch.

        A pass depends on the one before only through that end (its last ``r_k = k * n mod c`` rows), and the
        rows moved to the front of pass ``k - 1`` lie in its permutation's first ``c`` places: where
        ``r_k <= n - c`` the end of pass ``k - 1`` is its seeded permutation's own end, so pass ``k`` follows from
        two permutations (:meth:`_start_of_chain`). The passes are made from the last such pass at or before
        ``k`` (or a kept one), never from pass 0: reaching a far epoch costs at most ``ceil(c / (n - c)) + 1``
        passes of the source (one where ``n >= 2c`` or ``c == n``); the last two are kept (a pass of training
        asks for the next)."""
        got = self._pass_cache.setdefault(i, {})
        if k in got:
            return got[k]
        n, c = self.sizes[i], self.counts[i]
        j0 = self._start_of_chain(n, c, k)
        j = max((q for q in got if j0 <= q < k), default=-1)
        if j >= 0:
            prev, first = got[j], j + 1
        else:   # pass j0 from its seeded permutation and the seeded end of pass j0 - 1
            prev, first = None, j0
        for q in range(first, k + 1):
            perm = self._raw_pass(i, q)
            boundary = q * n                         # stream position where pass q starts
            r = boundary % c                          # samples of the straddling epoch before it
            if q > 0 and r:
                w = c - r                             # ... and from pass q
                tail = prev[n - r:] if prev is not None else self._raw_pass(i, q - 1)[n - r:]
                clash = np.isin(perm, tail)
                free = np.flatnonzero(~clash)[:w]     # w <= n - r: always enough rows that are not in the tail
                rest = np.ones(n, dtype=bool)
                rest[free] = False
                perm = np.concatenate([perm[free], perm[rest]])
            prev = perm
            got[q] = perm
            for old in [x for x in got if x < q - 1]:
                del got[old]
        return got[k]

    @staticmethod
    def _start_of_chain(n: int, c: int, k: int) -> int:
        """The last pass ``j <= k`` of a source of ``n`` rows and ``c <= n`` samples an epoch whose order follows
        from the seeded permutations of passes ``j - 1`` and ``j`` alone: the one whose straddling epoch's
        samples before it, ``r_j = j * n mod c``, are at most ``n - c`` (the end of pass ``j - 1`` lies past the
        rows its own straddling epoch moved to its front, which are in its first ``c`` places). Going back one
        pass lowers ``r`` by ``d = n - c`` (mod ``c``), so it is at most ``ceil(r_k / d)`` passes back; ``r_0 = 0``."""
        r = (k * n) % c
        d = n - c
        if r <= d:
            return k
        return k - (r - 1) // d   # the fewest t with r - t * d <= d: r - t * d stays > 0 on the way (no wrap)

    def _stream(self, i: int, start: int, count: int) -> np.ndarray:
        """Samples ``[start, start + count)`` of source ``i``'s endless stream of passes."""
        n = self.sizes[i]
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        pos = np.arange(start, start + count, dtype=np.int64)
        passes, off = np.divmod(pos, n)
        if not self.shuffle:
            return off            # consecutive rows modulo n: no row twice while count <= n
        out = np.empty(count, dtype=np.int64)
        for k in np.unique(passes).tolist():
            # more samples than rows per epoch: rows come again anyway, each pass its own permutation
            perm = self._pass(i, int(k)) if self.counts[i] <= n else self._raw_pass(i, int(k))
            sel = passes == k
            out[sel] = perm[off[sel]]
        return out

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The global mixed order of ``epoch`` (every rank's): ``(source, row)`` arrays of length ``N``."""
        counts = self.counts
        if self.shuffle:
            labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
            src = labels[rng_for(self.seed, "mix/order", int(epoch)).permutation(len(labels))]
        else:
            keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c] or [np.zeros(0)])
            labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
            src = labels[np.lexsort((labels, keys))]
        row = np.empty(len(src), dtype=np.int64)
        for i, c in enumerate(counts):
            row[src == i] = self._stream(i, int(epoch) * c, c)
        return src, row

    def _batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        got = self._orders.get(epoch)
        if got is None:
            if epoch < 0:
                raise ValueError(f"epoch must be >= 0, got {epoch}")
            if (int(epoch) + 1) * max(self.counts, default=0) >= 2 ** 63:   # stream positions are int64
                raise ValueError(f"Mix: epoch {epoch} is past the last epoch this Mix can count (each build's "
                                 f"stream positions, epoch x its samples per epoch {max(self.counts)}, are int64)")
            src, row = self.epoch_order(epoch)
            share = rank_share(np.arange(len(src), dtype=np.int64), self.rank, self.world_size, self.uneven)
            batches = split_batches(share, self.batch_size, self.drop_last)
            if self.sort_batches and self.shuffle:
                # the order inside a batch carries no information for training: each source's samples
                # together, in the order its reader reads fastest (the Loader's sort_batches)
                key = np.zeros(len(src), dtype=np.int64)
                for i, s in enumerate(self.sources):
                    at = src == i
                    key[at] = s.gather_key(row[at])
                batches = [b[np.lexsort((key[b], src[b]))] for b in batches]
            got = (src, row, batches)
            self._orders = {epoch: got}   # one epoch kept
        return got

    def batch_indices(self, epoch: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """This rank's batches of ``epoch`` (default: the current one) as ``(source, row)`` array pairs."""
        src, row, batches = self._batches(self.epoch if epoch is None else int(epoch))
        return [(src[b], row[b]) for b in batches]

    def __len__(self) -> int:
        return len(self._batches(self.epoch)[2])

    def batch_maps(self, b: int, epoch: int | None = None,
                   field: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where batch ``b`` of ``epoch`` (default: the current one) came from, as the Loader's ``batch_maps``:
        its samples' builds and rows (``batch_indices(epoch)[b]``) and (B, 2, 3) float64 maps from the batch's
        pixel coordinates back to each stored sample's (the inverse of the ``gpu_steps`` as drawn for that batch;
        identities without steps). ``precompile.open(sources[s]).to_source(r, ..., device_map=maps[j])`` gives a
        prediction in the source image's pixels. ``field``: the image field the maps follow (default: the first
        loaded image field). The draws are a function of (seed, epoch, rank, b): no pass is needed."""
        e = self.epoch if epoch is None else int(epoch)
        batches = self.batch_indices(e)
        if not 0 <= int(b) < len(batches):
            raise IndexError(f"batch {b} out of range: epoch {e} has {len(batches)} batches on this rank")
        src, row = batches[int(b)]
        if field is None:
            field = next((f for f in self.fixed if self.specs[f].get("kind") == "image"), None)
        params = gpu.step_params(self.steps, self.seed, e, self.rank, int(b), len(src))
        return src, row, gpu.device_maps(self.steps, params, len(src), field)

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is (epoch, batches handed out) and what the order depends on."""
        return {"epoch": self.epoch, "batch": self._pos, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "rank": self.rank, "world_size": self.world_size,
                "drop_last": self.drop_last, "uneven": self.uneven, "stop": self.stop, "sizes": list(self.sizes),
                "counts": list(self.counts), "sort_batches": self.sort_batches, "layout": self._layout()}

    def _layout(self) -> str:
        """A digest of every build's sample keys in row order, build by build (computed once)."""
        if self._layout_digest is None:
            import hashlib

            h = hashlib.sha256()
            for s in self.sources:
                h.update(hashlib.sha256("\0".join(s.ds.keys).encode("utf-8", "surrogatepass")).digest())
            self._layout_digest = h.hexdigest()[:16]
        return self._layout_digest

    # -- reading ----------------------------------------------------------------------------------
    def read_batch(self, src: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of the samples ``(src[j], row[j])`` in that order, as numpy arrays (plus ``__source``,
        ``__row``), in fresh arrays."""
        b = len(src)
        out = {f: np.empty((b, *self.shapes[f]), dtype=np.dtype(self.specs[f]["dtype"])) for f in self.fixed}
        self._read_fixed(src, row, out)
        out.update(self._ragged_rows(src, row))
        out[SOURCE] = np.asarray(src, dtype=np.int64).copy()
        out[ROW] = np.asarray(row, dtype=np.int64).copy()
        return out

    def read_task(self, src: np.ndarray, row: np.ndarray, sizes: list[int], pool: HostPool) -> Batch:
        """A gather task: the batches of ``sizes`` samples that ``(src, row)`` hold one after another, read into
        host buffers from ``pool`` (reused only once every tensor made from one is gone): each run of one
        source's rows in one call straight into its slice (sorted batches: a source's rows of a batch, and of the
        next batches where they follow on; one source: the whole task, as the Loader gathers a task), or, where
        the runs are short (:data:`RUN_BYTES`), each source's rows of the task in one call, then put in their
        places; the ragged fields padded over the task (:meth:`Finisher.finish_group` cuts each
        batch to its own width). Host tensors."""
        out = {f: pool.get((len(src), *self.shapes[f]), np.dtype(self.specs[f]["dtype"])) for f in self.fixed}
        cut = (np.flatnonzero(src[1:] != src[:-1]) + 1).tolist()
        row_bytes = sum(a[0].nbytes for a in out.values()) if len(src) else 0
        present = np.unique(src).tolist()
        if len(cut) + 1 <= len(present) or len(src) * row_bytes >= RUN_BYTES * (len(cut) + 1):
            # one run per source, or long runs (sorted batches: a source's samples of a batch, and of the next
            # batches where they follow on; one source: the whole task): each run read in one call into its slice
            for lo, hi in zip([0, *cut], [*cut, len(src)]):
                self.sources[int(src[lo])].read_into(row[lo:hi], {f: a[lo:hi] for f, a in out.items()})
        else:
            # short runs (small batches, several sources; unsorted batches): each source's samples of the task in
            # one call, into a buffer, then put in their places (a copy costs less than a call per run)
            for i in present:
                at = np.flatnonzero(src == i)
                tmp = {f: np.empty((len(at), *a.shape[1:]), dtype=a.dtype) for f, a in out.items()}
                self.sources[i].read_into(row[at], tmp)
                for f, a in out.items():
                    a[at] = tmp[f]
        out.update(self._ragged_rows(src, row))
        out[SOURCE] = np.asarray(src, dtype=np.int64).copy()
        out[ROW] = np.asarray(row, dtype=np.int64).copy()
        return {f: torch.from_numpy(a) for f, a in out.items()}

    def _read_fixed(self, src: np.ndarray, row: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` (``{field: (len(src), ...)}``, C-contiguous) with the fixed-shape fields of the samples
        ``(src[j], row[j])``. A source whose samples stand together (the sorted batches) is read straight into
        its slice; one whose samples are spread (``sort_batches=False``) into a buffer, then put in its places."""
        for i in np.unique(src).tolist():
            at = np.flatnonzero(src == i)
            lo, hi = int(at[0]), int(at[-1]) + 1
            if hi - lo == len(at):
                self.sources[i].read_into(row[lo:hi], {f: out[f][lo:hi] for f in self.fixed})
            else:
                tmp = {f: np.empty((len(at), *self.shapes[f]), dtype=out[f].dtype) for f in self.fixed}
                self.sources[i].read_into(row[at], tmp)
                for f in self.fixed:
                    out[f][at] = tmp[f]

    def _ragged_rows(self, src: np.ndarray, row: np.ndarray) -> dict[str, np.ndarray]:
        """The ragged fields of the samples, each from its own build, padded as the Loader pads them, and their
        counts."""
        out: dict[str, np.ndarray] = {}
        for f in self.ragged:
            rows = [self.sources[s].ragged.rows(f, r) for s, r in zip(src.tolist(), row.tolist())]
            spec = self.specs[f]
            out[f], out[count_name(f)] = pad_rows(rows, tuple(spec["shape"][1:]), np.dtype(spec["dtype"]))
        return out

    def _to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Tensors on the device; the ragged fields and their counts stay on the host until the Finisher has
        moved them with the device steps (as the Loader's), then go to the device."""
        out = {f: torch.from_numpy(a) for f, a in arrays.items()}
        if self.device.type == "cuda":
            host = set(self.finisher.ragged.keys()) if self.finisher.ragged is not None else set()
            out = {f: t if f in host else t.pin_memory().to(self.device, non_blocking=True) for f, t in out.items()}
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """A pass over the rest of the current epoch; starting a new pass closes an unfinished one."""
        old = self._active() if self._active is not None else None
        if old is not None:
            old.close()
        if not self.sources:
            raise PrecompileError("Mix: closed (make a new Mix to read again)")
        gen = self._run()   # the pass starts (and the restored position is used) at the first next()
        self._active = weakref.ref(gen)
        return gen

    def pass_plan(self, epoch: int, start: int = 0) -> PassPlan:
        """The CPU read tasks of ``epoch`` from batch ``start``: whole batches, about
        :data:`~precompile.reader.feed.GROUP_BYTES` of stored rows a task, as the Loader groups them
        (:func:`~precompile.reader.feed.group_size`); ``prefetch`` batches in flight."""
        row_bytes = sum(int(np.prod(self.shapes[f], dtype=np.int64)) * np.dtype(self.specs[f]["dtype"]).itemsize
                        for f in self.fixed)
        return PassPlan.make(epoch, self._batches(epoch)[2], start, group_size(row_bytes, self.batch_size),
                             self.prefetch)

    def _run(self) -> Iterator[dict[str, torch.Tensor]]:
        self._resume = False   # the pass starts here, at the first next(): as the Loader's (Lightning's order)
        epoch = self.epoch
        src, row, batches = self._batches(epoch)
        if self.device.type != "cuda":
            # the Loader's CPU feeder: tasks of whole batches read into reused host buffers, converted once a
            # task where there are no steps (the steps' draws keyed by batch: any grouping gives the same bytes)
            feed = _MixFeeder(self, src, row).feed(self.pass_plan(epoch, self._pos))
            try:
                for b, out in feed:
                    self._pos = b + 1
                    yield out
            finally:
                feed.close()
            self.epoch, self._pos = epoch + 1, 0
            return
        # CUDA: each batch read into fresh host arrays by a reading thread, then pinned, copied and finished on
        # the device in the consumer's thread, on the current stream
        todo = range(self._pos, len(batches))

        def finish(b: int, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
            return self.finisher.finish(self._to_device(arrays), epoch, b)

        if self.num_threads == 0:
            for b in todo:
                out = finish(b, self.read_batch(src[batches[b]], row[batches[b]]))
                self._pos = b + 1
                yield out
        else:
            pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="precompile-mix")
            ahead: deque = deque()
            it = iter(todo)

            def submit(b: int) -> None:
                ahead.append((b, pool.submit(self.read_batch, src[batches[b]], row[batches[b]])))

            try:
                for b in it:
                    submit(b)
                    if len(ahead) >= self.prefetch:
                        break
                while ahead:
                    b, fut = ahead.popleft()
                    nxt = next(it, None)
                    if nxt is not None:
                        submit(nxt)
                    out = finish(b, fut.result())
                    self._pos = b + 1
                    yield out
            finally:
                for _, fut in ahead:
                    fut.cancel()
                pool.shutdown(wait=True)
        self.epoch, self._pos = epoch + 1, 0

    def close(self) -> None:
        """Stop an unfinished pass, release every source's reader and the builds this Mix opened."""
        old = self._active() if getattr(self, "_active", None) is not None else None
        if old is not None:
            old.close()
        for s in self.sources:
            s.close()
        self.sources = []

    def __repr__(self) -> str:
        names = [s.name for s in self.sources]
        return (f"Mix({names}, weights={[float(w) for w in self.weights]}, stop={self.stop!r}, "
                f"counts={self.counts}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world_size}"
                + (" (from torch.distributed)" if self.distribution.source == "torch.distributed" else "")
                + f", device={self.device})")
