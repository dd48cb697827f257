"""Downloads into a cache folder, each once per node: the download lock of a file (another process asking for
it waits, then finds it in place), the object streamed in ranges of :data:`BLOCK` bytes into its reserved
``.part`` file while it is hashed, checked against the sha256 and size its index records, fsynced and renamed
into place; and an index's bytes put in under their digest. The downloading half of
:class:`~.shard_cache.ShardCache`; see that module's docstring for the rules.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import threading
import time
from typing import Callable, Optional

from ..errors import CacheError, FormatError
from .cache_node import _FETCH, offset
from .cache_room import FolderRoom, Room
from .files import file_sha256

log = logging.getLogger("precompile.cache")

#: bytes per read while downloading
BLOCK = 8 << 20


class Cancelled(Exception):
    """A download stopped by its caller (a Loader's pass ended); the partial file is removed."""


class Downloads(FolderRoom):
    """Downloads into the cache folder (mixed into :class:`~.shard_cache.ShardCache`: also ``pin``, ``unpin``,
    ``_present``, ``check_fits``, ``damaged_mark``)."""

    def pin(self, sha: str) -> None:
        raise NotImplementedError

    def unpin(self, sha: str) -> None:
        raise NotImplementedError

    def _present(self, path: str, size: int) -> bool:
        raise NotImplementedError

    def check_fits(self, size: int, url: str, what: str = "shard") -> None:
        raise NotImplementedError

    def damaged_mark(self, sha: str) -> str:
        raise NotImplementedError

    def _fetch(self, sha: str, size: int, url: str, read: Callable[[int, int], bytes], index: str, wait: bool,
               cancel: Optional[threading.Event], room: Room) -> Optional[str]:
        """Download ``url`` into place (the caller pins ``sha``), once per node: see the module docstring. None
        when ``wait`` is False and there is no room, or another process downloads it now."""
        n = self.node
        with n.mu:
            n.fetching.add(sha)
        try:
            if not self._lock_download(sha, room, wait):
                return None
            try:
                path = self.path(sha)
                if self._present(path, size):   # another process brought it in while this one waited
                    return path
                part = self._reserve(sha, size, url, wait, room)
                if part is None:
                    return None
                self._check(part, *self._download(read, part, size, url, cancel), sha, size, url, index)
                with self._locked():
                    os.replace(part, path)
                try:   # a copy removed as damaged while held: fetched again, so a reader finding it gone now
                    os.remove(self.damaged_mark(sha))   # was not told by that re-hash
                except FileNotFoundError:
                    pass
                with n.mu:
                    n.stats.downloads += 1
                    n.stats.downloaded_bytes += size
                return path
            finally:
                n.unlock(_FETCH + offset(sha))
        finally:
            with n.mu:
                n.fetching.discard(sha)

    @staticmethod
    def _check(part: str, got: str, nbytes: int, sha: str, size: int, url: str, index: str) -> None:
        """FormatError (and the part file removed) when a download is not the file its index records."""
        if nbytes != size or got != sha:
            os.remove(part)
            raise FormatError(f"{url}: read {nbytes} bytes with sha256 {got}; the index {index} records "
                              f"{size} bytes with sha256 {sha}: the object is damaged or not the one the index "
                              f"names. Nothing was kept in the cache; run precompile verify on the build, or "
                              f"build it again")

    def _lock_download(self, sha: str, room: Room, wait: bool) -> bool:
        """Take the download lock of ``sha`` (False: another process downloads it and ``wait`` is False). While
        another process downloads it and a read on the node waits for room (that download's, perhaps), the
        caller lets go of its own files (``room.let_go``) as it waits."""
        n, at = self.node, _FETCH + offset(sha)
        if n.lock(at, block=False):
            return True
        if not wait:
            return False
        if room.let_go is None:
            return n.lock(at)
        while not n.lock(at, block=False):
            if self._someone_waits():
                room.let_go()
            time.sleep(0.05)
        return True

    def _download(self, read: Callable[[int, int], bytes], part: str, size: int, url: str,
                  cancel: Optional[threading.Event]) -> tuple[str, int]:
        """The object's first ``size`` bytes into ``part`` by ranges of BLOCK bytes, hashed on the way; (sha256,
        bytes read: fewer when the object is shorter). The part file is removed on any error."""
        h, got = hashlib.sha256(), 0
        fd = os.open(part, os.O_WRONLY)
        try:
            _allocate(fd, size)
            while got < size:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(url)
                block = read(got, min(size, got + BLOCK))
                h.update(block)
                got += len(block)
                _write_all(fd, block)
                if len(block) < min(BLOCK, size - got + len(block)):
                    break   # the object ends early
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            os.remove(part)
            self._out_of_space(e, url)
            raise
        os.close(fd)
        return h.hexdigest(), got

    def _out_of_space(self, e: BaseException, url: str) -> None:
        """Raise the CacheError for a full disk (or quota) met while ``url`` was put in the cache; else nothing."""
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheError(f"the cache folder {self.root} is out of disk space while fetching {url} "
                             f"({e.strerror}): lower cache_limit below the free space, or pass another "
                             f"cache_dir") from None

    def open_index(self, url: str, data: bytes) -> tuple[str, str]:
        """Put an index's bytes (read in one GET) in the cache under their digest; (local path, sha256), pinned."""
        self.check_fits(len(data), url, "index")
        sha = hashlib.sha256(data).hexdigest()
        token = secrets.token_hex(16)
        n = self.node
        with n.mu:
            n.fetching.add(token)
        n.lock(_FETCH + offset(token))   # marks the part file as live for other processes' clean-up
        self.pin(sha)
        try:
            path = self.path(sha)
            if not self._present(path, len(data)) or not _intact(path, sha):
                try:
                    part = self._reserve(token, len(data), url, True, Room())
                except CacheError:
                    # several processes opening the same index at once each reserve room for it; when the cache
                    # holds one copy but not two, the later ones wait in vain: the copy another put there is theirs
                    if self._present(path, len(data)) and _intact(path, sha):
                        return path, sha
                    raise
                fd = os.open(part, os.O_WRONLY)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                except BaseException as e:
                    os.close(fd)
                    os.remove(part)
                    self._out_of_space(e, url)
                    raise
                os.close(fd)
                with self._locked():
                    os.replace(part, path)
            return path, sha
        except BaseException:
            self.unpin(sha)
            raise
        finally:
            n.unlock(_FETCH + offset(token))
            with n.mu:
                n.fetching.discard(token)


def _intact(path: str, sha: str) -> bool:
    """Whether the cached copy at ``path`` still hashes to ``sha`` (an index's, checked at each open: its bytes
    were just fetched whole, so hashing the copy costs less than the GET; a damaged one is replaced by them)."""
    try:
        if file_sha256(path) == sha:
            return True
    except FileNotFoundError:
        return False
    log.warning("%s: the cached copy of an index is damaged (its sha256 differs): writing it again", path)
    return False


def _allocate(fd: int, size: int) -> None:
    """Take the disk blocks of a file of ``size`` bytes now (a full disk is an OSError here, before any download),
    where the platform and file system can; otherwise the file stays sparse until written."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
