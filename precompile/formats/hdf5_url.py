"""An HDF5 build read from a URL: ``precompile.open("s3://bucket/prefix/images.h5", cache_dir=..., cache_limit=...)``.

The remote layout is the local one under a URL prefix: the index ``<prefix>/<name>.h5`` names its shard files
``<prefix>/<name>.shards/shard-00003-<key16>.h5`` with each one's size (``bytes``) and sha256 (``sha256``). Any
fsspec URL works (``s3://``, ``gs://``, ``http(s)://``, ``memory://``); the store's credentials and endpoint come
from its usual environment (``AWS_*``, ``AWS_ENDPOINT_URL``, ...) or ``storage_options``, which are only ever
held in memory (never written to the cache or any file).

:func:`open_url` fetches the index once per call, in one GET, into the cache (:mod:`precompile.shard_cache`, named
by its digest: a build replaced at the same URL is seen by the next open, and an unchanged one is the same
file), and opens it as a :class:`RemoteH5Dataset`: an :class:`~precompile.formats.hdf5.H5Dataset` whose shard
files are fetched into the cache when first read, checked against the index, and held (pinned) while open. A
dataset keeps at most :data:`OPEN_SHARDS` shard files open (the least recently used is closed and let go first),
so that many DataLoader workers leave the cache room, and when the cache has no room for the shard it opens, it
closes its own least recently used ones before it waits for other processes. It pickles without handles or pins;
each process fetches through the same cache folder. The Loader reads the same shards through the reader's hooks
(``RemoteH5Dataset.remote``: :class:`RemoteSource`; :mod:`precompile.reader.streaming`).
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

from . import names as fmt
from ..errors import CacheError, FormatError, PrecompileError
from ..remote import CREDENTIALS_HINT, filesystem, is_credentials_error, protocol
from ..shard_cache import Room, ShardCache, human
from .hdf5 import HDF5_MAGIC, H5Dataset

#: shard files a dataset keeps open (and pinned in the cache) at most
OPEN_SHARDS = 8


#: what :func:`index_now` found: the index is the one opened, another one, none, or it could not be asked
SAME, REPLACED, REMOVED, UNKNOWN = "same", "replaced", "removed", "unknown"


def store_error(url: str, e: BaseException, index_url: Optional[str] = None, index_state: str = REPLACED
                ) -> PrecompileError:
    """The error to raise for a store's exception while reading ``url`` (a shard of ``index_url``, or an index).
    A shard that is no object: ``index_state`` (:func:`index_now`) tells a build replaced since the index was
    opened (its old snapshot collected: open it again) from a shard missing under the same index (deleted
    by hand, or never uploaded: reopening mends nothing)."""
    if isinstance(e, PrecompileError):
        return e
    if isinstance(e, FileNotFoundError):
        if index_url is None:
            return FormatError(f"{url}: no such object: build to this URL first, or check the bucket and path")
        replaced = (f"the build was replaced and its old snapshot collected since {index_url} was opened: open it "
                    f"again (precompile.open, or a new Loader)")
        missing = (f"the index names this shard, but there is no such object: it was deleted (not by precompile, "
                   f"which never collects a shard that an index names) or never uploaded; see which shards are "
                   f"missing with: precompile verify {index_url}; build to this URL again to upload them")
        if index_state == SAME:
            return FormatError(f"{url}: no such object: {index_url} is the index this reader opened, and {missing}")
        if index_state == REMOVED:
            return FormatError(f"{url}: no such object, nor is there an index at {index_url} now: the build was "
                               f"removed since it was opened")
        if index_state == UNKNOWN:
            return FormatError(f"{url}: no such object: either {replaced}; or {missing}")
        return FormatError(f"{url}: no such object: {replaced}")
    if is_credentials_error(e):
        hint = CREDENTIALS_HINT.get(protocol(url), "set the store's credentials in its environment")
        return FormatError(f"{url}: no credentials for {protocol(url)}:// ({type(e).__name__}); {hint}, or pass "
                           f"them in storage_options")
    if isinstance(e, PermissionError):
        return FormatError(f"{url}: access denied ({e}); check the store's credentials (environment, or "
                           f"storage_options)")
    if isinstance(e, TypeError) and "keyword argument" in str(e):   # s3fs passes options on at first use
        return FormatError(f"{url}: bad storage_options for {protocol(url)}://: {e}")
    return FormatError(f"{url}: cannot read from the store: {type(e).__name__}: {e}; check the endpoint "
                       f"(storage_options endpoint_url, or AWS_ENDPOINT_URL for s3) and the network")


def index_now(fs: Any, index_url: str, sha: Optional[str], size: int) -> str:
    """Whether the index at ``index_url`` is still the one opened (its sha256 ``sha``, ``size`` bytes):
    :data:`SAME`, :data:`REPLACED`, :data:`REMOVED`, or :data:`UNKNOWN` when the store cannot be asked (the
    index is fetched only when its size is the one opened: asked only when a shard is found missing)."""
    import hashlib

    if sha is None:
        return UNKNOWN
    try:
        fs.invalidate_cache(index_url)
        if int(fs.info(index_url).get("size", -1)) != size:
            return REPLACED
        return SAME if hashlib.sha256(fs.cat_file(index_url)).hexdigest() == sha else REPLACED
    except FileNotFoundError:
        return REMOVED
    except Exception:  # noqa: BLE001  (the store's own errors: the message then says both causes)
        return UNKNOWN


def store(url: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """The fsspec filesystem for ``url`` (MissingDependencyError names the extra to install)."""
    return filesystem(url, storage_options, what="storage_options", error=FormatError)


class RemoteSource:
    """Where a remote build's shards come from: their URLs, sha256s and sizes, and the cache that holds them.

    Pickles without handles: the fsspec filesystem is made again in each process."""

    def __init__(self, url: str, shards: Sequence[dict], cache: ShardCache, storage_options: Optional[dict[str, Any]],
                 fs: Any = None, index_bytes: int = 0, index_sha: Optional[str] = None):
        self.url, self.base = url, url.rsplit("/", 1)[0]
        self.cache, self.storage_options = cache, dict(storage_options or {})
        self._fs, self._fs_pid = fs, os.getpid()
        #: the size of the index's cached copy, which the dataset pins while it is open (in every limit check)
        self.index_bytes = int(index_bytes)
        #: the opened index's sha256 (tells a replaced build from a shard missing under it; None: unknown)
        self.index_sha = index_sha
        self.files, self.shas, self.sizes = [], [], []
        for i, e in enumerate(shards):
            if not isinstance(e.get("sha256"), str) or not isinstance(e.get("bytes"), int):
                raise FormatError(f"{url}: shard entry {i} ({e.get('file')}) records no sha256 and bytes: build it "
                                  f"again with this precompile to read it from a URL")
            self.files.append(str(e["file"]))
            self.shas.append(e["sha256"])
            self.sizes.append(int(e["bytes"]))
            cache.check_fits(self.sizes[-1], self.shard_url(i))
        if self.sizes and max(self.sizes) + self.index_bytes > cache.limit:
            big = int(np.argmax(self.sizes))
            raise CacheError(f"{self.shard_url(big)}: the shard is {human(self.sizes[big])}, {self.with_index()}: "
                             f"more than cache_limit {human(cache.limit)} of {cache.root}: raise cache_limit to at "
                             f"least {human(self.sizes[big] + self.index_bytes)}")

    def with_index(self) -> str:
        """The words that add the index to a size in a message about the cache limit."""
        return f"plus the index {human(self.index_bytes)} that the reader holds"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None}

    def fs(self) -> Any:
        """The store's filesystem, made in this process (an s3fs client is not fork-safe)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, self._fs_pid = store(self.url, self.storage_options), os.getpid()
        return self._fs

    def shard_url(self, s: int) -> str:
        return f"{self.base}/{self.files[s]}"

    def path(self, s: int) -> str:
        """Shard ``s``'s place in the cache (whether it is there or not)."""
        return self.cache.path(self.shas[s])

    def size(self, s: int) -> int:
        return self.sizes[s]

    def lost(self, s: int) -> str:
        """The message for shard ``s``'s cached copy gone while this process held it."""
        return (f"{self.shard_url(s)}: its verified copy {self.path(s)} is gone while held open: something other "
                f"than precompile removed it from the cache folder {self.cache.root} (precompile never removes a "
                f"file a reader holds); open the build again, and leave the cache folder to precompile")

    def pin(self, s: int, wait: bool = True, cancel: Optional[threading.Event] = None,
            room: Optional[Room] = None) -> Optional[str]:
        """Shard ``s``'s local path, fetched if needed and held until :meth:`unpin` (None: no room and not
        ``wait``; ``room``: see :class:`~precompile.shard_cache.Room`)."""
        url = self.shard_url(s)
        try:
            return self.cache.open(self.shas[s], self.sizes[s], url,
                                   lambda start, end: self.fs().cat_file(url, start=start, end=end), index=self.url,
                                   wait=wait, cancel=cancel, room=room)
        except Exception as e:  # noqa: BLE001  (the store's own errors are not OSErrors: botocore, aiohttp)
            state = index_now(self.fs(), self.url, self.index_sha, self.index_bytes) \
                if isinstance(e, FileNotFoundError) else REPLACED
            raise store_error(url, e, self.url, state) from None

    def unpin(self, s: int) -> None:
        self.cache.unpin(self.shas[s])


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
                                   sha)
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
    fs = store(url, storage_options)
    try:
        data = fs.cat_file(url)
    except Exception as e:  # noqa: BLE001  (the store's own errors)
        raise store_error(url, e) from None
    if data[:8] != HDF5_MAGIC:
        what = "a JSON index (a png, bmp or wav build)" if data[:1] == b"{" else "neither an HDF5 nor a JSON index"
        raise FormatError(f"{url}: {what}; reading from a URL serves HDF5 builds only: copy the build to a local "
                          f"folder and open it there")
    path, sha = cache.open_index(url, data)
    try:
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


__all__ = ["OPEN_SHARDS", "RemoteH5Dataset", "RemoteSource", "open_url", "store", "store_error"]
