"""Where a build read from a URL comes from: its index fetched whole (:func:`fetch_index`), its shards'
URLs, sha256s and sizes, and the local cache that holds them (:class:`RemoteSource`), and the errors of the
store while reading (:func:`read_error`; a shard found missing is told apart from a replaced build by asking
whether the index is still the one opened: :func:`index_now`).

Nothing here knows a file format: the index's bytes are handed to the format that opens them
(:mod:`precompile.formats.hdf5_url`), which gives :class:`RemoteSource` the shard entries (``file``,
``sha256``, ``bytes``) it read from them. The Loader reads the same shards through the source's hooks
(``pin``/``unpin``/``path``: :mod:`precompile.reader.streaming`).
"""
from __future__ import annotations

import os
import re
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import CacheError, FormatError, PrecompileError, echo
from .remote import CREDENTIALS_HINT, dotted, filesystem, is_credentials_error, protocol
from .files import human
from .http_retry import server_error
from .shard_cache import Room, ShardCache

#: what :func:`index_now` found: the index is the one opened, another one, none, or it could not be asked
SAME, REPLACED, REMOVED, UNKNOWN = "same", "replaced", "removed", "unknown"


def read_error(url: str, e: BaseException, index_url: Optional[str] = None, index_state: str = REPLACED
               ) -> PrecompileError:
    """The error to raise for a store's exception while reading ``url`` (a shard of ``index_url``, or an index).
    A shard that is no object: ``index_state`` (:func:`index_now`) tells a build replaced since the index was
    opened (its old snapshot collected: open it again) from a shard missing under the same index (deleted
    by hand, or never uploaded: reopening mends nothing)."""
    if isinstance(e, PrecompileError):
        return e
    e = server_error(e) or e
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


_SHA256 = re.compile(r"[0-9a-f]{64}")


def entry_problem(e: dict) -> Optional[str]:
    """Why a shard entry of an index read from a URL cannot be followed, or None. Its ``file`` becomes a URL
    under the index's folder (a relative '/'-separated path: no empty, ``.`` or ``..`` part, no backslash or NUL,
    no percent-encoded ``..``: a store or an HTTP client may resolve those to another place); its ``sha256`` names the verified copy's file
    in the cache and its byte in the cache's locks (64 lowercase hex digits, as a build writes it); its
    ``bytes`` is a size (an int >= 0, not a bool)."""
    f = e.get("file")
    if not isinstance(f, str) or any(p in ("", ".", "..") for p in f.split("/")) or "\\" in f or "\0" in f \
            or dotted(f):
        return f"names the file {echo(f)}, which is not a path inside the index's folder"
    if not _SHA256.fullmatch(e["sha256"]):
        return f"({echo(f)}): its sha256 {echo(e['sha256'])} is not 64 lowercase hex digits"
    if isinstance(e["bytes"], bool) or e["bytes"] < 0:
        return f"({echo(f)}): its size (bytes) {e['bytes']!r} is not a number of bytes >= 0"
    return None


def check_entry(url: str, i: int, e: dict) -> None:
    """FormatError naming the index at ``url`` when its shard entry ``i`` cannot be read from a URL: it records
    no sha256 and bytes (an older build), or :func:`entry_problem`."""
    if not isinstance(e.get("sha256"), str) or not isinstance(e.get("bytes"), int):
        raise FormatError(f"{url}: shard entry {i} ({e.get('file')}) records no sha256 and bytes: build it "
                          f"again with this precompile to read it from a URL")
    bad = entry_problem(e)
    if bad:
        raise FormatError(f"{url}: the index is damaged: shard entry {i} {bad}; nothing was read from "
                          f"the store for it: build to this URL again")


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
    except FileNotFoundError as e:
        return UNKNOWN if server_error(e) is not None else REMOVED
    except Exception:  # noqa: BLE001  (the store's own errors: the message then says both causes)
        return UNKNOWN


def store(url: str, storage_options: Optional[dict[str, Any]]) -> Any:
    """The fsspec filesystem for ``url`` (MissingDependencyError names the extra to install)."""
    return filesystem(url, storage_options, what="storage_options", error=FormatError)


class RemoteSource:
    """Where a remote build's shards come from: their URLs, sha256s and sizes, and the cache that holds them.

    Pickles without handles: the fsspec filesystem is made again in each process."""

    def __init__(self, url: str, shards: Sequence[dict], cache: ShardCache, storage_options: Optional[dict[str, Any]],
                 fs: Any = None, index_bytes: int = 0, index_sha: Optional[str] = None,
                 inspect: Optional[Callable[[str], Optional[str]]] = None):
        self.url, self.base = url, url.rsplit("/", 1)[0]
        #: the format's check of a shard's verified copy before its first use in a process: why the file reads
        #: outside itself (an HDF5 external link, external storage, a virtual dataset), or None
        self.inspect = inspect
        self._inspected: set[str] = set()
        self.cache, self.storage_options = cache, dict(storage_options or {})
        self._fs, self._fs_pid = fs, os.getpid()
        #: the size of the index's cached copy, which the dataset pins while it is open (in every limit check)
        self.index_bytes = int(index_bytes)
        #: the opened index's sha256 (tells a replaced build from a shard missing under it; None: unknown)
        self.index_sha = index_sha
        self.files, self.shas, self.sizes = [], [], []
        for i, e in enumerate(shards):
            check_entry(url, i, e)
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
        """The message for shard ``s``'s cached copy gone while this process held it: removed as damaged by a
        re-hash (:meth:`ShardCache.rehash`, which marks it), or by something other than precompile."""
        if self.cache.removed_damaged(self.shas[s]):
            return (f"{self.shard_url(s)}: its verified copy {self.path(s)} was found damaged (its bytes no longer "
                    f"hash to the index's sha256) and removed by a re-hash (verify=True) while this reader held it: "
                    f"the bytes it held are not the build's; open the build again (the next read fetches the shard "
                    f"and checks it again)")
        return (f"{self.shard_url(s)}: its verified copy {self.path(s)} is gone while held open: something other "
                f"than precompile removed it from the cache folder {self.cache.root} (precompile removes a file a "
                f"reader holds only when a re-hash finds it damaged, and says so); open the build again, and leave "
                f"the cache folder to precompile")

    def pin(self, s: int, wait: bool = True, cancel: Optional[threading.Event] = None,
            room: Optional[Room] = None) -> Optional[str]:
        """Shard ``s``'s local path, fetched if needed and held until :meth:`unpin` (None: no room and not
        ``wait``; ``room``: see :class:`~.shard_cache.Room`)."""
        url = self.shard_url(s)
        try:
            path = self.cache.open(self.shas[s], self.sizes[s], url,
                                   lambda start, end: self.fs().cat_file(url, start=start, end=end), index=self.url,
                                   wait=wait, cancel=cancel, room=room)
        except Exception as e:  # noqa: BLE001  (the store's own errors are not OSErrors: botocore, aiohttp)
            state = index_now(self.fs(), self.url, self.index_sha, self.index_bytes) \
                if isinstance(e, FileNotFoundError) else REPLACED
            raise read_error(url, e, self.url, state) from None
        if path is not None and self.inspect is not None and self.shas[s] not in self._inspected:
            try:
                bad = self.inspect(path)
            except BaseException:
                self.cache.unpin(self.shas[s])
                raise
            if bad:
                self.cache.unpin(self.shas[s])
                raise FormatError(f"{url}: the shard reads outside its own file ({bad}): refused, nothing of it "
                                  f"was read; a build writes no such shard: the index {self.url} and its shards "
                                  f"were not written by precompile build")
            self._inspected.add(self.shas[s])
        return path

    def unpin(self, s: int) -> None:
        self.cache.unpin(self.shas[s])


def fetch_index(url: str, storage_options: Optional[dict[str, Any]], cache: Optional[ShardCache] = None
                ) -> tuple[Any, bytes]:
    """(the store's filesystem, the bytes of the index at ``url``), read in one GET; the store's refusals as
    :func:`read_error` words them. With ``cache``, at most its limit and one byte are read (a range GET): an
    object larger than the cache can hold is a CacheError, not a read of it into memory to its end."""
    fs = store(url, storage_options)
    try:
        data = fs.cat_file(url) if cache is None else fs.cat_file(url, start=0, end=cache.limit + 1)
    except Exception as e:  # noqa: BLE001  (the store's own errors)
        if cache is None or isinstance(e, FileNotFoundError) or not _empty(fs, url):
            raise read_error(url, e) from None
        data = b""   # S3 refuses a range GET of an empty object (416): it is no index, which the caller says
    if cache is not None and len(data) > cache.limit:
        try:   # its size for the message (one more request, only here)
            size = int(fs.size(url))
        except Exception:  # noqa: BLE001
            size = 0
        cache.check_fits(max(size, len(data)), url, "index")
    return fs, data


def _empty(fs: Any, url: str) -> bool:
    """Whether the object at ``url`` is empty (asked only when a range GET of it failed)."""
    try:
        return int(fs.size(url)) == 0
    except Exception:  # noqa: BLE001
        return False
