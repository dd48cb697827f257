"""``precompile verify``: re-read a built output and check it against its index.

The index records, per shard, its file, size, sample count, key and a sha256
per field of the fields' sample bytes. What "re-read and check" means is the
format's (``Format.verify`` in ``precompile.formats``: HDF5 datasets, or the
files of a shard folder); this module only finds the format by the index file.
"""
from __future__ import annotations

import os

from ..errors import FormatError
from ..formats import VerifyResult, find_format

__all__ = ["VerifyResult", "verify"]


def verify(path: str | os.PathLike, checksums: bool = True) -> VerifyResult:
    """Check every shard of the output at ``path``; raises FormatError only when the index itself is unusable."""
    path = str(path)
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such output (build it first)")
    fmt = find_format(path, by_extension=True)
    if fmt is None:
        raise FormatError(f"{path}: cannot read the index file: neither an HDF5 nor a JSON precompile index")
    return fmt.verify(path, checksums)
