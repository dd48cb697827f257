"""Room in a cache folder: what its files take (:meth:`FolderRoom.usage`), reservations for downloads
(``<name>.part`` at its full size once it fits the limit), eviction of the least recently used files nobody pins,
the clean-up of downloads that died, and the waits for room (a read first lets its caller let go of its own
files, :class:`Room`; a prefetch takes none while a read anywhere on the node waits). The bookkeeping half of
:class:`~.shard_cache.ShardCache`; see that module's docstring for the rules.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..errors import CacheError
from .cache_node import _FETCH, _GLOBAL, _PIN, _WAITING, offset
from .files import human

#: the names of the files a cache folder's ``files`` holds: ``<sha256>.h5``, and ``<sha256>.part`` or
#: ``<token>.part`` (an index's download: 32 hex digits) while downloading
OWN_NAME = re.compile(r"[0-9a-f]{64}\.(?:h5|part)|[0-9a-f]{32}\.part")

#: how long a download waits for files pinned by other processes to be let go before CacheError
WAIT_S = 60.0


@dataclass(frozen=True)
class Room:
    """How a download that finds the cache full behaves. ``let_go``: called before any wait, it lets go of files
    the caller itself holds and no read needs now, and says whether it let go of any (room is then sought again
    at once); ``prefetch``: a download no read waits for (a Loader's fetch ahead), which takes no room while a
    read anywhere on the node waits for room."""

    let_go: Optional[Callable[[], bool]] = None
    prefetch: bool = False


class FolderRoom:
    """Room in the cache folder (mixed into :class:`~.shard_cache.ShardCache`: ``node``, ``root``, ``limit``,
    ``path``)."""

    node: Any
    root: str
    limit: int

    def path(self, sha: str) -> str:
        raise NotImplementedError

    def usage(self) -> int:
        """Bytes of every file in the cache folder, downloads in progress included (their full size)."""
        with self._locked():
            return sum(size for _, size, _ in self._scan(clean=False))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The cache-wide lock: what is in the folder changes only under it (new parts, renames, evictions), so
        a scan under it neither misses nor counts twice a file being renamed (``readdir`` may, during a rename)."""
        n = self.node
        with n.room:
            n.lock(_GLOBAL)
            try:
                yield
            finally:
                n.unlock(_GLOBAL)

    def _reserve(self, name: str, size: int, url: str, wait: bool, room: Room) -> Optional[str]:
        """``<name>.part`` created at ``size`` bytes once that fits in the limit (evicting least recently used
        files nobody pins); while it does not, the caller lets go of its own files (``room.let_go``), then None
        when ``wait`` is False, else a wait of up to WAIT_S for others, marked as a wait for room (which stops
        every prefetch on the node: ``room.prefetch``)."""
        deadline = time.monotonic() + WAIT_S
        marked = False
        try:
            while True:
                if room.prefetch and self._someone_waits():
                    return None
                with self._locked():
                    short, held = self._make_room(size)
                    if short <= 0:
                        return self._new_part(name, size)
                if room.let_go is not None and room.let_go() and time.monotonic() <= deadline:
                    continue   # the caller let go of some of its own files: try again at once
                if not wait:
                    return None
                if time.monotonic() > deadline:
                    raise CacheError(
                        f"the cache {self.root} is full: {url} needs {human(size)}, cache_limit is "
                        f"{human(self.limit)}, and {human(held)} of it are files open or mapped by readers (this "
                        f"process's and others') after waiting {WAIT_S:g} s: raise cache_limit, read with fewer "
                        f"processes, or use shuffle='shard' (fewer shards in use at once)")
                if not marked:
                    self._mark_waiting(1)
                    marked = True
                time.sleep(0.1)
        finally:
            if marked:
                self._mark_waiting(-1)

    def _new_part(self, name: str, size: int) -> str:
        """``<name>.part`` at ``size`` bytes (sparse: its blocks are taken when its download starts)."""
        part = os.path.join(self.node.files, f"{name}.part")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return part

    def _mark_waiting(self, step: int) -> None:
        """Count a thread of this process in (``step`` 1) or out (-1) of a wait for room; the process holds a
        shared lock on the ``_WAITING`` byte while any of its threads waits."""
        n = self.node
        with n.mu:
            n.waiting += step
            if step > 0 and n.waiting == 1:
                n.lock(_WAITING, shared=True)
            elif step < 0 and n.waiting == 0:
                n.unlock(_WAITING)

    def _someone_waits(self) -> bool:
        """Whether a read of this process or another waits for room now (a prefetch then takes none)."""
        n = self.node
        with n.mu:   # never tested while this process holds the byte itself (the test would take its lock)
            if n.waiting:
                return True
            if not n.lock(_WAITING, block=False):
                return True
            n.unlock(_WAITING)
            return False

    def _make_room(self, size: int) -> tuple[int, int]:
        """Evict until ``size`` more bytes fit (call under the cache-wide lock); (bytes still short, bytes of
        files in use that could not be evicted)."""
        entries = self._scan(clean=True)
        over = sum(s for _, s, _ in entries) + size - self.limit
        held = 0
        for _, sz, name in sorted(e for e in entries if e[2].endswith(".h5")):
            if over <= 0:
                break
            if self._evict(name[:-3]):
                over -= sz
            else:
                held += sz
        return over, held

    def _evict(self, sha: str) -> bool:
        """Remove the file unless some process pins it (never waits)."""
        n = self.node
        with n.mu:
            if sha in n.pins or not n.lock(_PIN + offset(sha), block=False):
                return False
            try:
                path = self.path(sha)
                size = os.stat(path).st_size
                os.remove(path)
            except FileNotFoundError:
                return True
            finally:
                n.unlock(_PIN + offset(sha))
            n.stats.evictions += 1
            n.stats.evicted_bytes += size
            return True

    def _scan(self, clean: bool) -> list[tuple[int, int, str]]:
        """(mtime ns, size, name) of every file the cache made (:data:`OWN_NAME`: a file it did not name, such as
        a user's copy, is neither counted nor removed); ``clean``: first remove ``.part`` files whose download
        died with its process (nobody holds their download lock)."""
        n = self.node
        out = []
        with os.scandir(n.files) as it:
            for e in it:
                if not OWN_NAME.fullmatch(e.name):
                    continue
                if clean and e.name.endswith(".part") and self._stale(e.name[:-5]):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime_ns, st.st_size, e.name))
        return out

    def _stale(self, name: str) -> bool:
        """Remove ``<name>.part`` if its download is dead; True if it was removed."""
        n = self.node
        with n.mu:
            if name in n.fetching or not n.lock(_FETCH + offset(name), block=False):
                return False
            try:
                os.remove(os.path.join(n.files, f"{name}.part"))
            except FileNotFoundError:
                pass
            finally:
                n.unlock(_FETCH + offset(name))
        return True
