"""Local files: their sha256 and fingerprint (size and mtime, or content; a URL's as its listing recorded it),
fsync of a file and of its folder, the JSON a build writes (atomically), and sizes in words for messages. What
every room that writes or checks a local file shares; no file format here.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any


def human_bytes(n: float) -> str:
    """'1.5 MiB' and the like, for ``describe``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def human(n: int) -> str:
    """A size for a message: ``1.5 MiB (1572864 bytes)``."""
    return f"{human_bytes(n)} ({n} bytes)"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def json_bytes(obj: Any, indent: int | None = None) -> bytes:
    """The bytes every JSON file of a build holds: sorted keys, UTF-8, compact unless indented, a newline."""
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, indent=indent,
                       separators=None if indent else (",", ":")) + "\n").encode("utf-8")


def write_json_atomic(path: str, obj: Any, indent: int | None = None) -> None:
    """JSON text to ``path`` via a temporary name (``*.tmp-<pid>``), fsync and rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(json_bytes(obj, indent))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fingerprint(path: str, content: bool = False) -> list:
    """(size, mtime_ns) of a file, or a content hash; for a folder, of every file in it.
    A remote URL's is the (ETag, size, mtime) recorded when the plan listed it (see :mod:`.remote`).
    One ``stat`` per local file (a no-change rebuild of N inputs is N of them).
    """
    if "://" in path:
        from .remote import fingerprint as remote_fingerprint, is_url

        if is_url(path):
            return remote_fingerprint(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError):   # ValueError: a NUL byte, which no file name holds
        return ["missing"]
    if stat.S_ISDIR(st.st_mode):
        out = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for n in sorted(filenames):
                p = os.path.join(dirpath, n)
                out.append([os.path.relpath(p, path), fingerprint(p, content)])
        return out
    if content:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return [st.st_size, h.hexdigest()]
    return [st.st_size, st.st_mtime_ns]
