"""The local cache of builds read from a URL: verified copies of index and shard files, bounded in size and shared
safely by every process of a node (DDP ranks, DataLoader workers).

Layout of a cache folder (default :func:`default_cache_dir`)::

    <cache_dir>/files/<sha256>.h5     a verified copy of an index or shard file, named by the sha256 of its bytes
    <cache_dir>/files/<key>.part      a download in progress (its final size from the start, so the limit counts
                                      all of it; its disk blocks allocated before the first read, where the file
                                      system can)
    <cache_dir>/files/<sha256>.damaged  (empty) a re-hash removed that copy as damaged while another reader held
                                      it: the reader that finds it gone is told so; removed by its next download
    <cache_dir>/locks                 byte-range locks that the processes share (see "Locks" below)

A file of ``files`` that the cache did not name (a user's copy) is neither counted nor removed.

The rules:

- **Verified on the way in.** A shard is streamed to ``<sha256>.part`` while it is hashed, checked against the
  ``sha256`` and ``bytes`` its index records, fsynced, then renamed into place; a mismatch is a
  :class:`~precompile.errors.FormatError` naming the object and both digests, and nothing is kept. An index copy is
  named by the digest of what was read (one GET: never two versions of the object mixed), and hashed again
  at each open (a damaged copy is written again from the bytes just read).
- **Trusted by name and size.** A file under its final name was hashed before it got that name, so using it again
  costs a ``stat`` (its size must be the index's ``bytes``), not a re-hash (one read of the file, about 1 s per
  GiB); ``precompile.open(url, verify=True)`` re-hashes the cached copies of that build.
- **Pins.** A process holds a shared lock on a file's byte of ``locks`` while it has the file open or mapped. The
  kernel drops a process's locks when it exits, however it ends, so a killed reader pins nothing (a forked child
  closes its copy of the parent's lock file first thing, so it never keeps the parent's locks).
- **Least recently used first.** A file's modification time is its last use (set when it is pinned). To make room
  for a download, the oldest files that nobody pins are removed (an exclusive lock taken without waiting: a file
  open or mapped anywhere is never removed, so the limit counts every byte on disk; on POSIX an unlinked file
  would keep its blocks while mapped). When pinned files fill the limit, a download waits up to
  :data:`WAIT_S` for other processes to let go, then raises :class:`~precompile.errors.CacheError`.
- **Reads before prefetches.** A download that waits for room holds a shared lock on the ``_WAITING`` byte of
  ``locks`` while it waits; a prefetch (:class:`Room` ``prefetch``) that finds any such lock held, in this process
  or another, takes no room. A download first lets go of what its caller holds and no read uses now
  (``Room.let_go``), and so does a wait for another process's download of the same file while a read waits for
  room (that download may be the one waiting).
- **One download per file.** A download holds an exclusive lock on its file's byte of a second range; a process
  asking for the same file waits for it, then finds the file in place. Its size is reserved first, under the
  cache-wide lock, so processes downloading at once cannot overshoot the limit together. A ``.part`` file whose
  download lock nobody holds (its process died) is removed by the next download.

**Locks.** Open-file-description locks (``F_OFD_SETLKW``, Linux >= 3.15): they belong to the process's one open
file of ``locks``, so the threads of a process share them (its own threads are kept apart by in-process locks), a
descriptor of the file closed elsewhere in the process does not drop them (POSIX record locks would all go), and
the kernel does not check them for deadlocks between processes. POSIX record locks, checked per process, failed
a wait with EDEADLK when threads of two processes waited on each other's downloads although no thread waited on
itself; no thread here holds one lock while it waits for another that a waiter could hold (a download waits for
room by polling, not by locking), so there is no deadlock for the kernel to find. Where those locks are absent
(macOS, older kernels) POSIX record locks are used, and a wait failed with EDEADLK is tried again.

The cache is read in four parts: :class:`ShardCache` here (the folder, pins, ``open``, ``rehash``), over
:mod:`.cache_fetch` (downloads), :mod:`.cache_room` (room: usage, reservations, eviction, waits) and
:mod:`.cache_node` (one process's locks and state for the folder). It knows no file format and imports
neither h5py nor torch; callers give it a ``read(start, end)``
that returns those bytes of the object (``fs.cat_file(url, start=, end=)``: range GETs of :data:`BLOCK` bytes,
no metadata request, the size being the index's). POSIX only (``fcntl``); the folder must be on a local
file system (record locks over NFS are not to be relied on).
"""
from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Callable, Optional

from ..errors import CacheError
from . import cache_node
from .cache_fetch import Downloads
from .cache_node import _PIN, ENV_DIR, CacheStats, Node, offset
from .cache_room import Room
from .files import file_sha256, human

log = logging.getLogger("precompile.cache")

#: cache_limit when none is given: 20 GiB
DEFAULT_LIMIT = 20 << 30
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: Any, what: str = "cache_limit") -> int:
    """Bytes from an int or a size such as ``"20GiB"``, ``"500 MB"``, ``"1.5TiB"`` (KB/MB/GB/TB are powers of
    1000, KiB/MiB/GiB/TiB of 1024); ValueError for anything else or a size below 1 byte."""
    n: Optional[float] = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n is None or n < 1:
        raise ValueError(f"{what} must be a number of bytes >= 1 or a size such as '20GiB' or '500MB', "
                         f"got {value!r}")
    return int(n)


def default_cache_dir() -> str:
    """``$PRECOMPILE_CACHE``, else ``$XDG_CACHE_HOME/precompile``, else ``~/.cache/precompile``."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "precompile")


class ShardCache(Downloads):
    """One cache folder with a size limit, as seen from this process (see the module docstring).

    Pickles as its folder and limit: a process that unpickles it gets its own locks and pins."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, limit: int | str | None = None):
        self.root = os.path.abspath(os.path.expanduser(str(cache_dir or default_cache_dir())))
        self.limit = DEFAULT_LIMIT if limit is None else parse_size(limit)
        self.node  # noqa: B018  (creates the folder now: a bad cache_dir is an error when opening)

    def __getstate__(self) -> dict:
        return {"root": self.root, "limit": self.limit}

    def __repr__(self) -> str:
        return f"ShardCache({self.root!r}, limit={self.limit})"

    @property
    def node(self) -> Node:
        with cache_node.nodes_lock:
            n = cache_node.nodes.get(self.root)
            if n is None or n.pid != os.getpid() or self._gone(n):
                n = cache_node.nodes[self.root] = Node(self.root)   # a child process holds none of its parent's locks
            return n

    _checked: Optional[Node] = None

    def _gone(self, n: Node) -> bool:
        """True (once per ShardCache object: each open makes one) when the folder was removed or replaced
        since this process made its state for it: the lock file is then not the one other processes use."""
        if self._checked is n:
            return False
        try:
            gone = os.stat(os.path.join(self.root, "locks")).st_ino != os.fstat(n.fd).st_ino
        except FileNotFoundError:
            gone = True
        if not gone:
            self._checked = n
        return gone

    @property
    def stats(self) -> CacheStats:
        return self.node.stats

    def path(self, sha: str) -> str:
        """Where the verified copy of the file with this sha256 lives (whether it is there or not)."""
        return os.path.join(self.node.files, f"{sha}.h5")

    def check_fits(self, size: int, url: str, what: str = "shard") -> None:
        """CacheError when a file of ``size`` bytes can never fit under the limit."""
        if size > self.limit:
            fix = "above the largest shard (or build with a smaller samples_per_shard)" if what == "shard" else \
                "above the index's size"
            raise CacheError(f"{url}: the {what} is {human(size)}, more than cache_limit {human(self.limit)} of "
                             f"{self.root}: raise cache_limit {fix}")

    # -- pins ------------------------------------------------------------------------------------
    def pin(self, sha: str) -> None:
        """Hold the file (it cannot be evicted by any process) until :meth:`unpin`; counted per process."""
        n = self.node
        with n.mu:
            c = n.pins.get(sha, 0)
            if c == 0:
                n.lock(_PIN + offset(sha), shared=True)   # waits while an evictor is removing it
            n.pins[sha] = c + 1

    def unpin(self, sha: str) -> None:
        n = self.node
        with n.mu:
            c = n.pins.get(sha, 0)
            if c > 1:
                n.pins[sha] = c - 1
            elif c == 1:
                del n.pins[sha]
                n.unlock(_PIN + offset(sha))

    # -- getting files ---------------------------------------------------------------------------
    def open(self, sha: str, size: int, url: str, read: Callable[[int, int], bytes], index: str = "",
             wait: bool = True, cancel: Optional[threading.Event] = None, room: Optional[Room] = None
             ) -> Optional[str]:
        """The local path of the file ``url`` whose index (``index``) records ``sha`` and ``size``, pinned (call
        :meth:`unpin` when done): found in the cache, or downloaded with ``read(start, end)`` and verified.
        ``wait=False``: None instead of waiting for room; ``room``: how a download that finds no room behaves
        (:class:`Room`). Raises CacheError when it cannot fit, FormatError on a mismatch; whatever ``read``
        raises passes through (nothing is kept)."""
        self.check_fits(size, url)
        with self.node.key_lock(sha):
            self.pin(sha)
            try:
                path = self.path(sha)
                if not self._present(path, size):
                    path = self._fetch(sha, size, url, read, index, wait, cancel, room or Room())
                if path is None:
                    self.unpin(sha)
                return path
            except BaseException:
                self.unpin(sha)
                raise

    def _present(self, path: str, size: int) -> bool:
        """True (and the file marked used now) when the verified copy is in place with the expected size."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if st.st_size != size:
            log.warning("%s: %d bytes, expected %d: fetching it again", path, st.st_size, size)
            return False
        try:
            os.utime(path)
        except OSError:
            pass
        with self.node.mu:
            self.node.stats.hits += 1
        return True

    def damaged_mark(self, sha: str) -> str:
        """The empty file a re-hash leaves when it removed a damaged copy that another reader held
        (:meth:`rehash`); removed by the copy's next download."""
        return os.path.join(self.node.files, f"{sha}.damaged")

    def removed_damaged(self, sha: str) -> bool:
        """Whether a re-hash removed the copy ``sha`` as damaged while another reader held it (since its last
        download)."""
        return os.path.exists(self.damaged_mark(sha))

    def rehash(self, sha: str, size: int) -> Optional[bool]:
        """Hash the cached copy again: True when intact, None when not cached, False when damaged (then removed:
        the next read fetches it again). A damaged copy that another reader holds (a pin of another process, or
        of another user in this one) is removed too, so that nobody opens it again, and marked
        (:meth:`damaged_mark`), so that the reader who finds it gone is told why (RemoteSource.lost)."""
        self.pin(sha)
        try:
            path = self.path(sha)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return None
            if st.st_size == size and file_sha256(path) == sha:
                return True
            n = self.node
            with n.mu:   # our pin made exclusive when nobody else holds the file: nobody pins it while it goes
                alone = n.pins.get(sha) == 1 and n.lock(_PIN + offset(sha), block=False)
                try:
                    if not alone:
                        with open(self.damaged_mark(sha), "wb"):
                            pass
                    os.remove(path)
                finally:
                    if alone:
                        n.lock(_PIN + offset(sha), shared=True)   # back to the shared pin that unpin lets go
            log.warning("%s: the cached copy is damaged (size or sha256 differ): removed%s", path,
                        "" if alone else " (another reader holds it: it is told so when it finds it gone)")
            return False
        finally:
            self.unpin(sha)
