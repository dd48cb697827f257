"""Tables as inputs: one sample per row of a CSV, TSV, JSON Lines or Parquet file (``inputs.table``).

The table may be a local file, a URL (streamed from the store through its fsspec filesystem, with
``inputs.storage_options``), a glob of either, or a list of such (:func:`table_files`): the rows of every
file, in sorted file order, each row's messages naming its own file and data row.

The table is read with pyarrow (the ``tables`` extra), imported only here and
only when a recipe has a table, and only the columns the recipe names;
:mod:`precompile.compiler.table_columns` turns them into the plan's columns, by
column, with this module's per-cell rules. CSV and TSV cells are read as text (``"00012"``
stays ``"00012"``; numbers are parsed where a field needs them); JSON Lines and
Parquet keep their own types.

Rows are numbered from 1 in messages: *data row* n is the n-th row after the
header (a CSV's line n + 1, a JSON Lines file's line n, a Parquet file's row
n - 1 counted from 0).

Per row:

- the input path: ``inputs.path`` (a template over the row's columns, ``{col}``
  or ``{col:06d}`` with a Python format spec) under ``inputs.root``; a field's
  own ``path:`` is a template over the same columns;
- the key: the ``inputs.key`` column's value, or else the row's path;
- column fields (``inputs.columns``): ``label`` (class name -> id),
  ``target`` (float32, a blank cell is NaN, ``map:`` turns values such as -1
  into numbers or NaN), ``text`` (UTF-8; a blank cell is the empty string);
- decoder options given as ``{column: NAME}``: the row's value, checked by the
  decoder's own option model.

Every problem the table itself has (a missing file, an unknown column, a
duplicate key, a cell that is not a number) is a :class:`RecipeError` naming
the table file, the data row and the column, before anything is decoded. A row
whose *input file* is missing is not: it fails at decode like any missing input
(the build report names it; ``on_error`` applies).

Splits (``split:``) are assigned here too (:func:`assign_splits`): by a stable
hash (:func:`precompile.seeding.stable_hash`) of the seed and the key, or of the
group value, so an input's split depends on nothing else and adding rows never
moves an old one; or by a column naming each row's split.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import numpy as np

from ...errors import MissingDependencyError, RecipeError, clip, echo
from ...kinds import Kind
from ...recipe import NAME_RE
from ...sample import FieldSpec
from .read import TableError  # noqa: F401  (re-exported: table_columns and tests raise and catch it)

#: extension -> reader name
TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl",
                 ".parquet": "parquet", ".pq": "parquet"}
#: ``{column}`` or ``{column:spec}`` in a path template (any column name without braces or colons)
TEMPLATE_RE = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")
#: the longest path a row may give (Linux's PATH_MAX): a longer one names no file on any file system
MAX_PATH_CHARS = 4096


def table_format(path: str) -> str:
    """The reader for ``path`` by its extension (``.gz``/``.bz2`` allowed after it for CSV/TSV/JSON Lines)."""
    low = path.lower()
    for comp in (".gz", ".bz2"):
        if low.endswith(comp):
            low = low[:-len(comp)]
            if low.endswith((".parquet", ".pq")):
                break
    ext = os.path.splitext(low)[1]
    if ext not in TABLE_FORMATS:
        raise ValueError(f"unknown table extension {ext or '(none)'!r}: use "
                         + ", ".join(sorted(TABLE_FORMATS)) + " (.gz or .bz2 after csv/tsv/jsonl)")
    return TABLE_FORMATS[ext]


def _pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.csv  # noqa: F401
        import pyarrow.json  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError("table inputs (inputs.table) need pyarrow: pip install 'precompile[tables]'") from e
    return pyarrow


def read_table(path: str, source: Optional[str] = None, select: Optional[Any] = None,
               storage_options: Optional[dict[str, Any]] = None, quoting: Optional[str] = None,
               texts: Optional[set[str]] = None) -> Any:
    """The table file (a local path or a URL, streamed from the store) as a pyarrow Table (CSV and TSV
    cells as text), read as Python's csv and json modules read it (:mod:`.table_read`); a RecipeError
    naming the file (and the row) when it cannot be read, a PlanError naming the URL when the store
    refuses it (missing, access denied, no credentials). ``select(column names) -> the names to read``
    (it may raise): only those columns are kept. ``quoting`` (``inputs.quoting``): ``csv`` or ``none``
    for a CSV or TSV file (default: ``csv`` for .csv, ``none`` for .tsv/.tab: TSV has no quoting).
    ``texts``: the columns read as text (a JSON Lines number column among them holds the numbers'
    texts as ``str`` of ``json.loads``' values: ``1``, not pyarrow's ``1.0``)."""
    from ...storage.remote import file_fingerprint, is_url, store_error
    from .read import read_delimited, read_jsonl

    pa = _pyarrow()
    kind = table_format(path)
    remote = is_url(path)
    if remote:   # the store's own answer (pyarrow's fsspec handler calls every refusal "not found")
        file_fingerprint(path, storage_options, f"table {path!r}")
    elif not os.path.isfile(path):
        raise RecipeError(f"table file {path!r} does not exist", source=source, loc="inputs.table")
    fs, name = _arrow_filesystem(path, storage_options)
    pick = select or (lambda names: names)
    try:
        if kind in ("csv", "tsv"):
            with fs.open_input_stream(name, compression="detect") as f:
                data = f.read()
            quote = (quoting or ("csv" if kind == "csv" else "none")) == "csv"
            return read_delimited(pa, data, path, "\t" if kind == "tsv" else ",", quote, pick, source)
        if kind == "jsonl":
            with fs.open_input_stream(name, compression="detect") as f:
                data = f.read()
            return read_jsonl(pa, data, path, pick, source, texts or set())
        with fs.open_input_file(name) as f:
            pq = pa.parquet.ParquetFile(f)
            return pq.read(columns=pick(list(pq.schema_arrow.names)))
    except (pa.ArrowException, OSError, ValueError) as e:
        if remote and _store_fault(pa, e):
            raise store_error(f"table {path!r}", path, e, "read") from None
        raise RecipeError(f"table file {path!r} cannot be read as {kind}: {clip(str(e))}", source=source,
                          loc="inputs.table") from None
    except RecipeError:
        raise
    except Exception as e:  # a store's own errors (botocore's NoCredentialsError, ...) are not OSErrors
        if remote:
            raise store_error(f"table {path!r}", path, e, "read") from None
        raise


def _store_fault(pa: Any, e: BaseException) -> bool:
    """Whether reading a remote table failed in the store (a missing object, access denied, the network),
    not in its bytes."""
    return isinstance(e, (FileNotFoundError, PermissionError)) or (isinstance(e, OSError)
                                                                   and not isinstance(e, pa.ArrowException))


def _arrow_filesystem(path: str, storage_options: Optional[dict[str, Any]]) -> tuple[Any, str]:
    """A pyarrow filesystem that opens ``path`` and the name to open it by: the local one, or the URL's fsspec
    filesystem (:func:`precompile.storage.remote.filesystem`) seen through pyarrow, so a remote table is streamed."""
    import pyarrow.fs as pafs

    from ...storage.remote import filesystem, is_url

    if not is_url(path):
        return pafs.LocalFileSystem(), path
    fs = filesystem(path, storage_options)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), fs._strip_protocol(path)


#: a table entry with one of these is a glob pattern
GLOB_CHARS = re.compile(r"[*?[]")


def table_files(recipe: Any) -> list[str]:
    """Every file ``inputs.table`` names, sorted, each once: a path relative to the recipe's folder (or
    absolute), a URL (read with ``inputs.storage_options``), or a glob of either (``meta/part-*.parquet``);
    a list of such entries. A glob that matches nothing is an error naming it."""
    import glob

    from ...storage.remote import glob_urls, is_url

    t = recipe.model.inputs.table
    found: set[str] = set()
    for entry in [t] if isinstance(t, str) else t:
        pattern = GLOB_CHARS.search(entry) is not None
        if is_url(entry):
            found.update(glob_urls(entry, recipe.model.inputs.storage_options, f"table {entry!r}") if pattern
                         else [entry])
            continue
        path = entry if os.path.isabs(entry) else os.path.normpath(os.path.join(recipe.base_dir, entry))
        if not pattern:
            found.add(path)
            continue
        matches = [m for m in glob.glob(path) if os.path.isfile(m)]
        if not matches:
            raise RecipeError(f"table {entry!r} matches no file (under {recipe.base_dir})", source=recipe.source,
                              loc="inputs.table")
        found.update(matches)
    return sorted(found)


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v))


class CellError(ValueError):
    """A cell a template cannot use; ``column`` names it."""

    def __init__(self, column: str, what: str):
        super().__init__(what)
        self.column = column


def _as_int(v: Any, name: str, spec: str) -> int:
    """A cell as an integer for an integer format spec: 12, "12", 12.0 and "12.0" are 12."""
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise CellError(name, f"{echo(v)} is not an integer (format {{{name}:{spec}}})") from None
    if not f.is_integer():
        raise CellError(name, f"{echo(v)} is not an integer (format {{{name}:{spec}}})")
    return int(f)


def _cell_text(template: str, name: str, spec: Optional[str], v: Any) -> str:
    """One ``{name:spec}`` slot of ``template`` filled with the cell ``v`` (CellError when it cannot be)."""
    if _blank(v):
        raise CellError(name, f"blank cell (the template {template!r} needs it)")
    if not spec:
        return str(v)
    try:
        if spec[-1] in "bcdoxXn":
            v = _as_int(v, name, spec)
        elif spec[-1] in "eEfFgG%":
            v = float(v)
        return format(v, spec)
    except (TypeError, ValueError) as e:
        raise CellError(name, clip(str(e))) from None


def compile_template(template: str) -> Any:
    """``row -> str`` for a path template (parsed once; see :func:`fill_row_template`)."""
    parts: list[tuple[str, Optional[str], Optional[str]]] = []   # (literal before, column, spec)
    pos = 0
    for m in TEMPLATE_RE.finditer(template):
        parts.append((template[pos:m.start()], m.group(1), m.group(2)))
        pos = m.end()
    tail = template[pos:]

    def fill(row: dict[str, Any]) -> str:
        return "".join([lit + _cell_text(template, name, spec, row[name]) for lit, name, spec in parts]) + tail
    fill.columns = [name for _, name, _ in parts]   # type: ignore[attr-defined]
    return fill


def path_problem(rel: str) -> Optional[str]:
    """Why a path a row gives can name no file (a NUL byte, more than :data:`MAX_PATH_CHARS` characters),
    or None."""
    if "\x00" in rel:
        return f"the path {echo(rel)} holds a NUL byte, which no file name can"
    if len(rel) > MAX_PATH_CHARS:
        return f"the path {echo(rel)} is longer than {MAX_PATH_CHARS} characters, which no file system takes"
    return None


def _culprit(columns: list[str], row: dict[str, Any]) -> Optional[str]:
    """The column of a template whose cell makes its path unusable: the first holding a NUL byte, else the
    longest."""
    texts = {c: str(row[c]) for c in columns}
    return next((c for c in columns if "\x00" in texts[c]), max(columns, key=lambda c: len(texts[c]), default=None))


def fill_row_template(template: str, row: dict[str, Any]) -> str:
    """Put the row's values into ``{column}`` / ``{column:spec}`` slots. A spec ending in an integer type
    (``d``, ``x``, ...) reads the cell as an integer, a float type (``f``, ``e``, ``g``, ``%``) as a number.
    A KeyError for a missing column, a :class:`CellError` (naming the column) for a cell it cannot use."""
    return compile_template(template)(row)


def template_columns(template: str) -> list[str]:
    return [m.group(1) for m in TEMPLATE_RE.finditer(template)]


def _mapped(m: Any) -> float:
    """A ``map:`` value as a float (``nan``, ``NaN`` or null: NaN)."""
    return float("nan") if m is None or isinstance(m, str) else float(m)


def _key_number(k: Any) -> Optional[float]:
    """A ``map:`` key as a number, if it is one (``-1``, ``"-1"``, ``-1.0``); None for ``""`` or a word."""
    if isinstance(k, str):
        try:
            return float(k)
        except ValueError:
            return None
    return float(k)


def _number(v: Any, mapping: dict) -> float:
    """A target cell as a float: blank -> NaN (or ``map['']``); a cell whose text or number is a ``map:``
    key -> its value; else the number (a ValueError when it is not one)."""
    if _blank(v):
        return _mapped(mapping.get("", None))
    if isinstance(v, str):
        v = v.strip()
        if v in mapping:
            return _mapped(mapping[v])
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is a boolean, not a number")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{echo(v)} is not a number (a target needs numbers; blank = NaN; map: turns other values "
                         f"into numbers)") from None
    for k, m in mapping.items():
        if _key_number(k) == x:
            return _mapped(m)
    return x


def column_specs(columns: dict) -> dict[str, FieldSpec]:
    """The field spec of every column field: label int64 (), target float32 () or (n,), text uint8 (None,)."""
    out = {}
    for name, c in columns.items():
        if c.kind == "label":
            out[name] = FieldSpec(Kind.LABEL, (), "int64")
        elif c.kind == "target":
            out[name] = FieldSpec(Kind.TARGET, () if c.columns is None else (len(c.columns),), "float32")
        else:
            out[name] = FieldSpec(Kind.TEXT, (None,), "uint8")
    return out


def column_arrays(columns: dict, values: dict[str, Any]) -> dict[str, tuple[np.ndarray, Kind]]:
    """One row's column fields as arrays (text: its UTF-8 bytes) with their kinds."""
    out = {}
    for name, c in columns.items():
        v = values[name]
        if c.kind == "label":
            out[name] = (np.asarray(v, dtype=np.int64), Kind.LABEL)
        elif c.kind == "target":
            out[name] = (np.asarray(v, dtype=np.float32), Kind.TARGET)
        else:
            out[name] = (np.frombuffer(v.encode("utf-8"), dtype=np.uint8).copy(), Kind.TEXT)
    return out


def _check_columns(recipe: Any, table: str, names: list[str]) -> list[str]:
    """The columns the recipe reads, in the table's order; each must exist, once (a RecipeError naming the
    key and the table's columns)."""
    inp, have = recipe.model.inputs, set(names)
    wanted: list[tuple[str, str]] = []
    if inp.path is not None:
        wanted += [(c, "inputs.path") for c in template_columns(inp.path)]
    if inp.key is not None:
        wanted.append((inp.key, "inputs.key"))
    for f, decl in inp.fields.items():
        if decl.path is not None:
            wanted += [(c, f"inputs.fields.{f}.path") for c in template_columns(decl.path)]
        wanted += [(c, f"inputs.fields.{f}.{o}") for o, c in recipe.row_options.get(f, {}).items()]
    for f, c in inp.columns.items():
        wanted += [(col, f"inputs.columns.{f}") for col in ([c.column] if c.column is not None else c.columns)]
    sp = recipe.model.split
    if sp is not None:
        if sp.column is not None:
            wanted.append((sp.column, "split.column"))
        if sp.group is not None:
            wanted.append((sp.group if isinstance(sp.group, str) else sp.group.column, "split.group"))
    for col, loc in wanted:
        if col not in have:
            raise RecipeError(f"{table}: no column {col!r} (columns: {', '.join(names)})",
                              source=recipe.source, loc=loc)
        if names.count(col) > 1:
            raise RecipeError(f"{table}: column {col!r} is in the header {names.count(col)} times (columns: "
                              f"{', '.join(names)}): give each column its own name", source=recipe.source,
                              loc=loc)
    used = {c for c, _ in wanted}
    return [n for n in names if n in used] or names[:1]   # one column at least: it gives the row count


def _row_options(recipe: Any, row: dict[str, Any], where: Any) -> dict[str, dict[str, Any]]:
    """The decoder options taken from the row, checked by each decoder's own option model."""
    from pydantic import ValidationError

    out = {}
    for f, opts in recipe.row_options.items():
        vals = {}
        for o, col in opts.items():
            if _blank(row[col]):
                raise where(col, f"blank cell (decoder option {o} of field {f!r} is taken from it)",
                            f"inputs.fields.{f}.{o}")
            vals[o] = row[col]
        try:
            p = recipe.row_params(f, vals)
        except ValidationError as e:
            first = e.errors()[0]
            o = str(first["loc"][0]) if first["loc"] else next(iter(opts))
            msg = first["msg"].removeprefix("Value error, ")
            raise where(opts.get(o), f"decoder option {o} of field {f!r}: {msg}", f"inputs.fields.{f}.{o}") from None
        out[f] = {o: getattr(p, o) for o in opts}
    return out


def _path_filler(recipe: Any, root: str) -> Any:
    """``(row, where) -> (the row's path, {field: absolute input path})`` from ``inputs.path`` and the
    fields' own templates (compiled once)."""
    inp = recipe.model.inputs
    remote = "://" in root
    main = compile_template(inp.path) if inp.path is not None else None
    own = {f: compile_template(d.path) for f, d in inp.fields.items() if d.path is not None}

    def fill(template: Any, row: dict[str, Any], where: Any, loc: str) -> str:
        try:
            rel = template(row)
        except CellError as e:
            raise where(e.column, str(e), loc) from None
        problem = path_problem(rel)
        if problem is not None:
            raise where(_culprit(template.columns, row), problem, loc)
        if rel.startswith("/") or ".." in rel.split("/"):
            raise where(None, f"path {echo(rel)} leaves inputs.root (no leading '/' or '..')", loc)
        return rel

    def paths(row: dict[str, Any], where: Any) -> tuple[Optional[str], dict[str, str]]:
        rel = fill(main, row, where, "inputs.path") if main is not None else None
        out = {}
        for f in inp.fields:
            rp = fill(own[f], row, where, f"inputs.fields.{f}.path") if f in own else rel
            if rp is None:
                raise where(None, f"field {f!r} has no path (set inputs.path or the field's path)",
                            f"inputs.fields.{f}")
            out[f] = f"{root}/{rp}" if remote else root + os.sep + rp.replace("/", os.sep)
        return rel, out
    return paths


def split_group(spec: Any, captures: dict[str, Any]) -> Optional[str]:
    """An item's group value under ``split.group`` (None without one); the pattern's first group when given."""
    g = spec.group
    if g is None:
        return None
    col = g if isinstance(g, str) else g.column
    v = str(captures[col])
    if isinstance(g, str) or g.pattern is None:
        return v
    m = re.search(g.pattern, v)
    if m is None:
        raise ValueError(f"split.group pattern {g.pattern!r} does not match {echo(v)}")
    return m.group(1) if m.groups() else m.group(0)


def hash_split(fractions: dict[str, float], seed: int, name: str) -> str:
    """The split of ``name`` (a key or a group): a stable 64-bit hash of seed and name, as a point in [0, 1),
    falls in one split's share of the line (the fractions in their given order). Nothing else decides it."""
    from ...seeding import stable_hash

    u = stable_hash(f"split:{int(seed)}:{name}") / 2.0 ** 64
    acc = 0.0
    last = next(reversed(fractions))
    for split, f in fractions.items():
        acc += f
        if u < acc:
            return split
    return last


def assign_splits(recipe: Any, table: Any, factors: dict[str, tuple[np.ndarray, list]]) -> Any:
    """``table`` (an :class:`~precompile.compiler.items.ItemTable`) with each item's split set (see the
    module docstring), from the factors of the columns or captures the split reads (code per item, distinct
    values: :data:`precompile.compiler.listing.Factors`); each distinct value is checked and hashed once.
    A RecipeError names the first input (in key order) whose group or split value is unusable, or whose
    group is in two splits of a ``by: column`` split."""
    sp, source = recipe.model.split, recipe.source
    seed = recipe.seed if sp.seed is None else sp.seed
    gcol = sp.group if isinstance(sp.group, str) else getattr(sp.group, "column", None)
    for col in (sp.column, gcol):
        if col is not None and col not in factors:
            raise RecipeError(f"{col!r} is neither a table column nor a capture of match", source=source, loc="split")
    at = _where(table)
    groups = _Groups(sp, gcol, factors[gcol], at) if gcol is not None else None
    checks = [groups.check] if groups is not None else []
    if sp.by == "column":
        codes, names = _column_splits(recipe, factors[sp.column], groups, checks, at)
    else:
        _raise_first(recipe, checks)
        names = list(sp.fractions)
        pos = {s: i for i, s in enumerate(names)}
        if groups is None:
            codes = np.fromiter((pos[hash_split(sp.fractions, seed, k)] for k in table.keys.to_list()),
                                np.int64, len(table))
        else:
            codes = np.array([pos[hash_split(sp.fractions, seed, g)] for g in groups.values], np.int64)[groups.ids]
    table.split, table.split_names = codes.astype(np.int16), tuple(names)
    return table


def _where(table: Any) -> Any:
    """``i -> "table.csv: data row 7 (...)"`` or ``"input 'a/b.png'"``: how a message names item ``i``."""
    def at(i: int) -> str:
        if table.row is None:
            return f"input {echo(table.keys[i])}"
        return f"{table.row_files[int(table.row_file[i])]}: data row {int(table.row[i])} (1-based, header not counted)"
    return at


class _Groups:
    """The ``split.group`` of every item: each distinct cell through :func:`split_group` once; ``ids`` (per
    item, -1 where the cell is unusable) index ``values``; ``check`` flags and names the unusable ones."""

    def __init__(self, sp: Any, col: str, factor: tuple[np.ndarray, list], at: Any):
        codes, cells = factor
        found: dict[str, int] = {}
        per = np.full(len(cells), -1, np.int64)
        msgs = [""] * len(cells)
        for u, v in enumerate(cells):
            try:
                per[u] = found.setdefault(split_group(sp, {col: v}), len(found))
            except ValueError as e:
                msgs[u] = str(e)
        self.ids, self.values = per[codes], list(found)
        self.check = (self.ids < 0, lambda i: (f"{at(i)}: {msgs[codes[i]]}", "split.group"))


def _column_splits(recipe: Any, factor: tuple[np.ndarray, list], groups: Optional[_Groups], checks: list,
                   at: Any) -> tuple[np.ndarray, list[str]]:
    """``by: column``: each item's split code and the split names (sorted); raises the first input's error
    among ``checks`` and these: a split name that is not one, a group in two splits."""
    sp = recipe.model.split
    codes, cells = factor
    valid = [not _blank(v) and NAME_RE.match(str(v)) is not None for v in cells]
    names = sorted({str(v) for v, ok in zip(cells, valid) if ok})
    pos = {s: i for i, s in enumerate(names)}
    split = np.array([pos[str(v)] if ok else -1 for v, ok in zip(cells, valid)], np.int64)[codes]
    checks.append((split < 0, lambda i: (f"{at(i)}, column {sp.column!r}: split name {echo(cells[codes[i]])} must be "
                                         f"letters, digits, '_', '.', '-'", "split.column")))
    if groups is not None and len(split):
        g = groups.ids
        ok = (g >= 0) & (split >= 0)
        first = np.full(len(groups.values), -1, np.int64)   # each group's first usable item
        gids, at_first = np.unique(g[ok], return_index=True)
        first[gids] = np.flatnonzero(ok)[at_first]
        f = np.where(g >= 0, first[np.maximum(g, 0)], -1)
        clash = ok & (f >= 0) & (split != split[np.maximum(f, 0)])
        checks.append((clash, lambda i: (f"{at(i)}: group {echo(groups.values[g[i]])} is in split {names[split[i]]!r} "
                                         f"here and in {names[split[f[i]]]!r} at {at(int(f[i]))} (a group must not "
                                         f"be in two splits)", "split.group")))
    _raise_first(recipe, checks)
    return split, names


def _raise_first(recipe: Any, checks: list[tuple[np.ndarray, Any]]) -> None:
    """The error of the first input any check flags (``checks``: (flag per input, ``i -> (message, loc)``),
    in the order one input is checked); nothing when none does."""
    firsts = [int(np.argmax(flags)) for flags, _ in checks if flags.any()]
    if not firsts:
        return
    i = min(firsts)
    for flags, message in checks:
        if flags[i]:
            msg, loc = message(i)
            raise RecipeError(msg, source=recipe.source, loc=loc)
