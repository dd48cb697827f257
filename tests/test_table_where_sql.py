"""``inputs.where`` against SQLite (issue 35): the rows an expression keeps are the rows SQLite's ``WHERE`` keeps
for the same expression written in SQL, over the same rows (a property test drawn by hypothesis).

SQLite is the truth for the logic: three-valued NULL logic in ``not``/``and``/``or``, ``IN``/``NOT IN`` with a
null operand, ``IS NULL``, integers compared exactly, text compared by code point (SQLite's BINARY collation
compares UTF-8 bytes). The cells go in as docs/tables.md says a cell reads, computed here with plain Python on
the rows Python's csv and json modules read back: a blank cell (empty, only whitespace, null) is NULL; a CSV
cell compared with a number is ``float(cell)`` (NaN: NULL). pandas' ``DataFrame.query`` would be a second
truth, but it is not installed here and its NaN comparisons are two-valued (``not (x > 1)`` keeps a NaN row)."""
from __future__ import annotations

import csv
import json
import math
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precompile.inputs import read_inputs
from precompile.recipe import load_recipe

pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")

#: text cells: unicode (NFC and NFD forms, CJK, an emoji, a zero-width space that is no whitespace), blanks
#: (empty, spaces, a no-break and an ideographic space), cells that differ by case or surrounding space
TEXTS = ["a", "B", "b", "\u00e4", "\u00c4", "\u00e9", "e\u0301", "\u65e5\u672c", "a b", " a", "", " ", "\u00a0",
         "\u3000", "\u200b", "\U0001f600", "z", "Z9"]
#: number cells of a CSV (text read by float(): signs, exponents, spaces, nan, inf, Arabic-Indic and fullwidth
#: digits) and blanks
NUMS = ["1", "2.5", "-3", "", " 7 ", "1e2", "nan", "0", "10", "-0.5", "inf", "-inf", "\u0663", "\uff11\uff12", "  ",
        "+4", ".5", "3.", "1E-1"]
INTS = [None, 0, 1, -3, 7, 10, 100, 2 ** 40]
FLOATS = [None, 0.0, -0.0, 0.5, 2.5, -3.0, 100.0, 1e-9]
BOOLS = [None, True, False]
NUM_LITS = [0, 1, 3, 7, 10, -3, 2.5, -0.5, 100, 1e2, 0.1, 12, 2 ** 40, -0.0]


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


def _number(v: Any) -> Optional[float]:
    if _blank(v):
        return None
    x = float(v)
    return None if math.isnan(x) else x


# -- the tables ------------------------------------------------------------------------------------------------------
@st.composite
def tables(draw: Any) -> tuple[str, list[dict], dict[str, str]]:
    """The format, the rows (as the file will hold them) and each column's kind in the expression language."""
    fmt = draw(st.sampled_from(["csv", "jsonl"]))
    n = draw(st.integers(1, 25))
    if fmt == "csv":
        cols = {"n": st.sampled_from(NUMS), "t": st.sampled_from(TEXTS), "u": st.sampled_from(TEXTS)}
        kinds = {"n": "text", "t": "text", "u": "text"}
    else:
        cols = {"i": st.sampled_from(INTS), "x": st.sampled_from(FLOATS), "b": st.sampled_from(BOOLS),
                "t": st.sampled_from(TEXTS + [None])}
        kinds = {"i": "number", "x": "number", "b": "boolean", "t": "text"}
    rows = [{"id": f"r{k:03d}", **{c: draw(s) for c, s in cols.items()}} for k in range(n)]
    return fmt, rows, kinds


def _write(tmp: Path, fmt: str, rows: list[dict]) -> tuple[str, list[dict]]:
    path = tmp / f"t.{fmt}"
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(path, newline="", encoding="utf-8") as f:
            back = list(csv.DictReader(f))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        with open(path, encoding="utf-8") as f:
            back = [json.loads(line) for line in f]
    assert back == rows
    return str(path), back


# -- the expressions: a tree, rendered in the recipe's language and in SQL ---------------------------------------------
def _leaf(kinds: dict[str, str]) -> Any:
    """A type-correct leaf: a text column with text or (CSV numbers) numbers, a number column with numbers, a
    boolean column with true/false or alone; or a null test."""
    def for_col(col: str) -> Any:
        k = kinds[col]
        if k == "boolean":
            lits = st.booleans()
            ops = st.sampled_from(["==", "!="])
        elif k == "number" or col == "n":
            lits = st.sampled_from(NUM_LITS)
            ops = st.sampled_from(["==", "!=", "<", "<=", ">", ">="])
        else:
            lits = st.sampled_from(TEXTS + ["A", "\u00e4b", "y"])
            ops = st.sampled_from(["==", "!=", "<", "<=", ">", ">="])
        parts = [st.tuples(st.just("cmp"), st.just(col), ops, lits, st.booleans()),
                 st.tuples(st.just("in"), st.just(col), st.lists(lits, min_size=1, max_size=4, unique=True).map(tuple),
                           st.booleans()),
                 st.tuples(st.just("null"), st.just(col), st.booleans())]
        if k == "boolean":
            parts.append(st.tuples(st.just("truth"), st.just(col)))
        return st.one_of(parts)
    return st.sampled_from(sorted(kinds)).flatmap(for_col)


def expressions(kinds: dict[str, str]) -> Any:
    return st.recursive(_leaf(kinds), lambda sub: st.one_of(
        st.tuples(st.just("not"), sub),
        st.tuples(st.sampled_from(["and", "or"]), st.lists(sub, min_size=2, max_size=3))), max_leaves=8)


def _text_lit(v: str, quote: str) -> str:
    return quote + v.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote


def render(node: tuple) -> str:
    """The recipe's language (column names in backquotes or bare, keywords in mixed case)."""
    tag = node[0]

    def lit(v: Any) -> str:
        return ("TRUE" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, (int, float)) \
            else _text_lit(v, '"')

    if tag == "cmp":
        _, col, op, v, flip = node
        if flip:
            back = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
            return f"({lit(v)} {back[op]} `{col}`)"
        return f"({col} {op} {lit(v)})"
    if tag == "in":
        return f"({node[1]} {'NOT ' if node[3] else ''}in [{', '.join(lit(v) for v in node[2])}])"
    if tag == "null":
        return f"({node[1]} is {'not ' if node[2] else ''}Null)"
    if tag == "truth":
        return f"(`{node[1]}`)"
    if tag == "not":
        return f"(not {render(node[1])})"
    return "(" + f" {tag.upper()} ".join(render(a) for a in node[1]) + ")"


def to_sql(node: tuple, kinds: dict[str, str]) -> str:
    """The same expression in SQL over the table :func:`_sqlite` makes (``<col>`` as written, NULL when blank;
    ``<col>__num``: a CSV column's numbers)."""
    tag = node[0]

    def lit(v: Any) -> str:
        if isinstance(v, bool):
            return "1" if v else "0"
        if isinstance(v, (int, float)):
            return repr(float(v)) if isinstance(v, float) else str(v)
        return "'" + v.replace("'", "''") + "'"

    def ref(col: str, v: Any) -> str:
        as_num = isinstance(v, (int, float)) and not isinstance(v, bool) and kinds[col] == "text"
        return f'"{col}__num"' if as_num else f'"{col}"'

    if tag == "cmp":
        _, col, op, v, _ = node
        return f"({ref(col, v)} {({'==': '=', '!=': '<>'}).get(op, op)} {lit(v)})"
    if tag == "in":
        _, col, vals, neg = node
        return f"({ref(col, vals[0])} {'NOT IN' if neg else 'IN'} ({', '.join(lit(v) for v in vals)}))"
    if tag == "null":
        return f'("{node[1]}" IS {"NOT " if node[2] else ""}NULL)'
    if tag == "truth":
        return f'("{node[1]}")'
    if tag == "not":
        return f"(NOT {to_sql(node[1], kinds)})"
    return "(" + f" {tag.upper()} ".join(to_sql(a, kinds) for a in node[1]) + ")"


def _sqlite(rows: list[dict], kinds: dict[str, str]) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    cols = [c for c in rows[0] if c != "id"]
    decl = ['"id" TEXT'] + [f'"{c}" {"TEXT" if kinds[c] == "text" else "NUMERIC"}' for c in cols] + \
        [f'"{c}__num" REAL' for c in cols if kinds[c] == "text"]
    db.execute(f"CREATE TABLE t ({', '.join(decl)})")
    for row in rows:
        vals = [row["id"]] + [None if _blank(row[c]) else row[c] for c in cols] + \
            [_number(row[c]) if c == "n" else None for c in cols if kinds[c] == "text"]
        db.execute(f"INSERT INTO t VALUES ({', '.join('?' * len(vals))})", vals)
    return db


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_where_keeps_the_rows_sqlites_where_keeps(data):
    fmt, rows, kinds = data.draw(tables())
    tree = data.draw(expressions(kinds))
    with tempfile.TemporaryDirectory() as tmp:
        table, back = _write(Path(tmp), fmt, rows)
        db = _sqlite(back, kinds)
        sql = to_sql(tree, kinds)
        want = [r[0] for r in db.execute(f"SELECT id FROM t WHERE {sql} ORDER BY id")]
        text = render(tree)
        rec = {"name": "w", "inputs": {"root": ".", "table": table, "key": "id", "where": text,
                                       "columns": {"c": {"column": "t", "kind": "text"}}}}
        got = read_inputs(load_recipe(rec)).table.keys.to_list()
    assert got == want, (text, sql, back)
