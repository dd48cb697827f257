"""The state one process keeps for one cache folder (:class:`Node`): the folder's ``locks`` file and the byte-range
locks on it that the processes of a node share (the cache-wide lock, the waits for room, a pin and a download
lock per file: :func:`offset`), the pins and downloads of this process, and what it did (:class:`CacheStats`).
Open-file-description locks where the kernel has them (:func:`_ofd_locks`), else POSIX record locks; see
:mod:`.shard_cache`, "Locks". A forked child starts with none of its parent's.
"""
from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CacheError

#: the environment variable that names the default cache folder
ENV_DIR = "PRECOMPILE_CACHE"
# offsets in the lock file: the cache-wide lock, the waits for room, then one byte per file in two ranges (pins,
# downloads)
_GLOBAL, _WAITING, _PIN, _FETCH = 0, 1, 1 << 61, 1 << 62


@dataclass
class CacheStats:
    """What this process did with one cache folder: files downloaded (and their bytes), files found in place,
    files it removed to make room."""

    downloads: int = 0
    downloaded_bytes: int = 0
    hits: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


class Node:
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


#: root -> this process's node (made again in a forked child: _reset_after_fork)
nodes: dict[str, Node] = {}
nodes_lock = threading.Lock()


def _reset_after_fork() -> None:
    global nodes_lock
    nodes_lock = threading.Lock()   # a lock held by another thread at the fork would never be released here
    # the parent's lock files: with open-file-description locks, a child that kept them open would hold its
    # parent's pins after the parent died (the child makes its own state on first use: ShardCache.node)
    for n in nodes.values():
        with contextlib.suppress(OSError):
            os.close(n.fd)
    nodes.clear()


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


def offset(name: str) -> int:
    """A file's byte in each lock range: 60 bits of its name (a sha256 or a random token)."""
    return int(name[:15], 16)
