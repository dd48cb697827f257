"""Raw access to a build's shard files: chunk byte offsets resolved once, batches gathered from memory maps.

The Loader's hot path never calls h5py per batch. When a :class:`DirectReader`
opens a build it asks h5py, once per shard and field, where the bytes of every
chunk live (``dset.id.chunk_iter``, or ``get_offset`` for a contiguous
dataset), checks that the dataset is unfiltered and fully allocated, and maps
the shard file with ``np.memmap``. Each row then has a byte address. Rows whose
addresses agree modulo the row size sit in one C-contiguous 2-D view of the
map (one view per residue; a shard has a handful, one per distinct chunk
alignment), so a batch is a few ``np.take(view, rows, out=...)`` calls that
copy each row once, straight into the caller's (pinned) buffer, and release
the GIL, so gather threads scale. Small rows can land in many alignments
(784-byte MNIST rows in 4 KiB-aligned chunks); past ``MAX_VIEWS`` a shard uses
one fancy index over a strided view in which "row k" starts at byte k. ``gather_rank`` orders rows by (shard,
residue, address): a shuffled batch sorted by it is one take per group, read
in address order. Chunk addresses are taken from the table, never computed:
HDF5 does not space them evenly.

A dataset the map cannot serve (compressed or otherwise filtered, chunks that
do not hold whole samples, unallocated chunks, compact/virtual/external
storage, a non-native byte order) falls back to h5py with the chunk cache off,
reading each touched chunk once; ``fallbacks`` says which and why. This module
imports neither torch nor anything from the build path.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import FormatError

log = logging.getLogger("precompile.reader")

#: rows per "block" for a dataset without chunks (contiguous or fallback), in bytes
BLOCK_BYTES = 2 * 1024 * 1024
#: at most this many residue views per shard and field; beyond (small rows in many chunk
#: alignments, e.g. 784-byte MNIST rows), one strided fancy-index per shard does the gather
MAX_VIEWS = 4


def fixed_shape(spec: dict) -> tuple[int, ...] | None:
    """The spec's sample shape if every dimension is known, else None."""
    shape = spec.get("shape")
    if shape is None or any(d is None or int(d) < 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


class _Plan:
    """A batch's global row indices; grouped by shard (positions, shard-local rows) on demand."""

    def __init__(self, reader: "DirectReader", idx: np.ndarray):
        self.reader = reader
        self.idx = idx
        self.size = int(idx.size)
        self._groups: list[tuple[int, np.ndarray, np.ndarray]] | None = None

    @property
    def groups(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        if self._groups is None:
            idx, offsets = self.idx, self.reader.offsets
            shard_of = np.searchsorted(offsets, idx, side="right") - 1
            order = np.argsort(shard_of, kind="stable")
            so = shard_of[order]
            bounds = [0, *(np.flatnonzero(np.diff(so)) + 1).tolist(), self.size]
            self._groups = [(int(so[a]), order[a:b], idx[order[a:b]] - offsets[int(so[a])])
                            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return self._groups


@dataclass
class _FieldShard:
    """One field of one shard: row views of the map (fast), or an h5py fallback."""

    n: int
    rows_per_chunk: int
    views: list[np.ndarray] | None = None  # per residue r: mm[r:...].reshape(-1, row_bytes), C-contiguous
    strided: np.ndarray | None = None      # or: (file_bytes - row_bytes + 1, row_bytes), strides (1, 1)
    res_id: np.ndarray | None = None       # (n,) which view holds each row
    res_row: np.ndarray | None = None      # (n,) the row's index in that view
    row_addr: np.ndarray | None = None     # (n,) int64 byte address of each row
    reason: str | None = None              # why the fast path is off (None: fast)


@dataclass
class DirectReader:
    """Gathers rows of fixed-shape fields straight from the shard files of an HDF5 build.

    ``ds`` is an opened build (:class:`precompile.reader.dataset.H5Dataset`);
    ``fields`` the fields to serve (default: the dataset's). Thread-safe:
    gathers from maps run concurrently; fallback reads take a lock (h5py holds
    one process-wide lock anyway).
    """

    ds: Any
    fields: Sequence[str] | None = None
    shapes: dict[str, tuple[int, ...]] = field(init=False)
    dtypes: dict[str, np.dtype] = field(init=False)
    row_bytes: dict[str, int] = field(init=False)
    fallbacks: dict[tuple[int, str], str] = field(init=False)

    def __post_init__(self) -> None:
        ds = self.ds
        self.fields = list(self.fields) if self.fields is not None else list(ds.fields)
        self.base = os.path.dirname(os.path.abspath(ds.path))
        self.offsets = np.asarray(ds.offsets, dtype=np.int64)
        self.n = int(self.offsets[-1])
        self.shapes, self.dtypes, self.row_bytes = {}, {}, {}
        for name in self.fields:
            if name not in ds.field_specs:
                raise KeyError(f"no field {name!r} in {ds.path} (fields: {', '.join(ds.field_specs)})")
            spec = ds.field_specs[name]
            shape = fixed_shape(spec)
            if shape is None:
                raise FormatError(
                    f"{ds.path}: field {name!r} has shape {tuple(spec.get('shape') or ())} with unknown "
                    f"dimensions; the Loader gathers fixed-shape fields only (resize/crop to a fixed size in the "
                    f"recipe, or read it with precompile.open(path) inside a DataLoader)")
            self.shapes[name] = shape
            self.dtypes[name] = np.dtype(spec["dtype"])
            self.row_bytes[name] = int(np.prod(shape, dtype=np.int64)) * self.dtypes[name].itemsize
        self._lock = threading.Lock()
        self._maps: dict[int, np.memmap] = {}
        self._h5: dict[int, Any] = {}
        self.fallbacks = {}
        self.parts: dict[str, list[_FieldShard]] = {name: [] for name in self.fields}
        for s, shard in enumerate(ds.shards):
            n = int(shard["num_samples"])
            path = os.path.join(self.base, shard["file"])
            if n == 0:
                for name in self.fields:
                    self.parts[name].append(_FieldShard(0, 1))
                continue
            import h5py

            try:
                f = h5py.File(path, "r", rdcc_nbytes=0)
            except OSError as e:
                raise FormatError(f"{path}: cannot open shard: {e}") from None
            keep_open = False
            try:
                for name in self.fields:
                    if name not in f:
                        raise FormatError(f"{path}: shard has no dataset {name!r}")
                    part = self._resolve(s, path, f[name], name, n)
                    if part.reason is not None:
                        self.fallbacks[(s, name)] = part.reason
                        log.info("%s[%s]: h5py fallback (%s)", path, name, part.reason)
                        keep_open = True
                    self.parts[name].append(part)
            finally:
                if keep_open:
                    self._h5[s] = f
                else:
                    f.close()
        self.chunk_rows = self._chunk_ids()
        self.gather_rank = self._gather_rank()
        self._build_view_tables()

    # -- resolving chunk addresses (once) -------------------------------------------------
    def _resolve(self, s: int, path: str, d: Any, name: str, n: int) -> _FieldShard:
        import h5py

        shape, dtype, rb = self.shapes[name], self.dtypes[name], self.row_bytes[name]
        if d.shape != (n, *shape):
            raise FormatError(f"{path}: dataset {name!r} has shape {d.shape}, the index says {(n, *shape)}")
        if d.dtype != dtype:
            if d.dtype.newbyteorder("=") == dtype.newbyteorder("=") or d.dtype.kind == dtype.kind:
                return _FieldShard(n, _block_rows(rb), reason=f"stored as {d.dtype.str}, read as {dtype.str}")
            raise FormatError(f"{path}: dataset {name!r} has dtype {d.dtype}, the index says {dtype}")
        if dtype.byteorder not in ("=", "|") or dtype.hasobject:
            return _FieldShard(n, _block_rows(rb), reason=f"dtype {dtype.str} is not native plain data")
        plist = d.id.get_create_plist()
        layout = plist.get_layout()
        if plist.get_external_count() > 0:
            return _FieldShard(n, _block_rows(rb), reason="external storage")
        if layout == h5py.h5d.CONTIGUOUS:
            off = d.id.get_offset()
            if off is None:
                return _FieldShard(n, _block_rows(rb), reason="contiguous storage not allocated")
            addr = int(off) + np.arange(n, dtype=np.int64) * rb
            return self._mapped(s, path, n, _block_rows(rb), addr, rb)
        if layout != h5py.h5d.CHUNKED:
            kind = {h5py.h5d.COMPACT: "compact"}.get(layout, "virtual" if d.is_virtual else f"layout {layout}")
            return _FieldShard(n, _block_rows(rb), reason=f"{kind} storage")
        c = int(d.chunks[0])
        if tuple(d.chunks[1:]) != shape:
            return _FieldShard(n, _block_rows(rb), reason=f"chunks {d.chunks} do not hold whole samples")
        nf = plist.get_nfilters()
        if nf:
            names = []
            for i in range(nf):
                names.append(plist.get_filter(i)[3].decode(errors="replace") or str(plist.get_filter(i)[0]))
            return _FieldShard(n, c, reason=f"filtered ({', '.join(names)})")
        table = _chunk_table(d)
        nchunks = -(-n // c)
        if len(table) != nchunks:
            return _FieldShard(n, c, reason=f"{len(table)} of {nchunks} chunks allocated")
        table.sort(key=lambda t: t[0])
        starts = np.array([t[0] for t in table], dtype=np.int64)
        if not np.array_equal(starts, np.arange(nchunks, dtype=np.int64) * c):
            return _FieldShard(n, c, reason="unexpected chunk offsets")
        if any(t[3] != 0 for t in table):
            return _FieldShard(n, c, reason="a chunk skipped a filter (filter mask set)")
        if any(t[2] != c * rb for t in table):
            return _FieldShard(n, c, reason="chunk sizes differ from rows x row bytes")
        caddr = np.array([t[1] for t in table], dtype=np.int64)
        rows = np.arange(n, dtype=np.int64)
        addr = caddr[rows // c] + (rows % c) * rb
        return self._mapped(s, path, n, c, addr, rb)

    def _mapped(self, s: int, path: str, n: int, c: int, addr: np.ndarray, rb: int) -> _FieldShard:
        mm = self._maps.get(s)
        if mm is None:
            mm = np.memmap(path, mode="r", dtype=np.uint8)
            self._maps[s] = mm
        if n and (addr.min() < 0 or int(addr.max()) + rb > mm.size):
            raise FormatError(f"{path}: chunk table points past the end of the file ({mm.size} bytes)")
        mm = mm.view(np.ndarray)  # plain ndarray views: np.memmap's Python-level __getitem__ costs per call
        residues, res_id = np.unique(addr % rb, return_inverse=True)
        if len(residues) > MAX_VIEWS:
            strided = as_strided(mm, shape=(mm.size - rb + 1, rb), strides=(1, 1), writeable=False)
            return _FieldShard(n, c, strided=strided, res_id=np.zeros(n, np.int64), res_row=addr, row_addr=addr)
        views = []
        for r in residues.tolist():
            k = (mm.size - r) // rb
            views.append(mm[r:r + k * rb].reshape(k, rb))
        res_row = (addr - residues[res_id]) // rb
        return _FieldShard(n, c, views=views, res_id=res_id.astype(np.int64), res_row=res_row, row_addr=addr)

    def _chunk_ids(self) -> np.ndarray:
        """A global chunk id per row, from the field with the largest rows (the one that dominates I/O)."""
        name = max(self.fields, key=lambda f: self.row_bytes[f]) if self.fields else None
        ids = np.empty(self.n, dtype=np.int64)
        nxt = 0
        for s in range(len(self.offsets) - 1):
            lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
            c = self.parts[name][s].rows_per_chunk if name else 1
            local = np.arange(hi - lo, dtype=np.int64) // max(1, c)
            ids[lo:hi] = nxt + local
            nxt += int(local[-1]) + 1 if hi > lo else 0
        return ids

    def _build_view_tables(self) -> None:
        """Per field: every mapped view of every shard in one list, and per global row its view and
        row in it (-1: the shard is served by h5py), so a batch needs no per-shard bookkeeping."""
        self._views: dict[str, list[np.ndarray]] = {}
        self._takeable: dict[str, list[bool]] = {}
        self._vid: dict[str, np.ndarray] = {}
        self._vrow: dict[str, np.ndarray] = {}
        for name in self.fields:
            views: list[np.ndarray] = []
            takeable: list[bool] = []
            vid = np.full(self.n, -1, dtype=np.int64)
            vrow = np.zeros(self.n, dtype=np.int64)
            for s, part in enumerate(self.parts[name]):
                lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
                if part.views is not None:
                    vid[lo:hi] = len(views) + part.res_id
                    vrow[lo:hi] = part.res_row
                    views.extend(part.views)
                    takeable.extend([True] * len(part.views))
                elif part.strided is not None:
                    vid[lo:hi] = len(views)
                    vrow[lo:hi] = part.row_addr
                    views.append(part.strided)
                    takeable.append(False)
            self._views[name], self._takeable[name], self._vid[name], self._vrow[name] = views, takeable, vid, vrow

    def _gather_rank(self) -> np.ndarray:
        """Each row's place in (shard, residue view, byte address) order of the largest field."""
        name = max(self.fields, key=lambda f: self.row_bytes[f]) if self.fields else None
        shard, rid, addr = (np.empty(self.n, dtype=np.int64) for _ in range(3))
        for s in range(len(self.offsets) - 1):
            lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
            shard[lo:hi] = s
            part = self.parts[name][s] if name else None
            if part is not None and part.row_addr is not None:
                rid[lo:hi], addr[lo:hi] = part.res_id, part.row_addr
            else:
                rid[lo:hi], addr[lo:hi] = 0, np.arange(hi - lo)
        rank = np.empty(self.n, dtype=np.int64)
        rank[np.lexsort((addr, rid, shard))] = np.arange(self.n, dtype=np.int64)
        return rank

    def order_batch(self, indices: np.ndarray) -> np.ndarray:
        """The same rows, ordered for gathering: grouped by shard and view, in address order."""
        idx = np.asarray(indices, dtype=np.int64)
        return idx[np.argsort(self.gather_rank[idx], kind="stable")]

    # -- reading ----------------------------------------------------------------------------
    @property
    def fast(self) -> bool:
        """True when every field of every shard is served from the memory maps."""
        return not self.fallbacks

    def plan(self, indices: np.ndarray) -> _Plan:
        """Check a batch's global row indices once; shared by all fields' gathers."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"row index out of range for {self.n} rows")
        return _Plan(self, idx)

    def gather(self, name: str, plan: _Plan, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (``(len, *shape)`` of the field's dtype, C-contiguous) with the planned rows."""
        if out.shape != (plan.size, *self.shapes[name]) or out.dtype != self.dtypes[name]:
            raise ValueError(f"out has shape {out.shape} {out.dtype}, expected {(plan.size, *self.shapes[name])} "
                             f"{self.dtypes[name]}")
        if not plan.size:
            return out
        flat = out.reshape(plan.size, -1).view(np.uint8)
        vid = self._vid[name][plan.idx]
        if vid.min() < 0:  # some shards are served by h5py
            for s, pos, local in plan.groups:
                if self._vid[name][self.offsets[s]] < 0:
                    out[pos] = self._read_fallback(s, name, self.parts[name][s], local)
                else:
                    self._gather_runs(name, plan.idx[pos], vid[pos], flat, pos)
            return out
        self._gather_runs(name, plan.idx, vid, flat, None)
        return out

    def _gather_runs(self, name: str, idx: np.ndarray, vid: np.ndarray, flat: np.ndarray,
                     pos: np.ndarray | None) -> None:
        """Copy rows ``idx`` (all in mapped views ``vid``) to ``flat[pos]`` (``pos`` None: to ``flat`` in order).

        A run of rows in one view is one ``np.take`` straight into the output (one copy per row);
        a batch in scattered order is grouped by view first and scattered once.
        """
        views, takeable, vrow = self._views[name], self._takeable[name], self._vrow[name][idx]
        cuts = np.flatnonzero(vid[1:] != vid[:-1]) + 1
        if pos is not None or len(cuts) > 2 * len(views):
            order = np.argsort(vid, kind="stable")
            tmp = np.empty((len(idx), flat.shape[1]), np.uint8)
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
        plan = self.plan(np.asarray(indices, dtype=np.int64))
        return {f: self.gather(f, plan, np.empty((plan.size, *self.shapes[f]), self.dtypes[f]))
                for f in (fields or self.fields)}

    def _read_fallback(self, s: int, name: str, part: _FieldShard, local: np.ndarray) -> np.ndarray:
        """h5py, cache off: read each touched chunk's rows once, then pick the requested rows."""
        c = part.rows_per_chunk
        out = np.empty((len(local), *self.shapes[name]), self.dtypes[name])
        chunk = local // c
        order = np.argsort(chunk, kind="stable")
        ck = chunk[order]
        cuts = np.flatnonzero(np.diff(ck)) + 1
        with self._lock:
            d = self._h5[s][name]
            bounds = [0, *cuts.tolist(), len(local)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                k = int(ck[a])
                lo, hi = k * c, min(part.n, (k + 1) * c)
                block = d[lo:hi]
                sel = order[a:b]
                out[sel] = block[local[sel] - lo]
        return out

    def close(self) -> None:
        for f in self._h5.values():
            try:
                f.close()
            except Exception:  # closing a file h5py already dropped must not mask the real error
                pass
        self._h5 = {}
        self._maps = {}
        self.parts = {name: [] for name in self.fields}
        self._views = {name: [] for name in self.fields}


def _block_rows(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def _chunk_table(d: Any) -> list[tuple[int, int, int, int]]:
    """(first row, byte address, stored size, filter mask) of every allocated chunk of ``d``."""
    out: list[tuple[int, int, int, int]] = []
    dsid = d.id
    if hasattr(dsid, "chunk_iter"):
        try:
            dsid.chunk_iter(lambda ci: out.append((int(ci.chunk_offset[0]), int(ci.byte_offset), int(ci.size),
                                                   int(ci.filter_mask))))
            return out
        except (AttributeError, RuntimeError, TypeError):  # older HDF5 without H5Dchunk_iter
            out.clear()
    for i in range(dsid.get_num_chunks()):
        ci = dsid.get_chunk_info(i)
        out.append((int(ci.chunk_offset[0]), int(ci.byte_offset), int(ci.size), int(ci.filter_mask)))
    return out
