"""The local cache of builds read from a URL: verified copies of index and shard files, bounded in size and shared
safely by every process of a node (DDP ranks, DataLoader workers).

Layout of a cache folder (default :func:`default_cache_dir`)::

    <cache_dir>/files/<sha256>.h5     a verified copy of an index or shard file, named by the sha256 of its bytes
    <cache_dir>/files/<key>.part      a download in progress (its final size from the start, so the limit counts
                                      all of it; its disk blocks allocated before the first read, where the file
                                      system can)
    <cache_dir>/locks                 byte-range locks that the processes share (see "Locks" below)

The rules:

- **Verified on the way in.** A shard is streamed to ``<sha256>.part`` while it is hashed, checked against the
  ``sha256`` and ``bytes`` its index records, fsynced, then renamed into place; a mismatch is a
  :class:`~precompile.errors.FormatError` naming the object and both digests, and nothing is kept. An index copy is
  named by the digest of what was read (one GET: never two versions of the object mixed).
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

This module knows no file format and imports neither h5py nor torch; callers give it a ``read(start, end)``
that returns those bytes of the object (``fs.cat_file(url, start=, end=)``: range GETs of :data:`BLOCK` bytes,
no metadata request, the size being the index's). POSIX only (``fcntl``); the folder must be on a local
file system (record locks over NFS are not to be relied on).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..errors import CacheError, FormatError
from .files import file_sha256, human_bytes

log = logging.getLogger("precompile.cache")

#: cache_limit when none is given: 20 GiB
DEFAULT_LIMIT = 20 << 30
#: the environment variable that names the default cache folder
ENV_DIR = "PRECOMPILE_CACHE"
#: bytes per read while downloading
BLOCK = 8 << 20
#: how long a download waits for files pinned by other processes to be let go before CacheError
WAIT_S = 60.0
# offsets in the lock file: the cache-wide lock, the waits for room, then one byte per file in two ranges (pins,
# downloads)
_GLOBAL, _WAITING, _PIN, _FETCH = 0, 1, 1 << 61, 1 << 62
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


def human(n: int) -> str:
    return f"{human_bytes(n)} ({n} bytes)"


class Cancelled(Exception):
    """A download stopped by its caller (a Loader's pass ended); the partial file is removed."""


@dataclass
class CacheStats:
    """What this process did with one cache folder: files downloaded (and their bytes), files found in place,
    files it removed to make room."""

    downloads: int = 0
    downloaded_bytes: int = 0
    hits: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass(frozen=True)
class Room:
    """How a download that finds the cache full behaves. ``let_go``: called before any wait, it lets go of files
    the caller itself holds and no read needs now, and says whether it let go of any (room is then sought again
    at once); ``prefetch``: a download no read waits for (a Loader's fetch ahead), which takes no room while a
    read anywhere on the node waits for room."""

    let_go: Optional[Callable[[], bool]] = None
    prefetch: bool = False


class _Node:
    """This process's state for one cache folder: the lock file, the pins it holds, the downloads it runs."""

    def __init__(self, root: str):
        try:
            import fcntl
        except ImportError:
            raise CacheError("reading a build from a URL needs a POSIX system (fcntl record locks)") from None
        self.fcntl = fcntl
        self.root, self.files = root, os.path.join(root, "files")
        try:
            os.makedirs(self.files, exist_ok=True)
            self.fd = os.open(os.path.join(root, "locks"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise CacheError(f"cannot use the cache folder {root}: {e.strerror or e}; pass cache_dir=... or set "
                             f"${ENV_DIR} to a writable folder on a local disk") from None
        self.ofd = _ofd_locks(fcntl, self.fd)
        self.mu = threading.Lock()       # pins, fetching
        self.room = threading.Lock()     # one thread of this process in the cache-wide lock at a time
        self.pins: dict[str, int] = {}   # name -> this process's users of the file
        self.fetching: set[str] = set()  # names this process downloads (or waits to)
        self.waiting = 0                 # this process's threads waiting for room
        self.key_locks: dict[str, threading.Lock] = {}
        self.stats = CacheStats()
        self.pid = os.getpid()

    def lock(self, offset: int, shared: bool = False, block: bool = True) -> bool:
        """Lock byte ``offset`` of the lock file (True), or False when ``block`` is False and another process
        holds it. Open-file-description locks where the kernel has them (see :func:`_ofd_locks`); else POSIX
        record locks, whose waits the kernel may fail with EDEADLK when threads of two processes wait on each
        other's locks (no thread waits on itself: the wait is tried again)."""
        f = self.fcntl
        while True:
            try:
                if self.ofd:
                    f.fcntl(self.fd, f.F_OFD_SETLKW if block else f.F_OFD_SETLK,
                            _flock(f.F_RDLCK if shared else f.F_WRLCK, offset))
                else:
                    f.lockf(self.fd, (f.LOCK_SH if shared else f.LOCK_EX) | (0 if block else f.LOCK_NB), 1, offset)
                return True
            except OSError as e:
                if not block and e.errno in (errno.EACCES, errno.EAGAIN):
                    return False
                if e.errno != errno.EDEADLK:
                    raise
            time.sleep(0.01)

    def unlock(self, offset: int) -> None:
        f = self.fcntl
        if self.ofd:
            f.fcntl(self.fd, f.F_OFD_SETLK, _flock(f.F_UNLCK, offset))
        else:
            f.lockf(self.fd, f.LOCK_UN, 1, offset)

    def key_lock(self, name: str) -> threading.Lock:
        with self.mu:
            return self.key_locks.setdefault(name, threading.Lock())


_nodes: dict[str, _Node] = {}
_nodes_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _nodes_lock
    _nodes_lock = threading.Lock()   # a lock held by another thread at the fork would never be released here
    # the parent's lock files: with open-file-description locks, a child that kept them open would hold its
    # parent's pins after the parent died (the child makes its own state on first use: ShardCache.node)
    for n in _nodes.values():
        with contextlib.suppress(OSError):
            os.close(n.fd)
    _nodes.clear()


os.register_at_fork(after_in_child=_reset_after_fork)

_FLOCK = "hhqqi4x"   # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid


def _flock(kind: int, offset: int) -> bytes:
    """A ``struct flock`` for one byte at ``offset`` (``l_pid`` 0, as open-file-description locks need)."""
    return struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0)


def _ofd_locks(fcntl: Any, fd: int) -> bool:
    """Whether this system has open-file-description locks (Linux >= 3.15, 64-bit). They belong to the open
    file, not the process: the kernel does not check them for deadlocks between processes (POSIX record locks
    fail a wait with EDEADLK when threads of two processes wait on each other's locks, although no thread
    waits on itself), and closing another descriptor of the file elsewhere in the process does not drop them."""
    if not hasattr(fcntl, "F_OFD_SETLKW") or struct.calcsize(_FLOCK) != 32 or struct.calcsize("P") != 8:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, _GLOBAL))
        return True
    except OSError:   # EINVAL: a kernel older than the constants Python was built with
        return False


def _offset(name: str) -> int:
    """A file's byte in each lock range: 60 bits of its name (a sha256 or a random token)."""
    return int(name[:15], 16)


class ShardCache:
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
    def node(self) -> _Node:
        with _nodes_lock:
            n = _nodes.get(self.root)
            if n is None or n.pid != os.getpid() or self._gone(n):
                n = _nodes[self.root] = _Node(self.root)   # a child process holds none of its parent's locks
            return n

    _checked: Optional[_Node] = None

    def _gone(self, n: _Node) -> bool:
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
                n.lock(_PIN + _offset(sha), shared=True)   # waits while an evictor is removing it
            n.pins[sha] = c + 1

    def unpin(self, sha: str) -> None:
        n = self.node
        with n.mu:
            c = n.pins.get(sha, 0)
            if c > 1:
                n.pins[sha] = c - 1
            elif c == 1:
                del n.pins[sha]
                n.unlock(_PIN + _offset(sha))

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
                with n.mu:
                    n.stats.downloads += 1
                    n.stats.downloaded_bytes += size
                return path
            finally:
                n.unlock(_FETCH + _offset(sha))
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
        n, at = self.node, _FETCH + _offset(sha)
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
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheError(f"the cache folder {self.root} is out of disk space while fetching {url} "
                                 f"({e.strerror}): lower cache_limit below the free space, or pass another "
                                 f"cache_dir") from None
            raise
        os.close(fd)
        return h.hexdigest(), got

    def open_index(self, url: str, data: bytes) -> tuple[str, str]:
        """Put an index's bytes (read in one GET) in the cache under their digest; (local path, sha256), pinned."""
        self.check_fits(len(data), url, "index")
        sha = hashlib.sha256(data).hexdigest()
        token = secrets.token_hex(16)
        n = self.node
        with n.mu:
            n.fetching.add(token)
        n.lock(_FETCH + _offset(token))   # marks the part file as live for other processes' clean-up
        self.pin(sha)
        try:
            path = self.path(sha)
            if not self._present(path, len(data)):
                part = self._reserve(token, len(data), url, True, Room())
                fd = os.open(part, os.O_WRONLY)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                with self._locked():
                    os.replace(part, path)
            return path, sha
        except BaseException:
            self.unpin(sha)
            raise
        finally:
            n.unlock(_FETCH + _offset(token))
            with n.mu:
                n.fetching.discard(token)

    def rehash(self, sha: str, size: int) -> Optional[bool]:
        """Hash the cached copy again: True when intact, None when not cached, False when damaged (then removed:
        the next read fetches it again)."""
        self.pin(sha)
        try:
            path = self.path(sha)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return None
            if st.st_size == size and file_sha256(path) == sha:
                return True
            log.warning("%s: the cached copy is damaged (size or sha256 differ): removed", path)
            os.remove(path)
            return False
        finally:
            self.unpin(sha)

    # -- room --------------------------------------------------------------------------------------
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
            if sha in n.pins or not n.lock(_PIN + _offset(sha), block=False):
                return False
            try:
                path = self.path(sha)
                size = os.stat(path).st_size
                os.remove(path)
            except FileNotFoundError:
                return True
            finally:
                n.unlock(_PIN + _offset(sha))
            n.stats.evictions += 1
            n.stats.evicted_bytes += size
            return True

    def _scan(self, clean: bool) -> list[tuple[int, int, str]]:
        """(mtime ns, size, name) of every file in the cache; ``clean``: first remove ``.part`` files whose
        download died with its process (nobody holds their download lock)."""
        n = self.node
        out = []
        with os.scandir(n.files) as it:
            for e in it:
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
            if name in n.fetching or not n.lock(_FETCH + _offset(name), block=False):
                return False
            try:
                os.remove(os.path.join(n.files, f"{name}.part"))
            except FileNotFoundError:
                pass
            finally:
                n.unlock(_FETCH + _offset(name))
        return True


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
