"""An HDF5 build's files as h5py shows them, below the format class: a dataset's chunks and each shard's chunk
tables (what a reader maps), the index's ``__chunks__`` table and metadata, a field's digest. What the format
(:mod:`.hdf5`), a shard's index parts (:mod:`.hdf5_parts`), verify (:mod:`.hdf5_verify`, and a URL's:
:mod:`precompile.tools.verify_url`) and the reader (:mod:`precompile.reader.direct`) share; nothing here
imports them.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Sequence

import numpy as np

from . import names as fmt
from ..errors import FormatError
from .index_columns import check_dataset, recorded_crcs

#: bytes read at a time while hashing a field
BLOCK_BYTES = 8 << 20


def attr_text(v: Any) -> str:
    """An HDF5 attribute read back as text (h5py gives str or bytes)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def chunk_table(d: Any) -> list[tuple[int, int, int, int]]:
    """(first row, byte address, stored size, filter mask) of every allocated chunk of dataset ``d``."""
    out: list[tuple[int, int, int, int]] = []
    dsid = d.id
    if hasattr(dsid, "chunk_iter"):
        try:
            dsid.chunk_iter(lambda ci: out.append((int(ci.chunk_offset[0]), int(ci.byte_offset), int(ci.size),
                                                   int(ci.filter_mask))))
            return out
        except (AttributeError, RuntimeError, TypeError):  # older HDF5 without H5Dchunk_iter
            out.clear()
    for i in range(dsid.get_num_chunks()):
        ci = dsid.get_chunk_info(i)
        out.append((int(ci.chunk_offset[0]), int(ci.byte_offset), int(ci.size), int(ci.filter_mask)))
    return out


def shard_chunk_tables(f: Any, fields: Sequence[str]) -> dict[str, tuple[int, np.ndarray]]:
    """``{field: (rows per chunk, (chunks, 2) uint64 of byte address and size, in row order)}`` of an open
    shard file, for each fixed-shape field the reader can map: chunked by whole samples, unfiltered, every
    chunk allocated and written in full. Any other field is left out (the reader opens its shard with h5py)."""
    out: dict[str, tuple[int, np.ndarray]] = {}
    for name in fields:
        d = f.get(name)
        if d is None or not hasattr(d, "chunks") or d.chunks is None or d.ndim < 1 or d.shape[0] == 0:
            continue
        c = int(d.chunks[0])
        if tuple(d.chunks[1:]) != tuple(d.shape[1:]) or d.id.get_create_plist().get_nfilters():
            continue
        table = sorted(chunk_table(d))
        rb = int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
        if (len(table) != -(-d.shape[0] // c) or any(t[0] != i * c for i, t in enumerate(table))
                or any(t[3] or t[2] != c * rb for t in table)):
            continue
        out[name] = (c, np.array([(t[1], t[2]) for t in table], dtype=np.uint64).reshape(-1, 2))
    return out


def read_chunk_tables(path: str, where: Optional[str] = None) -> np.ndarray | None:
    """The index's ``__chunks__`` table (see :func:`_write_chunk_tables`), or None for an index written
    before the tables existed; checked against the index's recorded crc32 (FormatError naming ``where``,
    default ``path``)."""
    import h5py

    where = where or path
    try:
        with h5py.File(path, "r") as f:
            d = f.get(fmt.CHUNKS)
            if d is None:
                return None
            if not isinstance(d, h5py.Dataset) or d.ndim != 2 or d.shape[1] != 2:
                raise FormatError(f"{where}: the index's {fmt.CHUNKS} table is not (chunks, 2): the index is "
                                  f"damaged (build again)")
            table = d[:]
            check_dataset(where, recorded_crcs(f, where), fmt.CHUNKS, table)
            return table
    except OSError as e:
        raise FormatError(f"{where}: cannot read the index's chunk tables: {e}") from None


def field_digest(dset: Any, block_bytes: int = BLOCK_BYTES) -> tuple[str, int]:
    """sha256 of a dataset's samples (axis 0) in C order, read in blocks; and the bytes read."""
    h = hashlib.sha256()
    n = dset.shape[0]
    per = max(1, int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize)
    step = max(1, block_bytes // per)
    total = 0
    for i in range(0, n, step):
        a = np.ascontiguousarray(dset[i:i + step])
        h.update(a.data)
        total += a.nbytes
    return h.hexdigest(), total


def read_index(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """(fields, shard entries, sample count) from an index's attributes; FormatError naming ``path`` when it
    cannot be read."""
    import h5py

    if not os.path.exists(path):
        raise FormatError(f"{path}: no such output (build it first)")
    try:
        with h5py.File(path, "r") as f:
            a = f.attrs
            fmt.check_header(path, a)
            fields = fmt.loads(attr_text(a[fmt.A_FIELDS]))
            shards = fmt.loads(attr_text(a[fmt.A_SHARDS]))
            total = int(a[fmt.A_NUM])
    except OSError as e:
        raise FormatError(f"{path}: cannot read the index file as HDF5 ({e})") from None
    except (KeyError, ValueError) as e:
        raise FormatError(f"{path}: the index file's metadata is damaged ({e})") from None
    return fields, shards, total
