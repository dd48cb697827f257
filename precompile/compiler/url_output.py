"""A build written to a URL (``-o s3://bucket/prefix``, any fsspec URL): :class:`UrlOutput`.

The remote layout is the local one under the URL: ``<url>/<name>.h5`` (the index),
``<url>/<name>.report.json``, ``<url>/<name>.shards/shard-00003-<key16>.h5`` (+ sidecars, ``previous.json``,
``.lock``). What differs is how each rule is kept:

- shards: each shard task builds its shard in a local folder and uploads it (:mod:`.upload`); the parent
  never reads a shard's bytes (finalize takes each shard's parts from its task, the replaced index or the
  shard's ``.entry.json`` sidecar, :mod:`precompile.formats.hdf5_parts`);
- the index is written locally from those parts, then uploaded in one PUT after every shard: an object
  appears whole or not at all, so a reader sees the old build or the new one;
- what is stored is known from one listing of the objects under ``<url>/<name>.`` (names and sizes) and the
  index (fetched once): a no-change rebuild makes those two requests and writes nothing;
- resume: a shard already uploaded under its planned name is kept when the replaced index names it with
  its key and size, or when its ``.entry.json`` sidecar (uploaded after the shard: a commit marker) does;
- the lock is an object created with a conditional PUT (:mod:`precompile.storage.url_lock`).

The store side (the filesystem, the listing, copies, the staging folder, the store's errors as
:class:`~precompile.errors.OutputError`) is :class:`precompile.storage.objects.UrlFolder`; what is here is the
build's: which objects it keeps, trusts, writes and removes, and in which order. Storage options
(``--storage-option``, ``build(storage_options=...)``) travel with each shard task and are never written to the
index or the report.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Optional

from ..errors import BuildError, RecipeError
from ..formats import names as fmt
from ..formats import snapshot
from ..storage.objects import CONDITIONAL, UrlFolder
from ..storage.remote import protocol
from ..storage.url_lock import UrlLock, conditional_puts
from .keys import read_skipped, skipped_path
from .results import Failure


class UrlOutput(UrlFolder):
    """An output at a URL (see the module docstring): the objects of :class:`UrlFolder` under the build's rules.
    Use as a context manager: it owns a local staging folder (index copies, and the shards of local workers
    before their upload)."""

    remote = True

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None, name: Optional[str] = None):
        super().__init__(url, storage_options, name)
        self.notes: list[str] = []
        self.shard_dir: Optional[str] = None
        self._lock: Any = None

    def check_recipe(self, recipe: Any) -> None:
        """Refuse what a URL output cannot take, before any work: formats other than HDF5, stored stats."""
        form = recipe.model.output.format
        if form != "hdf5":
            raise RecipeError(f"format {form!r} cannot be written to a URL ({self.root}): it writes one object "
                              f"per sample and field (thousands of small PUTs, and no shard that appears whole); "
                              f"use format hdf5, or build into a local folder and copy it", source=recipe.source,
                              loc="output.format")
        if recipe.model.stats:
            raise RecipeError(f"stats cannot be stored in an output at a URL ({self.root}): computing them reads "
                              f"every shard back; build without stats (or into a local folder and run precompile "
                              f"stats there)", source=recipe.source, loc="stats")

    def prepare(self, shard_dir: str) -> None:
        """Nothing to create remotely (object stores have no folders); the local staging folder of the shards."""
        self.shard_dir = shard_dir
        os.makedirs(os.path.join(self.stage, os.path.basename(shard_dir)), exist_ok=True)

    @contextlib.contextmanager
    def lock(self, shard_dir: str, name: str) -> Iterator[None]:
        """Hold ``<shard folder>/.lock`` (:class:`~precompile.storage.url_lock.UrlLock`); a stale one is taken
        over (noted)."""
        conditional = protocol(self.root) in CONDITIONAL and conditional_puts(self.fs)
        lk = UrlLock(self.fs, f"{shard_dir}/{fmt.LOCK_FILE}", f"{name!r} into {self.root}", conditional)
        if not conditional:
            self.notes.append(f"the build lock {lk.url} is best effort: this store or its client does not do "
                              f"conditional PUTs (s3:// with s3fs >= 2024.12 does); run one build of an output at "
                              f"a time")
        with lk:
            if lk.took_over:
                self.notes.append(lk.took_over)
            self._lock = lk
            try:
                yield
            finally:
                self._lock = None

    # -- reading the stored build ---------------------------------------------------------------
    def index_copy(self, index_url: str) -> Optional[str]:
        """A local copy of the index at ``index_url`` (fetched once), or None when there is none."""
        return self.copy_of(index_url)

    def index_attrs(self, index_url: str) -> Optional[dict[str, str]]:
        local = self.index_copy(index_url)
        return snapshot.read_index_attrs(local) if local else None

    def read_skipped(self, url: str, key: str) -> list[Failure]:
        """The skipped inputs of the shard at ``url`` (its ``.skipped.json``: fetched only when listed)."""
        if skipped_path(url) not in self.listing():
            return []
        local = self.local_path(url)
        self.fs.get_file(skipped_path(url), skipped_path(local))
        return read_skipped(local, key)

    def finished_shard(self, writer: Any, url: str, key: str, entry: Optional[dict[str, Any]], parts: Any = None
                       ) -> tuple[Optional[dict[str, Any]], Any]:
        """(info, parts) of the uploaded shard at ``url`` built with ``key``, or (None, None). The replaced
        index's ``entry`` (with its ``parts``) vouches for it when key and size agree; else its
        ``.entry.json`` sidecar does (then its parts come from there)."""
        size = self.size(url)
        if size is None:
            return None, None
        if entry is not None and parts is not None and entry.get("key") == key and entry.get("bytes") == size:
            return {k: entry[k] for k in ("key", "num_samples", "checksums", "bytes", "sha256")}, None
        side = url + fmt.ENTRY_SIDECAR
        if side not in self.listing():
            return None, None
        from ..formats.hdf5_parts import ShardParts

        try:
            d = json.loads(self.fs.cat_file(side))
            info, own = dict(d["entry"]), ShardParts.from_json(d["parts"])
        except (ValueError, KeyError, TypeError, FileNotFoundError):
            return None, None
        if info.get("key") != key or info.get("bytes") != size or len(own.keys) != info.get("num_samples"):
            return None, None
        return info, own

    # -- the snapshot ---------------------------------------------------------------------------
    def _indexes(self) -> list[str]:
        """The index objects beside the shard folder (``<name>.h5``, ``<name>.<split>.h5``)."""
        return sorted(u for u in self.listing() if os.path.dirname(u) == self.root and u.endswith(".h5"))

    def referenced(self, shard_dir: str) -> set[str]:
        keep: set[str] = set()
        for index in self._indexes():
            local = self.index_copy(index)
            if local:
                keep |= snapshot.names_in(shard_dir, snapshot.index_files(local))
        return keep

    def previous(self, shard_dir: str) -> set[str]:
        d = self.read_json(f"{shard_dir}/{fmt.PREVIOUS_SNAPSHOT}")
        try:
            return {str(n) for n in d["files"]}
        except (KeyError, TypeError):
            return set()

    def remember_previous(self, shard_dir: str, files: list[str]) -> None:
        self.write_json(f"{shard_dir}/{fmt.PREVIOUS_SNAPSHOT}", {"files": sorted(snapshot.names_in(shard_dir, files))})

    def collect(self, shard_dir: str, keep: set[str], dry_run: bool = False) -> tuple[list[str], int]:
        """Remove the objects of the shard folder no index refers to (as :func:`snapshot.collect`)."""
        if self._lock is not None:
            self._lock.check()
        entries: dict[str, list[str]] = {}
        for u in self.listing():
            if u.startswith(shard_dir + "/"):
                entries.setdefault(u[len(shard_dir) + 1:].split("/", 1)[0], []).append(u)
        removed = [n for n in sorted(entries) if snapshot.removable(n, keep)]
        urls = [u for n in removed for u in entries[n]]
        freed = sum(self.listing()[u] for u in urls)
        if not dry_run:
            self.remove(urls)
        return removed, freed

    # -- writing --------------------------------------------------------------------------------
    def task_path(self, url: str) -> str:
        """Where a local shard task builds the shard that belongs at ``url``: the staging folder."""
        return os.path.join(self.stage, os.path.basename(os.path.dirname(url)), os.path.basename(url))

    def shard_target(self, private: bool) -> Any:
        """What each shard task needs to upload its shard (``private``: build it in the worker's own folder,
        as on a cluster, not in this process's staging folder)."""
        from .upload import ShardTarget

        assert self.shard_dir is not None
        return ShardTarget(self.shard_dir, self.options, private)

    def finalize(self, writer: Any, index_url: str, shards: list[dict[str, Any]], specs: Any,
                 attrs: dict[str, Any], parts: list[Any]) -> None:
        """Write the index locally from the shards' parts, then upload it in one PUT (the build's last shard
        object is already in place)."""
        missing = [s["file"] for s, p in zip(shards, parts) if p is None and s["num_samples"]]
        if missing:  # every kept or built shard of a URL build has parts: a bug, not a fault of the store
            raise BuildError(f"internal error: no index parts for {', '.join(missing)}; run build again")
        local = self.local_path(index_url)
        writer.finalize(local, shards, specs, attrs, parts)
        if self._lock is not None:
            self._lock.check()
        self.put(local, index_url)
