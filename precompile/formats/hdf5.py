"""Chunked, uncompressed HDF5 shards and the index file with virtual datasets.

Shards: one dataset per field, samples along axis 0, chunks of whole samples,
no filters, ``libver='latest'``, 4 KiB alignment, no timestamps (so the same
inputs give the same bytes). Index: a virtual dataset per field over the
shards, the key/copy/meta columns gathered, metadata as JSON attributes, and
every shard's chunk byte ranges (``__chunks__`` plus each entry's ``chunks``:
:func:`shard_chunk_tables`), so that a reader mapping the shards needs only
the index (``reader/direct.py``). Finalize takes each shard's columns, chunk
tables and ragged tables from :mod:`.hdf5_parts` (the writer's, as it closed
the shard, or the replaced index's for a kept shard): it opens a shard file
only when neither has them, and never for a build written to a URL.

Variable-shape fields (``None`` dims in the plan's spec) are stored "ragged":
a group ``<field>`` with a flat 1-D ``data`` array (chunked by bytes, no
filters), ``offsets`` (N+1) and ``shapes`` (N, ndim); in the index file
``data`` is a virtual dataset over the shards and ``offsets`` are global, so
``g["data"][o[i]:o[i+1]].reshape(g["shapes"][i])`` works in plain h5py on
either file. Fixed-shape fields keep exactly the (N, *shape) dataset layout
that the fast loader maps directly.

This module owns everything HDF5 about a build: the shard writer and index
(:class:`Hdf5Format`), the reader (:class:`H5Dataset`: shard files opened with
the chunk cache off, which is fastest for uncompressed random access; batches
read contiguous runs, never fancy indexing), ``describe`` for ``inspect``, and
``verify``: it re-reads every field dataset of every shard, recomputes the
per-field sha256 the writer stored (in the index and in the shard's own
attributes) and names each shard whose bytes, size, key or count differ, or
which is missing or unreadable.

Out of space: HDF5 cannot recover from a failed write (a file whose metadata flush
failed cannot be closed, and freeing its objects later crashes the process with
SIGSEGV: the "full disk ends in SIGSEGV" fault). So every HDF5 file written here
claims its disk blocks ahead of HDF5 with ``posix_fallocate`` (:class:`_Claim`):
running out of space is a plain ``OSError(ENOSPC)`` raised by us while HDF5 is
still consistent, never a failed write inside HDF5. The claim runs ahead of the
data by whole chunks plus a lead for metadata; after the file is closed it is
trimmed back to HDF5's end-of-file address (from the superblock), so the bytes are
exactly those of an unclaimed write.
"""
from __future__ import annotations

import errno
import math
import os
import shutil
import struct
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from . import names as fmt
from ..errors import FormatError, echo
from ..registry import WRITERS
from ..sample import FieldSpec, Sample
from .base import Format, ShardWriter, VerifyResult, range_text, shard_digest
from ..storage.files import fsync_dir, fsync_file, human_bytes
from .dataset import Batch, Dataset
from .hdf5_layout import attr_text, shard_chunk_tables
from .hdf5_parts import ShardParts, read_parts
from .index_columns import (ShardTable, array_crc, check_attrs, check_dataset, read_key_column, read_shard_table,
                            recorded_crcs, seal, strings_crc, write_key_column, write_shard_table)
from .snapshot import file_identity

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"

ALIGN = 4096
#: fitted to shards this writer wrote (see Hdf5Format.estimate_shard_bytes)
SHARD_OVERHEAD = 8192
COLUMN_BYTES = 88


def _h5():
    import h5py

    return h5py


def _new_file(path: str):
    h5py = _h5()
    return h5py.File(path, "w", libver="latest", alignment_threshold=ALIGN, alignment_interval=ALIGN)


class _Claim:
    """Disk blocks claimed for an HDF5 file ahead of HDF5's own writes (see the module docstring).

    ``grow(n)`` claims ``n`` more bytes (plus a lead of 256 KiB + 1/16 for metadata) or raises
    ``OSError(ENOSPC)`` naming the file and the bytes; ``trim()`` (after HDF5 closed the file) cuts it back
    to HDF5's end of file. Where the file system cannot preallocate, claiming is skipped (HDF5 then meets a
    full disk itself)."""

    LEAD = 256 << 10
    #: claim at all (benchmarks/bench_faults.py switches it off to measure what claiming costs)
    supported_here: bool = hasattr(os, "posix_fallocate")

    def __init__(self, path: str, first: int):
        self.path = path
        self.claimed = 0
        self.wanted = 0
        self.supported = self.supported_here
        self.fd = os.open(path, os.O_RDWR) if self.supported else -1
        self.grow(first)

    def grow(self, nbytes: int) -> None:
        self.wanted += int(nbytes)
        target = self.wanted + self.LEAD + self.wanted // 16
        if not self.supported or target <= self.claimed:
            return
        target += self.LEAD   # claim a lead ahead: one fallocate per few chunks, not one per chunk
        try:
            os.posix_fallocate(self.fd, 0, target)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self.supported = False
                return
            free = shutil.disk_usage(os.path.dirname(self.path) or ".").free
            raise OSError(e.errno, f"{os.strerror(e.errno)}: writing {self.path} needs {target - self.claimed} "
                                   f"more bytes ({human_bytes(target)} in all), {human_bytes(free)} free",
                          self.path) from None
        self.claimed = target

    def trim(self) -> None:
        """Cut the file back to HDF5's end-of-file address (superblock version 2 or 3, 8-byte offsets)."""
        if self.claimed:
            with open(self.path, "rb") as f:
                head = f.read(48)
            if head[:8] != HDF5_MAGIC or head[8] not in (2, 3) or head[9] != 8:
                raise OSError(errno.EIO, f"cannot read the superblock of {self.path} to trim it", self.path)
            base, _ext, eof = struct.unpack_from("<QQQ", head, 12)
            os.truncate(self.path, base + eof)
        self.close()

    def release(self) -> None:
        """Give the claimed blocks back (the file is being discarded): HDF5 can then close it cleanly."""
        if self.fd >= 0:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Hdf5ShardWriter(ShardWriter):
    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.f = _new_file(self.tmp_path)
        self.claim = _Claim(self.tmp_path, SHARD_OVERHEAD)
        self.dsets = {}
        self.ragged: dict[str, _Ragged] = {}
        for name, spec in self.specs.items():
            if not spec.fixed:
                self.ragged[name] = _Ragged(self.f, name, spec, self.chunking[name], self.claim)
                continue
            n = self.chunking[name]
            self.dsets[name] = self.f.create_dataset(
                name, shape=(0, *spec.shape), maxshape=(None, *spec.shape), dtype=spec.dtype,
                chunks=(n, *spec.shape), track_times=False, fillvalue=0)
        # the key/copy/meta columns are written at close, contiguous and exactly their size
        self.buf: dict[str, list[np.ndarray]] = {f: [] for f in self.dsets}
        self.colbuf: dict[str, list] = {c: [] for c in fmt.COLUMNS}
        self.written = {f: 0 for f in self.dsets}

    def _flush(self, name: str) -> None:
        buf = self.buf[name]
        if not buf:
            return
        d = self.dsets[name]
        start = self.written[name]
        c = self.chunking[name]
        self.claim.grow(-(-len(buf) // c) * (c * self.specs[name].nbytes() + ALIGN))
        d.resize(start + len(buf), axis=0)
        d[start:start + len(buf)] = np.stack(buf)
        self.written[name] += len(buf)
        buf.clear()

    def add(self, sample: Sample) -> None:
        self.check(sample)
        self.update_checksums(sample)
        for f in self.dsets:
            self.buf[f].append(sample.fields[f])
            if len(self.buf[f]) >= self.chunking[f]:
                self._flush(f)
        for f, r in self.ragged.items():
            r.add(sample.fields[f])
        self.colbuf[fmt.KEY].append(sample.key)
        self.colbuf[fmt.COPY].append(sample.copy)
        self.colbuf[fmt.META].append(fmt.dumps(sample.meta))
        self.count += 1

    def close(self) -> dict[str, Any]:
        for f in self.dsets:
            self._flush(f)
        for r in self.ragged.values():
            r.close()
        cols = sum(len(k.encode()) + len(m.encode()) for k, m in zip(self.colbuf[fmt.KEY], self.colbuf[fmt.META]))
        self.claim.grow(2 * (cols + (COLUMN_BYTES + 8) * self.count) + 16 * ALIGN)
        str_t = _h5().string_dtype("utf-8")
        for c in fmt.COLUMNS:
            vals = self.colbuf[c]
            if c == fmt.COPY:
                self.f.create_dataset(c, data=np.asarray(vals, dtype=np.int32), track_times=False)
            else:
                self.f.create_dataset(c, data=np.array(vals, dtype=object), dtype=str_t, track_times=False)
        self.f.attrs[fmt.A_SHARD_KEY] = self.shard_key
        self.f.attrs[fmt.A_NUM] = self.count
        self.f.attrs[fmt.A_VERSION] = fmt.FORMAT_VERSION
        self.f.attrs[fmt.A_CHECKSUMS] = fmt.dumps(self.checksums())
        self.f.close()
        self.claim.trim()
        fsync_file(self.tmp_path)
        digest = shard_digest(self.tmp_path)   # read back from the page cache
        parts = self._parts()
        os.replace(self.tmp_path, self.path)
        fsync_dir(os.path.dirname(self.path))
        return {"num_samples": self.count, "bytes": os.path.getsize(self.path), "checksums": self.checksums(),
                "sha256": digest, "parts": parts}

    def _parts(self) -> ShardParts:
        """The shard's share of the index (so that finalize never reopens it): the columns and ragged tables
        as written, the chunk tables read back from the closed file (from the page cache)."""
        with _h5().File(self.tmp_path, "r") as f:
            chunks = shard_chunk_tables(f, list(self.dsets))
        ragged = {n: (np.asarray(r.offsets, dtype=np.int64),
                      np.asarray(r.shapes, dtype=np.int64).reshape(-1, len(r.spec.shape)))
                  for n, r in self.ragged.items()}
        return ShardParts(list(self.colbuf[fmt.KEY]), np.asarray(self.colbuf[fmt.COPY], dtype=np.int32),
                          list(self.colbuf[fmt.META]), chunks, ragged)

    def abort(self) -> None:
        self.claim.release()  # space for HDF5's last metadata writes, whatever filled the disk
        try:
            self.f.close()
        except Exception:  # the file may already be broken; removing it is all that matters
            pass
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)


class _Ragged:
    """One variable-shape field of a shard: flat ``data`` + ``offsets`` + ``shapes``, written by chunks."""

    def __init__(self, f, name: str, spec: FieldSpec, chunk_elems: int, claim: Optional["_Claim"] = None):
        self.spec = spec
        self.claim = claim
        self.g = f.create_group(name)
        self.g.attrs[fmt.A_LAYOUT] = fmt.LAYOUT_RAGGED
        self.chunk = max(1, int(chunk_elems))
        self.data = None   # created at the first flush: a shard smaller than one chunk gets a chunk its size
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.written = 0
        self.shapes: list[tuple[int, ...]] = []
        self.offsets = [0]

    def add(self, a: np.ndarray) -> None:
        flat = np.ascontiguousarray(a).reshape(-1)
        self.buf.append(flat)
        self.buffered += flat.size
        self.shapes.append(tuple(a.shape))
        self.offsets.append(self.offsets[-1] + flat.size)
        if self.buffered >= self.chunk:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        block = np.concatenate(self.buf)
        if self.claim is not None:
            self.claim.grow(block.nbytes + self.chunk * block.itemsize + 16 * len(self.buf) + ALIGN)
        if self.data is None:
            self.data = self.g.create_dataset(fmt.RAGGED_DATA, shape=(0,), maxshape=(None,), dtype=self.spec.dtype,
                                              chunks=(max(1, min(self.chunk, block.size)),), track_times=False,
                                              fillvalue=0)
        self.data.resize(self.written + block.size, axis=0)
        self.data[self.written:self.written + block.size] = block
        self.written += block.size
        self.buf.clear()
        self.buffered = 0

    def close(self) -> None:
        self.flush()
        if self.data is None:  # no samples, or only empty ones
            self.data = self.g.create_dataset(fmt.RAGGED_DATA, shape=(0,), maxshape=(None,), dtype=self.spec.dtype,
                                              chunks=(1,), track_times=False, fillvalue=0)
        nd = len(self.spec.shape)
        self.g.create_dataset(fmt.RAGGED_OFFSETS, data=np.asarray(self.offsets, dtype=np.int64), track_times=False)
        self.g.create_dataset(fmt.RAGGED_SHAPES, data=np.asarray(self.shapes, dtype=np.int64).reshape(-1, nd),
                              track_times=False)


def _ragged_index(f, name: str, spec: FieldSpec, shards: list[dict[str, Any]], parts: list[ShardParts]
                  ) -> dict[str, int]:
    """The index's view of a ragged field: virtual ``data``, global ``offsets``, gathered ``shapes``; returns
    the crc32s of ``offsets`` and ``shapes`` (:func:`~.index_columns.array_crc`)."""
    nd = len(spec.shape)
    sizes, offsets, shapes = [], [np.zeros(1, np.int64)], []
    for s, p in zip(shards, parts):
        if not s["num_samples"]:
            sizes.append(0)
            continue
        o, sh = p.ragged[name]
        sizes.append(int(o[-1]))
        offsets.append(o[1:] + offsets[-1][-1])
        shapes.append(sh)
    total = int(sum(sizes))
    g = f.create_group(name)
    g.attrs[fmt.A_LAYOUT] = fmt.LAYOUT_RAGGED
    _virtual_dataset(g, fmt.RAGGED_DATA, (total,), spec.dtype,
                     [(s["file"], f"{name}/{fmt.RAGGED_DATA}", n) for s, n in zip(shards, sizes)])
    offsets_all = np.concatenate(offsets)
    shapes_all = np.concatenate(shapes) if shapes else np.zeros((0, nd), np.int64)
    g.create_dataset(fmt.RAGGED_OFFSETS, data=offsets_all, track_times=False)
    g.create_dataset(fmt.RAGGED_SHAPES, data=shapes_all, track_times=False)
    return {f"{name}/{fmt.RAGGED_OFFSETS}": array_crc(offsets_all),
            f"{name}/{fmt.RAGGED_SHAPES}": array_crc(shapes_all)}


def _virtual_dataset(parent: Any, name: str, shape: tuple[int, ...], dtype: str,
                     sources: list[tuple[str, str, int]]) -> None:
    """A virtual dataset stacking ``(file, dataset, rows)`` sources along axis 0, without timestamps.

    h5py's ``create_virtual_dataset`` keeps the object's creation time, so two builds of
    the same inputs would differ in the index file's bytes; the low-level calls let us
    switch that off. Source files are relative: HDF5 finds them beside the index.
    """
    h5py = _h5()
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    dcpl.set_fill_value(np.zeros((), dtype=dtype))
    vspace = h5py.h5s.create_simple(shape, shape)
    off = 0
    for file, dset, n in sources:
        if n:
            src_shape = (n, *shape[1:])
            sel = h5py.h5s.create_simple(shape, shape)
            sel.select_hyperslab((off,) + (0,) * (len(shape) - 1), src_shape)
            dcpl.set_virtual(sel, file.encode(), dset.encode(), h5py.h5s.create_simple(src_shape, src_shape))
        off += n
    tid = h5py.h5t.py_create(np.dtype(dtype))
    h5py.h5d.create(parent.id, name.encode(), tid, vspace, dcpl=dcpl).close()


def attach_chunk_entries(shards: list[dict[str, Any]],
                         tables: list[dict[str, tuple[int, np.ndarray]]]) -> list[dict[str, Any]]:
    """The shard entries with their ``chunks`` slot: ``{field: [rows per chunk, chunks]}`` (the chunks' byte
    ranges are the next rows of the index's ``__chunks__`` dataset, see :func:`_write_chunk_tables`)."""
    out = []
    for s, t in zip(shards, tables):
        e = {k: v for k, v in s.items() if k != fmt.E_CHUNKS}
        if t:
            e[fmt.E_CHUNKS] = {name: [c, int(a.shape[0])] for name, (c, a) in sorted(t.items())}
        out.append(e)
    return out


def _write_chunk_tables(f: Any, tables: list[dict[str, tuple[int, np.ndarray]]]) -> int:
    """``__chunks__``: (chunks, 2) uint64 of byte address and size, shard by shard, and within a shard field
    by field in name order (the order of its entry's ``chunks``); one flat dataset, so the index keeps
    only datasets at its top level besides ragged fields. Returns its crc32."""
    parts = [t[name][1] for t in tables for name in sorted(t)]
    data = (np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64)).astype("<u8")
    f.create_dataset(fmt.CHUNKS, data=data, dtype="<u8", track_times=False)
    return array_crc(data)


@WRITERS.register()
class Hdf5Format(Format):
    name = "hdf5"
    shard_ext = ".h5"
    index_ext = ".h5"

    def check_specs(self, specs: dict[str, FieldSpec], options: Any = None) -> None:
        for f, s in specs.items():
            if not s.fixed and len(s.shape) == 0:
                raise ValueError(f"field {f!r} ({s.describe()}) has no dimensions to vary")

    @staticmethod
    def estimate_shard_bytes(specs: dict[str, FieldSpec], n: int, chunking: dict[str, int], key_bytes: int) -> int:
        """Bytes of a shard of ``n`` samples as :class:`Hdf5ShardWriter` writes it; ``key_bytes`` is the
        sum of the keys' UTF-8 lengths, each rounded up to 8.

        Whole chunks of every fixed-shape field, plus a model fitted to shards this writer wrote
        (8x8x3 and 64x64x3 rows, 1 to 2,000 samples, 9- to 40-byte keys): 8 KiB of superblock,
        object headers, attributes and heap, and per sample 88 bytes for the key/copy/meta columns
        (references, global-heap object headers, meta ``{}``) plus its padded key. The heap grows
        in 4 KiB steps, so a shard of a few hundred tiny samples can be off by 4 KiB either way.
        """
        total = SHARD_OVERHEAD + COLUMN_BYTES * n + key_bytes
        for f, s in specs.items():
            c = max(1, int(chunking.get(f, n) or 1))
            total += -(-n // c) * c * (s.nbytes() or 0)
        return int(total)

    def open_shard(self, path, specs, shard_key, options, chunking) -> ShardWriter:
        return Hdf5ShardWriter(path, specs, shard_key, options, chunking)

    def read_shard_info(self, path: str) -> dict[str, Any] | None:
        h5py = _h5()
        try:
            with h5py.File(path, "r") as f:
                a = f.attrs
                return {"key": str(a[fmt.A_SHARD_KEY]), "num_samples": int(a[fmt.A_NUM]),
                        "checksums": fmt.loads(a[fmt.A_CHECKSUMS]), "bytes": os.path.getsize(path)}
        except (OSError, KeyError, ValueError):
            return None

    def finalize(self, out_path: str, shards: list[dict[str, Any]], specs: dict[str, FieldSpec],
                 attrs: dict[str, Any], parts: Optional[Sequence[Optional[ShardParts]]] = None) -> None:
        """Write the index at ``out_path``. ``parts[i]`` is shard ``i``'s share of it (:mod:`.hdf5_parts`);
        a shard without one is opened (beside the index) to read it."""
        base = os.path.dirname(out_path)
        total = sum(s["num_samples"] for s in shards)
        tmp = f"{out_path}.tmp-{os.getpid()}"
        got: list[ShardParts] = []
        for s, p in zip(shards, parts or [None] * len(shards)):
            if not s["num_samples"]:
                p = ShardParts([], np.zeros(0, np.int32), [], {}, {})
            elif p is None:
                p = read_parts(os.path.join(base, s["file"]), specs)
            got.append(p)
        keys = [k for p in got for k in p.keys]
        metas = [m for p in got for m in p.metas]
        tables = [p.chunks for p in got]
        shards = attach_chunk_entries(shards, tables)
        attrs = {**attrs, fmt.A_SHARDS: shards}
        per_shard = sum(2 * len(s["file"]) + 256 for s in shards) * (len(specs) + 1)
        per_shard += sum(64 * len(t) + sum(a.nbytes for _, a in t.values()) for t in tables)
        need = (2 * (sum(len(k.encode()) for k in keys) + sum(len(m.encode()) for m in metas))
                + (64 + 48 * len(specs)) * len(keys) + per_shard + 16 * ALIGN)
        f = _new_file(tmp)
        claim = None
        try:
            claim = _Claim(tmp, need)
            self._write_index(f, shards, specs, attrs, total, keys, metas, got)
        except BaseException:
            if claim is not None:
                claim.release()
            else:
                os.truncate(tmp, 0)
            f.close()
            os.remove(tmp)
            raise
        claim.trim()
        fsync_file(tmp)
        os.replace(tmp, out_path)
        fsync_dir(base)

    @staticmethod
    def _write_index(f: Any, shards: list[dict[str, Any]], specs: dict[str, FieldSpec], attrs: dict[str, Any],
                     total: int, keys: list[str], metas: list[str], parts: list[ShardParts]) -> None:
        """The index's datasets and attributes into the open file ``f`` (closed here): a virtual dataset per
        field, the key/copy/meta columns, ``__chunks__``, the attributes, and the columnar copies of the keys
        and the shard entries (:mod:`.index_columns`)."""
        h5py = _h5()
        copies = [p.copies for p in parts if p.keys]
        crcs: dict[str, int] = {}   # of every dataset readers take from the index (index_columns.seal)
        with f:
            for name, spec in specs.items():
                if not spec.fixed:
                    crcs.update(_ragged_index(f, name, spec, shards, parts))
                    continue
                _virtual_dataset(f, name, (total, *spec.shape), spec.dtype,
                                 [(s["file"], name, s["num_samples"]) for s in shards])
            str_t = h5py.string_dtype("utf-8")
            f.create_dataset(fmt.KEY, data=np.array(keys, dtype=object), dtype=str_t, track_times=False)
            crcs.update(write_key_column(f, keys))
            copy = (np.concatenate(copies) if copies else np.zeros(0, np.int32)).astype(np.int32)
            f.create_dataset(fmt.COPY, data=copy, dtype="int32", track_times=False)
            crcs[fmt.COPY] = array_crc(copy)
            f.create_dataset(fmt.META, data=np.array(metas, dtype=object), dtype=str_t, track_times=False)
            crcs[fmt.META] = strings_crc([m.encode("utf-8") for m in metas])
            crcs[fmt.CHUNKS] = _write_chunk_tables(f, [p.chunks for p in parts])
            texts = {k: v if isinstance(v, (int, float, str)) else fmt.dumps(v) for k, v in attrs.items()}
            for k, v in texts.items():
                f.attrs[k] = v
            f.attrs[fmt.A_NUM] = total
            crcs[fmt.SHARD_TABLE] = write_shard_table(f, shards, texts[fmt.A_SHARDS])
            seal(f, {**texts, fmt.A_NUM: total}, crcs)

    # -- read side ------------------------------------------------------------------------
    @classmethod
    def claims(cls, head: bytes) -> bool:
        return head[:8] == HDF5_MAGIC

    def open(self, path: str, fields: Sequence[str] | None = None) -> "H5Dataset":
        return H5Dataset(path, fields=fields)

    def describe(self, ds: Dataset) -> tuple[list[str], dict[str, str]]:
        return [], _hdf5_storage(ds)

    def verify(self, path: str, checksums: bool = True) -> VerifyResult:
        return verify_hdf5(path, checksums)

    def set_index_attr(self, path: str, name: str, text: str) -> None:
        """Set attribute ``name`` (keeping the index's ``index_crc32`` true when it records that attribute)."""
        from .index_columns import attr_crc

        h5py = _h5()
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            shutil.copyfile(path, tmp)
            with h5py.File(tmp, "r+") as f:
                f.attrs[name] = text
                crcs = recorded_crcs(f, path)
                if crcs is not None and name in crcs["attrs"]:
                    crcs["attrs"][name] = attr_crc(text)
                    f.attrs[fmt.A_INDEX_CRC] = fmt.dumps(crcs)
            fsync_file(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


# --- reading -----------------------------------------------------------------------------------

def outside_refs(path: Any, sources: Optional[set[str]] = None) -> Optional[str]:
    """Why the HDF5 file at ``path`` (or the open ``h5py.File`` ``path``: the very file whose entries gave
    ``sources``, not one a rebuild put at its name since) reads data outside itself, or None (also when it is no
    HDF5 file: opening it says so). An external link, a dataset with external storage (raw data in any local file
    named in it) or a virtual dataset (``sources``: the relative file names an index's virtual datasets may take
    theirs from, its shard files; a shard may have none) would let a file from a URL read local files: a build
    writes none of them."""
    import contextlib

    import h5py

    if hasattr(path, "visititems_links"):   # an open file (duck-typed: h5py.File may be wrapped, as tests do)
        f, hold = path, contextlib.nullcontext(path)
    else:
        try:
            f = h5py.File(path, "r")
        except OSError:
            return None
        hold = f
    found: list[str] = []

    def visit(name: str, link: Any) -> Optional[bool]:
        if isinstance(link, h5py.ExternalLink):
            found.append(f"{name!r} is an external link to the file {echo(link.filename)}")
        elif isinstance(link, h5py.HardLink):
            d = f.get(name)
            if isinstance(d, h5py.Dataset):
                if d.external:
                    found.append(f"the dataset {name!r} keeps its data in the file {echo(d.external[0][0])}")
                elif d.is_virtual:
                    names = sorted({v.file_name for v in d.virtual_sources()} - (sources or set()))
                    if names:
                        found.append(f"the dataset {name!r} is virtual, with data from the file {echo(names[0])}")
        return True if found else None

    with hold:
        f.visititems_links(visit)
    return found[0] if found else None


class H5Dataset(Dataset):
    """Samples of an HDF5 build. ``ds[i]`` -> {field: array}; ``ds.batch(idx)`` -> {field: stacked}."""

    MAX_GAP = 16  # rows skipped inside one read before a batch read is split in two

    def __init__(self, path: str | os.PathLike, fields: Sequence[str] | None = None, where: Optional[str] = None):
        import h5py

        self.path = os.path.abspath(str(path))
        #: what messages call the index (its path; a build read from a URL: its URL)
        self.where = where or self.path
        #: (device, inode, size, mtime) of the index file opened: tells a rebuild from a shard deleted by hand
        self._identity = file_identity(self.path)
        try:
            with h5py.File(self.path, "r") as f:
                a = dict(f.attrs)
                fmt.check_header(self.where, a)
                #: the index's recorded crc32s (index_columns.seal; None: written before them)
                self._crcs = recorded_crcs(a, self.where)
                check_attrs(self.where, self._crcs, a)
                self.attrs = {k: attr_text(v) if isinstance(v, (bytes, str)) else v for k, v in a.items()}
                table = read_shard_table(f, self.attrs.get(fmt.A_SHARDS), self._crcs, self.where)
                #: the shard entries' columns (from ``__shards__``; parsed from the entries for an index without it)
                self.shard_table: ShardTable = table if table is not None else self._table_from_entries()
                shard_files = set()
                for name in self.shard_table.files.tolist():   # an index is data: its shards stay in its folder
                    shard_files.add(fmt.check_entry(self.where, bytes(name).decode("utf-8", "replace"),
                                                    "shard entry"))
                if where is None:   # (one read from a URL was checked before it was opened: hdf5_url.open_url)
                    bad = outside_refs(f, shard_files)   # (this file: a rebuild may have replaced the path's)
                    if bad:
                        raise FormatError(f"{self.where}: the index reads outside its own file ({bad}): refused; a "
                                          f"build writes no such index")
                self._copies = f[fmt.COPY][:]
                self._key_column = read_key_column(f, len(self._copies))
                if self._key_column is None and self._crcs is not None and fmt.KEY_UTF8 in f:
                    for name in (fmt.KEY_UTF8, fmt.KEY_OFFSETS):   # damaged beyond reading: name which
                        check_dataset(self.where, self._crcs, name, f[name][()])
                self._keys: list[str] | None = None if self._key_column is not None else _read_strings(f[fmt.KEY])
        except OSError as e:
            raise FormatError(f"{self.where}: cannot open as HDF5: {e}") from None
        # the per-sample columns read above are checked on first use (index_columns: no cost at open)
        self._unchecked = {fmt.COPY} | ({fmt.KEY_UTF8, fmt.KEY_OFFSETS} if self._key_column is not None else set())
        if self._identity is not None and self._identity != file_identity(self.path):
            self._identity = None   # replaced while it was read: which one was read is not known
        self._setup(fields, self.shard_table.num_samples)
        if self._n != len(self._copies):
            raise FormatError(f"{self.where}: the index's shard entries count {self._n} samples, its {fmt.COPY} "
                              f"column {len(self._copies)}: the index is damaged (build again)")
        self._files: dict[int, Any] = {}
        self._dsets: dict[tuple[int, str], Any] = {}
        self._ragged: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

    def _entries(self) -> list[dict]:
        """:attr:`shards`, or FormatError when the index's entries are not a JSON list of objects (damaged)."""
        try:
            shards = self.shards
            if not isinstance(shards, list) or not all(isinstance(e, dict) for e in shards):
                raise ValueError("not a list of entries")
            return shards
        except (ValueError, RecursionError) as e:
            self._shards = None
            raise self._bad_entries(e) from None

    def _table_from_entries(self) -> ShardTable:
        try:
            return ShardTable.from_entries(self._entries())
        except (KeyError, ValueError, TypeError) as e:
            raise self._bad_entries(e) from None

    def _bad_entries(self, e: BaseException) -> FormatError:
        return FormatError(f"{self.where}: the index is damaged: its shard entries ({fmt.A_SHARDS}) cannot be read "
                           f"({type(e).__name__}: {str(e)[:100]}); write the index again with: precompile build "
                           f"<recipe> --repair (with the same -o)")

    def _check(self, *names: str) -> None:
        """Check the per-sample columns ``names`` against the index's crc32s, once (FormatError on a mismatch)."""
        todo = [n for n in names if n in self._unchecked]
        for name in todo:
            a = {fmt.COPY: self._copies, fmt.KEY_UTF8: getattr(self._key_column, "data", None),
                 fmt.KEY_OFFSETS: getattr(self._key_column, "offsets", None)}[name]
            check_dataset(self.where, self._crcs, name, a)
            self._unchecked.discard(name)

    def check_index_dataset(self, name: str, values: Any) -> None:
        """FormatError unless ``values``, read from the index's dataset ``name`` (a ragged field's
        ``<field>/offsets``, ...), have the crc32 the build recorded for it (nothing to check for an index
        written before the checksums)."""
        check_dataset(self.where, self._crcs, name, values)

    @property
    def copies(self) -> np.ndarray:
        """Every sample's copy index (``__copy__``), checked on first use."""
        if self._unchecked:
            self._check(fmt.COPY)
        return self._copies

    @property
    def keys(self) -> list[str]:
        """Every sample's key in index order (decoded from the index's key column on first use)."""
        if self._keys is None:
            self._check(fmt.KEY_UTF8, fmt.KEY_OFFSETS)
            self._keys = self._key_column.tolist()
        return self._keys

    def key(self, i: int) -> str:
        if self._keys is None:
            if self._unchecked:
                self._check(fmt.KEY_UTF8, fmt.KEY_OFFSETS)
            return self._key_column.key(self._index(i))
        return self._keys[self._index(i)]

    def shard_path(self, s: int) -> str:
        """Shard ``s``'s file (from the shard table: no entry JSON parsed)."""
        return os.path.join(os.path.dirname(self.path), self.shard_table.file(s))

    def _drop_handles(self, state: dict) -> None:
        state["_files"] = {}
        state["_dsets"] = {}

    def _file(self, shard: int):
        import h5py

        if self._pid != os.getpid():
            self._files = {}
            self._dsets = {}
            self._pid = os.getpid()
        f = self._files.get(shard)
        if f is None:
            p = self.shard_path(shard)
            try:
                f = h5py.File(p, "r", rdcc_nbytes=0)
            except OSError as e:
                if not os.path.exists(p):
                    from .snapshot import gone

                    raise FormatError(gone(p, self.path, self._identity)) from None
                raise FormatError(f"{p}: cannot open shard: {e}") from None
            bad = outside_refs(f)
            if bad:
                f.close()
                raise FormatError(f"{p}: the shard reads outside its own file ({bad}): refused; a build writes "
                                  f"no such shard")
            self._files[shard] = f
        return f

    def _dset(self, shard: int, name: str):
        """The h5py dataset, looked up once per process (a lookup by name costs ~70 us, a read ~6 us)."""
        d = self._dsets.get((shard, name)) if self._pid == os.getpid() else None
        if d is None:
            d = self._file(shard)[name]  # (re)opens the file in this process first if needed
            self._dsets[(shard, name)] = d
        return d

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        self._dsets = {}

    def _ragged_table(self, shard: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        t = self._ragged.get((shard, name))
        if t is None:
            g = self._file(shard)[name]
            t = (g[fmt.RAGGED_OFFSETS][:], g[fmt.RAGGED_SHAPES][:])
            self._ragged[(shard, name)] = t
        return t

    def _read(self, shard: int, j: int, name: str) -> np.ndarray:
        if not self.variable(name):
            return self._dset(shard, name)[j]
        f = self._file(shard)
        offsets, shapes = self._ragged_table(shard, name)
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        return f[name][fmt.RAGGED_DATA][lo:hi].reshape(tuple(int(d) for d in shapes[j]))

    def _sample(self, i: int, names: list[str]) -> dict[str, np.ndarray]:
        s, j = self.locate(i)
        return {name: self._read(s, j, name) for name in names}

    def batch(self, indices: Iterable[int], pad: Any = False) -> Batch:
        """Stack samples ``indices`` (any order); reads each shard's contiguous runs once.

        Variable-shape fields are read sample by sample; unequal shapes are refused unless
        ``pad`` is True (pad with 0) or a pad value."""
        idx = self._indices(indices)
        out = Batch()
        fixed = [n for n in self.fields if not self.variable(n)]
        ragged = [n for n in self.fields if self.variable(n)]
        for name in fixed:
            out[name] = np.empty((len(idx), *self.field_specs[name]["shape"]), dtype=self.field_specs[name]["dtype"])
        order = np.argsort(idx, kind="stable")
        sidx = idx[order]
        shard_of = np.searchsorted(self.offsets, sidx, side="right") - 1
        pos = 0
        while fixed and pos < len(sidx):
            s = shard_of[pos]
            end = pos
            while end < len(sidx) and shard_of[end] == s:
                end += 1
            local = sidx[pos:end] - self.offsets[s]
            f = self._file(int(s))
            # contiguous slices (never fancy indexing); a gap wider than MAX_GAP rows starts a new read
            cuts = np.flatnonzero(np.diff(local) > self.MAX_GAP) + 1
            for run in np.split(np.arange(len(local)), cuts):
                lo, hi = int(local[run[0]]), int(local[run[-1]]) + 1
                for name in fixed:
                    block = f[name][lo:hi]
                    out[name][order[pos + run]] = block[local[run] - lo]
            pos = end
        if ragged:
            self._batch_by_sample(idx, ragged, pad, out)
        return _reorder(out, self.fields)

    def meta(self, i: int) -> dict:
        s, j = self.locate(i)
        m = self._file(s)[fmt.META][j]
        return fmt.loads(m)


def _read_strings(d: Any) -> list[str]:
    """A variable-length string dataset as a list of str."""
    return [k.decode() if isinstance(k, bytes) else k for k in d[:]]


def _reorder(b: Batch, names: list[str]) -> Batch:
    out = Batch({n: b[n] for n in names})
    out.padded, out.shapes = b.padded, b.shapes
    return out


# --- inspect and verify ------------------------------------------------------------------------

def _hdf5_storage(ds: "H5Dataset") -> dict[str, str]:
    import h5py

    out = {}
    with h5py.File(ds.path, "r") as idx:
        # the dataset's own handle (a build read from a URL: fetched into the cache)
        shard0 = ds._file(0) if len(ds.shard_table) else None
        for name in ds.field_specs:
            if ds.variable(name):
                shapes = idx[name][fmt.RAGGED_SHAPES][:]
                text = f"ragged: flat data + offsets + shapes, shapes {range_text(shapes)}"
                if shard0 is not None and shard0[name][fmt.RAGGED_DATA].chunks:
                    d = shard0[name][fmt.RAGGED_DATA]
                    text += f", chunks of {human_bytes(d.dtype.itemsize * d.chunks[0])}"
                out[name] = text
            elif shard0 is not None and shard0[name].chunks:
                d = shard0[name]
                out[name] = f"chunks of {d.chunks[0]} sample(s), {human_bytes(int(d.dtype.itemsize * math.prod(d.chunks)))}"
    return out


def verify_hdf5(path: str, checksums: bool = True) -> VerifyResult:
    """Check every shard of the HDF5 output at ``path`` (see :mod:`.hdf5_verify`)."""
    from .hdf5_verify import verify_hdf5 as run

    return run(path, checksums)
