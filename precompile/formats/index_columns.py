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

**The index's own checksums.** ``index_crc32``, a JSON attribute ``{"attrs": {name: crc32}, "datasets":
{name: crc32}}``, records the crc32 of what readers take from the index without another check: every
attribute but ``shards`` (label names, field shapes and dtypes, the recipe, ...: :func:`attr_crc` of its
value as stored) and the datasets ``__key_utf8__``, ``__key_offsets__``, ``__copy__``, ``__shards__``,
``__chunks__``, ``__key__``, ``__meta__`` and each ragged field's ``offsets`` and ``shapes``
(:func:`array_crc`: their little-endian bytes; the string columns :func:`strings_crc`). The writer computes
them from the arrays it writes (:func:`seal`); a reader checks each one before it serves anything read
from it (:func:`check_attrs`, :func:`check_dataset`): the attributes and ``__shards__`` at open, the
per-sample columns on first use (a key, the keys, a copy index: opening a build of a million samples
reads 14 MB of columns, whose crc32 would add most of a millisecond per 100,000 samples to an open of a
few ms; benchmarks/bench_index_checksum.py), ``__chunks__`` when the Loader reads it, a rebuild the rows
it keeps. A mismatch is a :class:`~precompile.errors.FormatError` naming the index, what is damaged and
what to do (:func:`damaged`); ``verify`` reports it as damage to the index (:func:`checksum_problems`),
and ``build --repair`` writes the index again from the shards.

``shards`` is not covered: it has its own rule (``__shards__`` is used only while its ``entries_crc32``
matches the text, so a tool that rewrites the entries makes readers parse them), and what a reader takes
from it is checked downstream (the sample count against ``__copy__``, each file's size, a URL's shards
by their sha256). An index without ``index_crc32`` (written before it) is read as before; a tool that
rewrites a covered item must remove ``index_crc32`` (the index then reads as one written before it).
"""
from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from . import names as fmt
from ..errors import FormatError

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


def write_shard_table(f: Any, entries: Sequence[dict[str, Any]], text: str) -> int:
    """``__shards__`` into the open index ``f``: the columns of ``entries``, whose JSON is ``text`` (the
    ``shards`` attribute, byte for byte); returns the rows' :func:`array_crc`."""
    t = ShardTable.from_entries(entries)
    names = t.files.tolist()
    rows = np.zeros(len(t), dtype=_row_dtype(len(t.fields), max((len(n) for n in names), default=1)))
    rows["num_samples"], rows["bytes"], rows["file"] = t.num_samples, t.bytes, names
    if t.fields:
        rows["rows_per_chunk"], rows["chunks"] = t.rows_per_chunk, t.chunks
    d = f.create_dataset(fmt.SHARD_TABLE, data=rows, track_times=False)
    d.attrs[fmt.T_FIELDS] = fmt.dumps(list(t.fields))
    d.attrs[fmt.T_ENTRIES_CRC] = np.int64(entries_crc(text))
    return array_crc(rows)


def read_shard_table(f: Any, text: str | bytes | None, crcs: Optional[dict[str, Any]] = None,
                     where: Optional[str] = None) -> ShardTable | None:
    """The index's ``__shards__`` table, or None when it has none, or one that was not made from ``text``
    (the ``shards`` attribute as read: the table is then stale) or that cannot be read as one: the caller
    parses the entries instead (:meth:`ShardTable.from_entries`). A table made from ``text`` whose rows do
    not match the index's recorded ``crcs`` (:func:`recorded_crcs`) is a FormatError naming ``where``."""
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
        check_dataset(where or path, crcs, fmt.SHARD_TABLE, rows)
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


def write_key_column(f: Any, keys: Sequence[str]) -> dict[str, int]:
    """``__key_utf8__`` and ``__key_offsets__`` of ``keys`` into the open index ``f``; returns their crc32s,
    and that of the ``__key__`` column of the same keys (:func:`strings_crc`: the same bytes)."""
    enc = [k.encode("utf-8") for k in keys]
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in enc], dtype=np.int64)
    data = np.frombuffer(b"".join(enc), dtype=np.uint8)
    f.create_dataset(fmt.KEY_UTF8, data=data, track_times=False)
    f.create_dataset(fmt.KEY_OFFSETS, data=offsets, track_times=False)
    at = array_crc(offsets)
    return {fmt.KEY_UTF8: array_crc(data), fmt.KEY_OFFSETS: at, fmt.KEY: zlib.crc32(data, at)}


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
    return out + checksum_problems(path)


# -- the index's own checksums (see the module docstring) ------------------------------------------------

#: the datasets whose crc32 an index records (besides each ragged field's offsets and shapes)
SEALED_DATASETS = (fmt.KEY, fmt.COPY, fmt.META, fmt.KEY_UTF8, fmt.KEY_OFFSETS, fmt.SHARD_TABLE, fmt.CHUNKS)
#: the attributes it does not record: the entries (their own rule) and the record itself
UNSEALED_ATTRS = (fmt.A_SHARDS, fmt.A_INDEX_CRC)
#: string columns (variable-length UTF-8): :func:`strings_crc`
STRING_COLUMNS = (fmt.KEY, fmt.META)
_WORDS = {fmt.KEY_UTF8: "sample keys", fmt.KEY_OFFSETS: "key offsets", fmt.COPY: "copy column",
          fmt.KEY: "key column", fmt.META: "meta column", fmt.SHARD_TABLE: "shard table",
          fmt.CHUNKS: "chunk tables"}


def array_crc(a: np.ndarray) -> int:
    """crc32 of an array's bytes in C order, little-endian (what a little-endian reader gets from the file)."""
    a = np.ascontiguousarray(a)
    le = a.dtype.newbyteorder("<")
    if le != a.dtype:
        a = a.astype(le)
    return zlib.crc32(a.reshape(-1).view(np.uint8))


def strings_crc(encoded: Sequence[bytes]) -> int:
    """crc32 of a string column (its values' UTF-8 ``encoded``): of their N+1 int64 offsets, then of their
    bytes concatenated (so ``__key__``'s equals that of ``__key_utf8__`` continued from ``__key_offsets__``)."""
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([len(b) for b in encoded], dtype=np.int64)
    return zlib.crc32(b"".join(encoded), array_crc(offsets))


def attr_crc(v: Any) -> int:
    """crc32 of an attribute's value: text as its UTF-8, anything else as its canonical JSON (``names.dumps``),
    written (Python values) or read back (h5py's numpy scalars) alike."""
    if isinstance(v, bytes):
        b = v
    elif isinstance(v, str):
        b = v.encode("utf-8")
    else:
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        b = fmt.dumps(v).encode("utf-8")
    return zlib.crc32(b)


def seal(f: Any, attrs: Mapping[str, Any], datasets: Mapping[str, int]) -> None:
    """Record ``index_crc32`` in the open index ``f``: the crc32 of every attribute in ``attrs`` (as written)
    but those of :data:`UNSEALED_ATTRS`, and the crc32s ``datasets`` the writer computed."""
    rec = {"attrs": {k: attr_crc(v) for k, v in sorted(attrs.items()) if k not in UNSEALED_ATTRS},
           "datasets": dict(sorted(datasets.items()))}
    f.attrs[fmt.A_INDEX_CRC] = fmt.dumps(rec)


def _advice(where: str) -> str:
    return (f"write the index again with: precompile build <recipe> --repair (with the same -o: it checks every "
            f"shard and rewrites the index from them); see what is damaged with: precompile verify {where}")


def words(kind: str, name: str) -> str:
    """What a recorded item is called in messages."""
    if kind == "attrs":
        return f"attribute {name!r}"
    if name in _WORDS:
        return f"{_WORDS[name]} ({name})"
    field, _, part = name.rpartition("/")
    return f"{part} of field {field!r} ({name})"


def damaged(where: str, what: str) -> str:
    """The message for the recorded item ``what`` (:func:`words`) of the index at ``where`` whose crc32 differs."""
    return (f"{where}: the index is damaged: the crc32 of its {what} is not the one the build recorded "
            f"({fmt.A_INDEX_CRC}); {_advice(where)}")


def recorded_crcs(f: Any, where: str) -> Optional[dict[str, dict[str, int]]]:
    """The ``index_crc32`` (``{"attrs": {...}, "datasets": {...}}``) of the open index ``f`` (or of its
    attributes, already read: a mapping), or None for an index written before it; FormatError (naming
    ``where``) when it cannot be read."""
    raw = (f.attrs if hasattr(f, "attrs") else f).get(fmt.A_INDEX_CRC)
    if raw is None:
        return None
    try:
        rec = fmt.loads(raw if isinstance(raw, (str, bytes)) else str(raw))
        if not isinstance(rec, dict) or not all(
                isinstance(rec.get(k), dict) and all(isinstance(v, int) for v in rec[k].values())
                for k in ("attrs", "datasets")):
            raise ValueError("not {'attrs': {name: crc32}, 'datasets': {name: crc32}}")
    except (ValueError, TypeError, RecursionError):
        raise FormatError(f"{where}: the index is damaged: its checksums ({fmt.A_INDEX_CRC}) cannot be read; "
                          f"{_advice(where)}") from None
    return {"attrs": rec["attrs"], "datasets": rec["datasets"]}


def check_attrs(where: str, crcs: Optional[dict[str, Any]], attrs: Mapping[str, Any]) -> None:
    """FormatError (:func:`damaged`) unless every recorded attribute is in ``attrs`` with its crc32."""
    if crcs is None:
        return
    for name, crc in crcs["attrs"].items():
        if name not in attrs:
            raise FormatError(f"{where}: the index is damaged: its attribute {name!r} is missing; {_advice(where)}")
        if attr_crc(attrs[name]) != crc:
            raise FormatError(damaged(where, words("attrs", name)))


def check_dataset(where: str, crcs: Optional[dict[str, Any]], name: str, a: Any) -> None:
    """FormatError (:func:`damaged`) when dataset ``name``'s values ``a`` (an array; a string column: its
    values' UTF-8) do not have the crc32 recorded for it (nothing to check: no record, or none for it)."""
    if crcs is None or name not in crcs["datasets"]:
        return
    got = strings_crc(a) if name in STRING_COLUMNS else array_crc(a)
    if got != crcs["datasets"][name]:
        raise FormatError(damaged(where, words("datasets", name)))


def _sealed_datasets(f: Any) -> list[str]:
    import h5py

    names = [n for n in SEALED_DATASETS if n in f]
    for n, g in f.items():
        if isinstance(g, h5py.Group) and g.attrs.get(fmt.A_LAYOUT) == fmt.LAYOUT_RAGGED:
            names += [f"{n}/{fmt.RAGGED_OFFSETS}", f"{n}/{fmt.RAGGED_SHAPES}"]
    return names


def dataset_values(f: Any, name: str) -> Any:
    """Dataset ``name`` of the open index ``f`` as :func:`check_dataset` takes it."""
    d = f[name]
    if name in STRING_COLUMNS:
        return [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in d[:]]
    return d[()]


def index_crcs(f: Any, names: Optional[dict[str, Any]] = None) -> dict[str, dict[str, int]]:
    """The crc32s of the open index ``f``'s items computed from the file: those ``names`` records (absent
    ones left out), or every item an index records (:func:`seal`)."""
    attrs = {k: attr_crc(v) for k, v in f.attrs.items()
             if k not in UNSEALED_ATTRS and (names is None or k in names["attrs"])}
    datasets = {}
    for name in (names["datasets"] if names is not None else _sealed_datasets(f)):
        if name in f:
            v = dataset_values(f, name)
            datasets[name] = strings_crc(v) if name in STRING_COLUMNS else array_crc(v)
    return {"attrs": attrs, "datasets": datasets}


def checksum_problems(path: str) -> list[str]:
    """How the index at ``path`` differs from its own ``index_crc32`` (for ``verify``); [] when it agrees or
    records none."""
    import h5py

    with h5py.File(path, "r") as f:
        try:
            rec = recorded_crcs(f, path)
        except FormatError:
            return [f"its checksums ({fmt.A_INDEX_CRC}) cannot be read"]
        if rec is None:
            return []
        got = index_crcs(f, rec)
    return [f"the crc32 of its {words(kind, name)} is not the one the build recorded"
            + ("" if name in got[kind] else " (it is missing)")
            for kind in ("attrs", "datasets") for name, crc in rec[kind].items() if got[kind].get(name) != crc]
