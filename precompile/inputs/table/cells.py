"""A table's rules for one cell and one row (``inputs.table``), as the row-by-row reading states them: a blank
cell, a ``{column:spec}`` template slot filled from a cell, a target cell as a number (``map:``), the columns
the recipe reads (each once), the decoder options a row gives, a row's paths under ``inputs.root``, and the
column fields' specs and arrays. :mod:`.columns` applies them a column at a time, and falls back on them to
name the first row at fault. See :mod:`precompile.inputs.table`.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import numpy as np

from ...errors import RecipeError, clip, echo
from ...kinds import Kind
from ...sample import FieldSpec
from ..paths import leaves_root, path_problem
from .where import python_only

#: ``{column}`` or ``{column:spec}`` in a path template (any column name without braces or colons)
TEMPLATE_RE = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v))


class CellError(ValueError):
    """A cell a template cannot use; ``column`` names it."""

    def __init__(self, column: str, what: str):
        super().__init__(what)
        self.column = column


def _as_int(v: Any, name: str, spec: str) -> int:
    """A cell as an integer for an integer format spec: 12, "12", 12.0 and "12.0" are 12."""
    if isinstance(v, str):
        if python_only(v):
            raise CellError(name, f"{echo(v)} is not an integer (format {{{name}:{spec}}})")
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


def cell_text(template: str, name: str, spec: Optional[str], v: Any) -> str:
    """One ``{name:spec}`` slot of ``template`` filled with the cell ``v`` (CellError when it cannot be)."""
    if blank(v):
        raise CellError(name, f"blank cell (the template {template!r} needs it)")
    if not spec:
        return str(v)
    try:
        if spec[-1] in "bcdoxXn":
            v = _as_int(v, name, spec)
        elif spec[-1] in "eEfFgG%":
            if isinstance(v, str) and python_only(v):
                raise ValueError(f"could not convert string to float: {echo(v)}")
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
        return "".join([lit + cell_text(template, name, spec, row[name]) for lit, name, spec in parts]) + tail
    fill.columns = [name for _, name, _ in parts]   # type: ignore[attr-defined]
    return fill


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


def number(v: Any, mapping: dict) -> float:
    """A target cell as a float: blank -> NaN (or ``map['']``); a cell whose text or number is a ``map:``
    key -> its value; else the number (a ValueError when it is not one)."""
    if blank(v):
        return _mapped(mapping.get("", None))
    if isinstance(v, str):
        v = v.strip()
        if v in mapping:
            return _mapped(mapping[v])
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is a boolean, not a number")
    try:
        if isinstance(v, str) and python_only(v):
            raise ValueError
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{echo(v)} is not a number (a target needs numbers; blank = NaN; map: turns other values "
                         f"into numbers)") from None
    for k, m in mapping.items():
        if _key_number(k) == x:
            return _mapped(m)
    said_inf = isinstance(v, str) and v.lstrip("+-").lower() in ("inf", "infinity")
    if not said_inf and not math.isnan(x) and not -_F32_MAX <= x <= _F32_MAX:   # (it became inf, silently)
        raise ValueError(f"{echo(v)} is beyond float32's range (+-3.4e38), which targets are stored in")
    return x


_F32_MAX = 3.4028234663852886e38


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


def check_columns(recipe: Any, table: str, names: list[str]) -> list[str]:
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
        if sp.stratify is not None:
            wanted.append((sp.stratify, "split.stratify"))
    if isinstance(inp.where, str):
        from .where import where_columns

        wanted += [(c, "inputs.where") for c in where_columns(inp.where)]
    for col, loc in wanted:
        if col not in have:
            close = close_columns(col, names)
            hint = f"; did you mean {', '.join(echo(c, 60) for c in close)}?" if close else ""
            raise RecipeError(f"{table}: no column {echo(col)} (columns: {column_list(names)}){hint}",
                              source=recipe.source, loc=loc)
        if names.count(col) > 1:
            raise RecipeError(f"{table}: column {echo(col)} is in the header {names.count(col)} times (columns: "
                              f"{column_list(names)}): give each column its own name", source=recipe.source,
                              loc=loc)
    used = {c for c, _ in wanted}
    return [n for n in names if n in used] or names[:1]   # one column at least: it gives the row count


def column_list(names: list[str], limit: int = 400) -> str:
    """A header's columns as a message lists them: each cut to 60 characters, the list cut near ``limit``
    characters saying how many columns there are (a message never grows with the header)."""
    out, size = [], 0
    for name in names:
        part = clip(name, 60)
        if out and size + len(part) > limit:
            return f"{', '.join(out)}, ... ({len(names)} columns)"
        out.append(part)
        size += len(part) + 2
    return ", ".join(out)


def close_columns(col: str, names: list[str], n: int = 3) -> list[str]:
    """The header's columns a message suggests for the unknown ``col``: those equal to it but for case,
    surrounding spaces or Unicode normalisation (NFC), else the closest by :mod:`difflib` (in that form; names
    compared by their first 200 characters, among the first 10,000 columns)."""
    import difflib
    import unicodedata

    def key(s: str) -> str:
        return unicodedata.normalize("NFC", s[:200]).casefold().strip()

    k = key(col)
    same = [c for c in names if c != col and key(c) == k]
    if same:
        return same[:n]
    keys: dict[str, str] = {}
    for c in names[:10_000]:
        keys.setdefault(key(c), c)
    return [keys[c] for c in difflib.get_close_matches(k, list(keys), n=n, cutoff=0.6)]


def row_options(recipe: Any, row: dict[str, Any], where: Any) -> dict[str, dict[str, Any]]:
    """The decoder options taken from the row, checked by each decoder's own option model."""
    from pydantic import ValidationError

    out = {}
    for f, opts in recipe.row_options.items():
        vals = {}
        for o, col in opts.items():
            if blank(row[col]):
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


def path_filler(recipe: Any, root: str) -> Any:
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
        if leaves_root(rel):   # (a NUL byte: path_problem's)
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
