"""``precompile verify``: re-read a built output and check it against its index.

The index records, per shard, its file, size, sample count, key and a sha256
per field of the fields' sample bytes. What "re-read and check" means is the
format's (``Format.verify`` in ``precompile.formats``: HDF5 datasets, or the
files of a shard folder); this module only finds the format by the index file.
A build at a URL is checked object by object (:mod:`.verify_url`).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import FormatError
from ..formats import VerifyResult, find_format
from ..storage.remote import is_url

__all__ = ["VerifyResult", "verify"]


def verify(path: str | os.PathLike, checksums: bool = True,
           storage_options: Optional[dict[str, Any]] = None) -> VerifyResult:
    """Check every shard of the output at ``path``; raises FormatError only when the index itself is unusable.
    ``path`` may be a URL (the shard objects are streamed: :mod:`.verify_url`; ``storage_options`` as for
    ``precompile.build``)."""
    path = str(path)
    if is_url(path):
        from .verify_url import verify_url

        return verify_url(path, checksums, storage_options)
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such output (build it first)")
    fmt = find_format(path, by_extension=True)
    if fmt is None:
        raise FormatError(f"{path}: cannot read the index file: neither an HDF5 nor a JSON precompile index")
    return fmt.verify(path, checksums)
