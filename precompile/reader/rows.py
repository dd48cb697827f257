"""Where a build's rows live: each row's byte address in its shard file, resolved once (:class:`RowAddresses`),
and a batch's rows grouped by shard (:class:`BatchPlan`).

When a :class:`~precompile.reader.direct.DirectReader` opens a build it reads where the bytes of every chunk
live from the index's chunk tables (``__chunks__``, written at finalize: see docs/faults.md), checked against
the entries, for every shard at once in numpy: no shard file is opened to make a reader. For an index without
tables (built before them), or a field an entry has no table for, it asks h5py, once per shard and field
(``dset.id.chunk_iter``, or ``get_offset`` for a contiguous dataset), and checks that the dataset is
unfiltered and fully allocated; a dataset the maps cannot serve is read through h5py (``fallbacks`` says
which and why). Chunk addresses are taken from the table, never computed: HDF5 does not space them evenly.
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import FormatError
from ..formats import names as fmt
from ..formats.hdf5_layout import chunk_table, read_chunk_tables
from ..formats.index_columns import ShardTable
from .mapping import nofile_limits

log = logging.getLogger("precompile.reader")

#: rows per "block" for a dataset without chunks (contiguous or fallback), in bytes
BLOCK_BYTES = 2 * 1024 * 1024


def fixed_shape(spec: dict) -> tuple[int, ...] | None:
    """The spec's sample shape if every dimension is known, else None."""
    shape = spec.get("shape")
    if shape is None or any(d is None or int(d) < 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def shard_table_of(ds: Any) -> ShardTable:
    """The opened build's shard table (an H5Dataset reads it with the index), else one made from its entries."""
    table = getattr(ds, "shard_table", None)
    return table if table is not None else ShardTable.from_entries(ds.shards)


class BatchPlan:
    """A batch's global row indices; grouped by shard (positions, shard-local rows) on demand."""

    def __init__(self, reader: Any, idx: np.ndarray):   # a DirectReader (its offsets)
        self.reader = reader
        self.idx = idx
        self.size = int(idx.size)
        self._groups: list[tuple[int, np.ndarray, np.ndarray]] | None = None
        self.release: Any = None   # a build read from a URL: lets go of the shards the plan holds mapped

    def __enter__(self) -> "BatchPlan":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.release is not None:
            self.release()
            self.release = None

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
    """One field of one shard as h5py resolves it: its rows' byte addresses in the shard file (fast), or why
    h5py serves it."""

    n: int
    rows_per_chunk: int
    row_addr: np.ndarray | None = None     # (n,) int64 byte address of each row in the shard file
    reason: str | None = None              # why the fast path is off (None: fast)


@dataclass
class _FieldRows:
    """One field over every shard, as columns: per shard whether the maps serve its rows and its rows per
    chunk (for block shuffling and h5py reads), per global row its byte address in its shard file."""

    served: np.ndarray             # (shards,) bool
    rows_per_chunk: np.ndarray     # (shards,) int64
    addr: np.ndarray               # (rows,) int64; meaningful where its shard is served


class RowAddresses:
    """Where every row of the served fields lives in its shard file, worked out once when a reader is made:
    from the index's chunk tables (``__chunks__``), every shard at once in numpy; for a shard whose entry has
    no table for a field (an index built before them), through h5py, once per shard and field, which also
    says when h5py must read a field itself (``fallbacks``: compressed or filtered, chunks that do not hold
    whole samples, unallocated chunks, compact/virtual/external storage, a non-native byte order).

    ``rows[field]``: per shard whether the maps serve it and its rows per chunk, per row its byte address;
    ``tables``: the index's chunk table (None: none); ``h5_paths``: the files of shards h5py serves.
    ``path(s)``: shard ``s``'s local file; ``remote``: a build read from a URL (which needs the tables)."""

    def __init__(self, index: str, location: str, fields: Sequence[str], shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, np.dtype], offsets: np.ndarray, shard_table: ShardTable,
                 path: Callable[[int], str], remote: bool = False):
        self.index, self.location, self.fields, self.shapes, self.dtypes = index, location, fields, shapes, dtypes
        self.row_bytes = {name: int(np.prod(shapes[name], dtype=np.int64)) * dtypes[name].itemsize for name in fields}
        self.offsets, self.shard_table, self.path, self.remote = offsets, shard_table, path, remote
        self.fallbacks: dict[tuple[int, str], str] = {}
        self.h5_paths: dict[int, str] = {}
        counts = np.diff(offsets)
        n = int(offsets[-1])
        self.rows = {name: _FieldRows(np.zeros(len(counts), dtype=bool), np.ones(len(counts), dtype=np.int64),
                                      np.zeros(n, dtype=np.int64)) for name in fields}
        self.tables = self._index_tables()
        if self.tables is not None:
            self._parts_from_table(self.tables)
        self._resolve_rest()

    def _index_tables(self) -> np.ndarray | None:
        """The index's chunk table (None: an index without one; every shard is then resolved through
        h5py as before the tables existed)."""
        if not self.shard_table.has_chunks():
            return None
        table = read_chunk_tables(self.index, self.location)
        if table is None:
            raise FormatError(f"{self.location}: the shard entries list chunks but the index has no "
                              f"{fmt.CHUNKS} table: the index is damaged (build again)")
        return table.astype(np.int64)

    def _parts_from_table(self, table: np.ndarray) -> None:
        """Every served field's rows whose entry lists a chunk table, from the index's ``__chunks__``: its rows
        are the entries' chunks in order (shard by shard, a shard's fields in name order), their spans the
        shard table's columns. Numpy over all shards at once, whatever the shard count."""
        t = self.shard_table
        if t.total_chunks() != len(table):
            raise FormatError(f"{self.location}: the index's chunk table has {len(table)} chunks, its shard entries "
                              f"count {t.total_chunks()}: the index is damaged (build again)")
        counts = np.diff(self.offsets)
        for name in self.fields:
            self._field_from_table(name, table, *t.spans(name), counts, t.bytes)

    def _field_from_table(self, name: str, table: np.ndarray, c: np.ndarray, k: np.ndarray, start: np.ndarray,
                          counts: np.ndarray, limit: np.ndarray) -> None:
        """One field's rows from the table (see :meth:`_parts_from_table`), every shard checked at once:
        ``c``, ``k``, ``start`` per shard its rows per chunk, chunks and first row in ``table`` (``c`` and
        ``k`` 0: no table for it), ``limit`` its file's size (-1: not recorded)."""
        rb = self.row_bytes[name]
        live = ((c != 0) | (k != 0)) & (counts > 0)
        bad = live & ((c < 1) | (k != -(-counts // np.maximum(c, 1))))
        if bad.any():
            s = int(np.flatnonzero(bad)[0])
            raise FormatError(f"{self._where(s, name)}: the index's chunk table lists {int(k[s])} chunk(s) of "
                              f"{int(c[s])} rows for {int(counts[s])} samples: the index is damaged (build again)")
        sel = np.flatnonzero(live)
        shard_of_chunk = np.repeat(sel, k[sel])
        first = np.repeat(start[sel] - np.concatenate([[0], np.cumsum(k[sel])[:-1]]), k[sel])
        t = table[np.arange(len(shard_of_chunk), dtype=np.int64) + first]          # its rows of the table
        over = (t[:, 1] != c[shard_of_chunk] * rb) | (t[:, 0] < 0) | (
            (limit[shard_of_chunk] >= 0) & (t[:, 0] + t[:, 1] > limit[shard_of_chunk]))
        if over.any():
            s = int(shard_of_chunk[np.flatnonzero(over)[0]])
            raise FormatError(f"{self._where(s, name)}: the index's chunk table points outside the shard's "
                              f"{int(limit[s])} bytes or disagrees with rows of {rb} bytes: the index is damaged "
                              f"(build again)")
        n = counts[sel]
        starts = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        local = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(starts, n)
        first_chunk = np.concatenate([[0], np.cumsum(k[sel])[:-1]]).astype(np.int64)
        cs = np.repeat(c[sel], n)
        r = self.rows[name]
        r.served[sel], r.rows_per_chunk[sel] = True, c[sel]
        addr = t[np.repeat(first_chunk, n) + local // cs, 0] + (local % cs) * rb
        r.addr[np.repeat(self.offsets[sel], n) + local] = addr

    def _resolve_rest(self) -> None:
        """The shards with samples whose entry has no chunk table for a served field (every shard of an index
        without tables): each opened once with h5py, which says where the field's rows are or why h5py must
        read them (:meth:`_resolve`)."""
        if not self.fields:
            return
        counts = np.diff(self.offsets)
        todo = (counts > 0) & ~np.logical_and.reduce([r.served for r in self.rows.values()])
        for s in np.flatnonzero(todo).tolist():
            if self.remote:
                name = next(f for f in self.fields if not self.rows[f].served[s])
                raise FormatError(f"{self._where(s, name)}: the index has no chunk table for it; reading a build "
                                  f"from a URL needs the chunk tables of builds since issue 20: build it again")
            path, n, lo = self.path(s), int(counts[s]), int(self.offsets[s])
            with open_h5(path) as f:
                for name in self.fields:
                    r = self.rows[name]
                    if r.served[s]:
                        continue
                    if name not in f:
                        raise FormatError(f"{path}: shard has no dataset {name!r}")
                    part = self._resolve(s, path, f[name], name, n)
                    r.rows_per_chunk[s] = part.rows_per_chunk
                    if part.reason is not None:
                        self.fallbacks[(s, name)] = part.reason
                        log.info("%s[%s]: h5py fallback (%s)", path, name, part.reason)
                        self.h5_paths[s] = path   # opened on first read, in the reading process
                    else:
                        r.served[s] = True
                        r.addr[lo:lo + n] = part.row_addr

    def _where(self, s: int, name: str) -> str:
        return f"{self.location}: shard {self.shard_table.file(s)}, field {name!r}"

    def _resolve(self, s: int, path: str, d: Any, name: str, n: int) -> _FieldShard:
        import h5py

        shape, dtype, rb = self.shapes[name], self.dtypes[name], self.row_bytes[name]
        if d.shape != (n, *shape):
            raise FormatError(f"{path}: dataset {name!r} has shape {d.shape}, the index says {(n, *shape)}")
        if d.dtype != dtype:
            if d.dtype.newbyteorder("=") == dtype.newbyteorder("="):  # same values, other byte order: h5py converts
                return _FieldShard(n, _block_rows(rb), reason=f"stored as {d.dtype.str}, read as {dtype.str}")
            # anything else would be a silent conversion (wrapped or truncated values)
            raise FormatError(f"{path}: dataset {name!r} has dtype {d.dtype.str}, the index says {dtype.str}")
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
            return _FieldShard(n, _block_rows(rb), row_addr=addr)
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
        table = chunk_table(d)
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
        return _FieldShard(n, c, row_addr=addr)


def open_h5(path: str) -> Any:
    """A shard opened for reading; one whose HDF5 structure reads data from another file (an external link,
    external storage, a virtual dataset: a build writes none, a crafted shard would read local files) is a
    FormatError."""
    import h5py

    from ..formats.hdf5 import outside_refs

    try:
        f = h5py.File(path, "r", rdcc_nbytes=0)
    except OSError as e:
        hint = ""
        if "Too many open files" in str(e) or getattr(e, "errno", None) == errno.EMFILE:
            hint = (f" (open-file limit {nofile_limits()}; each memory-mapped shard keeps one file descriptor "
                    f"on Python < 3.13: raise ulimit -n)")
        raise FormatError(f"{path}: cannot open shard: {e}{hint}") from None
    bad = outside_refs(f)
    if bad:
        f.close()
        raise FormatError(f"{path}: the shard reads outside its own file ({bad}): refused; a build writes no such "
                          f"shard")
    return f


def _block_rows(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))
