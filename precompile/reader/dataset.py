"""The map-style dataset over a built output: ``len(ds)``, ``ds[i]``, ``ds.batch(indices)``.

One interface over every format: ``precompile.open(index)`` returns an
:class:`H5Dataset` for an HDF5 build and a :class:`FileDataset` for a
file-folder build (bmp, png, wav; JSON index). Both offer ``len``, ``ds[i]``
(a dict of arrays, each sample in its own shape), ``ds.batch(indices,
pad=False)``, ``key(i)``, ``meta(i)``, ``copy(i)``, ``field_specs`` (shape
dims that vary are ``None``), ``label_names``, ``attrs`` (JSON text for
non-scalar values, as HDF5 attributes are), ``shards`` and ``recipe``.

``batch`` stacks fields; when a variable-shape field's samples differ it
raises :class:`ShapeMismatchError` naming the field and two shapes, unless
``pad`` is given (``True`` pads with 0, a number pads with that value): each
field is then padded at the end of every dimension to the batch's largest
size, and the returned :class:`Batch` says what it padded (``batch.padded``)
and every sample's own shape (``batch.shapes``).

It knows the on-disk format (``precompile.format``), never the recipe classes.
Files are opened lazily in each process (never before a fork): the dataset
pickles without handles, so it works inside a torch DataLoader with workers.
HDF5 shard files are opened with the chunk cache off, which is fastest for
uncompressed random access; batches read contiguous runs, never fancy indexing.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import numpy as np

from .. import format as fmt
from ..errors import FormatError, ShapeMismatchError


def _attr_text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Batch(dict):
    """A dict of stacked arrays, plus ``padded`` ({field: {"to": shape, "value": v, "samples": [positions]}})
    and ``shapes`` ({field: (B, ndim) int array of each sample's own shape}) for variable-shape fields."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.padded: dict[str, dict[str, Any]] = {}
        self.shapes: dict[str, np.ndarray] = {}


def _pad_value(pad: Any) -> Any:
    if pad is None or pad is False:
        return None
    if pad is True:
        return 0
    if isinstance(pad, (int, float, np.integer, np.floating)):
        return pad
    raise TypeError(f"pad must be True, False or a number, got {pad!r}")


def stack_field(name: str, arrays: list[np.ndarray], spec: dict, pad: Any, out: Batch) -> None:
    """Stack one field's per-sample arrays into ``out[name]``: refuse or pad unequal shapes."""
    dtype = np.dtype(spec["dtype"])
    if not arrays:
        out[name] = np.empty((0, *[d or 0 for d in spec["shape"]]), dtype=dtype)
        return
    shapes = [a.shape for a in arrays]
    variable = any(d is None for d in spec["shape"])
    if variable:
        out.shapes[name] = np.asarray(shapes, dtype=np.int64).reshape(len(arrays), len(spec["shape"]))
    first = shapes[0]
    diff = next((i for i, s in enumerate(shapes) if s != first), None)
    if diff is None:
        out[name] = np.stack(arrays)
        return
    value = _pad_value(pad)
    if value is None:
        raise ShapeMismatchError(
            f"field {name!r}: cannot stack samples of different shapes {first} (batch position 0) and "
            f"{shapes[diff]} (batch position {diff}); pass pad=True (or a pad value) to pad them, "
            f"read them one by one, or resize to a fixed size in the recipe")
    if any(len(s) != len(first) for s in shapes):
        raise ShapeMismatchError(f"field {name!r}: samples differ in rank ({first} and {shapes[diff]}); cannot pad")
    to = tuple(int(max(s[k] for s in shapes)) for k in range(len(first)))
    res = np.full((len(arrays), *to), value, dtype=dtype)
    for i, a in enumerate(arrays):
        res[(i, *[slice(0, n) for n in a.shape])] = a
    out[name] = res
    out.padded[name] = {"to": to, "value": value, "samples": [i for i, s in enumerate(shapes) if s != to]}


class Dataset:
    """What every format's dataset shares: metadata, ``len``, keys, and stacking in ``batch``."""

    path: str
    attrs: dict[str, Any]
    field_specs: dict[str, dict]
    label_names: list[str]
    shards: list[dict]
    fields: list[str]
    keys: list[str]
    copies: np.ndarray

    def _setup(self, fields: Sequence[str] | None) -> None:
        self.field_specs = fmt.loads(self.attrs[fmt.A_FIELDS])
        self.label_names = fmt.loads(self.attrs[fmt.A_LABELS])
        self.shards = fmt.loads(self.attrs[fmt.A_SHARDS])
        self.fields = list(fields) if fields is not None else list(self.field_specs)
        for f in self.fields:
            if f not in self.field_specs:
                raise KeyError(f"no field {f!r} in {self.path} (fields: {', '.join(self.field_specs)})")
        counts = np.array([s["num_samples"] for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._n = int(self.offsets[-1])
        self._pid = None

    def variable(self, field: str) -> bool:
        """True when ``field``'s samples may differ in shape."""
        return any(d is None for d in self.field_specs[field]["shape"])

    @property
    def output_format(self) -> str:
        return str(self.attrs.get(fmt.A_OUTPUT, "hdf5"))

    def __len__(self) -> int:
        return self._n

    def _index(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"sample index {i} out of range for {self._n} samples")
        return i

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, position in the shard) of sample ``i``."""
        i = self._index(i)
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return s, i - int(self.offsets[s])

    def _indices(self, indices: Iterable[int]) -> np.ndarray:
        idx = np.asarray(list(indices), dtype=np.int64).reshape(-1)
        idx = np.where(idx < 0, idx + self._n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"sample index out of range for {self._n} samples")
        return idx

    def key(self, i: int) -> str:
        return self.keys[self._index(i)]

    def copy(self, i: int) -> int:
        return int(self.copies[self._index(i)])

    @property
    def recipe(self) -> dict:
        return fmt.loads(self.attrs[fmt.A_RECIPE])

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_pid"] = None
        self._drop_handles(d)
        return d

    def _drop_handles(self, state: dict) -> None:
        pass

    def _batch_by_sample(self, idx: np.ndarray, names: list[str], pad: Any, out: Batch) -> None:
        per = [self._sample(int(i), names) for i in idx]
        for name in names:
            stack_field(name, [p[name] for p in per], self.field_specs[name], pad, out)

    def _sample(self, i: int, names: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self._sample(self._index(i), self.fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {self._n} samples, format {self.output_format}, fields={self.fields})"


class H5Dataset(Dataset):
    """Samples of an HDF5 build. ``ds[i]`` -> {field: array}; ``ds.batch(idx)`` -> {field: stacked}."""

    MAX_GAP = 16  # rows skipped inside one read before a batch read is split in two

    def __init__(self, path: str | os.PathLike, fields: Sequence[str] | None = None):
        import h5py

        self.path = os.path.abspath(str(path))
        try:
            with h5py.File(self.path, "r") as f:
                a = dict(f.attrs)
                if _attr_text(a.get(fmt.A_FORMAT, "")) != fmt.FORMAT_NAME:
                    raise FormatError(f"{self.path}: not a precompile output (no {fmt.A_FORMAT!r} attribute)")
                version = int(a.get(fmt.A_VERSION, -1))
                if version != fmt.FORMAT_VERSION:
                    raise FormatError(f"{self.path}: format version {version}, this precompile reads {fmt.FORMAT_VERSION}")
                self.attrs = {k: _attr_text(v) if isinstance(v, (bytes, str)) else v for k, v in a.items()}
                self.keys = [k.decode() if isinstance(k, bytes) else k for k in f[fmt.KEY][:]]
                self.copies = f[fmt.COPY][:]
        except OSError as e:
            raise FormatError(f"{self.path}: cannot open as HDF5: {e}") from None
        self._setup(fields)
        self._files: dict[int, Any] = {}
        self._dsets: dict[tuple[int, str], Any] = {}
        self._ragged: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

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
            p = os.path.join(os.path.dirname(self.path), self.shards[shard]["file"])
            try:
                f = h5py.File(p, "r", rdcc_nbytes=0)
            except OSError as e:
                raise FormatError(f"{p}: cannot open shard: {e}") from None
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
        s, j = self.locate(int(i))
        m = self._file(s)[fmt.META][j]
        return fmt.loads(m)


def _reorder(b: Batch, names: list[str]) -> Batch:
    out = Batch({n: b[n] for n in names})
    out.padded, out.shapes = b.padded, b.shapes
    return out


# --- file-folder builds ----------------------------------------------------------------------

def read_image_file(path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A PNG or BMP written by precompile, as an array of ``shape`` and ``dtype``."""
    if np.dtype(dtype) == np.uint16 and len(shape) == 3 and shape[2] in (3, 4):
        import cv2

        a = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        if a is None:
            raise FormatError(f"{path}: OpenCV cannot read this image")
        a = a[..., [2, 1, 0]] if shape[2] == 3 else a[..., [2, 1, 0, 3]]
    else:
        from PIL import Image

        try:
            with Image.open(path) as img:
                a = np.asarray(img)
        except OSError as e:
            raise FormatError(f"{path}: cannot read image: {e}") from None
    a = np.ascontiguousarray(a).astype(dtype, copy=False)
    if a.size != int(np.prod(shape)):
        raise FormatError(f"{path}: holds {a.shape}, the index says {tuple(shape)}")
    return a.reshape(tuple(shape))


def read_wav_file(path: str, dtype: str) -> np.ndarray:
    """A WAV file as a (C, N) channels-first array of ``dtype`` (float32: PCM scaled by 1/32768)."""
    import soundfile as sf

    try:
        data, _ = sf.read(path, dtype=dtype, always_2d=True)
    except (RuntimeError, sf.LibsndfileError) as e:
        raise FormatError(f"{path}: cannot read WAV: {e}") from None
    return np.ascontiguousarray(data.T)


def read_sample_file(path: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".wav":
        return read_wav_file(path, dtype).reshape(tuple(shape))
    return read_image_file(path, dtype, shape)


class FileDataset(Dataset):
    """Samples of a file-folder build (bmp, png, wav): a JSON index listing each file."""

    def __init__(self, path: str | os.PathLike, fields: Sequence[str] | None = None):
        self.path = os.path.abspath(str(path))
        try:
            with open(self.path, encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, ValueError) as e:
            raise FormatError(f"{self.path}: cannot read as a JSON index: {e}") from None
        if not isinstance(index, dict) or not isinstance(index.get(fmt.J_ATTRS), dict):
            raise FormatError(f"{self.path}: not a precompile index (no {fmt.J_ATTRS!r} object)")
        raw = index[fmt.J_ATTRS]
        if raw.get(fmt.A_FORMAT) != fmt.FORMAT_NAME:
            raise FormatError(f"{self.path}: not a precompile output (no {fmt.A_FORMAT!r} attribute)")
        version = int(raw.get(fmt.A_VERSION, -1))
        if version != fmt.FORMAT_VERSION:
            raise FormatError(f"{self.path}: format version {version}, this precompile reads {fmt.FORMAT_VERSION}")
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
            return read_sample_file(os.path.join(self._base, e["files"][name]), spec["dtype"], shape)
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
        return None if rel is None else os.path.join(self._base, rel)


def open_dataset(path: str | os.PathLike, fields: Sequence[str] | None = None) -> Dataset:
    """Open a built output (the index file written by ``precompile build``): HDF5 or JSON."""
    p = str(path)
    if not os.path.exists(p):
        raise FormatError(f"{p}: no such file (build the recipe first)")
    if os.path.isdir(p):
        raise FormatError(f"{p}: is a folder; open the index file next to it (<name>.h5 or <name>.json)")
    with open(p, "rb") as f:
        head = f.read(8)
    if head == b"\x89HDF\r\n\x1a\n":
        return H5Dataset(p, fields=fields)
    if head.lstrip()[:1] == b"{":
        return FileDataset(p, fields=fields)
    raise FormatError(f"{p}: neither an HDF5 nor a JSON precompile index")
