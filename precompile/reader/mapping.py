"""Shard files in memory maps: all of them in one reserved range of virtual addresses (:class:`Region`: an
anonymous ``PROT_NONE`` reservation, each file mapped over its page-aligned slot with ``MAP_FIXED``, its
descriptor closed at once; POSIX systems through ctypes), or one map per file where that range cannot be
reserved (:func:`map_file`; on Python < 3.13 one descriptor per map, the soft ``RLIMIT_NOFILE`` raised toward
the hard limit when needed). Also the buffers a gather fills, which start on a page as mapped rows do
(:func:`page_aligned_empty`). What :class:`~precompile.reader.direct.DirectReader` maps its shards with; no
h5py, no torch.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
from typing import Any, Sequence

import numpy as np

from ..errors import FormatError

log = logging.getLogger("precompile.reader")


def page_aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts on a page boundary, as mapped shard rows do.

    A gather copies rows between arrays, and on the x86 machines measured a copy whose destination sits 1 to
    31 bytes past its source modulo 4 KiB runs at a quarter to half speed (192 KiB rows: 3.4 GB/s at 8
    bytes, 7.3 at 16, 13-17 at 0 or 32 and more; benchmarks/bench_mapped.py). numpy's large arrays start 16
    bytes into a page and HDF5 chunks (so page-multiple rows) on one: every buffer a gather writes, or reads
    as a private copy, is allocated here, so such rows are copied page to page."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + mmap.PAGESIZE, np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


_nofile_raised = False


def _raise_nofile_limit() -> bool:
    """Raise the soft RLIMIT_NOFILE to the hard limit (once per process); True if it went up."""
    global _nofile_raised
    if _nofile_raised:
        return False
    _nofile_raised = True
    try:
        import resource
    except ImportError:  # not a POSIX system
        return False
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        return False
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        return False
    log.info("raised the open-file limit from %d to %d to map the build's shards", soft, new)
    return True


def nofile_limits() -> str:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f"soft {soft}, hard {hard}"
    except ImportError:
        return "unknown"


def map_file(path: str) -> np.ndarray:
    """The whole file as a read-only uint8 array backed by a memory map.

    The file is closed at once; the mapping stays valid. Python < 3.13's ``mmap``
    keeps a duplicate descriptor per map, so a build with more shards than the
    open-file limit allows first raises the soft limit toward the hard one, then
    fails with a :class:`FormatError` that says so.
    """
    kw = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    for attempt in (0, 1):
        try:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ, **kw)
            return np.frombuffer(m, dtype=np.uint8)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and attempt == 0 and _raise_nofile_limit():
                continue
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise FormatError(
                    f"{path}: cannot map shard: too many open files ({e.strerror}; open-file limit "
                    f"{nofile_limits()}). Each memory-mapped shard keeps one file descriptor on Python < 3.13; "
                    f"raise the limit (ulimit -n) or build with more samples per shard") from None
            raise FormatError(f"{path}: cannot map shard: {e}") from None
        except ValueError as e:  # an empty file cannot be mapped
            raise FormatError(f"{path}: cannot map shard: {e}") from None
    raise AssertionError("unreachable")


class Region:
    """Shard files mapped read-only, side by side, into one reserved range of virtual addresses.

    ``Region.reserve(paths, sizes)`` reserves ``sum(page-rounded sizes)`` bytes
    with an anonymous ``PROT_NONE`` mapping (the sizes as the index records
    them); ``map_slot(i)`` maps file ``i`` over its slot with ``MAP_FIXED``
    (closing its descriptor at once) after checking its size, when the reader
    first needs it or all at once. ``bases[i]`` is file ``i``'s offset in
    ``array``, a read-only uint8 view of the whole range; ``mapped[i]`` says
    whether its slot is mapped (an unmapped slot must not be read). The range is
    unmapped when the last array on it is gone (the arrays keep it alive), never
    while a view exists. ``reserve`` returns None where ctypes cannot reach
    ``mmap`` (not Linux or macOS) or the reservation fails; callers then map
    files one by one.
    """

    _libc: Any = None

    def __init__(self, addr: int, size: int, bases: np.ndarray, sizes: np.ndarray):
        import ctypes

        self.addr, self.size, self.bases, self.sizes = addr, size, bases, sizes
        self.paths: list[str] = []
        self.mapped = np.ones(len(bases), dtype=bool)   # reserve(): every slot unmapped until map_slot
        buf = (ctypes.c_uint8 * max(1, size)).from_address(addr)
        # the buffer (and so every array on it) keeps the mapping alive; through an object that holds
        # neither the region nor an array, so no reference cycle delays the unmap until a gc pass
        # (each shard is a mapping: a few Loaders left to the gc could exhaust vm.max_map_count)
        buf._unmap = _Unmap(addr, size, type(self)._lib())
        a = np.frombuffer(buf, dtype=np.uint8)[:size]
        a.flags.writeable = False  # PROT_READ: a write would be a segfault, make it a ValueError
        self.array = a

    @classmethod
    def _lib(cls) -> Any:
        if cls._libc is None:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int64]
            libc.munmap.restype = ctypes.c_int
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            cls._libc = libc
        return cls._libc

    @classmethod
    def reserve(cls, paths: Sequence[str], sizes: Sequence[int] | None = None) -> "Region | None":
        """Reserve slots for ``paths`` (``sizes``: their sizes as the index records them, else stat'ed)
        without mapping any: :meth:`map_slot` maps one on first use."""
        if not (sys.platform.startswith("linux") or sys.platform == "darwin") or not paths:
            return None
        try:
            libc = cls._lib()
        except (OSError, AttributeError):
            return None
        page = mmap.PAGESIZE
        try:
            sz = np.array(sizes if sizes is not None else [os.path.getsize(p) for p in paths], dtype=np.int64)
        except OSError:
            return None
        if (sz <= 0).any():
            return None
        slots = -(-sz // page) * page
        bases = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
        total = int(slots.sum())
        failed = 2 ** 64 - 1  # MAP_FAILED as an unsigned pointer
        addr = libc.mmap(None, total, mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr is None or addr == failed:
            return None
        region = cls(addr, total, bases, sz)
        region.paths = list(paths)
        region.mapped = np.zeros(len(paths), dtype=bool)
        return region

    def map_slot(self, i: int, index: str | None = None, opened: tuple[int, int, int, int] | None = None) -> None:
        """Map file ``i`` over its slot; FormatError when it is gone (``index``: the index that names it,
        ``opened``: that index's identity when it was opened, :func:`~precompile.formats.snapshot.gone`), or its
        size is not the one its slot was reserved for (the file is not the shard the index describes)."""
        path, size = self.paths[i], int(self.sizes[i])
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            if not os.path.exists(path) and index is not None:
                from ..formats.snapshot import gone

                raise FormatError(gone(path, index, opened)) from None
            raise FormatError(f"{path}: cannot map shard: {e}") from None
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise FormatError(size_mismatch(path, have, size))
            fixed = 0x10  # MAP_FIXED: the same value on Linux and macOS
            got = self._lib().mmap(self.addr + int(self.bases[i]), size, mmap.PROT_READ, mmap.MAP_SHARED | fixed,
                                   fd, 0)
        finally:
            os.close(fd)
        if got != self.addr + int(self.bases[i]):
            raise FormatError(f"{path}: cannot map shard (mmap failed, errno {ctypes_errno()})")
        self.mapped[i] = True

    def unmap_slot(self, i: int) -> None:
        """Let go of file ``i``: its slot becomes reserved ``PROT_NONE`` space again (an anonymous map over it with
        ``MAP_FIXED``), so the file keeps no blocks once unlinked (a build read from a URL: the cache evicts it)."""
        addr = self.addr + int(self.bases[i])
        got = self._lib().mmap(addr, int(self.sizes[i]), mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0,
                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
        if got != addr:
            raise FormatError(f"{self.paths[i]}: cannot unmap shard (mmap failed, errno {ctypes_errno()})")
        self.mapped[i] = False


class _Unmap:
    """Unmaps a region's range when the last array on it is gone (see ``Region.__init__``)."""

    def __init__(self, addr: int, size: int, libc: Any):
        self.addr, self.size, self.libc = addr, size, libc

    def __del__(self) -> None:
        if self.addr:
            self.libc.munmap(self.addr, self.size)
            self.addr = 0


def size_mismatch(path: str, have: int, size: int) -> str:
    """The error of a shard file whose size is not the one the index recorded for it."""
    return (f"{path}: the shard file is {have} bytes, the index says {size}: it is not the file the index's chunk "
            f"table describes (damaged or replaced); run precompile verify, or build again")


def ctypes_errno() -> int:
    import ctypes

    return ctypes.get_errno()


def ensure_nofile(nshards: int) -> None:
    """Raise the soft open-file limit up front when mapping ``nshards`` files could exhaust it."""
    if sys.version_info >= (3, 13):
        return  # maps keep no descriptor
    try:
        import resource
    except ImportError:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and nshards + 256 > soft:
        _raise_nofile_limit()
