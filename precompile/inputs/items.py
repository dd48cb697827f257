"""The items, stored by column: what every input kind gives the plan, and what a plan of millions of inputs
holds in the parent.

A plan keeps one :class:`ItemTable` instead of one Python object per input: the sample keys and each
field's input path as UTF-8 blobs with int64 offsets (:class:`Strings`), labels, table rows, split
codes and listed fingerprints (size, mtime_ns) as numpy arrays, and a table's column fields by
column. Only what is rare or large per input anyway stays a list of objects (per-row decoder
options, a COCO image's annotations).

:class:`Item` objects are built on demand, per shard, when a shard task runs (:meth:`ItemTable.items`);
:class:`Items` is the read-only sequence view the plan and its shards expose as ``.items``.
:meth:`ItemTable.take` copies a subset of rows: a shard pickled for a worker carries only its own rows.

:class:`Inputs` is what an input kind gives the plan (:func:`precompile.inputs.read_inputs`): the table, the
label names, the factors of what ``split:`` reads, and the fields and index attributes the input adds.
This module sits below every input kind and the plan; it imports nothing of either.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np

from ..sample import FieldSpec

#: the rows of a table a view or shard covers: a range (contiguous) or an int64 index array
Rows = Union[range, np.ndarray]


@dataclass(frozen=True)
class Item:
    """One input as a shard task reads it (built from the plan's columns, per shard). ``captures``: the
    plan uses the match's captures while it plans; the items it builds leave them empty."""

    key: str                         # relative path of the match, '/'-separated
    paths: dict[str, str]            # field -> absolute input path
    label: Optional[int] = None
    captures: dict[str, str] = field(default_factory=dict)
    row: Optional[int] = None                                   # table inputs: the data row (1-based)
    row_file: Optional[str] = None                              # table inputs: the table file of that row
    values: dict[str, Any] = field(default_factory=dict)         # table inputs: column field -> value
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # field -> decoder options from the row
    split: Optional[str] = None                                  # with ``split:``: the split it belongs to
    annotations: Any = field(default=None, compare=False, repr=False)   # inputs.coco: a coco.CocoImage


class Strings:
    """``n`` UTF-8 strings as one byte blob and ``n + 1`` int64 offsets: string ``i`` is
    ``blob[offsets[i]:offsets[i + 1]]`` (the offsets need not start at 0: a view into a larger blob)."""

    __slots__ = ("blob", "offsets")

    def __init__(self, blob: np.ndarray, offsets: np.ndarray):
        self.blob, self.offsets = blob, offsets

    @classmethod
    def from_list(cls, strs: Sequence[str]) -> "Strings":
        b = StringsBuilder()
        b.add(list(strs))
        return b.build()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        i = range(len(self))[i]   # an IndexError out of range, negative counted from the end
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return str(memoryview(self.blob)[a:b], "utf-8")

    def __reduce__(self) -> tuple:
        """Pickled with only the bytes its offsets refer to (a view of a shard's rows stays small)."""
        a, b = int(self.offsets[0]), int(self.offsets[-1])
        return Strings, (self.blob[a:b], self.offsets - a)

    def lengths(self, rows: Optional[Rows] = None) -> np.ndarray:
        """Each string's length in bytes (of ``rows``, default all)."""
        if rows is None:
            return np.diff(self.offsets)
        return self.offsets[_plus_one(rows)] - self.offsets[row_index(rows)]

    def to_list(self, rows: Optional[Rows] = None) -> list[str]:
        """The strings of ``rows`` (default all) as Python strings."""
        rows = range(len(self)) if rows is None else rows
        starts = self.offsets[row_index(rows)].tolist()
        ends = self.offsets[_plus_one(rows)].tolist()
        mv = memoryview(self.blob)
        if isinstance(rows, range) and rows.step == 1 and len(rows):
            lo = starts[0]
            data = self.blob[lo:ends[-1]].tobytes()
            if data.isascii():   # one decode, then slices (the common case: ASCII paths)
                text = data.decode("ascii")
                return [text[a - lo:b - lo] for a, b in zip(starts, ends)]
        return [str(mv[a:b], "utf-8") for a, b in zip(starts, ends)]

    def take(self, rows: Rows) -> "Strings":
        """A compact copy holding only ``rows``, in that order."""
        if isinstance(rows, range) and rows.step == 1:
            return Strings(self.blob, self.offsets[rows.start:rows.stop + 1])
        rows = row_index(rows)
        starts, lens = self.offsets[rows], self.offsets[rows + 1] - self.offsets[rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        gather = np.repeat(starts - offsets[:-1], lens) + np.arange(offsets[-1], dtype=np.int64)
        return Strings(self.blob[gather], offsets)

    def argsort(self) -> np.ndarray:
        """The stable order of the strings by their UTF-8 bytes (= Python's ``str`` order: UTF-8 keeps
        code point order): pyarrow's sort when installed, else numpy's over fixed-width bytes."""
        try:
            import pyarrow as pa
            import pyarrow.compute as pc
        except ImportError:
            n, width = len(self), int(self.lengths().max(initial=0)) or 1
            fixed = np.zeros((n, width), np.uint8)
            lens = self.lengths()
            row = np.repeat(np.arange(n), lens)
            col = np.arange(int(lens.sum())) - np.repeat(self.offsets[:-1] - self.offsets[0], lens)
            fixed[row, col] = self.blob[self.offsets[0]:self.offsets[-1]]
            return np.argsort(fixed.view(f"S{width}").ravel(), kind="stable")
        arr = pa.Array.from_buffers(pa.large_binary(), len(self),
                                    [None, pa.py_buffer(self.offsets), pa.py_buffer(self.blob)])
        return pc.sort_indices(arr).to_numpy()


class StringsBuilder:
    """Appends lists of strings to one growing blob (a batch at a time: one encode per batch)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._lens: list[np.ndarray] = []

    def add(self, strs: list[str]) -> None:
        joined = "".join(strs)
        if joined.isascii():
            self._buf += joined.encode("ascii")
            self._lens.append(np.fromiter(map(len, strs), np.int64, len(strs)))
        else:
            enc = [s.encode("utf-8") for s in strs]
            self._buf += b"".join(enc)
            self._lens.append(np.fromiter(map(len, enc), np.int64, len(enc)))

    def build(self) -> Strings:
        lens = np.concatenate(self._lens) if self._lens else np.zeros(0, np.int64)
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return Strings(np.frombuffer(self._buf, np.uint8) if self._buf else np.zeros(0, np.uint8), offsets)


def row_index(rows: Rows) -> Any:
    """``rows`` as something numpy can index with (a slice for a contiguous range)."""
    if isinstance(rows, range):
        return slice(rows.start, rows.stop, rows.step) if rows.step > 0 else np.asarray(rows, np.int64)
    return np.asarray(rows, np.int64)


def _plus_one(rows: Rows) -> Any:
    if isinstance(rows, range) and rows.step > 0:
        return slice(rows.start + 1, rows.stop + 1, rows.step)
    return np.asarray(rows, np.int64) + 1


@dataclass
class ItemTable:
    """Every item of a plan, by column (see the module docstring).

    ``paths[f]`` holds field ``f``'s input path after ``prefix`` (the same :class:`Strings` object when
    fields share it, or share it with the keys). ``size``/``mtime`` (int64; size -1: the file could not be
    stat'ed) are the listing's fingerprint of the fields named in ``listed``; other fields are fingerprinted
    when the shard keys are computed. A table's rows: ``row`` is each item's data row (1-based) in its
    file, ``row_files[row_file]`` that file. ``values`` holds a table's column fields: int64 (a label id),
    float32 of one dimension (a target), float32 of two (a target vector), :class:`Strings` (a text).
    """

    keys: Strings
    prefix: str
    paths: dict[str, Strings]
    label: Optional[np.ndarray] = None
    size: Optional[np.ndarray] = None
    mtime: Optional[np.ndarray] = None
    listed: tuple[str, ...] = ()
    row: Optional[np.ndarray] = None
    row_file: Optional[np.ndarray] = None
    row_files: tuple[str, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)
    options: Optional[list] = None
    annotations: Optional[list] = None
    split: Optional[np.ndarray] = None
    split_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, rows: Rows) -> "ItemTable":
        """A copy holding only ``rows`` (in that order); columns shared between fields stay shared."""
        if isinstance(rows, range) and rows == range(len(self)):
            return self
        idx = row_index(rows)
        done: dict[int, Strings] = {}

        def strings(s: Strings) -> Strings:
            if id(s) not in done:
                done[id(s)] = s.take(rows)
            return done[id(s)]
        out: dict[str, Any] = {"keys": strings(self.keys), "paths": {f: strings(s) for f, s in self.paths.items()},
                               "values": {f: strings(v) if isinstance(v, Strings) else v[idx]
                                          for f, v in self.values.items()}}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                out[f.name] = v[idx]
            elif isinstance(v, list):
                out[f.name] = self.objects(f.name, rows, None)
        return replace(self, **out)

    def items(self, rows: Rows) -> list:
        """The :class:`Item` of each row in ``rows``, built now."""
        n = len(rows)
        idx = row_index(rows)
        keys = self.keys.to_list(rows)
        texts = {id(self.keys): keys}
        for s in self.paths.values():
            if id(s) not in texts:
                texts[id(s)] = s.to_list(rows)
        pre = self.prefix
        cols = [(f, texts[id(s)]) for f, s in self.paths.items()]
        labels = self.label[idx].tolist() if self.label is not None else [None] * n
        data_rows = self.row[idx].tolist() if self.row is not None else [None] * n
        row_files = ([self.row_files[c] for c in self.row_file[idx].tolist()] if self.row_file is not None
                     else [None] * n)
        splits = ([self.split_names[c] for c in self.split[idx].tolist()] if self.split is not None
                  else [None] * n)
        values = self.column_values(rows)
        options, anns = self.objects("options", rows, {}), self.objects("annotations", rows, None)
        return [Item(key=keys[j], paths={f: pre + col[j] for f, col in cols}, label=labels[j], row=data_rows[j],
                     row_file=row_files[j], values=values[j], options=options[j], split=splits[j],
                     annotations=anns[j]) for j in range(n)]

    def objects(self, name: str, rows: Rows, default: Any) -> list:
        """The per-row objects of the list column ``name`` (``options``, ``annotations``) for ``rows``, or
        ``default`` for each row when the table has no such column."""
        col = getattr(self, name)
        if col is None:
            return [default] * len(rows)
        return [col[i] for i in (rows if isinstance(rows, range) else np.asarray(rows).tolist())]

    def column_values(self, rows: Rows) -> list[dict[str, Any]]:
        """Each row's column fields (``Item.values``): label ids as int, targets as float (a vector as a
        list of floats), texts as str."""
        if not self.values:
            return [{} for _ in range(len(rows))]
        idx = row_index(rows)
        cols = [(f, v.to_list(rows) if isinstance(v, Strings) else v[idx].tolist()) for f, v in self.values.items()]
        return [{f: col[j] for f, col in cols} for j in range(len(rows))]

    def key_bytes(self, rows: Rows) -> int:
        """The bytes the keys of ``rows`` take in an HDF5 shard (each padded to 8)."""
        return int(((self.keys.lengths(rows) + 7) // 8 * 8).sum())


class Items(Sequence):
    """A read-only sequence of :class:`Item` over rows of an :class:`ItemTable`:
    ``len`` costs nothing; each item (or slice) is built when read."""

    __slots__ = ("table", "rows")
    CHUNK = 4096

    def __init__(self, table: ItemTable, rows: Optional[Rows] = None):
        self.table = table
        self.rows = range(len(table)) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.table.items(self.rows[i])
        n = len(self.rows)
        if not -n <= i < n:
            raise IndexError(f"item {i} of {n}")
        j = int(self.rows[i])
        return self.table.items(range(j, j + 1))[0]

    def __iter__(self) -> Iterator[Any]:
        for a in range(0, len(self.rows), self.CHUNK):
            yield from self.table.items(self.rows[a:a + self.CHUNK])

    def __repr__(self) -> str:
        return f"<{len(self)} items>"


#: column or capture name -> (int64 code per item, the distinct values the codes index)
Factors = dict[str, tuple[np.ndarray, list]]


def factorize(values: list) -> tuple[np.ndarray, list]:
    """(code per value, the distinct values in first-seen order)."""
    seen: dict[Any, int] = {}
    codes = np.fromiter((seen.setdefault(v, len(seen)) for v in values), np.int64, len(values))
    return codes, list(seen)


@dataclass
class Inputs:
    """What an input kind gives the plan (:func:`precompile.inputs.read_inputs`): the items' table in key order,
    the label names in id order, the factors of the columns or captures ``split:`` reads; and what only some
    kinds add: the specs of fields made beside the decoders' (``inputs.coco``'s annotations, which the steps
    then see), index attributes (its categories) and a parse owed to the output's cache (``pending``:
    :class:`precompile.inputs.coco.cache.Pending`)."""

    table: ItemTable
    label_names: list[str]
    factors: Factors
    specs: dict[str, FieldSpec] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    pending: Any = None

    @property
    def items(self) -> Items:
        return Items(self.table)
