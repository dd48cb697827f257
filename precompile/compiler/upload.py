"""The shard task of a build written to a URL: build the shard locally, upload it, delete the local copy.

Runs in the worker (in-process, loky or a dask worker on another machine). Everything it needs travels with
the task: the shard folder's URL and the output's storage options (:class:`ShardTarget`; never the recipe's
``inputs.storage_options``). The shard is built by :func:`~.shard.run_shard` into a local folder: the
parent's staging folder for local workers (so the dead-worker retry finds a killed task's temporaries), or
a private temporary folder of the worker (on a cluster: in the dask worker's ``--local-directory``).

Upload order: the ``.skipped.json`` sidecar (when inputs were skipped), the shard, then its
``.entry.json`` sidecar (its index entry and parts): a resumed build keeps an uploaded shard only when its
entry sidecar is there too, so it never needs the shard's bytes. The puts are
:func:`precompile.storage.upload.put_objects`'; a failed upload is an :class:`~precompile.errors.OutputError`
naming the URL (the build stops; uploaded shards are kept).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import OutputError
from ..formats import names as fmt
from ..storage.upload import put_objects
from .keys import skipped_path
from .results import ShardResult
from .shard import run_shard


@dataclass(frozen=True)
class ShardTarget:
    """Where a URL build's shard task uploads: the shard folder's URL and the filesystem's options."""

    url: str
    storage_options: dict[str, Any] = field(repr=False)   # may hold credentials: never printed
    private: bool = False      # build in the worker's own temporary folder (a cluster worker)


def _private_folder() -> str:
    """A new temporary folder of this worker: in a dask worker's local directory when there is one."""
    base = None
    try:
        from distributed import get_worker

        base = get_worker().local_directory
    except (ImportError, ValueError, AttributeError):
        pass
    return tempfile.mkdtemp(prefix="precompile-shard-", dir=base)


def entry_sidecar(res: ShardResult, key: str) -> bytes:
    """The ``.entry.json`` sidecar of a built shard: its index entry and parts (JSON, no pickle)."""
    entry = res.info(key)
    return json.dumps({"format_version": fmt.FORMAT_VERSION, "entry": entry, "parts": res.parts.to_json()},
                      sort_keys=True).encode()


def upload_shard(target: ShardTarget, local: str, res: ShardResult, key: str) -> None:
    """Upload a built shard (and its sidecars) from ``local`` to ``<target.url>/<its name>``: the skipped
    inputs' sidecar (when any), the shard, then its entry sidecar (the commit marker)."""
    url = f"{target.url}/{os.path.basename(local)}"
    skipped = [(skipped_path(local), skipped_path(url))] if os.path.exists(skipped_path(local)) else []
    put_objects(url, target.storage_options, [*skipped, (local, url)],
                [(url + fmt.ENTRY_SIDECAR, entry_sidecar(res, key))], f"uploading shard {res.index}",
                kept="the shards uploaded before are kept; run build again once that is fixed")


def run_shard_to_url(target: ShardTarget, recipe: Any, shard: Any, path: str, key: str, specs: Any,
                     chunking: dict[str, int], in_worker: bool = False, isolate: bool = False,
                     progress: Optional[Any] = None) -> ShardResult:
    """Build shard ``shard`` locally (at ``path``, or in a private folder), upload it to ``target``, remove
    the local copy; returns the shard's result (with its parts, for the index)."""
    private = _private_folder() if target.private or not os.path.isdir(os.path.dirname(path)) else None
    local = path if private is None else os.path.join(private, os.path.basename(os.path.dirname(path)),
                                                      os.path.basename(path))
    os.makedirs(os.path.dirname(local), exist_ok=True)
    try:
        try:
            res = run_shard(recipe, shard, local, key, specs, chunking, in_worker, isolate, progress)
        except OutputError as e:   # the local folder it builds in (a full disk): say which one that is
            raise OutputError(f"{e} (the local staging folder of {target.url}: TMPDIR moves it)") from None
        if not res.failed:
            upload_shard(target, local, res, key)
        return res
    finally:
        for p in (local, skipped_path(local)):
            if os.path.exists(p):
                os.remove(p)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
