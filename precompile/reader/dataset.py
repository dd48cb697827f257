"""The map-style dataset over a built output: ``len(ds)``, ``ds[i]``, ``ds.batch(indices)``.

It knows the on-disk format (``precompile.format``), never the recipe classes.
Files are opened lazily in each process (never before a fork): the dataset
pickles without handles, so it works inside a torch DataLoader with workers.
Shard files are opened with the chunk cache off, which is fastest for
uncompressed random access; batches read contiguous runs, never fancy indexing.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import numpy as np

from .. import format as fmt
from ..errors import FormatError


def _attr_text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class H5Dataset:
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
        self.field_specs: dict[str, dict] = fmt.loads(self.attrs[fmt.A_FIELDS])
        self.label_names: list[str] = fmt.loads(self.attrs[fmt.A_LABELS])
        self.shards: list[dict] = fmt.loads(self.attrs[fmt.A_SHARDS])
        self.fields = list(fields) if fields is not None else list(self.field_specs)
        for f in self.fields:
            if f not in self.field_specs:
                raise KeyError(f"no field {f!r} in {self.path} (fields: {', '.join(self.field_specs)})")
        counts = np.array([s["num_samples"] for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self._n = int(self.offsets[-1])
        self._pid = None
        self._files: dict[int, Any] = {}
        self._meta = None

    # -- pickling: no open handles travel to workers --------------------------------
    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_files"] = {}
        d["_pid"] = None
        return d

    def _file(self, shard: int):
        import h5py

        if self._pid != os.getpid():
            self._files = {}
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

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    # -- access ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def locate(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"sample index {i} out of range for {self._n} samples")
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return s, i - int(self.offsets[s])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        s, j = self.locate(int(i))
        f = self._file(s)
        return {name: f[name][j] for name in self.fields}

    def batch(self, indices: Iterable[int]) -> dict[str, np.ndarray]:
        """Stack samples ``indices`` (any order); reads each shard's contiguous runs once."""
        idx = np.asarray(list(indices), dtype=np.int64)
        idx = np.where(idx < 0, idx + self._n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"sample index out of range for {self._n} samples")
        out = {name: np.empty((len(idx), *self.field_specs[name]["shape"]), dtype=self.field_specs[name]["dtype"])
               for name in self.fields}
        order = np.argsort(idx, kind="stable")
        sidx = idx[order]
        shard_of = np.searchsorted(self.offsets, sidx, side="right") - 1
        pos = 0
        while pos < len(sidx):
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
                for name in self.fields:
                    block = f[name][lo:hi]
                    out[name][order[pos + run]] = block[local[run] - lo]
            pos = end
        return out

    def key(self, i: int) -> str:
        return self.keys[i]

    def meta(self, i: int) -> dict:
        s, j = self.locate(int(i))
        m = self._file(s)[fmt.META][j]
        return fmt.loads(m)

    @property
    def recipe(self) -> dict:
        return fmt.loads(self.attrs[fmt.A_RECIPE])

    def __repr__(self) -> str:
        return f"H5Dataset({self.path!r}, {self._n} samples, fields={self.fields})"


def open_dataset(path: str | os.PathLike, fields: Sequence[str] | None = None):
    """Open a built output (the index file written by ``precompile build``)."""
    p = str(path)
    if not os.path.exists(p):
        raise FormatError(f"{p}: no such file (build the recipe first)")
    return H5Dataset(p, fields=fields)
