"""``precompile verify`` of a build at a URL: every shard object streamed and hashed, never stored whole.

The index (fetched once) records each shard's whole-object ``sha256`` and size; one listing gives every
object's size. A shard object that is missing, of another size, or whose bytes hash to another sha256 is
named with the messages of a local verify (``formats/hdf5_verify.py``), and the same exit code. An entry
that records no ``sha256`` or ``bytes`` is an index problem that says what could not be checked
(:func:`unchecked`), never a silent pass.
``checksums=False`` (``--quick``) checks presence and sizes only (one listing, no object read). A
damaged object is not localised further (to a field, column or sample): that needs its bytes on disk
(copy it and verify the copy). Objects are hashed four at a time, in blocks of 8 MiB.

The index copy gets the checks of a local verify that read no shard (with ``--quick`` too): its sample
count, its columns, and its columnar copies (the ``__shards__`` table against the entries, the
``__key_utf8__`` key column against ``__key__``), so damage that readers of the URL would serve (wrong
keys, counts) is named as index damage and ``build --repair`` writes the index again. What only the
shards' bytes tell (an index row or field checksum that disagrees with its intact shard) is left to a
local verify of a copy.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ..errors import FormatError, PrecompileError
from ..formats.base import VerifyResult

BLOCK = 8 << 20
STREAMS = 4


def object_sha256(fs: Any, url: str, block: int = BLOCK) -> str:
    """sha256 of the object at ``url``, read in ``block``-sized ranged reads (nothing cached or stored)."""
    h = hashlib.sha256()
    with fs.open(url, "rb", block_size=block, cache_type="none") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_object(out: Any, s: dict[str, Any], checksums: bool) -> tuple[list[str], int]:
    """(problems of one shard object, bytes hashed)."""
    url = f"{out.root}/{s['file']}"
    size = out.size(url)
    if size is None:
        return ["file is missing"], 0
    if "bytes" in s and size != int(s["bytes"]):
        return [f"size {size} bytes differs from the recorded {s['bytes']}"], 0
    if not checksums or not s.get("sha256"):   # an entry without one is said by unchecked()
        return [], 0
    if object_sha256(out.fs, url) != s["sha256"]:
        return ["whole-file sha256 differs from the index's: the object's bytes changed (to name the field, "
                "column and sample, copy it and verify the copy)"], size
    return [], size


def unchecked(shards: list[dict[str, Any]], checksums: bool) -> list[str]:
    """What could not be checked of each entry: one without a ``sha256`` (with ``checksums``) or a ``bytes``
    (an older build's index, or a damaged one): its object's bytes or size are not compared with anything.
    Readers of the URL refuse such an entry, so it is an index problem, not a silent pass."""
    out = []
    for i, s in enumerate(shards):
        missing = [what for what, key, asked in (("sha256", "sha256", checksums), ("size (bytes)", "bytes", True))
                   if asked and not (isinstance(s.get(key), str) if key == "sha256" else "bytes" in s)]
        if missing:
            out.append(f"shard entry {i} ({s.get('file')}) records no {' and no '.join(missing)}: its object's "
                       f"{'bytes' if 'sha256' in missing else 'size'} could not be checked (readers of the URL "
                       f"refuse the entry too): build to this URL again")
    return out


def _index_problems(local: str, index_url: str, shards: list[dict[str, Any]], total: int) -> list[str]:
    """The checks of a local verify that need the index only (its copy at ``local``): its sample count,
    its columns, and its columnar copies (shard table, key column) against its entries and ``__key__``."""
    from ..formats.hdf5_verify import columnar_copy_problems, index_count_and_columns

    problems, cols = index_count_and_columns(local, shards, total)
    problems += columnar_copy_problems(local, shards, cols)
    return [p.replace(local, index_url) for p in problems]


def verify_url(index_url: str, checksums: bool = True, storage_options: Optional[dict[str, Any]] = None
               ) -> VerifyResult:
    """Check every shard object of the HDF5 build whose index is at ``index_url``; raises FormatError only
    when the index itself is unusable (OutputError when the store cannot be read)."""
    from ..storage.objects import UrlFolder
    from ..formats.hdf5_layout import read_index

    name = os.path.splitext(os.path.basename(index_url))[0]
    with UrlFolder(os.path.dirname(index_url), storage_options, name.split(".")[0]) as out:
        try:
            local = out.copy_of(index_url)
            if local is None:
                raise FormatError(f"{index_url}: no such output (build it first)")
            if not index_url.endswith(".h5"):
                raise FormatError(f"{index_url}: verify reads HDF5 indexes at a URL (the formats a URL build writes)")
            try:
                fields, shards, total = read_index(local)
            except FormatError as e:
                raise FormatError(str(e).replace(local, index_url)) from None
            res = VerifyResult(num_shards=len(shards), counted="bytes of shard objects" if checksums else "bytes")
            res.index_problems = _index_problems(local, index_url, shards, total) + unchecked(shards, checksums)
            with ThreadPoolExecutor(STREAMS) as pool:
                found = list(pool.map(lambda s: _check_object(out, s, checksums), shards))
        except PrecompileError:
            raise
        except Exception as e:
            err = out.fault(e, f"verifying {index_url}")
            if err is None:
                raise
            raise err from None
    for s, (bad, nbytes) in zip(shards, found):
        res.bytes_checked += nbytes
        res.num_samples += int(s["num_samples"])
        if bad:
            res.bad_shards.append(s["file"])
            res.problems.extend(f"{s['file']}: {b}" for b in bad)
    res.problems.extend(f"index: {p}" for p in res.index_problems)
    return res
