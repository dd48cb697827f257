"""Where a build goes: a local folder (:class:`LocalOutput`) or a URL (:class:`~.url_output.UrlOutput`).

The driver (:mod:`.driver`) asks its output for everything that touches the stored build: the lock, the
index being replaced, the finished shards, the sidecars, the report, the snapshot's garbage and writing
the new index. Both kinds keep the same on-disk layout (``formats/names.py``) and the same rules (the
index written last, in one replace; a rebuild's shards beside the old ones; ``previous.json``). A local
output does what the build always did (``flock``, ``os.replace``, the shard files read with h5py); a URL
output does it with object requests (:mod:`.url_output`).

:func:`output_for` picks the kind from ``out_dir``: a URL (``s3://bucket/prefix``, any fsspec protocol
but ``file://``) or a folder.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..errors import OutputError
from ..formats import names as fmt
from ..formats import snapshot
from ..storage.files import write_json_atomic
from ..storage.folder_lock import folder_lock
from ..storage.remote import URL_RE
from ..storage.faults import is_output_fault, output_error
from .keys import read_skipped
from .results import Failure


def output_for(out_dir: str | os.PathLike, storage_options: Optional[dict[str, Any]] = None,
               name: Optional[str] = None) -> Any:
    """The output at ``out_dir``: a :class:`LocalOutput`, or for a URL a :class:`~.url_output.UrlOutput`
    (``storage_options`` go to its fsspec filesystem; ``name``, the output's name, narrows its listings)."""
    out = str(out_dir)
    if URL_RE.match(out):
        if out.lower().startswith("file://"):
            raise OutputError(f"output {out!r}: give a local output folder as a path, not a file:// URL")
        from .url_output import UrlOutput

        return UrlOutput(out, storage_options, name)
    if storage_options:
        raise OutputError(f"output {out!r} is a local folder: storage options ({', '.join(sorted(storage_options))}) "
                          f"apply to a URL output only (s3://bucket/prefix, ...)")
    return LocalOutput(out)


class LocalOutput:
    """A local output folder: files, ``flock``, atomic renames (what a build has always done)."""

    remote = False

    def __init__(self, folder: str):
        self.root = os.path.abspath(folder)
        self.notes: list[str] = []    # what the build's report should say about the output (events)

    def __enter__(self) -> "LocalOutput":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def prepare(self, shard_dir: str) -> None:
        """Create the shard folder (and the output folder)."""
        try:
            os.makedirs(shard_dir, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the output folder {shard_dir}: {e.strerror or e}"
                              + (f" ({e.filename})" if e.filename and e.filename != shard_dir else "")) from None

    def lock(self, shard_dir: str, name: str) -> Any:
        return folder_lock(os.path.join(shard_dir, fmt.LOCK_FILE), f"{name!r} into {os.path.dirname(shard_dir)}")

    def fault(self, e: BaseException, doing: str, kept: Optional[str] = None) -> Optional[OutputError]:
        """The OutputError for an error about the output folder, or None when it is not about it (``kept``: what
        is kept, for a URL output's messages; a folder's always say it)."""
        if isinstance(e, OSError) and is_output_fault(e, self.root):
            return output_error(e, self.root, doing)
        return None

    # -- reading the stored build ---------------------------------------------------------------
    def forget(self) -> None:
        """Nothing is cached: every question asks the folder."""

    def index_attrs(self, index_path: str) -> Optional[dict[str, str]]:
        return snapshot.read_index_attrs(index_path)

    def index_copy(self, index_path: str) -> Optional[str]:
        """A local file of the index at ``index_path`` (here: itself), or None when there is none."""
        return index_path if os.path.isfile(index_path) else None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> Optional[int]:
        try:
            return os.stat(path).st_size
        except OSError:
            return None

    def read_skipped(self, path: str, key: str) -> list[Failure]:
        return read_skipped(path, key)

    def finished_shard(self, writer: Any, path: str, key: str, entry: Optional[dict[str, Any]], parts: Any = None
                       ) -> tuple[Optional[dict[str, Any]], Any]:
        """(info, parts of its own) of the finished shard at ``path`` built with ``key``, or (None, None). Here
        its info is read from the file (the replaced index's ``entry`` and ``parts`` are not needed to trust
        it); the parts are the index's, or finalize reads them from the file."""
        info = writer.read_shard_info(path)
        return (info, None) if info is not None and info["key"] == key else (None, None)

    def read_json(self, path: str) -> Any:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_json(self, path: str, obj: Any, indent: Optional[int] = None) -> None:
        write_json_atomic(path, obj, indent=indent)

    # -- the snapshot ---------------------------------------------------------------------------
    def referenced(self, shard_dir: str) -> set[str]:
        return snapshot.referenced(shard_dir)

    def previous(self, shard_dir: str) -> set[str]:
        return snapshot.previous(shard_dir)

    def remember_previous(self, shard_dir: str, files: list[str]) -> None:
        snapshot.remember_previous(shard_dir, files)

    def collect(self, shard_dir: str, keep: set[str], dry_run: bool = False) -> tuple[list[str], int]:
        return snapshot.collect(shard_dir, keep, dry_run)

    # -- writing --------------------------------------------------------------------------------
    def task_path(self, path: str) -> str:
        """Where a shard task writes the shard that belongs at ``path`` (here: there)."""
        return path

    def shard_target(self, private: bool) -> None:
        """What a shard task needs to upload its shard (nothing: it writes in place)."""
        return None

    def finalize(self, writer: Any, index_path: str, shards: list[dict[str, Any]], specs: Any,
                 attrs: dict[str, Any], parts: list[Any]) -> None:
        writer.finalize(index_path, shards, specs, attrs, parts)
