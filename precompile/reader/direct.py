"""Raw access to a build's shard files: chunk byte offsets resolved once, batches gathered from memory maps.

The Loader's hot path never calls h5py per batch. When a :class:`DirectReader`
opens a build it reads where the bytes of every chunk live from the index's
chunk tables (``__chunks__``, written at finalize: see docs/faults.md), checked
against the entries, for every shard at once in numpy: no shard file is opened
to make a reader. For an index without tables (built before them), or a field
an entry has no table for, it asks h5py, once per shard and field
(``dset.id.chunk_iter``, or ``get_offset`` for a contiguous dataset), and checks
that the dataset is unfiltered and fully allocated. Each row then has a byte
address in its shard file.

All shard files are then mapped into ONE reserved range of virtual addresses
(:class:`Region`: an anonymous ``PROT_NONE`` reservation, each file mapped
over its page-aligned slot with ``MAP_FIXED``, descriptors closed at once;
POSIX systems; every slot when the reader is made, or with ``lazy`` a slot on
the first batch that reads it, its size checked against the index's record),
so every row of a fixed-shape field has one address in one
array, whatever shard it lives in. Rows whose addresses agree modulo the row
size sit in one C-contiguous 2-D view of the range (one view per residue; a
field has a handful, one per distinct chunk alignment), so a batch is a few
``np.take(view, rows, out=...)`` calls however many shards it touches: the
cost per batch no longer grows with the shards touched (with one map per
shard, a shuffled batch over thousands of shards was one ``np.take`` per
row). Small rows can land in many alignments (784-byte MNIST rows in 4 KiB
aligned chunks); past ``MAX_VIEWS`` a field of rows under ``VIEW_ALL_BYTES``
uses one fancy index over a strided view in which "row k" starts at byte k
(larger rows keep a view per residue: a 192 KiB row lands in up to 48, and the
fancy index's temporary, allocated and copied again per batch, ran at a quarter
of the takes' speed). ``gather_rank`` orders rows by
(view, address): a shuffled batch sorted by it is one take per view, read in
address order. Chunk addresses are taken from the table, never computed: HDF5
does not space them evenly. Where the range cannot be reserved (no POSIX
``mmap`` through ctypes, or ``USE_REGION`` off), each shard is mapped on its
own (``map_file``; on Python < 3.13 one descriptor per map, the soft
``RLIMIT_NOFILE`` raised toward the hard limit when needed) and the views are
per shard.

``in_memory=True`` copies every served field into one private array per field
(rows in index order) at construction; a batch is then a single ``np.take``
from process memory, the same operation as an in-memory gather.

A dataset the map cannot serve (compressed or otherwise filtered, chunks that
do not hold whole samples, unallocated chunks, compact/virtual/external
storage, a non-native byte order) falls back to h5py with the chunk cache off,
reading each touched chunk once; ``fallbacks`` says which and why. Those shard
files are opened lazily in the process that reads them (never inherited across
a fork). This module imports neither torch nor anything from the build path.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import FormatError, PrecompileError
from ..formats import names as fmt
from ..formats.hdf5 import chunk_table, read_chunk_tables
from ..formats.index_columns import ShardTable

log = logging.getLogger("precompile.reader")

#: a batch in fewer runs of one view than this is gathered run by run, without grouping it first
MIN_SORT_RUNS = 8
#: rows per "block" for a dataset without chunks (contiguous or fallback), in bytes
BLOCK_BYTES = 2 * 1024 * 1024
#: at most this many residue views per shard and field; beyond (small rows in many chunk
#: alignments, e.g. 784-byte MNIST rows), one strided fancy-index per shard does the gather
MAX_VIEWS = 4
#: rows of at least this many bytes get a view per residue however many there are: one np.take per view
#: in a batch costs a few microseconds, less than copying one such row
VIEW_ALL_BYTES = 64 << 10


def fixed_shape(spec: dict) -> tuple[int, ...] | None:
    """The spec's sample shape if every dimension is known, else None."""
    shape = spec.get("shape")
    if shape is None or any(d is None or int(d) < 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def page_aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts on a page boundary, as mapped shard rows do.

    A gather copies rows between arrays, and on the x86 machines measured a copy whose destination sits 1 to
    31 bytes past its source modulo 4 KiB runs at a quarter to half speed (192 KiB rows: 3.4 GB/s at 8
    bytes, 7.3 at 16, 13-17 at 0 or 32 and more; benchmarks/bench_mapped.py). numpy's large arrays start 16
    bytes into a page and HDF5 chunks (so page-multiple rows) on one: every buffer a gather writes, or reads
    as a private copy, is allocated here, so such rows are copied page to page."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + mmap.PAGESIZE, np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


def shard_table_of(ds: Any) -> ShardTable:
    """The opened build's shard table (an H5Dataset reads it with the index), else one made from its entries."""
    table = getattr(ds, "shard_table", None)
    return table if table is not None else ShardTable.from_entries(ds.shards)


_nofile_raised = False


def _raise_nofile_limit() -> bool:
    """Raise the soft RLIMIT_NOFILE to the hard limit (once per process); True if it went up."""
    global _nofile_raised
    if _nofile_raised:
        return False
    _nofile_raised = True
    try:
        import resource
    except ImportError:  # not a POSIX system
        return False
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        return False
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        return False
    log.info("raised the open-file limit from %d to %d to map the build's shards", soft, new)
    return True


def _nofile_limits() -> str:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f"soft {soft}, hard {hard}"
    except ImportError:
        return "unknown"


def map_file(path: str) -> np.ndarray:
    """The whole file as a read-only uint8 array backed by a memory map.

    The file is closed at once; the mapping stays valid. Python < 3.13's ``mmap``
    keeps a duplicate descriptor per map, so a build with more shards than the
    open-file limit allows first raises the soft limit toward the hard one, then
    fails with a :class:`FormatError` that says so.
    """
    kw = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    for attempt in (0, 1):
        try:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ, **kw)
            return np.frombuffer(m, dtype=np.uint8)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and attempt == 0 and _raise_nofile_limit():
                continue
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise FormatError(
                    f"{path}: cannot map shard: too many open files ({e.strerror}; open-file limit "
                    f"{_nofile_limits()}). Each memory-mapped shard keeps one file descriptor on Python < 3.13; "
                    f"raise the limit (ulimit -n) or build with more samples per shard") from None
            raise FormatError(f"{path}: cannot map shard: {e}") from None
        except ValueError as e:  # an empty file cannot be mapped
            raise FormatError(f"{path}: cannot map shard: {e}") from None
    raise AssertionError("unreachable")


#: map every shard into one reserved address range when the platform allows it
USE_REGION = True


class Region:
    """Shard files mapped read-only, side by side, into one reserved range of virtual addresses.

    ``Region.reserve(paths, sizes)`` reserves ``sum(page-rounded sizes)`` bytes
    with an anonymous ``PROT_NONE`` mapping (the sizes as the index records
    them); ``map_slot(i)`` maps file ``i`` over its slot with ``MAP_FIXED``
    (closing its descriptor at once) after checking its size, when the reader
    first needs it or all at once. ``bases[i]`` is file ``i``'s offset in
    ``array``, a read-only uint8 view of the whole range; ``mapped[i]`` says
    whether its slot is mapped (an unmapped slot must not be read). The range is
    unmapped when the last array on it is gone (the arrays keep it alive), never
    while a view exists. ``reserve`` returns None where ctypes cannot reach
    ``mmap`` (not Linux or macOS) or the reservation fails; callers then map
    files one by one.
    """

    _libc: Any = None

    def __init__(self, addr: int, size: int, bases: np.ndarray, sizes: np.ndarray):
        import ctypes

        self.addr, self.size, self.bases, self.sizes = addr, size, bases, sizes
        self.paths: list[str] = []
        self.mapped = np.ones(len(bases), dtype=bool)   # reserve(): every slot unmapped until map_slot
        buf = (ctypes.c_uint8 * max(1, size)).from_address(addr)
        # the buffer (and so every array on it) keeps the mapping alive; through an object that holds
        # neither the region nor an array, so no reference cycle delays the unmap until a gc pass
        # (each shard is a mapping: a few Loaders left to the gc could exhaust vm.max_map_count)
        buf._unmap = _Unmap(addr, size, type(self)._lib())
        a = np.frombuffer(buf, dtype=np.uint8)[:size]
        a.flags.writeable = False  # PROT_READ: a write would be a segfault, make it a ValueError
        self.array = a

    @classmethod
    def _lib(cls) -> Any:
        if cls._libc is None:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int64]
            libc.munmap.restype = ctypes.c_int
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            cls._libc = libc
        return cls._libc

    @classmethod
    def reserve(cls, paths: Sequence[str], sizes: Sequence[int] | None = None) -> "Region | None":
        """Reserve slots for ``paths`` (``sizes``: their sizes as the index records them, else stat'ed)
        without mapping any: :meth:`map_slot` maps one on first use."""
        if not (sys.platform.startswith("linux") or sys.platform == "darwin") or not paths:
            return None
        try:
            libc = cls._lib()
        except (OSError, AttributeError):
            return None
        page = mmap.PAGESIZE
        try:
            sz = np.array(sizes if sizes is not None else [os.path.getsize(p) for p in paths], dtype=np.int64)
        except OSError:
            return None
        if (sz <= 0).any():
            return None
        slots = -(-sz // page) * page
        bases = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
        total = int(slots.sum())
        failed = 2 ** 64 - 1  # MAP_FAILED as an unsigned pointer
        addr = libc.mmap(None, total, mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr is None or addr == failed:
            return None
        region = cls(addr, total, bases, sz)
        region.paths = list(paths)
        region.mapped = np.zeros(len(paths), dtype=bool)
        return region

    def map_slot(self, i: int, index: str | None = None, opened: tuple[int, int, int, int] | None = None) -> None:
        """Map file ``i`` over its slot; FormatError when it is gone (``index``: the index that names it,
        ``opened``: that index's identity when it was opened, :func:`~precompile.formats.snapshot.gone`), or its
        size is not the one its slot was reserved for (the file is not the shard the index describes)."""
        path, size = self.paths[i], int(self.sizes[i])
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            if not os.path.exists(path) and index is not None:
                from ..formats.snapshot import gone

                raise FormatError(gone(path, index, opened)) from None
            raise FormatError(f"{path}: cannot map shard: {e}") from None
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise FormatError(size_mismatch(path, have, size))
            fixed = 0x10  # MAP_FIXED: the same value on Linux and macOS
            got = self._lib().mmap(self.addr + int(self.bases[i]), size, mmap.PROT_READ, mmap.MAP_SHARED | fixed,
                                   fd, 0)
        finally:
            os.close(fd)
        if got != self.addr + int(self.bases[i]):
            raise FormatError(f"{path}: cannot map shard (mmap failed, errno {ctypes_errno()})")
        self.mapped[i] = True

    def unmap_slot(self, i: int) -> None:
        """Let go of file ``i``: its slot becomes reserved ``PROT_NONE`` space again (an anonymous map over it with
        ``MAP_FIXED``), so the file keeps no blocks once unlinked (a build read from a URL: the cache evicts it)."""
        addr = self.addr + int(self.bases[i])
        got = self._lib().mmap(addr, int(self.sizes[i]), mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0,
                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
        if got != addr:
            raise FormatError(f"{self.paths[i]}: cannot unmap shard (mmap failed, errno {ctypes_errno()})")
        self.mapped[i] = False


class _Unmap:
    """Unmaps a region's range when the last array on it is gone (see ``Region.__init__``)."""

    def __init__(self, addr: int, size: int, libc: Any):
        self.addr, self.size, self.libc = addr, size, libc

    def __del__(self) -> None:
        if self.addr:
            self.libc.munmap(self.addr, self.size)
            self.addr = 0


class _Plan:
    """A batch's global row indices; grouped by shard (positions, shard-local rows) on demand."""

    def __init__(self, reader: "DirectReader", idx: np.ndarray):
        self.reader = reader
        self.idx = idx
        self.size = int(idx.size)
        self._groups: list[tuple[int, np.ndarray, np.ndarray]] | None = None
        self.release: Any = None   # a build read from a URL: lets go of the shards the plan holds mapped

    def __enter__(self) -> "_Plan":
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
                raise KeyError(f"no field {name!r} in {self.location} (fields: {', '.join(ds.field_specs)})")
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
        self._h5_paths: dict[int, str] = {}
        self._pid = os.getpid()
        self._closed = False
        self.fallbacks = {}
        table = self.shard_table = shard_table_of(ds)
        counts = np.diff(self.offsets)
        self.rows = {name: _FieldRows(np.zeros(len(counts), dtype=bool), np.ones(len(counts), dtype=np.int64),
                                      np.zeros(self.n, dtype=np.int64)) for name in self.fields}
        self._tables = self._index_tables()
        if self._tables is not None:
            self._parts_from_table(self._tables)
        self._resolve_rest()
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

    def _index_tables(self) -> np.ndarray | None:
        """The index's chunk table (None: an index without one; every shard is then resolved through
        h5py as before the tables existed)."""
        if not self.shard_table.has_chunks():
            return None
        table = read_chunk_tables(self.ds.path, self.location)
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
            if self.source is not None:
                name = next(f for f in self.fields if not self.rows[f].served[s])
                raise FormatError(f"{self._where(s, name)}: the index has no chunk table for it; reading a build "
                                  f"from a URL needs the chunk tables of builds since issue 20: build it again")
            path, n, lo = self._path(s), int(counts[s]), int(self.offsets[s])
            with _open_h5(path) as f:
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
                        self._h5_paths[s] = path   # opened on first read, in the reading process
                    else:
                        r.served[s] = True
                        r.addr[lo:lo + n] = part.row_addr

    def _where(self, s: int, name: str) -> str:
        return f"{self.location}: shard {self.shard_table.file(s)}, field {name!r}"

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
            _ensure_nofile(len(order))
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

    # -- resolving chunk addresses (once) -------------------------------------------------
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
        return self._mapped(s, path, n, c, addr, rb)

    def _mapped(self, s: int, path: str, n: int, c: int, addr: np.ndarray, rb: int) -> _FieldShard:
        return _FieldShard(n, c, row_addr=addr)

    def _chunk_ids_and_rank(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, from the field with the largest rows (the one that dominates I/O): a global chunk
        id, and the row's place in gather order: the h5py-served rows first, in index order, then the
        mapped rows by (view, address) (one sort key: a million rows in 0.05 s)."""
        name = max(self.fields, key=lambda f: self.row_bytes[f]) if self.fields else None
        counts = np.diff(self.offsets)
        shard = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        rpc = np.maximum(1, self.rows[name].rows_per_chunk) if name else np.ones(len(counts), dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(-(-counts // rpc))[:-1]]).astype(np.int64)
        local = np.arange(self.n, dtype=np.int64) - self.offsets[shard]
        ids = first[shard] + local // rpc[shard]
        if name is None:
            return ids, np.arange(self.n, dtype=np.int64)
        vid, vrow = self._vid[name], self._vrow[name]
        span = max(self.n, int(vrow.max(initial=0)) + 1)       # every served key above every row index
        key = np.where(vid >= 0, (vid + 1) * span + vrow, np.arange(self.n, dtype=np.int64))
        rank = np.empty(self.n, dtype=np.int64)
        rank[np.argsort(key, kind="stable")] = np.arange(self.n, dtype=np.int64)
        return ids, rank

    def _build_view_tables(self) -> None:
        """Per field: the views of every mapped space in one list, and per global row its view and
        row in it (-1: the shard is served by h5py), so a batch needs no per-shard bookkeeping."""
        self._views: dict[str, list[np.ndarray]] = {}
        self._takeable: dict[str, list[bool]] = {}
        self._vid: dict[str, np.ndarray] = {}
        self._vrow: dict[str, np.ndarray] = {}
        for name in self.fields:
            rb = self.row_bytes[name]
            views: list[np.ndarray] = []
            takeable: list[bool] = []
            vid = np.full(self.n, -1, dtype=np.int64)
            vrow = np.zeros(self.n, dtype=np.int64)
            for arr, bases in self._spaces:
                if self.region is not None:   # one space for all shards: every row at once
                    served, addr = self._field_rows(name)
                    base = np.zeros(len(self.offsets) - 1, dtype=np.int64)
                    base[list(bases)] = list(bases.values())
                    g_rows = np.flatnonzero(served)
                    g_addr = addr[g_rows] + np.repeat(base, np.diff(self.offsets))[g_rows]
                    if not len(g_rows):
                        continue
                else:
                    rows, addr = [], []
                    for s, b in bases.items():
                        if not self.rows[name].served[s]:
                            continue
                        lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
                        rows.append(np.arange(lo, hi, dtype=np.int64))
                        addr.append(self.rows[name].addr[lo:hi] + b)
                    if not rows:
                        continue
                    g_rows, g_addr = np.concatenate(rows), np.concatenate(addr)
                res = g_addr % rb    # the same for a chunk's rows: unique over runs, not over every row
                residues = np.unique(res[np.flatnonzero(np.diff(res, prepend=res[0] - 1))])
                rid = np.searchsorted(residues, res)
                if len(residues) > MAX_VIEWS and rb < VIEW_ALL_BYTES:
                    vid[g_rows] = len(views)
                    vrow[g_rows] = g_addr
                    views.append(as_strided(arr, shape=(arr.size - rb + 1, rb), strides=(1, 1), writeable=False))
                    takeable.append(False)
                    continue
                vid[g_rows] = len(views) + rid
                vrow[g_rows] = (g_addr - residues[rid]) // rb
                for r in residues.tolist():
                    k = (arr.size - r) // rb
                    views.append(arr[r:r + k * rb].reshape(k, rb))
                    takeable.append(True)
            self._views[name], self._takeable[name], self._vid[name], self._vrow[name] = views, takeable, vid, vrow

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

    def plan(self, indices: np.ndarray) -> _Plan:
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
        return _Plan(self, idx)

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

    def gather(self, name: str, plan: _Plan, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (``(len, *shape)`` of the field's dtype, C-contiguous) with the planned rows."""
        self._check_open()
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
                    out[pos] = self._read_fallback(s, name, local)
                else:
                    self._gather_runs(name, plan.idx[pos], vid[pos], flat, pos)
            return out
        self._gather_runs(name, plan.idx, vid, flat, None)
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
            f = self._h5[s] = _open_h5(self._h5_paths[s])
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


def size_mismatch(path: str, have: int, size: int) -> str:
    """The error of a shard file whose size is not the one the index recorded for it."""
    return (f"{path}: the shard file is {have} bytes, the index says {size}: it is not the file the index's chunk "
            f"table describes (damaged or replaced); run precompile verify, or build again")


def ctypes_errno() -> int:
    import ctypes

    return ctypes.get_errno()


def _distinct(ids: np.ndarray) -> int:
    """How many distinct values in ``ids`` (small non-negative ints), without ``np.unique``
    (whose first call imports ``numpy.ma``: 0.1-1 s on the first batch)."""
    return int(np.count_nonzero(np.bincount(ids)))


def _ensure_nofile(nshards: int) -> None:
    """Raise the soft open-file limit up front when mapping ``nshards`` files could exhaust it."""
    if sys.version_info >= (3, 13):
        return  # maps keep no descriptor
    try:
        import resource
    except ImportError:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and nshards + 256 > soft:
        _raise_nofile_limit()


def _open_h5(path: str) -> Any:
    import h5py

    try:
        return h5py.File(path, "r", rdcc_nbytes=0)
    except OSError as e:
        hint = ""
        if "Too many open files" in str(e) or getattr(e, "errno", None) == errno.EMFILE:
            hint = (f" (open-file limit {_nofile_limits()}; each memory-mapped shard keeps one file descriptor "
                    f"on Python < 3.13: raise ulimit -n)")
        raise FormatError(f"{path}: cannot open shard: {e}{hint}") from None


def _block_rows(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))
