"""Raw access to a build's shard files: chunk byte offsets resolved once, batches gathered from memory maps.

The Loader's hot path never calls h5py per batch. When a :class:`DirectReader` opens a build, each row of a
served field gets its byte address in its shard file (:mod:`.rows`: from the index's chunk tables, every
shard at once, or through h5py for a shard without them), and the shard files are mapped
(:mod:`.mapping`).

All shard files are mapped into ONE reserved range of virtual addresses
(:class:`~.mapping.Region`; every slot when the reader is made, or with ``lazy`` a slot on the first batch
that reads it, its size checked against the index's record), so every row of a fixed-shape field has one
address in one array, whatever shard it lives in.

A gather is ONE ``np.take`` per field, which numpy runs without the interpreter lock from the first row to
the last (issue 33; before, a Python loop over the views below took the lock between them): where the row
size and every row's address share a factor of at least 64 bytes (256 for rows of 64 KiB or more; the writer
puts chunks of 4 KiB or more on 4 KiB, so most image sizes), the range is cut into pieces of that size, a
row is a few consecutive pieces, and a batch is one take over the table of its rows' pieces, in any order,
however many shards and chunk alignments it touches (:class:`~.views.Pieces`). A task split across gather
threads is one take per range and field, so the threads copy side by side.

Other fields (rows whose size has no such factor: 227x227x3 or 28x28 uint8) are gathered from views: rows
whose addresses agree modulo the row size sit in one C-contiguous 2-D view of the range (one view per
residue; a field has a handful, one per distinct chunk alignment), so a batch is a few
``np.take(view, rows, out=...)`` calls however many shards it touches. Small rows can land in many
alignments (784-byte MNIST rows in 4 KiB aligned chunks); past ``MAX_VIEWS`` a field of rows under
``VIEW_ALL_BYTES`` (:mod:`.views`) uses one fancy index over a strided view in which "row k" starts at byte k
(larger rows keep a view per residue: a 192 KiB row lands in up to 48, and the fancy index's temporary,
allocated and copied again per batch, ran at a quarter of the takes' speed). ``gather_rank`` orders rows by
(view, address) whichever way a field is copied: a shuffled batch sorted by it is read in address order (and
is one take per view). Where the range cannot be reserved (no POSIX ``mmap`` through ctypes, or
``USE_REGION`` off), each shard is mapped on its own (:func:`~.mapping.map_file`) and the views are per shard.

``in_memory=True`` copies every served field into one private array per field
(rows in index order) at construction; a batch is then a single ``np.take``
from process memory, the same operation as an in-memory gather.

A dataset the map cannot serve falls back to h5py with the chunk cache off,
reading each touched chunk once; ``fallbacks`` says which and why. Those shard
files are opened lazily in the process that reads them (never inherited across
a fork). This module imports neither torch nor anything from the build path.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import FormatError, PrecompileError, echo
from .mapping import Region, ensure_nofile, map_file, page_aligned_empty, size_mismatch
from .rows import BatchPlan, RowAddresses, fixed_shape, open_h5, shard_table_of
from .views import Pieces, field_pieces, field_views, gather_order

#: a batch in fewer runs of one view than this is gathered run by run, without grouping it first
MIN_SORT_RUNS = 8
#: map every shard into one reserved address range when the platform allows it
USE_REGION = True
#: copy a field's rows as pieces of the range, one np.take per task (:func:`~.views.field_pieces`), where its
#: rows allow; False: one np.take per view a task touches, as before issue 33 (kept to measure against)
PIECE_TAKE = True


@dataclass
class DirectReader:
    """Gathers rows of fixed-shape fields straight from the shard files of an HDF5 build.

    ``ds`` is an opened build (:class:`precompile.formats.hdf5.H5Dataset`);
    ``fields`` the fields to serve (default: the dataset's). Thread-safe:
    gathers from maps run concurrently; fallback reads take a lock (h5py holds
    one process-wide lock anyway). ``in_memory`` copies the served fields into
    process memory at construction (see the module docstring).
    """

    ds: Any
    fields: Sequence[str] | None = None
    in_memory: bool = False
    lazy: bool = False
    shapes: dict[str, tuple[int, ...]] = field(init=False)
    dtypes: dict[str, np.dtype] = field(init=False)
    row_bytes: dict[str, int] = field(init=False)
    fallbacks: dict[tuple[int, str], str] = field(init=False)

    def __post_init__(self) -> None:
        ds = self.ds
        self.fields = list(self.fields) if self.fields is not None else list(ds.fields)
        self.base = os.path.dirname(os.path.abspath(ds.path))
        # a build read from a URL (formats/hdf5_url.py): shards come through the local cache, mapped while used
        self.source = getattr(ds, "remote", None)
        #: what messages name the build by: its index's URL (a build read from one), else its path
        self.location = self.source.url if self.source is not None else ds.path
        self.streaming: Any = None
        self.offsets = np.asarray(ds.offsets, dtype=np.int64)
        self.n = int(self.offsets[-1])
        self.shapes, self.dtypes, self.row_bytes = {}, {}, {}
        for name in self.fields:
            if name not in ds.field_specs:
                raise KeyError(f"no field {echo(name)} in {self.location} (fields: {', '.join(ds.field_specs)})")
            spec = ds.field_specs[name]
            shape = fixed_shape(spec)
            if shape is None:
                raise FormatError(
                    f"{self.location}: field {name!r} has shape {tuple(spec.get('shape') or ())} with unknown "
                    f"dimensions; the Loader gathers fixed-shape fields only (resize/crop to a fixed size in the "
                    f"recipe, or read it with precompile.open(path) inside a DataLoader)")
            self.shapes[name] = shape
            self.dtypes[name] = np.dtype(spec["dtype"])
            self.row_bytes[name] = int(np.prod(shape, dtype=np.int64)) * self.dtypes[name].itemsize
        self._lock = threading.Lock()
        self._maps: dict[int, np.ndarray] = {}
        self._h5: dict[int, Any] = {}      # fallback shards' open files, in process self._pid
        self._pid = os.getpid()
        self._closed = False
        self.shard_table = shard_table_of(ds)
        where = RowAddresses(ds.path, self.location, self.fields, self.shapes, self.dtypes, self.offsets,
                             self.shard_table, self._path, remote=self.source is not None)
        self.rows, self.fallbacks, self._tables = where.rows, where.fallbacks, where.tables
        self._h5_paths: dict[int, str] = where.h5_paths   # opened on first read, in the reading process
        counts = np.diff(self.offsets)
        served = np.zeros(len(counts), dtype=bool)
        for r in self.rows.values():
            served |= r.served
        mapped = np.flatnonzero(served)
        paths = dict(zip(mapped.tolist(), self._paths(mapped)))
        self._map(paths)
        if self.source is not None and paths:
            from .streaming import StreamingSlots

            self.streaming = StreamingSlots.for_reader(self, order=sorted(paths))
        self._build_view_tables()
        self.chunk_rows, self.gather_rank = self._chunk_ids_and_rank()
        if self.in_memory:
            self._load_into_memory()

    def _path(self, s: int) -> str:
        """Shard ``s``'s file: beside the index, or (a build read from a URL) its place in the local cache."""
        return self.source.path(s) if self.source is not None else os.path.join(self.base, self.shard_table.file(s))

    def _paths(self, shards: np.ndarray) -> list[str]:
        """The files of ``shards`` (see :meth:`_path`), without a Python pass over the entries locally."""
        if self.source is not None:
            return [self.source.path(s) for s in shards.tolist()]
        return self.shard_table.paths(self.base, shards)

    @contextlib.contextmanager
    def _local_file(self, s: int) -> Iterator[str]:
        """Shard ``s``'s file while it is read (a build read from a URL: fetched and held in the cache meanwhile)."""
        if self.source is None:
            yield self._path(s)
            return
        path = self.source.pin(s)
        try:
            yield path
        finally:
            self.source.unpin(s)

    def _map(self, paths: dict[int, str]) -> None:
        """Map the shards that have mapped fields: one region for all, else one map per shard.

        ``self._spaces`` lists (array, {shard: offset of the shard's file in the array}).
        """
        order = sorted(paths)
        sizes_known = [b for b in self.shard_table.bytes[order].tolist() if b >= 0]
        use = sizes_known if self._tables is not None and len(sizes_known) == len(order) else None
        self.region = Region.reserve([paths[s] for s in order], use) if USE_REGION else None
        self._row_slot = np.full(self.n, -1, dtype=np.int32)
        self._unmapped = 0
        if self.region is not None:
            self._spaces = [(self.region.array, dict(zip(order, self.region.bases.tolist())))]
            sizes = dict(zip(order, self.region.sizes.tolist()))
            slot = np.full(len(self.offsets) - 1, -1, dtype=np.int32)
            slot[order] = np.arange(len(order), dtype=np.int32)
            self._row_slot = np.repeat(slot, np.diff(self.offsets))
            if not self.lazy and self.source is None:   # from a URL: StreamingSlots maps them
                for i in range(len(order)):
                    self.region.map_slot(i, self.ds.path, getattr(self.ds, "_identity", None))
            self._unmapped = int(np.count_nonzero(~self.region.mapped))
        elif self.source is not None and order:
            raise FormatError(f"{self.location}: reading a build from a URL maps its shards into one reserved address "
                              f"range, which this platform does not allow (POSIX mmap through ctypes)")
        else:
            ensure_nofile(len(order))
            self._spaces = []
            sizes = {}
            for s in order:
                if not os.path.exists(paths[s]):
                    from ..formats.snapshot import gone

                    raise FormatError(gone(paths[s], self.ds.path, getattr(self.ds, "_identity", None)))
                mm = self._maps[s] = map_file(paths[s])  # a plain ndarray on the map: no np.memmap __getitem__
                if use is not None and mm.size != use[len(sizes)]:
                    raise FormatError(size_mismatch(paths[s], mm.size, use[len(sizes)]))
                self._spaces.append((mm, {s: 0}))
                sizes[s] = mm.size
        size_of = np.zeros(len(self.offsets) - 1, dtype=np.int64)
        size_of[order] = [sizes[s] for s in order]
        row_size = np.repeat(size_of, np.diff(self.offsets))
        for name in self.fields:  # the chunk table must stay inside the file
            served, addr = self._field_rows(name)
            bad = served & ((addr < 0) | (addr + self.row_bytes[name] > row_size))
            if bad.any():
                s = int(np.searchsorted(self.offsets, np.flatnonzero(bad)[0], side="right") - 1)
                raise FormatError(f"{paths[s]}: chunk table points past the end of the file ({sizes[s]} bytes)")

    def _field_rows(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Per global row of ``name``: whether the maps serve it, and its byte address in its shard file."""
        r = self.rows[name]
        return np.repeat(r.served, np.diff(self.offsets)), r.addr

    def _chunk_ids_and_rank(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row: a global chunk id and its place in gather order (:func:`~.views.gather_order`), from the
        field with the largest rows (the one that dominates I/O)."""
        name = max(self.fields, key=lambda f: self.row_bytes[f]) if self.fields else None
        if name is None:
            return gather_order(self.offsets, None, None, None)
        return gather_order(self.offsets, self.rows[name], self._vid[name], self._vrow[name])

    def _build_view_tables(self) -> None:
        """Per field: the views of every mapped space in one list, and per global row its view and row in it
        (-1: the shard is served by h5py), so a batch needs no per-shard bookkeeping (:func:`~.views.field_views`)."""
        self._views: dict[str, list[np.ndarray]] = {}
        self._takeable: dict[str, list[bool]] = {}
        self._vid: dict[str, np.ndarray] = {}
        self._vrow: dict[str, np.ndarray] = {}
        self._pieces: dict[str, Pieces | None] = {}
        self._all_mapped: dict[str, bool] = {}
        for name in self.fields:
            self._views[name], self._takeable[name], self._vid[name], self._vrow[name] = field_views(
                self._spaces, self.region is not None, self.rows[name], self.offsets, self.row_bytes[name])
            self._all_mapped[name] = not any(f == name for _, f in self.fallbacks)
            self._pieces[name] = None
            if PIECE_TAKE and self.region is not None:   # one space for every shard: rows are pieces of it
                arr, bases = self._spaces[0]
                base = np.zeros(len(self.offsets) - 1, dtype=np.int64)
                base[list(bases)] = list(bases.values())
                self._pieces[name] = field_pieces(arr, base, self.rows[name], self.offsets, self.row_bytes[name])

    def _load_into_memory(self) -> None:
        """Copy every field's rows, in index order, into one private array; then drop the maps.

        Mapped rows are read from the shard files with ``readinto`` (one call per run of
        adjacent rows: the kernel copies, the map takes no page faults), h5py-served rows
        through the usual fallback.
        """
        mem = {name: page_aligned_empty((self.n, *self.shapes[name]), self.dtypes[name]) for name in self.fields}
        flat = {name: mem[name].reshape(self.n, -1).view(np.uint8) for name in self.fields}
        for s in range(len(self.offsets) - 1):
            lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
            mapped = [name for name in self.fields if self.rows[name].served[s] and hi > lo]
            if not mapped:
                continue
            with self._local_file(s) as path, open(path, "rb", buffering=0) as f:
                for name in mapped:
                    addr, rb = self.rows[name].addr[lo:hi], self.row_bytes[name]
                    cuts = [0, *(np.flatnonzero(np.diff(addr) != rb) + 1).tolist(), len(addr)]
                    for a, b in zip(cuts[:-1], cuts[1:]):
                        dest = memoryview(flat[name][lo + a:lo + b]).cast("B")
                        f.seek(int(addr[a]))
                        got = 0
                        while got < len(dest):
                            k = f.readinto(dest[got:])
                            if not k:
                                raise FormatError(f"{path}: file ends inside dataset {name!r}")
                            got += k
        for name in self.fields:
            rest = np.flatnonzero(self._vid[name] < 0)
            if rest.size:
                mem[name][rest] = self.gather(name, self.plan(rest),
                                              np.empty((rest.size, *self.shapes[name]), self.dtypes[name]))
        for name in self.fields:
            self._views[name] = [flat[name]]
            self._takeable[name] = [True]
            self._vid[name] = np.zeros(self.n, dtype=np.int64)
            self._vrow[name] = np.arange(self.n, dtype=np.int64)
            self._all_mapped[name] = True
            self._pieces[name] = Pieces(flat[name], self._vrow[name], 1) if PIECE_TAKE else None
        # gather_rank stays the files' (view, address) order: a sorted batch keeps the mapped Loader's row order,
        # so in_memory=True gives the same batches (in memory any order gathers at the same speed)
        self._spaces, self._maps, self.region = [], {}, None
        self._unmapped = 0
        if self.streaming is not None:
            self.streaming.close()
            self.streaming = None

    def order_batch(self, indices: np.ndarray) -> np.ndarray:
        """The same rows, ordered for gathering: grouped by shard and view, in address order."""
        idx = np.asarray(indices, dtype=np.int64)
        return idx[np.argsort(self.gather_rank[idx], kind="stable")]

    # -- reading ----------------------------------------------------------------------------
    @property
    def fast(self) -> bool:
        """True when every field of every shard is served from the memory maps."""
        return not self.fallbacks

    def _check_open(self) -> None:
        if self._closed:
            raise PrecompileError(f"{self.location}: reader is closed (open a new Loader to read again)")

    def plan(self, indices: np.ndarray) -> BatchPlan:
        """Check a batch's global row indices once (and map the shards they need); shared by all fields'
        gathers."""
        self._check_open()
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"row index out of range for {self.n} rows")
        if self.streaming is not None:
            return self.streaming.plan(idx)
        if self._unmapped and idx.size:
            slots = self._row_slot[idx]
            slots = slots[slots >= 0]
            need = slots[~self.region.mapped[slots]]
            if need.size:
                self._map_slots(np.flatnonzero(np.bincount(need)))
        return BatchPlan(self, idx)

    def _map_slots(self, slots: np.ndarray) -> None:
        """Map the region's slots ``slots`` that are not mapped yet (each shard once, under the lock)."""
        with self._lock:
            self._check_open()
            for i in slots.tolist():
                if not self.region.mapped[i]:
                    self.region.map_slot(i, self.ds.path, getattr(self.ds, "_identity", None))
                    self._unmapped -= 1

    @property
    def mapped_shards(self) -> int:
        """How many shard files are mapped so far (all of them unless ``lazy``)."""
        return len(self._maps) if self.region is None else int(self.region.mapped.sum())

    def gather(self, name: str, plan: BatchPlan, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (``(len, *shape)`` of the field's dtype, C-contiguous) with the planned rows."""
        self._check_open()
        if out.shape != (plan.size, *self.shapes[name]) or out.dtype != self.dtypes[name]:
            raise ValueError(f"out has shape {out.shape} {out.dtype}, expected {(plan.size, *self.shapes[name])} "
                             f"{self.dtypes[name]}")
        if not plan.size:
            return out
        flat = out.reshape(plan.size, -1).view(np.uint8)
        pieces = self._pieces[name]
        if pieces is not None:
            first = pieces.first[plan.idx]
            if self._all_mapped[name] or first.min() >= 0:
                pieces.take(first, flat)   # every row in one call, without the interpreter lock
                return out
            return self._gather_mixed(name, plan, first, pieces, out, flat)
        vid = self._vid[name][plan.idx]
        if vid.min() < 0:  # some shards are served by h5py
            for s, pos, local in plan.groups:
                if self._vid[name][self.offsets[s]] < 0:
                    out[pos] = self._read_fallback(s, name, local)
                else:
                    self._gather_runs(name, plan.idx[pos], vid[pos], flat, pos)
            return out
        self._gather_runs(name, plan.idx, vid, flat, None)
        return out

    def _gather_mixed(self, name: str, plan: BatchPlan, first: np.ndarray, pieces: Pieces, out: np.ndarray,
                      flat: np.ndarray) -> np.ndarray:
        """A batch whose rows are partly in shards h5py serves: the mapped rows in one take, then the others."""
        mapped = np.flatnonzero(first >= 0)
        if mapped.size:
            tmp = page_aligned_empty((mapped.size, flat.shape[1]), np.uint8)
            pieces.take(first[mapped], tmp)
            flat[mapped] = tmp
        for s, pos, local in plan.groups:
            if pieces.first[self.offsets[s]] < 0:
                out[pos] = self._read_fallback(s, name, local)
        return out

    def _gather_runs(self, name: str, idx: np.ndarray, vid: np.ndarray, flat: np.ndarray,
                     pos: np.ndarray | None) -> None:
        """Copy rows ``idx`` (all in mapped views ``vid``) to ``flat[pos]`` (``pos`` None: to ``flat`` in order).

        A run of rows in one view is one ``np.take`` straight into the output (one copy per row);
        a batch whose runs are many more than the views it touches (scattered order) is grouped by
        view first (then each view is one run) and scattered once.
        """
        views, takeable, vrow = self._views[name], self._takeable[name], self._vrow[name][idx]
        cuts = np.flatnonzero(vid[1:] != vid[:-1]) + 1
        if pos is not None or (len(cuts) >= MIN_SORT_RUNS and len(cuts) + 1 > 2 * _distinct(vid)):
            order = np.argsort(vid, kind="stable")
            tmp = page_aligned_empty((len(idx), flat.shape[1]), np.uint8)
            self._gather_runs(name, idx[order], vid[order], tmp, None)
            flat[order if pos is None else pos[order]] = tmp
            return
        bounds = [0, *cuts.tolist(), len(idx)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            v = int(vid[a])
            if takeable[v]:
                # mode="clip" keeps numpy from buffering `out` (indices come from the chunk table)
                np.take(views[v], vrow[a:b], axis=0, out=flat[a:b], mode="clip")
            else:  # a strided view: one fancy index (a temporary, then a copy)
                flat[a:b] = views[v][vrow[a:b]]

    def read(self, indices: Sequence[int] | np.ndarray, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """``{field: rows}`` for ``indices`` in the given order (a fresh array per field)."""
        with self.plan(np.asarray(indices, dtype=np.int64)) as plan:
            return {f: self.gather(f, plan, page_aligned_empty((plan.size, *self.shapes[f]), self.dtypes[f]))
                    for f in (fields or self.fields)}

    def _read_fallback(self, s: int, name: str, local: np.ndarray) -> np.ndarray:
        """h5py, cache off: read each touched chunk's rows once, then pick the requested rows."""
        c, n = int(self.rows[name].rows_per_chunk[s]), int(self.offsets[s + 1] - self.offsets[s])
        out = np.empty((len(local), *self.shapes[name]), self.dtypes[name])
        chunk = local // c
        order = np.argsort(chunk, kind="stable")
        ck = chunk[order]
        cuts = np.flatnonzero(np.diff(ck)) + 1
        with self._lock:
            self._check_open()
            d = self._h5_file(s)[name]
            bounds = [0, *cuts.tolist(), len(local)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                k = int(ck[a])
                lo, hi = k * c, min(n, (k + 1) * c)
                block = d[lo:hi]
                sel = order[a:b]
                out[sel] = block[local[sel] - lo]
        return out

    def _h5_file(self, s: int) -> Any:
        """Shard ``s``'s h5py file, opened in this process (call with the lock held)."""
        if self._pid != os.getpid():  # a forked child: never use the parent's HDF5 handles
            self._h5, self._pid = {}, os.getpid()
        f = self._h5.get(s)
        if f is None:
            f = self._h5[s] = open_h5(self._h5_paths[s])
        return f

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop the maps and close the fallback files; reading afterwards is a :class:`PrecompileError`."""
        with self._lock:
            self._closed = True
            if self._pid == os.getpid():
                for f in self._h5.values():
                    try:
                        f.close()
                    except Exception:  # closing a file h5py already dropped must not mask the real error
                        pass
            self._h5 = {}
            self._maps = {}
            self._spaces, self.region = [], None
            if self.streaming is not None:
                self.streaming.close()
            self.rows = {}
            self._views = {name: [] for name in self.fields}
            self._takeable = {name: [] for name in self.fields}
            self._pieces = {name: None for name in self.fields}


def _distinct(ids: np.ndarray) -> int:
    """How many distinct values in ``ids`` (small non-negative ints), without ``np.unique``
    (whose first call imports ``numpy.ma``: 0.1-1 s on the first batch)."""
    return int(np.count_nonzero(np.bincount(ids)))


