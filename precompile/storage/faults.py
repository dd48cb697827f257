"""Faults of a local folder a build writes, told as they are: out of space, over its quota, read-only,
vanished, I/O errors (an output folder, or the staging folder of an output at a URL; a store's own faults:
:func:`.objects.url_fault`), and the free space checked before a build. Never blamed on an input nor
answered with ``on_error: skip``; see ``docs/faults.md`` for the table of faults, messages and exit codes
(a worker killed by the kernel: :func:`precompile.compiler.backends.worker_killed`).
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

from ..errors import OutputError
from .files import human_bytes

#: errnos that are always about the output (the build writes nowhere else)
_OUTPUT_ERRNOS = {errno.ENOSPC: "out of space", errno.EDQUOT: "over its disk quota",
                  errno.EROFS: "read-only", errno.EFBIG: "over the file size limit"}

KEPT = ("nothing built before is lost (the index still names the previous build, finished shards are kept); "
        "run build again once that is fixed")


def free_bytes(folder: str) -> Optional[int]:
    """Free bytes for an unprivileged writer in ``folder`` (or the nearest existing folder above it)."""
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    try:
        return shutil.disk_usage(folder or ".").free
    except OSError:
        return None


def is_output_fault(e: BaseException, out_dir: str) -> bool:
    """True when an OSError is about the output folder: an errno only writing can cause, a file under
    ``out_dir``, or the folder gone."""
    if not isinstance(e, OSError):
        return False
    if e.errno in _OUTPUT_ERRNOS:
        return True
    name = getattr(e, "filename", None)
    under = isinstance(name, str) and os.path.abspath(name).startswith(os.path.abspath(out_dir) + os.sep)
    return under or not os.path.isdir(out_dir)


def output_error(e: OSError, out_dir: str, doing: str) -> OutputError:
    """The :class:`OutputError` for an OSError met while ``doing`` something in ``out_dir``."""
    what = _OUTPUT_ERRNOS.get(e.errno or 0)
    detail = e.strerror or str(e)
    if not os.path.isdir(out_dir):
        head = f"output folder {out_dir} no longer exists (removed during the build)"
    elif what:
        head = f"output folder {out_dir} is {what}"
    elif e.errno == errno.EACCES or e.errno == errno.EPERM:
        head = f"output folder {out_dir} is not writable"
    else:
        head = f"I/O error in output folder {out_dir}"
    free = free_bytes(out_dir)
    room = f" ({human_bytes(free)} free)" if e.errno in (errno.ENOSPC, errno.EDQUOT) and free is not None \
        and "free" not in detail else ""
    return OutputError(f"{head}: {detail}{room}, while {doing}; the inputs are fine: {KEPT}")


def check_space(folder: str, needed: int, shards: int) -> None:
    """Refuse (``OutputError``) when ``needed`` bytes do not fit in the free space of ``folder``."""
    free = free_bytes(folder)
    if free is not None and needed > free:
        raise OutputError(f"not enough space in {folder}: the build needs about {human_bytes(needed)} "
                          f"({needed} bytes for {shards} shard(s) to write), {human_bytes(free)} ({free} bytes) free; "
                          f"free some space or build into another folder (or pass --force-space, "
                          f"build(force_space=True), if the estimate is wrong)")
