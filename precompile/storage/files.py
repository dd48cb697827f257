"""Local files: their sha256, fsync of a file and of its folder, the JSON a build writes (atomically), and
sizes in words for messages. What every room that writes or checks a local file shares; no file format here.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def human_bytes(n: float) -> str:
    """'1.5 MiB' and the like, for ``describe``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


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

