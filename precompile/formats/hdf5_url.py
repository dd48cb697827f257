"""An HDF5 build read from a URL: ``precompile.open("s3://bucket/prefix/images.h5", cache_dir=..., cache_limit=...)``.

The remote layout is the local one under a URL prefix: the index ``<prefix>/<name>.h5`` names its shard files
``<prefix>/<name>.shards/shard-00003-<key16>.h5`` with each one's size (``bytes``) and sha256 (``sha256``). Any
fsspec URL works (``s3://``, ``gs://``, ``http(s)://``, ``memory://``); the store's credentials and endpoint come
from its usual environment (``AWS_*``, ``AWS_ENDPOINT_URL``, ...) or ``storage_options``, which are only ever
held in memory (never written to the cache or any file).

:func:`open_url` fetches the index once per call, in one GET (:mod:`precompile.storage.remote_source`), into the
cache (:mod:`precompile.storage.shard_cache`, named
by its digest: a build replaced at the same URL is seen by the next open, and an unchanged one is the same
file), and opens it as a :class:`RemoteH5Dataset`: an :class:`~precompile.formats.hdf5.H5Dataset` whose shard
files are fetched into the cache when first read, checked against the index, and held (pinned) while open. A
dataset keeps at most :data:`OPEN_SHARDS` shard files open (the least recently used is closed and let go first),
so that many DataLoader workers leave the cache room, and when the cache has no room for the shard it opens, it
closes its own least recently used ones before it waits for other processes. It pickles without handles or pins;
each process fetches through the same cache folder. The Loader reads the same shards through the reader's hooks
(``RemoteH5Dataset.remote``: :class:`~precompile.storage.remote_source.RemoteSource`;
:mod:`precompile.reader.streaming`).
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

from . import names as fmt
from . import snapshot
from ..errors import FormatError, PrecompileError
from ..storage.remote_source import RemoteSource, check_entry, fetch_index
from ..storage.shard_cache import Room, ShardCache
from .hdf5 import HDF5_MAGIC, H5Dataset, outside_refs

#: shard files a dataset keeps open (and pinned in the cache) at most
OPEN_SHARDS = 8


class RemoteH5Dataset(H5Dataset):
    """An HDF5 build at a URL, read through the local cache (see the module docstring)."""

    def __init__(self, index_path: str, url: str, cache: ShardCache, storage_options: Optional[dict[str, Any]],
                 fields: Sequence[str] | None = None, fs: Any = None):
        super().__init__(index_path, fields=fields, where=url)
        self.url = url
        self._released = False
        name = os.path.splitext(os.path.basename(index_path))[0]   # the cache names the index by its sha256
        sha = name if len(name) == 64 and all(c in "0123456789abcdef" for c in name) else None
        self.remote = RemoteSource(url, self._entries(), cache, storage_options, fs, os.path.getsize(index_path),
                                   sha, inspect=outside_refs)
        self._start()

    def _start(self) -> None:
        """This process's handles: open shard files (least recently used first) and the pins they hold."""
        self._held: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.RLock()
        self._files, self._dsets, self._pid = {}, {}, None

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start()

    def _drop_handles(self, state: dict) -> None:
        super()._drop_handles(state)
        for k in ("_held", "_lock", "_finalizer"):
            state.pop(k, None)

    def _file(self, shard: int) -> Any:
        import h5py

        if self._pid != os.getpid():   # first use in this process (unpickled in a worker, or inherited by a fork)
            self._own(None)
        with self._lock:
            self._check_held()
            f = self._files.get(shard)
            if f is not None:
                self._held.move_to_end(shard)
                return f
            while len(self._held) >= OPEN_SHARDS:
                self._close_shard(next(iter(self._held)))
            path = self.remote.pin(shard, room=Room(let_go=self._close_oldest))
            try:
                f = h5py.File(path, "r", rdcc_nbytes=0)
            except OSError as e:
                self.remote.unpin(shard)
                raise FormatError(f"{self.remote.shard_url(shard)} (cached as {path}): cannot open shard: "
                                  f"{e}") from None
            self._files[shard] = self._held[shard] = f
            return f

    def _own(self, index_sha: Optional[str]) -> None:
        """Start this process's handles; they (and the index's pin ``index_sha``) are let go when the
        dataset is garbage-collected."""
        self._start()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _let_go, self.remote, self._held, index_sha)

    def _close_oldest(self) -> bool:
        """Close (and let go of) the least recently used shard this dataset holds, when the cache has no room for
        the one it opens (called with the lock held: no read is using it); False when it holds none."""
        if not self._held:
            return False
        self._close_shard(next(iter(self._held)))
        return True

    def _close_shard(self, shard: int) -> None:
        f = self._held.pop(shard)
        self._files.pop(shard, None)
        for key in [k for k in self._dsets if k[0] == shard]:
            del self._dsets[key]
        f.close()
        self.remote.unpin(shard)

    def close(self) -> None:
        """Close the open shard files and let go of them (they are opened again when read)."""
        with self._lock:
            if self._pid == os.getpid():
                for shard in list(self._held):
                    self._close_shard(shard)

    def release(self) -> None:
        """:meth:`close`, and let go of the index's cached copy too, for good: reading afterwards is a
        PrecompileError (a Loader that opened the dataset calls this when it closes)."""
        with self._lock:
            self.close()
            self._released = True
            if self._pid == os.getpid():
                self._finalizer()

    def _check_held(self) -> None:
        if self._released:
            raise PrecompileError(f"{self.url}: the dataset was released when the Loader that opened it closed: "
                                  f"open the build again (precompile.open)")

    def batch(self, indices: Any, pad: Any = False) -> Any:
        with self._lock:   # a shard file is never closed while another thread reads it
            return super().batch(indices, pad)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with self._lock:
            return super().__getitem__(i)

    def meta(self, i: int) -> dict:
        with self._lock:
            return super().meta(i)

    def reopen(self, fields: Sequence[str]) -> "RemoteH5Dataset":
        """The same snapshot serving only ``fields``, with its own handles (while this dataset holds the index)."""
        self._check_held()
        r = self.remote
        return RemoteH5Dataset(self.path, self.url, r.cache, r.storage_options, fields, r._fs)

    def ragged_arrays(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A ragged field's flat data (read from each shard in turn: the index's virtual ``data`` points at files
        beside it, which a cached index has not), global offsets and shapes."""
        import h5py

        self._check_held()
        with h5py.File(self.path, "r") as f:
            offsets, shapes = f[name][fmt.RAGGED_OFFSETS][:], f[name][fmt.RAGGED_SHAPES][:]
        self.check_index_dataset(f"{name}/{fmt.RAGGED_OFFSETS}", offsets)
        self.check_index_dataset(f"{name}/{fmt.RAGGED_SHAPES}", shapes)
        with self._lock:
            parts = [self._file(s)[name][fmt.RAGGED_DATA][:] for s in range(len(self.shards))
                     if self.shards[s]["num_samples"]]
        data = np.concatenate(parts) if parts else np.zeros(0, np.dtype(self.field_specs[name]["dtype"]))
        return data, offsets, shapes

    def verify_cached(self) -> dict[str, int]:
        """Hash again the cached copies of this build's shards; a damaged copy is removed (fetched again, and
        checked, when next read). Counts of ``intact``, ``damaged`` and ``absent`` copies."""
        out = {"intact": 0, "damaged": 0, "absent": 0}
        for s in range(len(self.shards)):
            ok = self.remote.cache.rehash(self.remote.shas[s], self.remote.sizes[s])
            out[{True: "intact", False: "damaged", None: "absent"}[ok]] += 1
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.url!r}, {len(self)} samples, format {self.output_format}, "
                f"fields={self.fields}, cache={self.remote.cache.root!r})")


def _shard_files(url: str, index_path: str) -> set[str]:
    """The shard files the index at ``index_path`` (read from ``url``) names, each entry checked first
    (:func:`~precompile.storage.remote_source.check_entry`: a FormatError for one outside its folder); entries
    that cannot be parsed are left to the dataset, which says the index is damaged."""
    attrs = snapshot.read_index_attrs(index_path) or {}
    try:
        entries = fmt.loads(attrs[fmt.A_SHARDS])
    except (KeyError, ValueError, TypeError, RecursionError):
        return set()
    if not isinstance(entries, list):
        return set()
    for i, e in enumerate(entries):
        if isinstance(e, dict):
            check_entry(url, i, e)
    return {e["file"] for e in entries if isinstance(e, dict)}


def _let_go(source: RemoteSource, held: dict, index_sha: Optional[str]) -> None:
    """Unpin what a dataset held when it is garbage-collected (its files close with it)."""
    for shard in list(held):
        source.unpin(shard)
    held.clear()
    if index_sha is not None:
        source.cache.unpin(index_sha)


def open_url(url: str, fields: Sequence[str] | None = None, verify: bool = False, cache_dir: Any = None,
             cache_limit: int | str | None = None, storage_options: Optional[dict[str, Any]] = None
             ) -> RemoteH5Dataset:
    """Open the HDF5 build whose index is at ``url`` (see the module docstring). ``verify=True`` re-hashes the
    cached copies of its shards first (every download is checked anyway)."""
    cache = ShardCache(cache_dir, cache_limit)
    fs, data = fetch_index(url, storage_options, cache)
    if data[:8] != HDF5_MAGIC:
        what = "a JSON index (a png, bmp or wav build)" if data[:1] == b"{" else "neither an HDF5 nor a JSON index"
        raise FormatError(f"{url}: {what}; reading from a URL serves HDF5 builds only: copy the build to a local "
                          f"folder and open it there")
    path, sha = cache.open_index(url, data)
    try:
        bad = outside_refs(path, _shard_files(url, path))
        if bad:
            raise FormatError(f"{url}: the index reads outside its own file ({bad}): refused, nothing of it was "
                              f"read; a build writes no such index: it was not written by precompile build")
        ds = RemoteH5Dataset(path, url, cache, storage_options, fields, fs)
    except BaseException as e:
        cache.unpin(sha)
        if isinstance(e, FormatError) and url not in str(e):
            raise FormatError(f"{url}: {e}") from None
        raise
    ds._own(sha)
    if verify:
        ds.verify_cached()
    return ds


__all__ = ["OPEN_SHARDS", "RemoteH5Dataset", "open_url"]
