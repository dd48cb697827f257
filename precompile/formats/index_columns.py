"""The index's columnar copies of what it also keeps as JSON or variable-length strings, read with numpy.

Opening a build reads its index once. Two of the index's records are slow to read as they are stored, and
both stay the source of truth (snapshot collection, ``verify`` and plain-h5py users read them):

- the ``shards`` attribute (JSON text, one entry per shard: ``names.SHARD_ENTRY``): parsing it costs about
  3 us per entry (16 ms at 5,000 shards, most of ``precompile.open``);
- the ``__key__`` column (variable-length strings): 0.3 s at a million samples.

So an HDF5 index also carries:

``__shards__``, one compound dataset with a row per entry, in entry order:

- ``num_samples`` and ``bytes`` (int64; ``bytes`` -1 where the entry records none);
- ``rows_per_chunk`` and ``chunks`` (int64, one column per field of the dataset's ``fields`` attribute, a
  JSON list in name order: the entry's ``chunks`` slot, ``[rows per chunk, chunks]``; 0 and 0 where the
  entry has no table for that field); left out when no entry has a chunk table;
- ``file`` (fixed-length UTF-8: the shard's path relative to the index's folder);

and the attribute ``entries_crc32``, the crc32 of the ``shards`` text it was made from. A reader uses the
table only when that crc matches the ``shards`` text it read (0.4 ms at 5,000 shards): a tool that rewrites
the entries and not the table (an older precompile, plain h5py) makes readers parse the JSON again, never
read a stale table. An index without the table (written before it existed) is read from the JSON the same
way (:meth:`ShardTable.from_entries`).

``__key_utf8__`` (uint8: every sample key's UTF-8 bytes, concatenated in index order) and
``__key_offsets__`` (N+1 int64: key i is ``__key_utf8__[offsets[i]:offsets[i+1]]``), read whole at open
(a few ms at a million samples) and decoded only when asked (:class:`KeyColumn`), so the keys are those of
the snapshot that was opened even when the index is replaced later. An index without them gives its keys
from ``__key__``, read at open as before.

They are datasets, not groups, so the index keeps only datasets at its top level besides ragged fields
(plain-h5py code that walks the index reads every name as an array). This module owns their layout:
writing them (:func:`write_shard_table`, :func:`write_key_column`), reading them
(:func:`read_shard_table`, :func:`read_key_column`) and, for ``verify``, checking them against what they
copy (:func:`column_problems`).
"""
from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import names as fmt

log = logging.getLogger("precompile.formats")


def entries_crc(text: str | bytes) -> int:
    """The crc32 of the ``shards`` attribute's UTF-8 text (what ``entries_crc32`` records)."""
    return zlib.crc32(text.encode("utf-8") if isinstance(text, str) else text)


@dataclass(frozen=True)
class ShardTable:
    """The shard entries' columns (one row per entry, entry order); see the module docstring."""

    num_samples: np.ndarray          # (S,) int64
    bytes: np.ndarray                # (S,) int64, -1: not recorded
    files: np.ndarray                # (S,) bytes (UTF-8)
    fields: tuple[str, ...]          # the fields of the chunk columns, name order
    rows_per_chunk: np.ndarray       # (S, F) int64, 0: no chunk table for that field
    chunks: np.ndarray               # (S, F) int64
    source: str                      # "table" (read from __shards__) or "entries" (from the JSON)

    def __len__(self) -> int:
        return int(self.num_samples.shape[0])

    def file(self, s: int) -> str:
        """Shard ``s``'s path relative to the index's folder."""
        return bytes(self.files[s]).decode("utf-8")

    def paths(self, base: str, shards: np.ndarray) -> list[str]:
        """The files of ``shards`` (entry numbers) under the folder ``base``."""
        join = os.path.join
        return [join(base, name.decode("utf-8")) for name in self.files[shards].tolist()]

    def has_chunks(self) -> bool:
        """True when some entry lists a chunk table (so the index must hold ``__chunks__``)."""
        return bool(self.fields)

    def spans(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Field ``name``'s (rows per chunk, chunks, first row in ``__chunks__``) per shard; rows per chunk
        0 where an entry has no table for it. ``__chunks__`` holds the entries' chunks shard by shard, a
        shard's fields in name order: the row-major order of :attr:`chunks`."""
        starts = np.concatenate([[0], np.cumsum(self.chunks.reshape(-1))[:-1]]).astype(np.int64)
        starts = starts.reshape(self.chunks.shape)
        if name not in self.fields:
            zero = np.zeros(len(self), dtype=np.int64)
            return zero, zero.copy(), zero.copy()
        j = self.fields.index(name)
        return self.rows_per_chunk[:, j], self.chunks[:, j], starts[:, j]

    def total_chunks(self) -> int:
        return int(self.chunks.sum())

    @classmethod
    def from_entries(cls, entries: Sequence[dict[str, Any]]) -> "ShardTable":
        """The same columns from parsed entries (an index without ``__shards__``, or whose table is stale)."""
        fields = tuple(sorted({name for e in entries for name in (e.get(fmt.E_CHUNKS) or {})}))
        col = {name: j for j, name in enumerate(fields)}
        spans = np.zeros((len(entries), len(fields), 2), dtype=np.int64)
        for s, e in enumerate(entries):
            for name, (c, k) in (e.get(fmt.E_CHUNKS) or {}).items():
                spans[s, col[name]] = (int(c), int(k))
        return cls(num_samples=np.array([int(e["num_samples"]) for e in entries], dtype=np.int64),
                   bytes=np.array([int(e.get("bytes", -1)) for e in entries], dtype=np.int64),
                   files=np.array([str(e["file"]).encode("utf-8") for e in entries], dtype=bytes),
                   fields=fields, rows_per_chunk=spans[:, :, 0], chunks=spans[:, :, 1], source="entries")


def _row_dtype(nfields: int, name_bytes: int) -> np.dtype:
    import h5py

    cols: list[tuple] = [("num_samples", "<i8"), ("bytes", "<i8")]
    if nfields:
        cols += [("rows_per_chunk", "<i8", (nfields,)), ("chunks", "<i8", (nfields,))]
    cols.append(("file", h5py.string_dtype("utf-8", max(1, name_bytes))))
    return np.dtype(cols)


def write_shard_table(f: Any, entries: Sequence[dict[str, Any]], text: str) -> None:
    """``__shards__`` into the open index ``f``: the columns of ``entries``, whose JSON is ``text`` (the
    ``shards`` attribute, byte for byte)."""
    t = ShardTable.from_entries(entries)
    names = t.files.tolist()
    rows = np.zeros(len(t), dtype=_row_dtype(len(t.fields), max((len(n) for n in names), default=1)))
    rows["num_samples"], rows["bytes"], rows["file"] = t.num_samples, t.bytes, names
    if t.fields:
        rows["rows_per_chunk"], rows["chunks"] = t.rows_per_chunk, t.chunks
    d = f.create_dataset(fmt.SHARD_TABLE, data=rows, track_times=False)
    d.attrs[fmt.T_FIELDS] = fmt.dumps(list(t.fields))
    d.attrs[fmt.T_ENTRIES_CRC] = np.int64(entries_crc(text))


def read_shard_table(f: Any, text: str | bytes | None) -> ShardTable | None:
    """The index's ``__shards__`` table, or None when it has none, or one that was not made from ``text``
    (the ``shards`` attribute as read: the table is then stale) or that cannot be read as one: the caller
    parses the entries instead (:meth:`ShardTable.from_entries`)."""
    d = f.get(fmt.SHARD_TABLE)
    if d is None or text is None:
        return None
    path = f.filename
    try:
        crc = int(d.attrs[fmt.T_ENTRIES_CRC])
        fields = tuple(fmt.loads(d.attrs[fmt.T_FIELDS]))
        if crc != entries_crc(text):
            log.info("%s: %s was not written from this index's shard entries; reading the entries", path,
                     fmt.SHARD_TABLE)
            return None
        rows = d[()]
        n, nf = len(rows), len(fields)
        names = ("num_samples", "bytes", "file") + (("rows_per_chunk", "chunks") if nf else ())
        if rows.ndim != 1 or not set(names) <= set(rows.dtype.names or ()):
            raise ValueError(f"a {rows.dtype} array of shape {rows.shape}, not rows of {', '.join(names)}")
        spans = ((rows["rows_per_chunk"], rows["chunks"]) if nf else
                 (np.zeros((n, 0), np.int64), np.zeros((n, 0), np.int64)))
        if spans[0].shape != (n, nf) or spans[1].shape != (n, nf):
            raise ValueError(f"chunk columns of shape {spans[0].shape} for {nf} fields")
        return ShardTable(num_samples=rows["num_samples"].astype(np.int64), bytes=rows["bytes"].astype(np.int64),
                          files=rows["file"], fields=fields, rows_per_chunk=spans[0].astype(np.int64),
                          chunks=spans[1].astype(np.int64), source="table")
    except (KeyError, ValueError, TypeError, OSError) as e:
        log.warning("%s: cannot read %s (%s); reading the shard entries instead", path, fmt.SHARD_TABLE, e)
        return None


class KeyColumn:
    """Sample keys as one UTF-8 buffer and offsets (``__key_utf8__``, ``__key_offsets__``): :meth:`key`
    decodes one, :meth:`tolist` all of them."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def key(self, i: int) -> str:
        return self.data[int(self.offsets[i]):int(self.offsets[i + 1])].tobytes().decode("utf-8")

    def tolist(self) -> list[str]:
        raw = self.data.tobytes()
        o = self.offsets.tolist()
        if len(raw) == len(self.data) and raw.isascii():   # one decode, then str slices
            text = raw.decode("ascii")
            return [text[a:b] for a, b in zip(o[:-1], o[1:])]
        return [raw[a:b].decode("utf-8") for a, b in zip(o[:-1], o[1:])]


def write_key_column(f: Any, keys: Sequence[str]) -> None:
    """``__key_utf8__`` and ``__key_offsets__`` of ``keys`` into the open index ``f``."""
    enc = [k.encode("utf-8") for k in keys]
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in enc], dtype=np.int64)
    f.create_dataset(fmt.KEY_UTF8, data=np.frombuffer(b"".join(enc), dtype=np.uint8), track_times=False)
    f.create_dataset(fmt.KEY_OFFSETS, data=offsets, track_times=False)


def read_key_column(f: Any, n: int) -> KeyColumn | None:
    """The index's keys as a :class:`KeyColumn`, or None when it has no such column or one that is not ``n``
    samples' keys (the caller reads ``__key__``)."""
    d, o = f.get(fmt.KEY_UTF8), f.get(fmt.KEY_OFFSETS)
    if d is None or o is None:
        return None
    try:
        data, offsets = d[()], o[()].astype(np.int64)
        if (data.dtype != np.uint8 or data.ndim != 1 or offsets.shape != (n + 1,) or offsets[0] != 0
                or offsets[-1] != data.shape[0] or (np.diff(offsets) < 0).any()):
            raise ValueError(f"{data.shape} {data.dtype} bytes and {offsets.shape} offsets for {n} samples")
    except (ValueError, TypeError, OSError) as e:
        log.warning("%s: cannot read %s (%s); reading %s instead", f.filename, fmt.KEY_UTF8, e, fmt.KEY)
        return None
    return KeyColumn(data, offsets)


def column_problems(path: str, entries: Sequence[dict[str, Any]], keys: Sequence[str] | None) -> list[str]:
    """How the index's columnar copies disagree with what they copy: the shard ``entries`` (a current
    ``__shards__`` only: a stale one is never read) and ``keys`` (the ``__key__`` column); [] when they
    agree or are absent. For ``verify``: a damaged copy would give readers wrong counts or keys."""
    import h5py

    out: list[str] = []
    with h5py.File(path, "r") as f:
        text = f.attrs.get(fmt.A_SHARDS)
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        table = read_shard_table(f, text)
        col = read_key_column(f, len(keys)) if keys is not None else None
        if keys is not None and (fmt.KEY_UTF8 in f) and col is None:
            out.append(f"{fmt.KEY_UTF8}/{fmt.KEY_OFFSETS} do not hold {len(keys)} keys")
    if table is not None:
        want = ShardTable.from_entries(entries)
        for column in ("num_samples", "bytes", "files", "rows_per_chunk", "chunks"):
            a, b = getattr(table, column), getattr(want, column)
            if a.shape != b.shape or not np.array_equal(a, b):
                rows = np.flatnonzero((a != b).reshape(len(a), -1).any(axis=1)) if a.shape == b.shape else [0]
                out.append(f"{fmt.SHARD_TABLE} column {column!r} differs from the shard entries (first at entry "
                           f"{int(rows[0])})")
        if table.fields != want.fields:
            out.append(f"{fmt.SHARD_TABLE} lists chunk fields {list(table.fields)}, the entries {list(want.fields)}")
    if col is not None:
        got = col.tolist()
        bad = next((i for i, (a, b) in enumerate(zip(got, keys)) if a != b), None)
        if bad is not None:
            out.append(f"its two copies of the keys differ at sample {bad}: {got[bad]!r} in {fmt.KEY_UTF8}, "
                       f"{keys[bad]!r} in {fmt.KEY}")
    return out
