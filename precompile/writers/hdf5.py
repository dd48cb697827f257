"""Chunked, uncompressed HDF5 shards and the index file with virtual datasets.

Shards: one dataset per field, samples along axis 0, chunks of whole samples,
no filters, ``libver='latest'``, 4 KiB alignment, no timestamps (so the same
inputs give the same bytes). Index: a virtual dataset per field over the
shards, the key/copy/meta columns gathered, metadata as JSON attributes.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import format as fmt
from ..registry import WRITERS
from ..sample import FieldSpec, Sample
from .base import ShardWriter, Writer, WriterOptions, fsync_dir, fsync_file

ALIGN = 4096


def _h5():
    import h5py

    return h5py


def _new_file(path: str):
    h5py = _h5()
    return h5py.File(path, "w", libver="latest", alignment_threshold=ALIGN, alignment_interval=ALIGN)


class Hdf5ShardWriter(ShardWriter):
    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        for f, s in self.specs.items():
            if not s.fixed:
                raise ValueError(f"field {f!r} has no fixed shape ({s.describe()})")
        h5py = _h5()
        self.f = _new_file(self.tmp_path)
        self.dsets = {}
        for name, spec in self.specs.items():
            n = self.chunking[name]
            self.dsets[name] = self.f.create_dataset(
                name, shape=(0, *spec.shape), maxshape=(None, *spec.shape), dtype=spec.dtype,
                chunks=(n, *spec.shape), track_times=False, fillvalue=0)
        str_t = h5py.string_dtype("utf-8")
        self.cols = {
            fmt.KEY: self.f.create_dataset(fmt.KEY, shape=(0,), maxshape=(None,), dtype=str_t, chunks=(1024,), track_times=False),
            fmt.COPY: self.f.create_dataset(fmt.COPY, shape=(0,), maxshape=(None,), dtype="int32", chunks=(1024,), track_times=False),
            fmt.META: self.f.create_dataset(fmt.META, shape=(0,), maxshape=(None,), dtype=str_t, chunks=(1024,), track_times=False),
        }
        self.buf: dict[str, list[np.ndarray]] = {f: [] for f in self.specs}
        self.colbuf: dict[str, list] = {c: [] for c in self.cols}
        self.written = {f: 0 for f in self.specs}

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
        for f in self.specs:
            self.buf[f].append(sample.fields[f])
            if len(self.buf[f]) >= self.chunking[f]:
                self._flush(f)
        self.colbuf[fmt.KEY].append(sample.key)
        self.colbuf[fmt.COPY].append(sample.copy)
        self.colbuf[fmt.META].append(fmt.dumps(sample.meta))
        self.count += 1

    def close(self) -> dict[str, Any]:
        for f in self.specs:
            self._flush(f)
        for c, d in self.cols.items():
            vals = self.colbuf[c]
            d.resize(len(vals), axis=0)
            if vals:
                d[:] = np.array(vals, dtype=np.int32) if c == fmt.COPY else vals
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


@WRITERS.register()
class Hdf5Writer(Writer):
    name = "hdf5"
    shard_ext = ".h5"

    def check_specs(self, specs: dict[str, FieldSpec]) -> None:
        for f, s in specs.items():
            if not s.fixed:
                raise ValueError(f"field {f!r} ends as {s.describe()}: HDF5 output needs a fixed shape "
                                 f"(add a resize/crop to a fixed size)")

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
                layout = h5py.VirtualLayout(shape=(total, *spec.shape), dtype=spec.dtype)
                off = 0
                for s in shards:
                    n = s["num_samples"]
                    if n:
                        layout[off:off + n] = h5py.VirtualSource(s["file"], name, shape=(n, *spec.shape))
                    off += n
                f.create_virtual_dataset(name, layout, fillvalue=0)
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
