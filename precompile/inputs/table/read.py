"""One table file's bytes as a pyarrow Table that holds what Python's csv and json modules read, row for
row and cell for cell, or an error naming the file and the row.

pyarrow parses (fast, in parallel blocks); the checks here make its reading the standard library's, and
cost a few scans of the bytes with numpy. Where a check finds something odd the file is read again with
the standard library (the truth), which names the first row at fault, or agrees and the table stands.

CSV and TSV (:func:`read_delimited`), with or without quoting (``inputs.quoting``):

- ``csv`` quoting is RFC 4180's, as ``csv.reader(f, delimiter=..., strict=True)``: a quoted cell may hold
  separators, doubled quotes and line breaks. pyarrow is told that cells may hold line breaks whenever the
  file has a quote, so it cuts its blocks between rows only. A quote left open to the end of the file
  (which would swallow every later row into one cell) or closed before anything but a separator or a line
  end is an error naming the row where it opens.
- ``none``: a quote is a character like any other, as ``csv.reader(f, delimiter=..., quoting=csv.QUOTE_NONE)``
  (TSV has no quoting: text/tab-separated-values).
- a UTF-8 byte order mark is skipped; blank lines are no rows (as ``csv.DictReader``); a row whose cell count
  is not the header's, and a cell the recipe reads that is not UTF-8, are errors naming the row;
- a cell of any length is read: the block size grows until the longest row fits in one block.

JSON Lines (:func:`read_jsonl`): one JSON object per non-blank line, as ``json.loads`` of each line.

- a string stays a string: pyarrow's reader turns strings that look like dates into timestamps (losing
  their text and offsets); such a file is read again with those columns as text;
- a line holding two values, a value spread over lines, a column whose JSON type changes (a number in one
  row, a string in another; null goes anywhere), a key given twice in an object, nesting deeper than
  :data:`MAX_JSON_DEPTH` (pyarrow's parser recurses without a limit, and crashes), a number too large for
  a 64-bit float, a line that is not UTF-8: an error naming the row (and the column).

Row numbers are *data rows*: 1 for the first row after the header (CSV, TSV) or the first non-blank line
(JSON Lines); blank lines are not counted. Messages add the line a row starts on where it can differ.
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ...errors import RecipeError, clip, echo

#: deeper JSON nesting is refused before pyarrow reads the file (its parser recurses: about 30,000 levels
#: crash the process)
MAX_JSON_DEPTH = 100
#: the UTF-8 byte order mark (skipped at the start of a file, as ``encoding="utf-8-sig"`` does)
BOM = b"\xef\xbb\xbf"
#: pyarrow's first block size; it grows (x4) while a row is longer than a block
BLOCK = 1 << 20
#: pyarrow's largest block (its block size is a 32-bit int)
MAX_BLOCK = (1 << 31) - 1
LOC = "inputs.table"


class TableError(RecipeError):
    """A problem in one row of a table: names the file, the data row (1-based) and the column."""

    def __init__(self, table: str, row: int, column: Optional[str], what: str, source: Optional[str], loc: str):
        col = f", column {echo(column)}" if column is not None else ""
        super().__init__(f"{table}: data row {row} (1-based, header not counted){col}: {what}", source=source, loc=loc)


def _threads(pa: Any) -> bool:
    """Whether pyarrow may read a CSV or JSON file with its thread pool. Not before pyarrow 24: a threaded
    read that fails early (a parse error, a row longer than the block) can deadlock in the reader's
    destructor, in the read or at the process's exit (apache/arrow GH-48741, fixed in January 2026;
    GH-38676 before 15.0); the serial reader cannot."""
    return int(pa.__version__.split(".")[0]) >= 24


def _grow_blocks(pa: Any, read: Callable[[int], Any], size: int) -> Any:
    """``read(block_size)``, again with a larger block while pyarrow finds a row longer than its block."""
    block = BLOCK
    while True:
        try:
            return read(block)
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e) or block >= min(size + 1, MAX_BLOCK):
                raise
            block = min(block * 4, size + 1, MAX_BLOCK)


# -- CSV and TSV ------------------------------------------------------------------------------------------

def read_delimited(pa: Any, data: bytes, path: str, delimiter: str, quoting: bool, select: Callable,
                   source: Optional[str]) -> Any:
    """A CSV or TSV file's bytes as a table of text columns, the columns ``select(header names)`` names."""
    buf = pa.py_buffer(data)   # pyarrow skips one byte order mark, as utf-8-sig does; the checks read the rest
    data = data[len(BOM):] if data.startswith(BOM) else data
    quoted = quoting and b'"' in data
    parse = pa.csv.ParseOptions(delimiter=delimiter, quote_char='"' if quoting else False,
                                newlines_in_values=quoted)

    threads = _threads(pa)

    def header(block: int) -> list[str]:
        with pa.csv.open_csv(pa.BufferReader(buf), read_options=pa.csv.ReadOptions(
                block_size=block, use_threads=threads), parse_options=parse) as r:
            return list(r.schema.names)

    def rows(block: int) -> Any:
        return pa.csv.read_csv(pa.BufferReader(buf), read_options=pa.csv.ReadOptions(
            block_size=block, use_threads=threads), parse_options=parse, convert_options=conv)

    names = None
    try:
        names = select(_grow_blocks(pa, header, len(data)))
        conv = pa.csv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False,
                                     quoted_strings_can_be_null=False, include_columns=names)
        table = _grow_blocks(pa, rows, len(data))
    except pa.ArrowInvalid as e:
        _csv_truth(data, path, delimiter, quoting, names, None, source)   # raises the error naming the row
        raise RecipeError(f"{path}: pyarrow cannot read it ({clip(str(e))}), though Python's csv module can",
                          source=source, loc=LOC) from None
    if quoted and not _strict_quotes(np.frombuffer(data, np.uint8), ord(delimiter)):
        _csv_truth(data, path, delimiter, quoting, names, table, source)   # raises, or the rows are csv's
    return table


def _strict_quotes(a: np.ndarray, delimiter: int) -> bool:
    """Whether every quote in ``a`` (a file's bytes) is where RFC 4180 puts one, so that pyarrow and
    ``csv.reader(strict=True)`` surely read the same cells. Then quotes alternate: the 1st, 3rd, ... open a
    cell (at the file's start, after a separator or a line end, or right after a closing quote: ``""`` is a
    quote inside the cell) and the 2nd, 4th, ... close it (before a separator, a line end, the file's end or
    an opening quote), and their count is even (no cell open at the end). False does not mean wrong: a quote
    inside an unquoted cell (``5" tall``) is text to both readers, but the file is then checked by the csv
    module."""
    q = np.flatnonzero(a == 34)
    if not len(q):
        return True
    if len(q) % 2:
        return False
    ok = np.zeros(256, bool)
    ok[[delimiter, 10, 13, 34]] = True
    opens, closes = q[0::2], q[1::2]
    first = opens[0] == 0 or ok[a[opens[0] - 1]]
    last = closes[-1] == len(a) - 1 or ok[a[closes[-1] + 1]]
    return bool(first and last and ok[a[opens[1:] - 1]].all() and ok[a[closes[:-1] + 1]].all())


def _lines(text: str) -> Iterator[str]:
    r"""The lines of ``text`` with their ends (``\n``, ``\r\n`` or ``\r``), one at a time."""
    for m in _LINE.finditer(text):
        yield m.group()


_LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)|[^\r\n]+\Z")


def _csv_truth(data: bytes, path: str, delimiter: str, quoting: bool, names: Optional[list[str]], table: Any,
               source: Optional[str]) -> None:
    """Read the file with ``csv.reader(strict=True)``: raise a :class:`TableError` for its first problem (a
    quote never closed, a quote closed inside a cell, a row whose cell count is not the header's, a cell of
    the columns ``names`` that is not UTF-8 or that pyarrow read otherwise into ``table``); return when there
    is none."""
    text = data.decode("latin-1")   # byte for byte: the csv module sees the same separators and quotes
    fmt = {"delimiter": delimiter, "quoting": csv.QUOTE_MINIMAL if quoting else csv.QUOTE_NONE, "strict": True}
    want = names or []
    got = {c: table.column(c).to_pylist() for c in want} if table is not None else {}
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, min(len(text) + 1, 2 ** 31 - 1)))
    try:
        reader = csv.reader(_lines(text), **fmt)
        header: Optional[list[str]] = None
        n, where = 0, {}
        while True:
            line = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                if "unexpected end of data" in str(e):
                    what = (f"a quote opens a cell in the row that starts on line {line} and is never closed: the "
                            f"cell would run to the end of the file and swallow every row after it (which rows "
                            f"are lost in it cannot be known, so the file is refused); close the quote, or set "
                            f"inputs.quoting: none if the file's quotes are plain text")
                else:
                    what = (f"not valid CSV in the row that starts on line {line}: {clip(str(e))} (a quoted cell "
                            f"ends at a separator or a line end; a quote inside it is written twice: \"\"), or "
                            f"set inputs.quoting: none if the file's quotes are plain text")
                raise TableError(path, n + 1, None, what, source, LOC) from None
            if not row:
                continue   # a blank line: no row
            if header is None:
                header = [h.encode("latin-1").decode("utf-8", "replace") for h in row]
                where = {c: header.index(c) for c in want if c in header}
                continue
            n += 1
            if len(row) != len(header):
                hint = ("; set inputs.quoting: csv if the file quotes its cells" if not quoting and '"' in text
                        else "")
                raise TableError(path, n, None, f"{len(row)} cells, the header has {len(header)} (the row starts "
                                 f"on line {line}){hint}", source, LOC)
            for c, i in where.items():
                try:
                    cell = row[i].encode("latin-1").decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TableError(path, n, c, f"not UTF-8 text (byte {e.start} of the cell; the row starts on "
                                     f"line {line})", source, LOC) from None
                if table is not None and (n > len(got[c]) or got[c][n - 1] != cell):
                    raise TableError(path, n, c, f"pyarrow read {echo(got[c][n - 1] if n <= len(got[c]) else None)}"
                                     f" where Python's csv module reads {echo(cell)}: please report this file",
                                     source, LOC)
        if header is None:
            raise RecipeError(f"{path}: no header row (the file is empty or blank)", source=source, loc=LOC)
        if table is not None and n != table.num_rows:
            raise TableError(path, min(n, table.num_rows) + 1, None, f"pyarrow read {table.num_rows} rows where "
                             f"Python's csv module reads {n}: please report this file", source, LOC)
    finally:
        csv.field_size_limit(limit)


# -- JSON Lines -------------------------------------------------------------------------------------------

#: the bytes that shape JSON (quotes, brackets, line ends); translate() drops every other
_SHAPE = b'"[]{}\n'
_NOT_SHAPE = bytes(sorted(set(range(256)) - set(_SHAPE)))
_DEPTH = np.zeros(256, np.int8)
_DEPTH[[ord("["), ord("{")]] = 1
_DEPTH[[ord("]"), ord("}")]] = -1


def _json_shape(data: bytes) -> tuple[int, bool]:
    """(how many lines hold a top-level object or array, whether the shape is sound): no string runs over
    a line end, no value over a line end, at most one value per line, nesting at most MAX_JSON_DEPTH.
    A cheap scan of the bytes (escaped quotes aside, only quotes, brackets and line ends count); what it
    doubts, :func:`_json_truth` reads line by line."""
    if b"\\" in data:   # an escaped quote is no quote: blank it (a run of backslashes escapes when odd)
        a = np.frombuffer(data, np.uint8)
        bs = np.flatnonzero(a == 92)
        cut = np.flatnonzero(np.diff(bs) != 1)
        first, last = bs[np.r_[0, cut + 1]], bs[np.r_[cut, len(bs) - 1]]
        odd = ((last - first) & 1) == 0
        nxt = last + 1
        ok = nxt < len(a)
        hit = nxt[ok & odd]
        hit = hit[a[hit] == 34] if len(hit) else hit
        if len(hit):
            b = bytearray(data)
            np.frombuffer(b, np.uint8)[hit] = 32
            data = bytes(b)
    s = np.frombuffer(data.translate(None, _NOT_SHAPE), np.uint8)
    quote = s == 34
    inside = np.bitwise_xor.accumulate(quote.view(np.uint8)).view(bool)   # after each quote: in a string
    if len(s) and inside[-1]:
        return 0, False
    if ((s == 10) & inside).any():
        return 0, False
    t = s[~(inside | quote)]
    step = _DEPTH[t]
    depth = np.cumsum(step, dtype=np.int32)
    if len(depth) and (depth.max() > MAX_JSON_DEPTH or depth.min() < 0 or depth[-1] != 0):
        return 0, False
    line = t == 10
    if (depth[line] != 0).any():
        return 0, False
    top = np.flatnonzero((step == 1) & (depth == 1))
    lines = np.cumsum(line)[top]
    if len(lines) > 1 and (np.diff(lines) == 0).any():
        return 0, False
    return len(top), True


def read_jsonl(pa: Any, data: bytes, path: str, select: Callable, source: Optional[str],
               texts: Optional[set[str]] = None, exact: Optional[set[str]] = None) -> Any:
    """A JSON Lines file's bytes as a table of the columns ``select(column names)`` names, each in its
    JSON type (strings as text, never timestamps). A column of ``texts`` (read as text) that pyarrow
    made float though some of its numbers may be integers (``1`` beside ``1.5``, or an integer beyond
    int64) holds ``str`` of each value as ``json.loads`` gives it (``"1"``, ``"1.5"``; NaN, blank as
    everywhere, and null are null). A column of ``exact`` (compared with numbers by ``inputs.where``) that
    pyarrow made float is refused, a :class:`TableError` naming the first row, when it holds an integer
    no 64-bit float holds (``2**53 + 1``): its float would compare as another number."""
    buf = pa.py_buffer(data)   # pyarrow skips one byte order mark, as utf-8-sig does; the checks read the rest
    data = data[len(BOM):] if data.startswith(BOM) else data
    objects, sound = _json_shape(data)
    if not sound:
        _json_truth(data, path, source)   # raises the error naming the line
        raise RecipeError(f"{path}: a JSON value spans lines, two share one, or nesting is deeper than "
                          f"{MAX_JSON_DEPTH} levels", source=source, loc=LOC)

    threads = _threads(pa)

    def read(schema: Any) -> Callable[[int], Any]:
        parse = pa.json.ParseOptions(explicit_schema=schema) if schema is not None else None
        return lambda block: pa.json.read_json(pa.BufferReader(buf), read_options=pa.json.ReadOptions(
            block_size=block, use_threads=threads), parse_options=parse)

    try:
        table = _grow_blocks(pa, read(None), len(data))
        if table.num_rows != objects:
            raise pa.ArrowInvalid(f"{table.num_rows} rows where the file has {objects} objects")
        schema = pa.schema([f.with_type(_no_dates(pa, f.type)) for f in table.schema])
        if not schema.equals(table.schema):   # strings that looked like dates: read as the strings they are
            table = _grow_blocks(pa, read(schema), len(data))
        table = table.select(select(list(table.column_names)))
        for col in table.columns:
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                col.validate(full=True)   # pyarrow's JSON reader does not check that strings are UTF-8
    except pa.ArrowInvalid as e:
        _json_truth(data, path, source)
        raise RecipeError(f"{path}: pyarrow cannot read it ({clip(str(e))}), though Python's json module can",
                          source=source, loc=LOC) from None
    import pyarrow.compute as pc

    redo = [c for c in table.column_names if c in (texts or ()) and pa.types.is_floating(table.column(c).type)
            and pc.any(pc.equal(pc.floor(table.column(c)), table.column(c))).as_py()]
    inexact = [c for c in table.column_names if c in (exact or ()) and pa.types.is_floating(table.column(c).type)
               and pc.any(pc.greater_equal(pc.abs(table.column(c)), float(2 ** 53))).as_py()]
    for c, values in _json_values(data, inexact).items():
        for row, v in enumerate(values, 1):
            if isinstance(v, int) and not isinstance(v, bool) and float(v) != v:
                raise TableError(path, row, c, f"the integer {v} is no 64-bit float, and pyarrow reads the column "
                                 f"as 64-bit floats (it holds a decimal or an integer beyond int64), which "
                                 f"would compare {v} as {float(v):.17g}: inputs.where compares numbers exactly "
                                 f"and cannot compare this column (write its numbers as strings to compare "
                                 f"them as text)", source, "inputs.where")
    for c, values in _json_values(data, redo).items():
        cells = [None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v) for v in values]
        table = table.set_column(table.column_names.index(c), c, pa.array(cells, pa.string()))
    return table


def _lines_of(data: bytes) -> Iterator[tuple[int, bytes]]:
    """Each non-blank line of ``data`` with its number (from 1)."""
    number = pos = 0
    while pos <= len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        raw, pos, number = data[pos:end], end + 1, number + 1
        if raw.strip(b" \t\r"):
            yield number, raw


def _json_values(data: bytes, names: list[str]) -> dict[str, list[Any]]:
    """The values of the columns ``names`` in each row, as ``json.loads`` gives them."""
    out: dict[str, list[Any]] = {c: [] for c in names}
    if names:
        for _, raw in _lines_of(data):
            row = json.loads(raw)
            for c in names:
                out[c].append(row.get(c))
    return out


def _no_dates(pa: Any, t: Any) -> Any:
    """``t`` with every timestamp, date or time (inferred from a string) as a string, at any depth."""
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_no_dates(pa, t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = t.value_field.with_type(_no_dates(pa, t.value_type))
        return pa.list_(item) if pa.types.is_list(t) else pa.large_list(item)
    return t


class _Twice(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Twice(k)
            seen.add(k)
    return out


def _float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise OverflowError(text)
    return v


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "list" if isinstance(v, list) else "object"


def _depth(v: Any) -> int:
    """How deep lists and objects nest in ``v`` (a scalar: 0), without recursion."""
    best, todo = 0, [(v, 0)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (dict, list)):
            best = max(best, d + 1)
            todo.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return best


def _types(v: Any, at: str, seen: dict[str, tuple[str, int]], row: int) -> Optional[tuple[str, str, str, int]]:
    """The first value under ``at`` whose JSON type differs from the one first seen there (at, kind here,
    kind there, its row); records the kinds of this row's values."""
    if v is None:
        return None
    k = _kind(v)
    first = seen.setdefault(at, (k, row))
    if first[0] != k:
        return at, k, first[0], first[1]
    items = v.items() if isinstance(v, dict) else (("[]", x) for x in v) if isinstance(v, list) else ()
    for name, x in items:
        hit = _types(x, f"{at}/{name}", seen, row)
        if hit is not None:
            return hit
    return None


def _json_truth(data: bytes, path: str, source: Optional[str]) -> None:
    """Read the file a line at a time with ``json.loads``: raise a :class:`TableError` for the first line that
    is not one JSON object pyarrow reads as Python does; return when there is none."""
    seen: dict[str, tuple[str, int]] = {}
    n = 0
    for number, raw in _lines_of(data):
        n += 1
        line = f" (line {number})" if number != n else ""

        def fail(what: str, column: Optional[str] = None) -> TableError:
            return TableError(path, n, column, what + line, source, LOC)

        try:
            v = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs, parse_float=_float)
        except UnicodeDecodeError as e:
            raise fail(f"not UTF-8 text (byte {e.start} of the line)") from None
        except RecursionError:
            raise fail(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
        except _Twice as e:
            raise fail(f"key {echo(str(e))} is given twice in one object") from None
        except OverflowError as e:
            raise fail(f"the number {clip(str(e))} is too large for a 64-bit float") from None
        except ValueError as e:
            raise fail(f"not valid JSON: {clip(str(e))}") from None
        if not isinstance(v, dict):
            kind = _kind(v)
            raise fail(f"a JSON Lines row is one object ({{...}}); this line holds {'an' if kind[0] in 'ao' else 'a'} "
                       f"{kind}")
        if _depth(v) > MAX_JSON_DEPTH:
            raise fail(f"nested deeper than {MAX_JSON_DEPTH} levels")
        for k, x in v.items():
            hit = _types(x, k, seen, n)
            if hit is not None:
                at, here, there, row = hit
                inner = f" (at {echo(at)})" if at != k else ""
                raise fail(f"a {here} here{inner} but a {there} in data row {row} (a JSON Lines column keeps one "
                           f"JSON type; null is allowed anywhere)", k)
