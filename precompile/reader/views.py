"""The views a :class:`~precompile.reader.direct.DirectReader` gathers from: per field, the mapped range cut into
C-contiguous 2-D views of whole rows, one per residue of the rows' addresses modulo the row size (a field has a
handful, one per distinct chunk alignment); past :data:`MAX_VIEWS` a field of rows under :data:`VIEW_ALL_BYTES`
gets one strided view in which "row k" starts at byte k, read with a fancy index. And the order a batch is
gathered in: the h5py-served rows first, then the mapped rows by (view, address).

What a gather copies with (:func:`field_pieces`): where every row's address in the range and the row size share
a factor of at least :data:`MIN_PIECE_BYTES` (64 bytes; 256 for rows of 64 KiB or more; the writer puts chunks
of 4 KiB or more on 4 KiB, so: uint8 images with sides a multiple of 8 or 16, 64x64x3 or 224x224x3, float32
ones a multiple of 4 or 8; smaller chunks lie where HDF5 puts them), the range is cut once into pieces of
that size, a row is ``count`` consecutive pieces, and a task's rows, in any order and from any number of
shards and alignments, are ONE ``np.take`` over a table of their pieces, which numpy runs without the
interpreter lock from the first row to the last. Other fields (rows
whose size is odd or has a small power of two, e.g. 227x227x3 or 28x28 uint8) keep the views: one
``np.take`` per view a task touches, or one strided fancy index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from numpy.lib.stride_tricks import as_strided

#: at most this many residue views per shard and field; beyond (small rows in many chunk
#: alignments, e.g. 784-byte MNIST rows), one strided fancy-index per shard does the gather
MAX_VIEWS = 4
#: rows of at least this many bytes get a view per residue however many there are: one np.take per view
#: in a batch costs a few microseconds, less than copying one such row
VIEW_ALL_BYTES = 64 << 10
#: a field's rows are copied as pieces when its row size and every row's address share a factor this large
#: (rows of VIEW_ALL_BYTES or more: MIN_PIECE_BYTES_LARGE). numpy's take costs a few ns per piece beyond the
#: bytes it copies: a bare take of pieces against one of whole rows (``bench_threads.py --per-thread``) ran at
#: 0.33x (64 B pieces), 0.68x (256 B), 0.78x (1 KiB), 0.86-1.02x (4 KiB); through the reader, against the views
#: they replace, 1.01-1.14x for rows of 192 B-12 KiB (the views' Python per take cost more) and 0.83-0.86x for
#: 147-192 KiB rows in 1-4 KiB pieces, the price of one call without the interpreter per task
MIN_PIECE_BYTES = 64
MIN_PIECE_BYTES_LARGE = 256


@dataclass
class Pieces:
    """One field's rows as pieces of one array: ``view`` is the array cut into ``(K, g)`` pieces of ``g``
    bytes, ``first[row]`` the global row's first piece (-1: not in ``view``, a shard h5py serves) and a row
    is ``count`` consecutive pieces (its size is ``count * g``)."""

    view: np.ndarray
    first: np.ndarray
    count: int

    def __post_init__(self) -> None:
        self.steps = np.arange(self.count, dtype=np.int64)

    def take(self, firsts: np.ndarray, flat: np.ndarray) -> None:
        """Copy the rows whose first pieces are ``firsts`` (all in ``view``) to ``flat`` (``(len, row bytes)``
        uint8, C-contiguous), in order: one ``np.take``, which releases the interpreter lock for the whole copy
        (``mode="clip"`` keeps numpy from buffering ``out``; the pieces come from the checked chunk table)."""
        if self.count == 1:
            np.take(self.view, firsts, axis=0, out=flat, mode="clip")
        else:
            np.take(self.view, np.add.outer(firsts, self.steps), axis=0,
                    out=flat.reshape(len(firsts), self.count, self.view.shape[1]), mode="clip")


def field_pieces(arr: np.ndarray, base: np.ndarray, rows: Any, offsets: np.ndarray, rb: int) -> Optional[Pieces]:
    """One field's rows as :class:`Pieces` of ``arr`` (a uint8 range holding every mapped shard: shard ``s``'s
    file starts at byte ``base[s]``), or None when the row size and the rows' addresses share no factor of
    :data:`MIN_PIECE_BYTES` or more (:data:`MIN_PIECE_BYTES_LARGE` for rows of :data:`VIEW_ALL_BYTES` or more):
    the views serve that field. ``rows``: the field's :class:`~.rows._FieldRows`; ``rb``: its row bytes."""
    counts = np.diff(offsets)
    served = np.repeat(rows.served, counts)
    addr = rows.addr + np.repeat(base, counts)
    g = int(np.gcd.reduce(addr[served], initial=rb)) if rb > 0 else 0
    least = MIN_PIECE_BYTES if rb < VIEW_ALL_BYTES else MIN_PIECE_BYTES_LARGE
    if g <= 0 or (g < least and g != rb):
        return None
    first = np.where(served, addr // g, -1)
    return Pieces(arr[:arr.size // g * g].reshape(-1, g), first, rb // g)


def field_views(spaces: list[tuple[np.ndarray, dict[int, int]]], one_region: bool, rows: Any, offsets: np.ndarray,
                rb: int) -> tuple[list[np.ndarray], list[bool], np.ndarray, np.ndarray]:
    """One field's views over the mapped ``spaces`` ((array, {shard: offset of its file in the array})), whether
    each is takeable (a 2-D view of whole rows) or strided, and per global row its view (-1: served by h5py)
    and its row in that view. ``rows``: the field's :class:`~.rows._FieldRows`; ``rb``: its row bytes;
    ``one_region``: every shard in one space (the region), so every row is placed at once."""
    n = int(offsets[-1])
    views: list[np.ndarray] = []
    takeable: list[bool] = []
    vid = np.full(n, -1, dtype=np.int64)
    vrow = np.zeros(n, dtype=np.int64)
    for arr, bases in spaces:
        if one_region:   # one space for all shards: every row at once
            served, addr = np.repeat(rows.served, np.diff(offsets)), rows.addr
            base = np.zeros(len(offsets) - 1, dtype=np.int64)
            base[list(bases)] = list(bases.values())
            g_rows = np.flatnonzero(served)
            g_addr = addr[g_rows] + np.repeat(base, np.diff(offsets))[g_rows]
            if not len(g_rows):
                continue
        else:
            parts, addrs = [], []
            for s, b in bases.items():
                if not rows.served[s]:
                    continue
                lo, hi = int(offsets[s]), int(offsets[s + 1])
                parts.append(np.arange(lo, hi, dtype=np.int64))
                addrs.append(rows.addr[lo:hi] + b)
            if not parts:
                continue
            g_rows, g_addr = np.concatenate(parts), np.concatenate(addrs)
        res = g_addr % rb    # the same for a chunk's rows: unique over runs, not over every row
        residues = np.unique(res[np.flatnonzero(np.diff(res, prepend=res[0] - 1))])
        rid = np.searchsorted(residues, res)
        if len(residues) > MAX_VIEWS and rb < VIEW_ALL_BYTES:
            vid[g_rows] = len(views)
            vrow[g_rows] = g_addr
            views.append(as_strided(arr, shape=(arr.size - rb + 1, rb), strides=(1, 1), writeable=False))
            takeable.append(False)
            continue
        vid[g_rows] = len(views) + rid
        vrow[g_rows] = (g_addr - residues[rid]) // rb
        for r in residues.tolist():
            k = (arr.size - r) // rb
            views.append(arr[r:r + k * rb].reshape(k, rb))
            takeable.append(True)
    return views, takeable, vid, vrow


def gather_order(offsets: np.ndarray, rows: Optional[Any], vid: Optional[np.ndarray], vrow: Optional[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per row, from one field's ``rows`` (:class:`~.rows._FieldRows`) and views (``vid``, ``vrow``; None: no
    field): a global chunk id, and the row's place in gather order: the h5py-served rows first, in index order,
    then the mapped rows by (view, address) (one sort key: a million rows in 0.05 s)."""
    n = int(offsets[-1])
    counts = np.diff(offsets)
    shard = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    rpc = np.maximum(1, rows.rows_per_chunk) if rows is not None else np.ones(len(counts), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(-(-counts // rpc))[:-1]]).astype(np.int64)
    local = np.arange(n, dtype=np.int64) - offsets[shard]
    ids = first[shard] + local // rpc[shard]
    if vid is None:
        return ids, np.arange(n, dtype=np.int64)
    span = max(n, int(vrow.max(initial=0)) + 1)       # every served key above every row index
    key = np.where(vid >= 0, (vid + 1) * span + vrow, np.arange(n, dtype=np.int64))
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(key, kind="stable")] = np.arange(n, dtype=np.int64)
    return ids, rank
