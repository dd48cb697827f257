"""The build lock of a local output folder: an exclusive ``flock`` on ``<shard folder>/.lock``.

The kernel drops it when its process ends, however it ends, so a killed build never leaves a stale lock. The
file's content is never read or written: only its ``flock`` counts. (An output at a URL has no ``flock``:
:mod:`.url_lock`.)
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from ..errors import BuildError, OutputError


@contextlib.contextmanager
def folder_lock(path: str, what: str) -> Iterator[None]:
    """An exclusive lock on the file ``path`` (a build's ``<shard folder>/.lock``) for the build's duration
    (released if it dies); ``what`` names the build in the message of a second one (``'name' into folder``)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except IsADirectoryError as e:   # something else in its place: named (other errors: the output's faults)
        raise OutputError(f"cannot open the build lock {path}: {e.strerror}; it must be a file (its content is "
                          f"never read): remove what is there") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BuildError(f"another build of {what} is running (lock {path}); "
                             f"wait for it to finish") from None
        yield
    finally:
        os.close(fd)
