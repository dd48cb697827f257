"""Chunked, uncompressed HDF5 shards and the index file with virtual datasets.

Shards: one dataset per field, samples along axis 0, chunks of whole samples,
no filters, ``libver='latest'``, 4 KiB alignment, no timestamps (so the same
inputs give the same bytes). Index: a virtual dataset per field over the
shards, the key/copy/meta columns gathered, metadata as JSON attributes.

Variable-shape fields (``None`` dims in the plan's spec) are stored "ragged":
a group ``<field>`` with a flat 1-D ``data`` array (chunked by bytes, no
filters), ``offsets`` (N+1) and ``shapes`` (N, ndim); in the index file
``data`` is a virtual dataset over the shards and ``offsets`` are global, so
``g["data"][o[i]:o[i+1]].reshape(g["shapes"][i])`` works in plain h5py on
either file. Fixed-shape fields keep exactly the (N, *shape) dataset layout
that the fast loader maps directly.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import format as fmt
from ..registry import WRITERS
from ..sample import FieldSpec, Sample
from .base import ShardWriter, Writer, fsync_dir, fsync_file

ALIGN = 4096
#: fitted to shards this writer wrote (see Hdf5Writer.estimate_shard_bytes)
SHARD_OVERHEAD = 8192
COLUMN_BYTES = 88


def _h5():
    import h5py

    return h5py


def _new_file(path: str):
    h5py = _h5()
    return h5py.File(path, "w", libver="latest", alignment_threshold=ALIGN, alignment_interval=ALIGN)


class Hdf5ShardWriter(ShardWriter):
    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        h5py = _h5()
        self.f = _new_file(self.tmp_path)
        self.dsets = {}
        self.ragged: dict[str, _Ragged] = {}
        for name, spec in self.specs.items():
            if not spec.fixed:
                self.ragged[name] = _Ragged(self.f, name, spec, self.chunking[name])
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
        fsync_file(self.tmp_path)
        os.replace(self.tmp_path, self.path)
        fsync_dir(os.path.dirname(self.path))
        return {"num_samples": self.count, "bytes": os.path.getsize(self.path), "checksums": self.checksums()}

    def abort(self) -> None:
        try:
            self.f.close()
        except Exception:  # the file may already be broken; removing it is all that matters
            pass
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)


class _Ragged:
    """One variable-shape field of a shard: flat ``data`` + ``offsets`` + ``shapes``, written by chunks."""

    def __init__(self, f, name: str, spec: FieldSpec, chunk_elems: int):
        self.spec = spec
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


def _ragged_index(f, name: str, spec: FieldSpec, shards: list[dict[str, Any]], base: str) -> None:
    """The index's view of a ragged field: virtual ``data``, global ``offsets``, gathered ``shapes``."""
    h5py = _h5()
    sizes, offsets, shapes = [], [np.zeros(1, np.int64)], []
    for s in shards:
        if not s["num_samples"]:
            sizes.append(0)
            continue
        with h5py.File(os.path.join(base, s["file"]), "r") as sf:
            g = sf[name]
            o = g[fmt.RAGGED_OFFSETS][:]
            sizes.append(int(o[-1]))
            offsets.append(o[1:] + offsets[-1][-1])
            shapes.append(g[fmt.RAGGED_SHAPES][:])
    total = int(sum(sizes))
    g = f.create_group(name)
    g.attrs[fmt.A_LAYOUT] = fmt.LAYOUT_RAGGED
    _virtual_dataset(g, fmt.RAGGED_DATA, (total,), spec.dtype,
                     [(s["file"], f"{name}/{fmt.RAGGED_DATA}", n) for s, n in zip(shards, sizes)])
    g.create_dataset(fmt.RAGGED_OFFSETS, data=np.concatenate(offsets), track_times=False)
    nd = len(spec.shape)
    g.create_dataset(fmt.RAGGED_SHAPES, data=np.concatenate(shapes) if shapes else np.zeros((0, nd), np.int64),
                     track_times=False)


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


@WRITERS.register()
class Hdf5Writer(Writer):
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
                 attrs: dict[str, Any]) -> None:
        h5py = _h5()
        base = os.path.dirname(out_path)
        total = sum(s["num_samples"] for s in shards)
        tmp = f"{out_path}.tmp-{os.getpid()}"
        keys: list[str] = []
        copies: list[np.ndarray] = []
        metas: list[str] = []
        for s in shards:
            if not s["num_samples"]:
                continue
            with h5py.File(os.path.join(base, s["file"]), "r") as sf:
                keys.extend(k.decode() if isinstance(k, bytes) else k for k in sf[fmt.KEY][:])
                copies.append(sf[fmt.COPY][:])
                metas.extend(m.decode() if isinstance(m, bytes) else m for m in sf[fmt.META][:])
        with _new_file(tmp) as f:
            for name, spec in specs.items():
                if not spec.fixed:
                    _ragged_index(f, name, spec, shards, base)
                    continue
                _virtual_dataset(f, name, (total, *spec.shape), spec.dtype,
                                 [(s["file"], name, s["num_samples"]) for s in shards])
            str_t = h5py.string_dtype("utf-8")
            f.create_dataset(fmt.KEY, data=np.array(keys, dtype=object), dtype=str_t, track_times=False)
            f.create_dataset(fmt.COPY, data=np.concatenate(copies) if copies else np.zeros(0, np.int32),
                             dtype="int32", track_times=False)
            f.create_dataset(fmt.META, data=np.array(metas, dtype=object), dtype=str_t, track_times=False)
            for k, v in attrs.items():
                f.attrs[k] = v if isinstance(v, (int, float, str)) else fmt.dumps(v)
            f.attrs[fmt.A_NUM] = total
        fsync_file(tmp)
        os.replace(tmp, out_path)
        fsync_dir(base)
