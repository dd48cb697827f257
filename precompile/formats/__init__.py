"""Output formats, one module each, owning both sides of their files: options and spec checks,
chunking, shard writing, the index, opening a dataset, ``describe`` (inspect) and ``verify``.

Importing this package registers the built-in ones in ``registry.WRITERS``:
``hdf5`` (fixed and variable-shape fields), ``png`` and ``bmp`` (image files),
``wav`` (audio files). Shared pieces: ``base`` (the :class:`Format` interface),
``names`` (on-disk names and the format version), ``dataset`` (the map-style
dataset every reader shares), ``folder`` (the file-folder formats' writer,
reader and verify) and ``image`` (png/bmp field rules and reading).

:func:`find_format` is the one lookup from an index file to its format (each
format ``claims`` the first bytes of its index); ``precompile.open``,
``precompile inspect`` and ``precompile verify`` all go through it.

Adding a format: one module here with a :class:`Format` subclass registered
with ``@WRITERS.register()``, and its import below.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from ..errors import FormatError
from ..registry import WRITERS
from .base import Format, ShardWriter, VerifyResult, WriterOptions
from .dataset import Batch, Dataset
from .folder import FileDataset, FolderFormat, FolderOptions
from . import hdf5  # noqa: F401  (registers "hdf5")
from . import png  # noqa: F401  (registers "png")
from . import bmp  # noqa: F401  (registers "bmp")
from . import wav  # noqa: F401  (registers "wav")
from .hdf5 import H5Dataset

__all__ = ["Batch", "Dataset", "FileDataset", "FolderFormat", "FolderOptions", "Format", "H5Dataset",
           "ShardWriter", "VerifyResult", "WriterOptions", "find_format", "open_dataset"]

HEAD_BYTES = 8


def find_format(path: str | os.PathLike, by_extension: bool = False) -> Format | None:
    """The registered format whose index file ``path`` is (by its first bytes), or None.

    ``by_extension``: when no format claims the bytes (a damaged index), fall back to the format
    whose ``index_ext`` the name ends with, so it can say what is wrong."""
    p = str(path)
    try:
        with open(p, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        head = b""
    for _, cls in WRITERS.items():
        if cls.claims(head):
            return cls()
    if by_extension:
        for _, cls in WRITERS.items():
            if p.endswith(cls.index_ext):
                return cls()
    return None


def open_dataset(path: str | os.PathLike, fields: Sequence[str] | None = None, verify: bool = False,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 storage_options: dict[str, Any] | None = None) -> Dataset:
    """Open a built output (the index file written by ``precompile build``), whatever its format.

    ``verify=True`` first checks every stored byte against the index (as ``precompile verify`` does: the
    cost is one read of the whole output, see docs/limits.md) and raises FormatError naming what is damaged.

    ``path`` may be the URL of an HDF5 build's index (``s3://bucket/prefix/images.h5``, any fsspec URL): its
    shards are then read through the local cache ``cache_dir`` of at most ``cache_limit`` bytes, with the
    store's ``storage_options`` (:mod:`precompile.formats.hdf5_url`); ``verify=True`` then re-hashes the
    cached copies of its shards."""
    from ..optschema import flag
    from ..sample import field_list
    from ..storage.remote import is_url

    fields, verify = field_list(fields), flag(verify, "verify")   # ("no" was a verify)
    if is_url(path):
        from .hdf5_url import open_url

        return open_url(str(path), fields, verify, cache_dir, cache_limit, storage_options)
    if cache_dir is not None or cache_limit is not None or storage_options is not None:
        raise ValueError(f"{path}: cache_dir, cache_limit and storage_options apply to a build read from a URL "
                         f"(s3://..., gs://..., https://...), not to a local path")
    p = str(path)
    if not os.path.exists(p):
        raise FormatError(f"{p}: no such file (build the recipe first)")
    if os.path.isdir(p):
        raise FormatError(f"{p}: is a folder; open the index file next to it (<name>.h5 or <name>.json)")
    fmt = find_format(p)
    if fmt is None:
        raise FormatError(f"{p}: neither an HDF5 nor a JSON precompile index")
    if verify:
        check_intact(fmt, p)
    return fmt.open(p, fields=fields)


def check_intact(fmt: Format, path: str) -> None:
    """FormatError listing what ``verify`` found damaged in the output at ``path`` (nothing when intact)."""
    res = fmt.verify(path, True)
    if res.ok:
        return
    what = (f"{len(res.bad_shards)} of {res.num_shards} shard(s) damaged" if res.bad_shards else "its index is damaged")
    more = f" (and {len(res.problems) - 5} more)" if len(res.problems) > 5 else ""
    raise FormatError(f"{path}: verify on open failed, {what}: " + "; ".join(res.problems[:5]) + more
                      + " (rebuild with `precompile build --repair`)")
