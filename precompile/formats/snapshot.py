"""Snapshots of a build on disk: which shard files the indexes refer to, and removing the rest.

A build is a snapshot: one index file that names its shard files (``attrs["shards"][i]["file"]``).
Shard files are named by content key (:func:`precompile.formats.names.shard_file_name`), so a rebuild
writes its new shards beside the old ones, replaces the index in one atomic rename, and only then
removes what no index refers to. The snapshot the index replaced is remembered in
``<name>.shards/previous.json`` and kept until the next build starts (or ``precompile gc --all``), so a
reader opened on it a moment before the rename can still open its shards. See ``docs/faults.md``.

Nothing here writes outside the shard folder it is given.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Iterable, Optional

from . import names as fmt
from ..storage.files import write_json_atomic


def read_index_attrs(index_path: str) -> Optional[dict[str, str]]:
    """The index's attributes as canonical JSON text per key, or None if it is missing or unreadable.

    An HDF5 index holds scalars as themselves and everything else as JSON text
    (``Hdf5Format.finalize``); a JSON index holds JSON values. Both come back as the
    text :func:`precompile.formats.names.dumps` gives the values (strings of an HDF5 index as they are).
    """
    if not os.path.isfile(index_path):
        return None
    try:
        if index_path.endswith(fmt.INDEX_JSON_EXT):
            with open(index_path, encoding="utf-8") as f:
                attrs = json.load(f)[fmt.J_ATTRS]
            return {k: fmt.dumps(v) for k, v in attrs.items()}
        import h5py

        out = {}
        with h5py.File(index_path, "r") as f:
            for k, v in f.attrs.items():
                if isinstance(v, bytes):
                    v = v.decode("utf-8")
                out[k] = v if isinstance(v, str) else fmt.dumps(v.item() if hasattr(v, "item") else v)
        return out
    except (OSError, KeyError, ValueError, TypeError):
        return None


def index_files(index_path: str) -> list[str]:
    """The shard files (relative to the index's folder) that the index at ``index_path`` names; [] when it is
    missing or unreadable. Any format version: an old index's files are kept until it is replaced."""
    attrs = read_index_attrs(index_path)
    if attrs is None or fmt.A_SHARDS not in attrs:
        return []
    try:
        shards = fmt.loads(attrs[fmt.A_SHARDS])
        return [str(s["file"]) for s in shards if isinstance(s, dict) and "file" in s]
    except (ValueError, TypeError):
        return []


def indexes_in(out_dir: str) -> list[str]:
    """Every index file in ``out_dir`` (``*.h5`` and ``*.json`` but build reports)."""
    found = []
    for ext in (".h5", fmt.INDEX_JSON_EXT):
        for p in glob.glob(os.path.join(glob.escape(out_dir), "*" + ext)):
            if not p.endswith(fmt.REPORT_SUFFIX) and os.path.isfile(p):
                found.append(p)
    return sorted(found)


def names_in(shard_dir: str, files: Iterable[str]) -> set[str]:
    """The names inside ``shard_dir`` of ``files`` (paths relative to the index's folder, as indexes name them)."""
    prefix = os.path.basename(shard_dir) + "/"
    return {f[len(prefix):] for f in files if f.startswith(prefix)}


def referenced(shard_dir: str) -> set[str]:
    """Names inside ``shard_dir`` that an index beside it refers to (every index in its folder is asked, so
    outputs that share a shard folder keep each other's files)."""
    keep = set()
    for index in indexes_in(os.path.dirname(shard_dir)):
        keep |= names_in(shard_dir, index_files(index))
    return keep


def previous(shard_dir: str) -> set[str]:
    """The names of the snapshot the last build replaced (``previous.json``), or an empty set."""
    try:
        with open(os.path.join(shard_dir, fmt.PREVIOUS_SNAPSHOT), encoding="utf-8") as f:
            return {str(n) for n in json.load(f)["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def remember_previous(shard_dir: str, files: Iterable[str]) -> None:
    """Record the replaced snapshot's files (names relative to the index's folder) in ``previous.json``."""
    write_json_atomic(os.path.join(shard_dir, fmt.PREVIOUS_SNAPSHOT), {"files": sorted(names_in(shard_dir, files))})


def owner(name: str) -> str:
    """The entry of a shard folder that ``name`` belongs to: a sidecar's shard, else itself."""
    for suffix in fmt.SIDECARS:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def removable(name: str, keep: set[str]) -> bool:
    """True for an entry of a shard folder that :func:`collect` removes: not the lock, not ``previous.json``,
    not the parsed COCO file, not kept, nor a sidecar of a kept shard."""
    return name not in (fmt.LOCK_FILE, fmt.PREVIOUS_SNAPSHOT, fmt.COCO_PLAN_CACHE) and owner(name) not in keep


def collect(shard_dir: str, keep: set[str], dry_run: bool = False) -> tuple[list[str], int]:
    """Remove every entry of ``shard_dir`` that is not in ``keep`` (a kept shard's sidecars stay with it; the
    lock, ``previous.json`` and the parsed COCO file always stay). Returns (removed names, bytes freed).

    Safe with readers open: on POSIX an open or memory-mapped file survives its unlink."""
    removed, freed = [], 0
    try:
        entries = sorted(os.listdir(shard_dir))
    except FileNotFoundError:
        return [], 0
    for n in entries:
        if not removable(n, keep):
            continue
        p = os.path.join(shard_dir, n)
        freed += _size(p)
        if not dry_run:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
        removed.append(n)
    return removed, freed


def _size(path: str) -> int:
    if os.path.isdir(path) and not os.path.islink(path):
        total = 0
        for dirpath, _, files in os.walk(path):
            for n in files:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    pass
        return total
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0



def file_identity(path: str) -> Optional[tuple[int, int, int, int]]:
    """(device, inode, size, mtime in ns) of the file at ``path``, or None when there is none: a rebuild renames
    a new index over the old one (another inode), so an index whose identity is unchanged is the one opened."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def gone(path: str, index_path: str, opened: Optional[tuple[int, int, int, int]] = None) -> str:
    """The message for a shard file missing under a reader of the index ``index_path`` (``opened``: the
    index's :func:`file_identity` when the reader opened it). The index replaced since: its snapshot was
    removed (reopen). The index unchanged: the shard it names is missing (deleted, or never written), which
    no reopening mends. Not known (no identity): both are said."""
    rebuilt = (f"the output was rebuilt since {index_path} was opened, and the snapshot this reader holds was "
               f"removed (a build keeps the snapshot it replaces until the next build starts, or until "
               f"'precompile gc --all')")
    missing = (f"{index_path} names it, but it is not there: it was deleted (not by precompile, which never "
               f"removes a shard that an index names) or never written (an output copied without all its shards); "
               f"see which shards are missing with: precompile verify {index_path}; build again to write them")
    if opened is None:
        return (f"{path}: the shard file is gone: either {rebuilt}: open the output again to read the new build; "
                f"or {missing}")
    if file_identity(index_path) == opened:
        return f"{path}: the shard file is missing: the index is the one this reader opened, and {missing}"
    return f"{path}: the shard file is gone: {rebuilt}; open the output again to read the new build"
