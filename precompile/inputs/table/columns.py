"""A table's rows (``inputs.table``) as the plan's columns, a column at a time with pyarrow.

:func:`table_items` reads the table once and makes every per-row value the plan needs (each field's
path from its template, the key, label ids, targets, texts, the split's columns) as arrays; it never
builds a dict per row. The rules are :mod:`.cells`' per-cell ones: where a
column's type or a template's format spec has no exact columnar equivalent (a float cell under
``{x:.1f}``, say) that one template slot is filled cell by cell with :func:`.cells.cell_text`. Only
per-row decoder options are validated row by row (each distinct combination once).

Errors are the same as the row-by-row reading gave: every check is computed for all rows, and the first
row any check flags is read again as a dict and put through the per-row code, which raises the
:class:`~.read.TableError` naming the file, the data row and the column.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import numpy as np

from ...errors import PlanError, RecipeError, echo
from ...storage.remote import is_url, list_tree
from ..items import Inputs, ItemTable, Strings
from ..paths import MAX_PATH_CHARS
from .cells import (TEMPLATE_RE, CellError, blank, cell_text, check_columns, number, path_filler, row_options,
                    template_columns)
from .files import load_pyarrow, read_table, table_files
from .read import TableError
from .where import evaluate_where, number_columns

#: what Python's ``str.isspace`` calls whitespace, as an RE2 class: a cell of only these is blank
_WS = r"[\t\n\x0b\x0c\r\x1c-\x20\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]"
#: integer format specs with an exact columnar form for non-negative integers: zero or space padding
_INT_SPEC = re.compile(r"(0?)(\d*)d")


def _is_text(pa: Any, t: Any) -> bool:
    return pa.types.is_large_string(t)   # every text column is read as large_string (_plain)


def _plain(pa: Any, table: Any) -> Any:
    """``table`` (one file's) with its columns in the types the plan's code reads: dictionary columns
    (pandas categoricals) decoded, so unused categories are no values and nulls plain nulls; text
    (string, string_view) as large_string, cast chunk by chunk, so a column of more than 2 GiB of text
    keeps its offsets when its chunks are joined. Files whose types differ only so (a categorical in one,
    text in another) then join."""
    cols = []
    for col in table.columns:
        typ = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
        if pa.types.is_string(typ) or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(typ)):
            typ = pa.large_string()   # (is_string_view: pyarrow >= 16; the floor, 14.0.1, has no such type)
        chunks = [c.dictionary_decode() if pa.types.is_dictionary(c.type) else c for c in col.chunks]
        cols.append(pa.chunked_array([c.cast(typ) for c in chunks], typ))
    return pa.Table.from_arrays(cols, names=table.column_names)


class _Columns:
    """The columns the recipe reads, each one arrow array in its own type (the rows of every table file,
    in file order), one row of them as a dict, and the file and data row a row came from."""

    def __init__(self, recipe: Any):
        self.pa = load_pyarrow()
        self.source = recipe.source
        self.files = table_files(recipe)
        opts = recipe.model.inputs.storage_options
        quoting, texts = recipe.model.inputs.quoting, _text_columns(recipe)
        where = recipe.model.inputs.where
        exact = set(number_columns(where)) if isinstance(where, str) else set()
        tables = [read_table(f, recipe.source, lambda names, f=f: check_columns(recipe, f, names), opts, quoting,
                             texts, exact) for f in self.files]
        schemas = [t.schema for t in tables]   # the types as the files hold them, for messages
        tables = [_plain(self.pa, t) for t in tables]
        self.starts = np.cumsum([0] + [t.num_rows for t in tables]).astype(np.int64)   # each file's first row
        table = tables[0] if len(tables) == 1 else _concat(self.pa, tables, schemas, self.files, recipe.source)
        del tables
        self.n = table.num_rows
        self.kept: Optional[np.ndarray] = None   # after inputs.where: each kept row's index among all rows
        self._cols: dict[str, Any] = {}
        for name in table.column_names:   # each column's chunks are freed once it is one array
            col = table.column(name)
            self._cols[name] = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
            table = table.drop_columns([name])
        self.pa.default_memory_pool().release_unused()
        if isinstance(recipe.model.inputs.where, str):
            self._select(recipe.model.inputs.where)

    def _select(self, expression: str) -> None:
        """Keep only the rows ``inputs.where`` keeps (:mod:`.where`): every later rule (keys, labels, paths,
        splits) sees those rows alone, while messages still name each row's data row in its file."""
        keep = evaluate_where(expression, self)
        if keep.all():
            return
        self.kept = np.flatnonzero(keep).astype(np.int64)
        mask = self.pa.array(keep)
        for name in list(self._cols):
            self._cols[name] = self._cols[name].filter(mask)
        self.n = len(self.kept)
        self.pa.default_memory_pool().release_unused()

    def original(self, i: Any) -> Any:
        """Row(s) ``i`` of the kept rows as indices among every row of the files."""
        return i if self.kept is None else self.kept[i]

    def where(self, i: int) -> tuple[str, int]:
        """Row ``i`` (0-based, over every file; after ``inputs.where``, over the kept rows) as (its file, its data
        row there, 1-based)."""
        i = int(self.original(i))
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.files[k], i - int(self.starts[k]) + 1

    def error(self, i: int, column: Optional[str], what: str, loc: str) -> TableError:
        """The :class:`TableError` of row ``i`` (0-based, over every file), naming its file and data row."""
        return TableError(*self.where(i), column, what, self.source, loc)

    def file_codes(self) -> np.ndarray:
        """Per row: the index of its file in :attr:`files`."""
        codes = np.repeat(np.arange(len(self.files), dtype=np.int32), np.diff(self.starts))
        return codes if self.kept is None else codes[self.kept]

    def col(self, name: str) -> Any:
        return self._cols[name]

    def row(self, i: int) -> dict[str, Any]:
        return {c: a[i].as_py() for c, a in self._cols.items()}

    def blank(self, name: str) -> np.ndarray:
        """Per row: the cell is blank (null, only whitespace, NaN), as :func:`.cells.blank` says."""
        import pyarrow.compute as pc

        arr = self.col(name)
        mask = pc.is_null(arr)
        if _is_text(self.pa, arr.type):
            mask = pc.or_(mask, pc.match_substring_regex(arr, f"^{_WS}*$"))
        elif self.pa.types.is_floating(arr.type):
            mask = pc.or_(mask, pc.is_nan(arr))
        return _bools(mask)


def _bools(arr: Any) -> np.ndarray:
    return arr.fill_null(True).to_numpy(zero_copy_only=False).astype(bool)


def _concat(pa: Any, tables: list, schemas: list, files: list[str], source: Optional[str]) -> Any:
    """The tables of several files as one, in file order; a column's types unify where no value changes
    (int32 and int64, int and float, a column all null in one file); else a RecipeError naming the column and
    two files whose types do not join, as the files hold them (``schemas``)."""
    names = list(dict.fromkeys(n for t in tables for n in t.column_names))
    tables = [t.select([n for n in names if n in t.column_names]) for t in tables]
    errors = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except errors as e:
        reason = e
    for n in names:   # the first column whose types do not join: the first file holding it against another
        have = [k for k, t in enumerate(tables) if n in t.column_names]
        for k in have[1:]:
            try:
                pa.concat_tables([tables[have[0]].select([n]), tables[k].select([n])], promote_options="permissive")
            except errors:
                a = have[0]
                raise RecipeError(f"column {n!r} is {schemas[a].field(n).type} in {files[a]} but "
                                  f"{schemas[k].field(n).type} in {files[k]}: the table files must agree",
                                  source=source, loc="inputs.table") from None
    raise RecipeError(f"the table files cannot be joined: {reason}", source=source, loc="inputs.table") from None


def table_items(recipe: Any) -> Inputs:
    """The items of a table recipe in key order, the label names in id order, and the factors of the
    columns ``split:`` reads."""
    inp = recipe.model.inputs
    cols = _Columns(recipe)
    _check_values(recipe, cols)
    label_names, values = _column_values(recipe, cols)
    if not cols.n:
        return Inputs(ItemTable(keys=Strings.from_list([]), prefix="", paths={}), label_names, {})
    rels, bad = _paths(recipe, cols)
    keys = rels[None] if inp.key is None else _key_texts(cols, inp.key)
    if inp.key is not None:
        import pyarrow.compute as pc

        bad |= cols.blank(inp.key) | _bools(pc.match_substring(keys, "\x00"))
    order, sorted_keys, dup = _order(keys)
    first = _first(bad, dup)
    same = _respelled(cols, keys) if inp.key is None else None
    if same is not None and (first is None or same[0] < first):
        first = None   # this row's error comes first
    options = _options(recipe, cols, first if first is not None else (same[0] if same is not None else cols.n))
    if first is not None:
        _row_error(recipe, cols, first, order)
    if same is not None:
        i, j = same
        file, row = cols.where(j)
        other = "" if file == cols.where(i)[0] else f" of {file}"
        cs = template_columns(inp.path)
        raise cols.error(i, cs[0] if len(cs) == 1 else None,
                         f"path {echo(keys[i].as_py())} names the file of data row {row}{other} "
                         f"({echo(keys[j].as_py())}), written another way: a file enters a build once (give "
                         f"inputs.key a column whose values are unique when paths repeat)", "inputs.path")
    return _assemble(recipe, cols, (keys, sorted_keys), rels, order, label_names, values, options)


def _respelled(cols: _Columns, keys: Any) -> Optional[tuple[int, int]]:
    """Rows whose paths (the keys, with no key column) name one file in two spellings (``a/./x.png``,
    ``./a/x.png``, ``a//x.png`` beside ``a/x.png``): the first such row (0-based) and an earlier row naming
    its file, or None. Exact repeats are :func:`_order`'s. Before, each spelling was a sample of its own: the
    same image twice, in two splits when the split hashes the key."""
    import posixpath

    import pyarrow.compute as pc

    odd = np.flatnonzero(_bools(pc.match_substring_regex(keys, r"(^|/)\.(/|$)|//")))
    if not odd.size:
        return None
    texts = keys.to_pylist()
    norm = {i: posixpath.normpath(texts[i]) for i in odd.tolist()}
    first_of: dict[str, int] = {}   # the first odd row of each file
    plain = {t: i for i, t in enumerate(texts) if i not in norm}
    found: Optional[tuple[int, int]] = None
    for i in sorted(norm):
        n = norm[i]
        j = plain.get(n, first_of.get(n))
        if j is None:
            first_of[n] = i
            continue
        a, b = (i, j) if i > j else (j, i)
        if found is None or a < found[0]:
            found = (a, b)
    return found


#: the format types that read a cell as a number (``{n:06d}``, ``{x:.1f}``)
_NUMBER_SPECS = set("bcdoxXneEfFgG%")


def _uses(recipe: Any) -> list[tuple[str, str, str, bool]]:
    """Every column the recipe reads as a value, with its use, the recipe key that reads it, and whether it is
    read as text: (column, use, loc, as text). Decoder options taken from the row are not here (their own
    option models check them: a list may be a size)."""
    inp, out = recipe.model.inputs, []
    temps = ([("inputs.path", inp.path)] if inp.path is not None else []) + [
        (f"inputs.fields.{f}.path", d.path) for f, d in inp.fields.items() if d.path is not None]
    for loc, template in temps:
        for m in TEMPLATE_RE.finditer(template):   # {x:.1f} and {n:06d} read numbers; others, text
            out.append((m.group(1), "path", loc, (m.group(2) or "")[-1:] not in _NUMBER_SPECS))
    if inp.key is not None:
        out.append((inp.key, "key", "inputs.key", True))
    for f, c in inp.columns.items():
        for col in [c.column] if c.column is not None else c.columns:
            out.append((col, c.kind, f"inputs.columns.{f}", c.kind != "target"))
    sp = recipe.model.split
    if sp is not None and sp.column is not None:
        out.append((sp.column, "split column", "split.column", True))
    if sp is not None and sp.group is not None:
        out.append((sp.group if isinstance(sp.group, str) else sp.group.column, "group", "split.group", True))
    if sp is not None and sp.stratify is not None:
        out.append((sp.stratify, "stratify column", "split.stratify", True))
    return out


def _text_columns(recipe: Any) -> set[str]:
    """The columns the recipe reads as text (a key, a label, a text field, a template slot without a numeric
    format, a split column or group)."""
    return {col for col, _, _, text in _uses(recipe) if text}


def _check_values(recipe: Any, cols: _Columns) -> None:
    """Each column read as a value holds text, numbers or booleans: a struct, list, map or binary column is
    an error naming its first non-null row."""
    import pyarrow.compute as pc

    pa = cols.pa
    if not cols.n:
        return
    for col, use, loc, _ in _uses(recipe):
        t = cols.col(col).type
        if pa.types.is_nested(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t) or \
                pa.types.is_fixed_size_binary(t):
            i = int(np.argmax(_bools(pc.is_valid(cols.col(col)))))
            raise cols.error(i, col, f"holds {t} values; a {use} needs text, numbers or booleans", loc)


def _column_values(recipe: Any, cols: _Columns) -> tuple[list[str], dict[str, Any]]:
    """The label names and every column field by column (unsorted rows): label ids (int64), targets
    (float32, one or two dimensions), texts (arrow strings)."""
    import pyarrow.compute as pc

    names: list[str] = []
    out: dict[str, Any] = {}
    inp = recipe.model.inputs
    lab = next((f for f, c in inp.columns.items() if c.kind == "label"), None)
    if lab is not None:
        names, out[lab] = _labels(recipe, cols, lab)
    for f, c in inp.columns.items():
        if c.kind == "target":
            cs = [c.column] if c.column is not None else c.columns
            arr = np.stack([_numbers(recipe, cols, f, col, c.map) for col in cs], axis=1)
            out[f] = arr[:, 0] if c.column is not None else arr
        elif c.kind == "text":
            arr = cols.col(c.column)
            if not _is_text(cols.pa, arr.type):
                arr = cols.pa.array(["" if blank(v) else str(v) for v in arr.to_pylist()], cols.pa.large_string())
            out[f] = pc.fill_null(arr, "")
    return names, out


def _labels(recipe: Any, cols: _Columns, field: str) -> tuple[list[str], np.ndarray]:
    """A label column's class names in id order and each row's id; the first blank cell, or the first class
    not in ``classes``, is a TableError."""
    import pyarrow.compute as pc

    c = recipe.model.inputs.columns[field]
    blank = cols.blank(c.column)
    if blank.any():
        raise cols.error(int(np.argmax(blank)), c.column, "blank class name", f"inputs.columns.{field}")
    enc = pc.dictionary_encode(cols.col(c.column))
    cells = [str(v) for v in enc.dictionary.to_pylist()]
    codes = enc.indices.to_numpy(zero_copy_only=False)
    if c.classes is None:
        names = sorted(set(cells))
    else:
        known = set(c.classes)
        unknown = np.array([v not in known for v in cells], bool)
        if unknown.any() and unknown[codes].any():
            i = int(np.argmax(unknown[codes]))
            raise cols.error(i, c.column, f"class {echo(cells[codes[i]])} is not in classes {c.classes}",
                             f"inputs.columns.{field}.classes")
        names = list(c.classes)
    ids = {n: i for i, n in enumerate(names)}
    return names, np.array([ids[v] for v in cells], np.int64)[codes] if cells else np.zeros(0, np.int64)


def _numbers(recipe: Any, cols: _Columns, field: str, col: str, mapping: dict) -> np.ndarray:
    """A target column as float32: each distinct cell through :func:`.cells.number` once; the first row
    whose cell is not a number is a TableError."""
    import pyarrow.compute as pc

    enc = pc.dictionary_encode(cols.col(col), null_encoding="encode")
    cells = enc.dictionary.to_pylist()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    conv = np.zeros(len(cells), np.float32)
    bad: dict[int, str] = {}
    for u, v in enumerate(cells):
        try:
            conv[u] = number(v, mapping)
        except ValueError as e:
            bad[u] = str(e)
    if bad:
        flags = np.zeros(len(cells), bool)
        flags[list(bad)] = True
        i = int(np.argmax(flags[codes]))
        raise cols.error(i, col, bad[int(codes[i])], f"inputs.columns.{field}")
    return conv[codes]


def _slot(cols: _Columns, template: str, name: str, spec: Optional[str]) -> tuple[Any, np.ndarray]:
    """One ``{name:spec}`` slot of ``template`` for every row: (texts, flag per row whose cell it cannot
    use). Columnar where that is exact, else cell by cell (:func:`.cells.cell_text`)."""
    pa = cols.pa
    arr, blank = cols.col(name), cols.blank(name)
    fast = _fast_slot(cols, arr, blank, spec)
    if fast is not None:
        return fast, blank
    texts, bad = [], np.zeros(cols.n, bool)
    for i, v in enumerate(arr.to_pylist()):
        try:
            texts.append(cell_text(template, name, spec, v))
        except CellError:
            texts.append("")
            bad[i] = True
    return pa.array(texts, pa.large_string()), bad


def _fast_slot(cols: _Columns, arr: Any, blank: np.ndarray, spec: Optional[str]) -> Any:
    """The slot's texts computed by column, or None where that would not be exactly ``cell_text``: text
    cells with no spec; integers with no spec; non-negative integers (or cells of ASCII digits) under
    ``d``, ``6d`` or ``06d``."""
    import pyarrow.compute as pc

    pa, t = cols.pa, arr.type
    text = _is_text(pa, t)
    if not spec:
        if text:
            return pc.fill_null(arr, "") if arr.null_count else arr
        return arr.cast(pa.string()).fill_null("") if pa.types.is_integer(t) else None
    m = _INT_SPEC.fullmatch(spec)
    if m is None or not (text or pa.types.is_integer(t)):
        return None
    if text:
        filled = pc.if_else(pa.array(blank), pa.scalar("0", t), arr)
        if not pc.all(pc.match_substring_regex(filled, "^[0-9]+$")).as_py():
            return None
        try:
            arr = filled.cast(pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
    if pc.any(pc.less(arr, 0)).as_py() or pc.any(pc.greater(arr, 2 ** 53)).as_py():
        return None   # _as_int reads a number through float: exact up to 2**53
    out = arr.cast(pa.string()).fill_null("")
    width = int(m.group(2) or 0)
    return pc.utf8_lpad(out, width=width, padding="0" if m.group(1) else " ") if width else out


def _fill(cols: _Columns, template: str) -> tuple[Any, np.ndarray]:
    """A path template filled for every row: (texts, flag per row it cannot be filled for or whose path
    leaves inputs.root)."""
    import pyarrow.compute as pc

    pa = cols.pa
    lits, texts, bad, pos = [], [], np.zeros(cols.n, bool), 0
    for m in TEMPLATE_RE.finditer(template):
        text, b = _slot(cols, template, m.group(1), m.group(2))
        lits.append(template[pos:m.start()])
        texts.append(text)
        bad |= b
        pos = m.end()
    if len(texts) == 1 and not lits[0] and pos == len(template):
        out = texts[0]   # "{column}": the column's own texts
    elif not texts:
        out = pa.repeat(pa.scalar(template, pa.string()), cols.n)
    else:
        typ = pa.large_string() if any(pa.types.is_large_string(t.type) for t in texts) else pa.string()
        pieces = [p for lit, t in zip(lits, texts) for p in (pa.scalar(lit, typ), t.cast(typ))]
        out = pc.binary_join_element_wise(*pieces, pa.scalar(template[pos:], typ), pa.scalar("", typ))
    leaves = pc.or_(pc.starts_with(out, "/"), pc.match_substring_regex(out, r"(^|/)\.\.(/|$)"))
    unusable = pc.or_(pc.match_substring(out, "\x00"), pc.greater(pc.utf8_length(out), MAX_PATH_CHARS))
    return out, bad | _bools(leaves) | _bools(unusable)


def _paths(recipe: Any, cols: _Columns) -> tuple[dict[Optional[str], Any], np.ndarray]:
    """Each field's path relative to the root (``None``: ``inputs.path``'s), and the rows any of them fails for."""
    inp = recipe.model.inputs
    out: dict[Optional[str], Any] = {}
    bad = np.zeros(cols.n, bool)
    if inp.path is not None:
        out[None], bad = _fill(cols, inp.path)
    for f, d in inp.fields.items():
        if d.path is not None:
            out[f], b = _fill(cols, d.path)
            bad |= b
        elif inp.path is None:
            bad[:] = True   # a field without a path: the row-by-row code names it at row 1
            out[f] = None
        else:
            out[f] = out[None]
    return out, bad


def _key_texts(cols: _Columns, name: str) -> Any:
    """The key column as text: ``str`` of each cell (blank cells are flagged by the caller)."""
    pa = cols.pa
    arr = cols.col(name)
    if _is_text(pa, arr.type):
        return arr.fill_null("") if arr.null_count else arr
    if pa.types.is_integer(arr.type):
        return arr.cast(pa.string()).fill_null("")
    return pa.array([str(v) for v in arr.to_pylist()], pa.large_string())


def _order(keys: Any) -> tuple[np.ndarray, Any, np.ndarray]:
    """The rows in key order (stable), the keys in that order, and per row whether its key repeats an
    earlier row's."""
    import pyarrow.compute as pc

    order = pc.sort_indices(keys).to_numpy()
    srt = keys.take(order)
    dup = np.zeros(len(order), bool)
    if len(order) > 1:
        same = _bools(pc.equal(srt.slice(1), srt.slice(0, len(order) - 1)))
        dup[order[1:][same]] = True   # the second and later rows of a run of equal keys
    return order, srt, dup


def _first(bad: np.ndarray, dup: np.ndarray) -> Optional[int]:
    """The first row (0-based) a path, key or duplicate check flags, or None."""
    flags = bad | dup
    return int(np.argmax(flags)) if flags.any() else None


def _options(recipe: Any, cols: _Columns, upto: int) -> Optional[list[dict]]:
    """Each row's decoder options from its cells (:func:`.cells.row_options`, each distinct combination
    once), for the rows before ``upto`` (the first row with another error: its options come after); None
    when the recipe takes no option from the table."""
    if not recipe.row_options:
        return None
    used = sorted({c for opts in recipe.row_options.values() for c in opts.values()})
    lists = [cols.col(c).to_pylist() for c in used]
    seen: dict[tuple, dict] = {}
    out = []
    for i in range(upto):
        vals = [lst[i] for lst in lists]
        try:
            cells: Any = tuple((type(v), repr(v) if isinstance(v, float) else v) for v in vals)   # -0.0 != 0.0
            hit = seen.get(cells)
        except TypeError:   # a list cell (JSON Lines): not cached
            cells, hit = None, None
        if hit is None:
            def where(col: Optional[str], what: str, loc: str, _i: int = i) -> TableError:
                return cols.error(_i, col, what, loc)
            hit = row_options(recipe, dict(zip(used, vals)), where)
            if cells is not None:
                seen[cells] = hit
        out.append(hit)
    return out


def _row_error(recipe: Any, cols: _Columns, i: int, order: np.ndarray) -> None:
    """Raise the error of row ``i`` (0-based) as the row-by-row reading raised it: its paths, then a blank
    key, then a key that repeats an earlier row's."""
    inp = recipe.model.inputs

    def where(col: Optional[str], what: str, loc: str) -> TableError:
        return cols.error(i, col, what, loc)

    row = cols.row(i)
    rel, _ = path_filler(recipe, recipe.input_root)(row, where)
    if inp.key is not None and cols.blank(inp.key)[i]:
        raise where(inp.key, "blank key", "inputs.key")
    key = rel if inp.key is None else str(row[inp.key])
    if "\x00" in key:
        raise where(inp.key, f"the key {echo(key)} holds a NUL byte, which a stored key cannot", "inputs.key")
    pos = int(np.flatnonzero(order == i)[0])
    file, first = cols.where(int(order[pos - 1]))
    other = "" if file == cols.where(i)[0] else f" of {file}"
    cs = template_columns(inp.path) if inp.key is None else [inp.key]
    raise where(cs[0] if len(cs) == 1 else None,
                f"key {echo(key)} repeats data row {first}{other} (give inputs.key a column whose values are unique when "
                f"paths repeat)", "inputs.key" if inp.key else "inputs.path")


def _assemble(recipe: Any, cols: _Columns, keys: tuple[Any, Any], rels: dict, order: np.ndarray,
              label_names: list[str], values: dict[str, Any], options: Optional[list]) -> Inputs:
    """The columns in key order as the plan's :class:`ItemTable` (``keys``: the key texts in row order and
    in key order)."""
    pa = cols.pa
    inp = recipe.model.inputs
    root = recipe.input_root
    remote = "://" in root
    if remote and is_url(root):   # the objects' fingerprints (ETag, size, mtime), which the shard keys hash
        try:
            list_tree(root, any(d.reads_dirs for d in recipe.decoders.values()), inp.storage_options)
        except PlanError:   # a root the store will not list (GetObject granted, ListBucket not): the rows are
            pass            # read all the same, without fingerprints (a changed object is not seen)
    idx = pa.array(order)
    done: dict[tuple[int, bool], Strings] = {}

    def strings(arr: Any, path: bool = False) -> Strings:
        local = path and not remote and os.sep != "/"   # a local path column: '/' as the OS separator
        if (id(arr), local) not in done:
            done[(id(arr), local)] = _strings(keys[1] if arr is keys[0] else arr.take(idx), local)
        return done[(id(arr), local)]

    files = cols.file_codes()[order]
    table = ItemTable(keys=strings(keys[0]), prefix=f"{root}/" if remote else root + os.sep,
                      paths={f: strings(rels[f], True) for f in inp.fields},
                      row=cols.original(order.astype(np.int64)) + 1 - cols.starts[files], row_file=files,
                      row_files=tuple(cols.files),
                      values={f: (strings(v) if isinstance(v, pa.Array) else v[order]) for f, v in values.items()},
                      options=[options[i] for i in order.tolist()] if options is not None else None)
    sp = recipe.model.split
    factors = {}
    if sp is not None:
        for c in (sp.column, sp.group if isinstance(sp.group, str) else getattr(sp.group, "column", None),
                  sp.stratify):
            if c is not None:
                factors[c] = _factor(cols, c, order)
    return Inputs(table, label_names, factors)


def _strings(arr: Any, os_sep: bool) -> Strings:
    """An arrow string array as :class:`Strings` (its data buffer, no copy; int32 offsets widened); with
    ``os_sep``, '/' replaced by the OS separator (a local path column on Windows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if os_sep:
        arr = pc.replace_substring(arr, "/", os.sep)
    _, offsets, data = arr.buffers()
    width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    off = np.asarray(np.frombuffer(offsets, width)[arr.offset:arr.offset + len(arr) + 1], np.int64)
    return Strings(np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8), off)


def _factor(cols: _Columns, name: str, order: np.ndarray) -> tuple[np.ndarray, list]:
    """A column's distinct cells and each row's code into them (rows in key order)."""
    import pyarrow.compute as pc

    enc = pc.dictionary_encode(cols.col(name), null_encoding="encode")
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)[order], enc.dictionary.to_pylist()
