"""The writer interface: one ``ShardWriter`` per shard task, ``finalize`` once in the parent.

A shard writer writes to a temporary name and renames on ``close`` (after an
fsync), so a killed build never leaves a half-written file under a final name.

Also here: the shared machinery of the file-folder formats (bmp, png, wav):
``FolderWriter`` decides where each field goes (one file per sample, a
companion ``.npy`` per shard, or the JSON index), and ``FolderShardWriter``
writes a shard folder under a temporary name with ``info.json`` inside and
renames it into place on close.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from .. import format as fmt
from ..errors import SampleError
from ..sample import FieldSpec, Sample, dtype_name


class WriterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardWriter:
    def __init__(self, path: str, specs: dict[str, FieldSpec], shard_key: str, options: Any, chunking: dict[str, int]):
        self.path = path
        self.tmp_path = f"{path}.tmp-{os.getpid()}"
        self.specs = specs
        self.shard_key = shard_key
        self.options = options
        self.chunking = chunking
        self.count = 0
        self._hash = {f: hashlib.sha256() for f in specs}

    def check(self, sample: Sample) -> None:
        """Raise :class:`SampleError` when a sample does not match the declared specs (dtype, rank,
        fixed dims) or cannot be stored; ``add`` of a checked sample fails only on I/O errors."""
        for f, spec in self.specs.items():
            if f not in sample.fields:
                raise SampleError(f"sample has no field {f!r}", f)
            a = sample.fields[f]
            if dtype_name(a.dtype) != spec.dtype:
                raise SampleError(f"field {f!r}: dtype {a.dtype} differs from the declared {spec.dtype}", f)
            if spec.fixed:
                if tuple(a.shape) != tuple(spec.shape):
                    raise SampleError(f"field {f!r}: shape {tuple(a.shape)} differs from the declared "
                                      f"{tuple(spec.shape)}", f)
            elif a.ndim != len(spec.shape) or any(d is not None and d != n for d, n in zip(spec.shape, a.shape)):
                raise SampleError(f"field {f!r}: shape {tuple(a.shape)} does not fit the declared {spec.describe()}", f)

    def update_checksums(self, sample: Sample) -> None:
        for f in self.specs:
            self._hash[f].update(np.ascontiguousarray(sample.fields[f]).data)

    def checksums(self) -> dict[str, str]:
        return {f: h.hexdigest() for f, h in self._hash.items()}

    def add(self, sample: Sample) -> None:
        raise NotImplementedError

    def close(self) -> dict[str, Any]:
        """Finish the shard (rename into place); returns {num_samples, bytes, checksums}."""
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class Writer:
    """A registered output format."""

    name: ClassVar[str]
    Options: ClassVar[type[WriterOptions]] = WriterOptions
    shard_ext: ClassVar[str] = ".h5"    # "" for a shard that is a folder
    index_ext: ClassVar[str] = ".h5"

    def check_specs(self, specs: dict[str, FieldSpec], options: Any = None) -> None:
        """Raise ValueError (naming the field) when this format cannot hold these fields."""

    def open_shard(self, path: str, specs: dict[str, FieldSpec], shard_key: str, options: Any,
                   chunking: dict[str, int]) -> ShardWriter:
        raise NotImplementedError

    def read_shard_info(self, path: str) -> dict[str, Any] | None:
        """{key, num_samples, checksums, bytes} of a finished shard, or None if missing or unreadable."""
        raise NotImplementedError

    def finalize(self, out_path: str, shards: list[dict[str, Any]], specs: dict[str, FieldSpec],
                 attrs: dict[str, Any]) -> None:
        raise NotImplementedError


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any, indent: int | None = None) -> None:
    """JSON text to ``path`` via a temporary name (``*.tmp-<pid>``), fsync and rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, sort_keys=True, ensure_ascii=False, indent=indent,
                  separators=None if indent else (",", ":"))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


# --- file-folder formats -------------------------------------------------------------------

class FolderOptions(WriterOptions):
    # where fields the format cannot hold (a flow field in a PNG dataset, say) go:
    # "npy": a companion <field>.npy per shard; "refuse": the recipe is refused at plan time
    extra_fields: Literal["npy", "refuse"] = "npy"


def is_index_field(spec: FieldSpec) -> bool:
    """Scalars (label ids, ...) live in the JSON index itself."""
    return spec.fixed and tuple(spec.shape) == () and np.dtype(spec.dtype).kind in "biuf"


class _NpyStream:
    """A ``.npy`` file written sample by sample: a fixed 256-byte header rewritten on close."""

    HEADER = 256

    def __init__(self, path: str, dtype: str, sample_shape: tuple | None):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.sample_shape = sample_shape     # None: flat 1-D (variable shapes)
        self.n = 0                           # samples (stacked) or elements (flat)
        self.f = open(path, "wb")
        self.f.write(b"\0" * self.HEADER)

    def add(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        self.f.write(a.data)
        self.n += 1 if self.sample_shape is not None else a.size

    def close(self) -> None:
        shape = (self.n,) if self.sample_shape is None else (self.n, *self.sample_shape)
        d = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape}
        text = repr(d).encode("latin1")
        body_len = self.HEADER - 10
        text = text + b" " * (body_len - len(text) - 1) + b"\n"
        self.f.seek(0)
        self.f.write(b"\x93NUMPY\x01\x00" + body_len.to_bytes(2, "little") + text)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


class FolderShardWriter(ShardWriter):
    """A shard folder: one file per sample and file field, ``<field>.npy`` companions, ``info.json``."""

    def __init__(self, writer: "FolderWriter", *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.writer = writer
        self.storage = writer.storage(self.specs, self.options)
        file_fields = [f for f, s in self.storage.items() if s["store"] == fmt.STORE_FILE]
        self.several = len(file_fields) > 1
        if os.path.exists(self.tmp_path):
            shutil.rmtree(self.tmp_path)
        os.makedirs(self.tmp_path)
        self.npy = {f: _NpyStream(os.path.join(self.tmp_path, fmt.npy_file_name(f)), self.specs[f].dtype,
                                  tuple(self.specs[f].shape) if self.specs[f].fixed else None)
                    for f, s in self.storage.items() if s["store"] == fmt.STORE_NPY}
        self.samples: list[dict[str, Any]] = []

    def check(self, sample: Sample) -> None:
        super().check(sample)
        for f, st in self.storage.items():
            if st["store"] == fmt.STORE_FILE:
                try:
                    self.writer.check_file(f, sample.fields[f], sample, self.options)
                except ValueError as e:
                    raise SampleError(str(e), f) from None

    def add(self, sample: Sample) -> None:
        self.check(sample)
        i = self.count
        entry: dict[str, Any] = {"key": sample.key, "copy": int(sample.copy), "meta": sample.meta,
                                 "files": {}, "shapes": {}, "values": {}, "sha256": {}}
        # files first (removed again if one fails); npy streams and checksums only once all are written
        written: list[str] = []
        stored_files: dict[str, np.ndarray] = {}
        try:
            for f, st in self.storage.items():
                if st["store"] == fmt.STORE_FILE:
                    name = fmt.sample_file_name(i, st["ext"], f if self.several else None)
                    p = os.path.join(self.tmp_path, name)
                    written.append(p)
                    stored_files[f] = self.writer.write_file(p, f, sample.fields[f], sample, self.options)
                    entry["files"][f] = name
                    entry["sha256"][f] = file_sha256(p)   # lets verify name the very file whose bytes changed
        except BaseException:
            for p in written:
                if os.path.exists(p):
                    os.remove(p)
            raise
        for f, st in self.storage.items():
            a = sample.fields[f]
            if st["store"] == fmt.STORE_INDEX:
                entry["values"][f] = a.item()
                stored = a
            else:
                entry["shapes"][f] = list(a.shape)
                if st["store"] == fmt.STORE_FILE:
                    stored = stored_files[f]
                else:
                    self.npy[f].add(a)
                    stored = a
            self._hash[f].update(np.ascontiguousarray(stored).data)
        self.samples.append(entry)
        self.count += 1

    def close(self) -> dict[str, Any]:
        for s in self.npy.values():
            s.close()
        names = sorted(os.listdir(self.tmp_path))
        for n in names:
            if not n.endswith(".npy"):
                fsync_file(os.path.join(self.tmp_path, n))
        nbytes = sum(os.path.getsize(os.path.join(self.tmp_path, n)) for n in names)
        info = {"key": self.shard_key, "num_samples": self.count, "checksums": self.checksums(), "bytes": nbytes,
                fmt.A_VERSION: fmt.FORMAT_VERSION, "files": len(names), fmt.J_STORAGE: self.storage,
                fmt.J_SAMPLES: self.samples}
        info_path = os.path.join(self.tmp_path, fmt.SHARD_INFO)
        with open(info_path, "w", encoding="utf-8") as f:
            json.dump(info, f, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp_path)
        old = None
        if os.path.lexists(self.path):  # an out-of-date shard being rebuilt: move it aside in one rename
            old = f"{self.path}.tmp-old-{os.getpid()}"  # a "*.tmp-*" name: the next build removes it if we die
            os.replace(self.path, old)
        os.replace(self.tmp_path, self.path)
        fsync_dir(os.path.dirname(self.path))
        if old is not None:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        return {"num_samples": self.count, "bytes": nbytes, "checksums": self.checksums()}

    def abort(self) -> None:
        for s in self.npy.values():
            try:
                s.f.close()
            except OSError:
                pass
        shutil.rmtree(self.tmp_path, ignore_errors=True)


class FolderWriter(Writer):
    """A format whose shards are folders of ordinary files; the index is JSON."""

    Options: ClassVar[type[WriterOptions]] = FolderOptions
    shard_ext: ClassVar[str] = ""
    index_ext: ClassVar[str] = fmt.INDEX_JSON_EXT
    file_ext: ClassVar[str]
    label: ClassVar[str]            # "PNG", "BMP", "WAV": for messages

    # -- per format -----------------------------------------------------------------------
    def file_field(self, name: str, spec: FieldSpec) -> bool:
        """True: one file per sample; False: not a field for files. Raise ValueError when the
        field is of a kind this format is meant for but it cannot store it (naming the field)."""
        raise NotImplementedError

    def write_file(self, path: str, field: str, array: np.ndarray, sample: Sample, options: Any) -> np.ndarray:
        """Write one file; returns the array as a reader will get it back (for checksums)."""
        raise NotImplementedError

    def check_file(self, field: str, array: np.ndarray, sample: Sample, options: Any) -> None:
        """Raise ValueError when ``array`` cannot be written as a file (checked before anything is written)."""

    # -- shared ---------------------------------------------------------------------------
    def storage(self, specs: dict[str, FieldSpec], options: Any = None) -> dict[str, dict[str, Any]]:
        options = options if options is not None else self.Options()
        out: dict[str, dict[str, Any]] = {}
        for f, s in specs.items():
            if self.file_field(f, s):
                out[f] = {"store": fmt.STORE_FILE, "ext": self.file_ext}
            elif is_index_field(s):
                out[f] = {"store": fmt.STORE_INDEX}
            elif options.extra_fields == "npy":
                out[f] = {"store": fmt.STORE_NPY, "layout": "stacked" if s.fixed else "flat"}
            else:
                raise ValueError(f"field {f!r} ({s.describe()}) cannot be stored as {self.label} files; set "
                                 f"output.options.extra_fields: npy to keep it in a companion .npy per shard, "
                                 f"or use format hdf5")
        if not any(v["store"] == fmt.STORE_FILE for v in out.values()):
            raise ValueError(f"no field can be stored as {self.label} files (fields: "
                             + ", ".join(f"{f}: {s.describe()}" for f, s in specs.items()) + "); use format hdf5")
        return out

    def check_specs(self, specs: dict[str, FieldSpec], options: Any = None) -> None:
        self.storage(specs, options)

    def open_shard(self, path, specs, shard_key, options, chunking) -> ShardWriter:
        return FolderShardWriter(self, path, specs, shard_key, options, chunking)

    def read_shard_info(self, path: str) -> dict[str, Any] | None:
        info = _read_info(path)
        if info is None:
            return None
        try:
            return {"key": info["key"], "num_samples": int(info["num_samples"]), "checksums": info["checksums"],
                    "bytes": int(info["bytes"])}
        except (KeyError, TypeError, ValueError):
            return None

    def finalize(self, out_path: str, shards: list[dict[str, Any]], specs: dict[str, FieldSpec],
                 attrs: dict[str, Any]) -> None:
        base = os.path.dirname(out_path)
        samples: list[dict[str, Any]] = []
        storage = None
        for si, s in enumerate(shards):
            info = _read_info(os.path.join(base, s["file"]))
            if info is None:
                raise OSError(f"{os.path.join(base, s['file'])}: shard has no readable {fmt.SHARD_INFO}")
            storage = info[fmt.J_STORAGE]
            for e in info[fmt.J_SAMPLES]:
                e = dict(e)
                e["shard"] = si
                e["files"] = {f: f"{s['file']}/{n}" for f, n in e["files"].items()}
                samples.append(e)
        if storage is None:
            storage = self.storage(specs)
        index = {fmt.J_ATTRS: dict(attrs) | {fmt.A_NUM: len(samples)}, fmt.J_STORAGE: storage,
                 fmt.J_SAMPLES: samples}
        write_json_atomic(out_path, index)


def _read_info(shard_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(shard_dir, fmt.SHARD_INFO), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
