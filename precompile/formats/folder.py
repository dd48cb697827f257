"""The shared machinery of the file-folder formats (bmp, png, wav): write, read, describe, verify.

Writing: :class:`FolderFormat` decides where each field goes (one file per
sample, a companion ``.npy`` per shard, or the JSON index) and
:class:`FolderShardWriter` writes a shard folder under a temporary name with
``info.json`` inside and renames it into place on close; ``finalize`` gathers
the shards' ``info.json`` into the JSON index. Reading: :class:`FileDataset`
over the JSON index, each file decoded by the format that owns its extension
(:func:`codec_for`). Also the folder formats' ``describe`` (inspect) and
:func:`verify_folders`: per shard folder (``info.json`` present, its key and
count), and per sample file: every file is hashed and compared with the sha256
its shard recorded when it was written, so a changed byte names the very file;
with ``checksums`` every field is also decoded again and its digest compared
with the index's (this covers the ``.npy`` companions and the values kept in
the index).

A concrete folder format (``png.py``, ``bmp.py``, ``wav.py``) is a small
subclass: ``file_field``, ``write_file``, ``read_file`` and its registration.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, ClassVar, Iterable, Literal, Sequence

import numpy as np
from pydantic import Field

from . import names as fmt
from ..errors import FormatError, SampleError
from ..sample import FieldSpec, Sample
from .base import Format, ShardWriter, VerifyResult, WriterOptions, range_text, shard_digest
from ..storage.files import file_sha256, fsync_dir, fsync_file, write_json_atomic
from .dataset import Batch, Dataset


class FolderOptions(WriterOptions):
    # where fields the format cannot hold (a flow field in a PNG dataset, say) go:
    # "npy": a companion <field>.npy per shard; "refuse": the recipe is refused at plan time
    extra_fields: Literal["npy", "refuse"] = Field("npy", description="fields the format cannot store as its "
                                                   "files: written as .npy beside them, or refused at plan time")


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

    def __init__(self, writer: "FolderFormat", *a: Any, **kw: Any):
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
        digest = shard_digest(self.tmp_path)
        old = None
        if os.path.lexists(self.path):  # an out-of-date shard being rebuilt: move it aside in one rename
            old = f"{self.path}.tmp-old-{os.getpid()}"  # a "*.tmp-*" name: the next build removes it if we die
            os.replace(self.path, old)
        os.replace(self.tmp_path, self.path)
        fsync_dir(os.path.dirname(self.path))
        if old is not None:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        return {"num_samples": self.count, "bytes": nbytes, "checksums": self.checksums(), "sha256": digest}

    def abort(self) -> None:
        for s in self.npy.values():
            try:
                s.f.close()
            except OSError:
                pass
        shutil.rmtree(self.tmp_path, ignore_errors=True)


class FolderFormat(Format):
    """A format whose shards are folders of ordinary files; the index is JSON. A subclass says which
    fields become files (``file_field``) and brings the file codec (``write_file``, ``read_file``)."""

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

    @classmethod
    def read_file(cls, path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
        """One file written by ``write_file``, as an array of ``shape`` and ``dtype`` (FormatError if unreadable)."""
        raise NotImplementedError

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
        """The shard's ``info.json`` entry, or None when it is unreadable or the folder no longer holds what it
        records: as many files (``info.json`` left out) of as many bytes in all, so a sample file deleted or
        truncated by hand makes the shard one to build again (one ``stat`` per file; its bytes are not read)."""
        info = _read_info(path)
        if info is None:
            return None
        try:
            out = {"key": info["key"], "num_samples": int(info["num_samples"]), "checksums": info["checksums"],
                   "bytes": int(info["bytes"])}
            files = int(info["files"])
        except (KeyError, TypeError, ValueError):
            return None
        on_disk = _files_and_bytes(path)
        return out if on_disk == (files, out["bytes"]) else None

    def finalize(self, out_path: str, shards: list[dict[str, Any]], specs: dict[str, FieldSpec],
                 attrs: dict[str, Any], parts: Sequence[Any] | None = None) -> None:
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

    # -- read side ------------------------------------------------------------------------
    @classmethod
    def claims(cls, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{"

    def open(self, path: str, fields: Sequence[str] | None = None) -> "FileDataset":
        return FileDataset(path, fields=fields)

    def describe(self, ds: Dataset) -> tuple[list[str], dict[str, str]]:
        assert isinstance(ds, FileDataset)
        nfiles = sum(len(s["files"]) for s in ds.samples)
        nnpy = sum(1 for st in ds.storage.values() if st["store"] == fmt.STORE_NPY) * len(ds.shards)
        line = (f"  files        {nfiles} sample file(s)" + (f", {nnpy} .npy companion(s)" if nnpy else "")
                + f", {len(ds.shards)} {fmt.SHARD_INFO}")
        return [line], _file_storage(ds)

    def verify(self, path: str, checksums: bool = True) -> VerifyResult:
        return verify_folders(path, checksums)

    def set_index_attr(self, path: str, name: str, text: str) -> None:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        index[fmt.J_ATTRS][name] = json.loads(text)
        write_json_atomic(path, index)


def _files_and_bytes(shard_dir: str) -> tuple[int, int] | None:
    """(count, summed size) of the files of a shard folder but ``info.json``, as ``close`` records them."""
    try:
        sizes = [e.stat().st_size for e in os.scandir(shard_dir) if e.name != fmt.SHARD_INFO]
    except OSError:
        return None
    return len(sizes), sum(sizes)


def _read_info(shard_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(shard_dir, fmt.SHARD_INFO), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def codec_for(ext: str) -> type[FolderFormat]:
    """The registered folder format whose files end in ``ext`` (``.png``, ``.wav``, ...)."""
    from ..registry import WRITERS

    ext = ext.lower()
    for _, cls in WRITERS.items():
        if isinstance(cls, type) and issubclass(cls, FolderFormat) and getattr(cls, "file_ext", None) == ext:
            return cls
    raise FormatError(f"no registered format writes {ext!r} files")


def read_sample_file(path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A sample file of any folder format, decoded by the format that owns its extension."""
    return codec_for(os.path.splitext(path)[1]).read_file(path, dtype, shape)


class FileDataset(Dataset):
    """Samples of a file-folder build (bmp, png, wav): a JSON index listing each file."""

    def __init__(self, path: str | os.PathLike, fields: Sequence[str] | None = None):
        self.path = os.path.abspath(str(path))
        from .snapshot import file_identity

        #: the index file's identity when opened: tells a rebuild from a shard file deleted by hand (snapshot.gone)
        self._identity = file_identity(self.path)
        try:
            with open(self.path, encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, ValueError) as e:
            raise FormatError(f"{self.path}: cannot read as a JSON index: {e}") from None
        if self._identity != file_identity(self.path):
            self._identity = None   # replaced while it was read: which one was read is not known
        if not isinstance(index, dict) or not isinstance(index.get(fmt.J_ATTRS), dict):
            raise FormatError(f"{self.path}: not a precompile index (no {fmt.J_ATTRS!r} object)")
        raw = index[fmt.J_ATTRS]
        fmt.check_header(self.path, raw)
        # the same attribute types as an HDF5 index: scalars as they are, the rest as JSON text
        self.attrs = {k: v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else fmt.dumps(v)
                      for k, v in raw.items()}
        self.storage: dict[str, dict] = index[fmt.J_STORAGE]
        self.samples: list[dict] = index[fmt.J_SAMPLES]
        self.keys = [s["key"] for s in self.samples]
        self.copies = np.array([s["copy"] for s in self.samples], dtype=np.int32)
        self._setup(fields)
        if len(self.samples) != self._n:
            raise FormatError(f"{self.path}: lists {len(self.samples)} samples, its shards hold {self._n}")
        self._base = os.path.dirname(self.path)
        for sh in self.shards:   # (each sample's files are checked as they are read: _sample_path)
            fmt.check_entry(self.path, sh.get("file") if isinstance(sh, dict) else None, "shard entry")
        self._npy: dict[tuple[int, str], np.ndarray] = {}
        self._flat_offsets: dict[str, np.ndarray] = {}

    def _drop_handles(self, state: dict) -> None:
        state["_npy"] = {}

    def close(self) -> None:
        self._npy = {}

    def _npy_array(self, shard: int, name: str) -> np.ndarray:
        if self._pid != os.getpid():
            self._npy = {}
            self._pid = os.getpid()
        a = self._npy.get((shard, name))
        if a is None:
            p = os.path.join(self._base, self.shards[shard]["file"], fmt.npy_file_name(name))
            try:
                a = np.load(p, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                if not os.path.exists(p):
                    from .snapshot import gone

                    raise FormatError(gone(p, self.path, self._identity)) from None
                raise FormatError(f"{p}: cannot read: {e}") from None
            self._npy[(shard, name)] = a
        return a

    def _flat_offset(self, name: str, i: int) -> int:
        """Element offset of sample ``i`` in its shard's flat ``<name>.npy`` (variable shapes)."""
        o = self._flat_offsets.get(name)
        if o is None:
            sizes = np.array([int(np.prod(s["shapes"][name])) for s in self.samples], dtype=np.int64)
            o = np.zeros(len(sizes), np.int64)
            for k in range(len(self.shards)):
                lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
                if hi > lo:
                    o[lo:hi] = np.concatenate([[0], np.cumsum(sizes[lo:hi - 1])])
            self._flat_offsets[name] = o
        return int(o[i])

    def _read(self, i: int, name: str) -> np.ndarray:
        e = self.samples[i]
        st = self.storage[name]["store"]
        spec = self.field_specs[name]
        if st == fmt.STORE_INDEX:
            return np.asarray(e["values"][name], dtype=spec["dtype"])
        shape = tuple(e["shapes"][name])
        if st == fmt.STORE_FILE:
            p = self._sample_path(e["files"][name])
            try:
                return read_sample_file(p, spec["dtype"], shape)
            except (FormatError, OSError):
                if not os.path.exists(p):
                    from .snapshot import gone

                    raise FormatError(gone(p, self.path, self._identity)) from None
                raise
        s, j = self.locate(i)
        a = self._npy_array(s, name)
        if self.variable(name):
            lo = self._flat_offset(name, i)
            return np.array(a[lo:lo + int(np.prod(shape))]).reshape(shape)
        return np.array(a[j])

    def _sample(self, i: int, names: list[str]) -> dict[str, np.ndarray]:
        return {name: self._read(i, name) for name in names}

    def batch(self, indices: Iterable[int], pad: Any = False) -> Batch:
        """Stack samples ``indices`` (any order); unequal shapes are refused unless ``pad`` is given."""
        out = Batch()
        self._batch_by_sample(self._indices(indices), self.fields, pad, out)
        return out

    def meta(self, i: int) -> dict:
        return self.samples[self._index(i)]["meta"]

    def file(self, i: int, field: str) -> str | None:
        """Absolute path of sample ``i``'s file for ``field`` (None when the field is not stored as files)."""
        rel = self.samples[self._index(i)]["files"].get(field)
        return None if rel is None else self._sample_path(rel)

    def _sample_path(self, rel: object) -> str:
        """A sample file's path from its index entry, which must stay in the index's folder (fmt.check_entry)."""
        return os.path.join(self._base, fmt.check_entry(self.path, rel, "sample file entry"))


def _file_storage(ds: FileDataset) -> dict[str, str]:
    out = {}
    for name, st in ds.storage.items():
        store = st["store"]
        if store == fmt.STORE_INDEX:
            out[name] = "in the JSON index"
            continue
        shapes = np.array([s["shapes"][name] for s in ds.samples], dtype=np.int64).reshape(len(ds.samples), -1)
        rng = f", shapes {range_text(shapes)}" if ds.variable(name) else ""
        if store == fmt.STORE_FILE:
            out[name] = f"one {st['ext']} file per sample{rng}"
        else:
            out[name] = f"{fmt.npy_file_name(name)} per shard ({st.get('layout', 'stacked')}){rng}"
    return out


def verify_folders(path: str, checksums: bool = True) -> VerifyResult:
    """:func:`verify` for a file-folder output (png, bmp, wav) with a JSON index.

    Each sample file is hashed against its recorded sha256 and (with ``checksums``) decoded into the
    field checksum; ``bytes_checked`` counts what was checked once: each sample file's bytes on disk
    and each ``.npy`` field's sample bytes (values kept in the index are not counted)."""
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such output (build it first)")
    ds = FileDataset(path)
    base = os.path.dirname(os.path.abspath(path))
    res = VerifyResult(num_shards=len(ds.shards), counted="bytes of sample files and .npy data")
    for k, s in enumerate(ds.shards):
        name = s["file"]
        folder = os.path.join(base, name)
        bad = _check_shard_info(folder, s)
        digests = {f: hashlib.sha256() for f in ds.field_specs}
        readable = True
        for i in range(int(ds.offsets[k]), int(ds.offsets[k + 1])):
            readable = _check_sample_files(ds, base, i, checksums, res, bad) and readable
            if checksums and readable:
                readable = _digest_sample(ds, i, digests, res, bad)
        if checksums and readable:
            for f, h in digests.items():
                want = s["checksums"].get(f)
                if h.hexdigest() != want:
                    bad.append(f"field {f!r}: data checksum mismatch (sha256 {h.hexdigest()[:16]}..., "
                               f"recorded {str(want)[:16]}...): its bytes changed")
        if checksums and not bad and s.get("sha256") and shard_digest(folder) != s["sha256"]:
            bad.append(f"whole-shard sha256 (every file of the folder: {fmt.SHARD_INFO}, .npy headers, extra "
                       f"files) differs from the index's")
        res.num_samples += int(s["num_samples"])
        if bad:
            res.bad_shards.append(name)
            res.problems.extend(f"{name}: {b}" for b in bad)
    return res


def _check_shard_info(folder: str, s: dict[str, Any]) -> list[str]:
    """Problems of a shard folder's info file against the index's shard entry ``s``."""
    if not os.path.isdir(folder):
        return ["shard folder is missing"]
    info = _read_info(folder)
    if info is None:
        return [f"{fmt.SHARD_INFO} is missing or unreadable"]
    bad = []
    if info.get("key") != s["key"]:
        bad.append("shard key differs from the index's (the shard was rebuilt or replaced)")
    if info.get("num_samples") != s["num_samples"]:
        bad.append(f"holds {info.get('num_samples')} samples, the index says {s['num_samples']}")
    return bad


def _check_sample_files(ds: FileDataset, base: str, i: int, checksums: bool, res: VerifyResult,
                        bad: list[str]) -> bool:
    """Hash sample ``i``'s files against their recorded sha256, counting each file's size once when it
    is read (hashed, or decoded later); False when a file is missing."""
    e = ds.samples[i]
    ok = True
    for f, rel in e["files"].items():
        p = ds._sample_path(rel)
        if not os.path.isfile(p):
            bad.append(f"{rel}: file is missing")
            ok = False
            continue
        want = e.get("sha256", {}).get(f)
        if want is not None or checksums:
            res.bytes_checked += os.path.getsize(p)
        if want is not None:
            got = file_sha256(p)
            if got != want:
                bad.append(f"{rel}: bytes changed (sha256 {got[:16]}..., recorded {want[:16]}...)")
    return ok


def _digest_sample(ds: FileDataset, i: int, digests: dict[str, Any], res: VerifyResult, bad: list[str]) -> bool:
    """Add sample ``i``'s decoded fields to the field checksums; count its ``.npy`` bytes (its files are
    counted by :func:`_check_sample_files`); False when it cannot be read."""
    try:
        sample = ds._sample(i, ds.fields)   # stored arrays (a text field as its UTF-8 bytes)
    except (FormatError, OSError, ValueError) as ex:
        bad.append(f"sample {ds.samples[i]['key']!r}: unreadable ({ex})")
        return False
    for f, a in sample.items():
        a = np.ascontiguousarray(a)
        digests[f].update(a.data)
        if ds.storage[f]["store"] == fmt.STORE_NPY:
            res.bytes_checked += a.nbytes
    return True
