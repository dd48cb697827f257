"""``inputs.where`` on table inputs (issue 35): an expression over the row's columns, parsed by a small
recursive-descent parser (never eval) and evaluated with pyarrow.compute.

The truth is computed here, not by the code under test: each generated table is read back with Python's csv
and json modules, each generated expression is kept as a tree and evaluated on those rows with plain Python
comparisons under the rules docs/tables.md states (blank cells are null, SQL's three-valued logic, a text
column compared with a number read by ``float``), and only then rendered as text for the recipe."""
from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path
from typing import Any, Optional

import pytest

from precompile.errors import RecipeError
from precompile.inputs import read_inputs
from precompile.inputs.table.where import MAX_CHARS, MAX_DEPTH, WhereSyntaxError, parse_where
from precompile.recipe import load_recipe

pa = pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")

NAMES = ["a", "b", "B", "\u00e4", "a b", "", " ", "10", "9", "a\"q", "x'y"]
NUMS = ["1", "2.5", "-3", "", "1e2", " 7 ", "0", "10", "nan", "-0.5", "3"]
WORDS = ["x", "1", "2", "", "y z"]
FRONTAL = ["Frontal", "Lateral", ""]


# -- the table ----------------------------------------------------------------------------------------------------
def _table(tmp: Path, fmt: str, seed: int, n: int = 40) -> tuple[str, list[dict], dict[str, str]]:
    """A table of ``n`` rows as ``fmt`` (csv, jsonl), the rows as Python's csv / json modules read the file back,
    and each column's kind as the file holds it (csv: all text)."""
    r = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        if fmt == "csv":
            rows.append({"id": f"r{i:03d}", "name": r.choice(NAMES), "num": r.choice(NUMS),
                         "flag": r.choice(["true", "false", ""]), "Frontal/Lateral": r.choice(FRONTAL),
                         "word": r.choice(WORDS), "and": r.choice(["p", "q"])})
        else:
            rows.append({"id": f"r{i:03d}", "name": r.choice(NAMES + [None]),
                         "num": r.choice([1, 2.5, -3, None, 100, 7, 0, 10, -0.5, 3]),
                         "flag": r.choice([True, False, None]), "Frontal/Lateral": r.choice(FRONTAL),
                         "word": r.choice(WORDS), "and": r.choice(["p", "q"])})
    path = tmp / f"t{seed}.{fmt}"
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(path, newline="", encoding="utf-8") as f:
            back = list(csv.DictReader(f))
        kinds = {c: "text" for c in rows[0]}
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        with open(path, encoding="utf-8") as f:
            back = [json.loads(line) for line in f if line.strip()]
        kinds = {c: "text" for c in rows[0]}
        kinds.update(num="number", flag="boolean")
    assert back == rows
    return str(path), back, kinds


# -- the truth: the rules of docs/tables.md, in plain Python ---------------------------------------------------------
class Expected(Exception):
    """The error the rules expect: ('type', column) or ('number', column, row index)."""


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v))


def _lit_kind(v: Any) -> str:
    return "boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else "text"


def _as_number(v: Any) -> Optional[float]:
    """A cell compared with a number: None when blank, else the number (text read by float(); NaN is null)."""
    if _blank(v):
        return None
    if isinstance(v, str):
        x = float(v)   # a ValueError: not a number (the oracle checks this before it evaluates)
        return None if math.isnan(x) else x
    return v


def _cell(row: dict, col: str, as_number: bool) -> Any:
    v = row[col]
    return _as_number(v) if as_number else (None if _blank(v) else v)


OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
       ">": lambda a, b: a > b, ">=": lambda a, b: a >= b}


def truth(node: tuple, row: dict) -> Optional[bool]:
    """SQL's three-valued logic: None is unknown."""
    tag = node[0]
    if tag == "cmp":
        _, col, op, lit, _ = node
        v = _cell(row, col, _lit_kind(lit) == "number")
        return None if v is None else OPS[op](v, lit)
    if tag == "in":
        _, col, values, neg = node
        v = _cell(row, col, bool(values) and _lit_kind(values[0]) == "number")
        if v is None:
            return None
        hit = any(v == x for x in values)
        return (not hit) if neg else hit
    if tag == "null":
        _, col, neg, _ = node
        return (not _blank(row[col])) if neg else _blank(row[col])
    if tag == "truth":
        return _cell(row, node[1], False)
    if tag == "not":
        v = truth(node[1], row)
        return None if v is None else not v
    vals = [truth(a, row) for a in node[1]]
    if tag == "and":
        return False if False in vals else None if None in vals else True
    return True if True in vals else None if None in vals else False


def leaves(node: tuple) -> list[tuple]:
    if node[0] in ("and", "or"):
        return [x for a in node[1] for x in leaves(a)]
    if node[0] == "not":
        return leaves(node[1])
    return [node]


def expected(node: tuple, rows: list[dict], kinds: dict[str, str]) -> Any:
    """The ids of the rows kept, or the Expected error (the first type error in the text's order; else the first
    row, over the columns compared with numbers, whose text cell is not a number)."""
    number_cols: list[str] = []
    for leaf in leaves(node):
        tag, col = leaf[0], leaf[1]
        k = kinds[col]
        if tag == "truth" and k != "boolean":
            raise Expected("type", col)
        if tag in ("cmp", "in"):
            lits = [leaf[3]] if tag == "cmp" else list(leaf[2])
            if not lits:
                continue
            lk = _lit_kind(lits[0])
            ok = (lk == k) or (lk == "number" and k == "text")
            if tag == "cmp" and k == "boolean" and leaf[2] not in ("==", "!="):
                ok = False
            if not ok:
                raise Expected("type", col)
            if lk == "number" and k == "text" and col not in number_cols:
                number_cols.append(col)
    firsts = []
    for order, col in enumerate(number_cols):
        for i, row in enumerate(rows):
            try:
                _as_number(row[col])
            except ValueError:
                firsts.append((i, order, col))
                break
    if firsts:
        i, _, col = min(firsts)
        raise Expected("number", col, i)
    return [row["id"] for row in rows if truth(node, row) is True]


# -- drawing expressions ----------------------------------------------------------------------------------------------
def _literal(r: random.Random, kind: str, col: str) -> Any:
    if kind == "boolean":
        return r.choice([True, False])
    if kind == "number":
        return r.choice([0, 1, 3, 7, 10, -3, 2.5, -0.5, 100, 1e2, 0.1])
    pool = {"name": NAMES, "num": NUMS, "flag": ["true", "false"], "Frontal/Lateral": FRONTAL, "word": WORDS,
            "and": ["p", "q"]}[col]
    return r.choice(pool + ["zz", "A"])


def draw_leaf(r: random.Random, kinds: dict[str, str], wrong: float) -> tuple:
    col = r.choice(list(k for k in kinds if k != "id"))
    k = kinds[col]
    lk = "number" if (k == "text" and col in ("num", "word") and r.random() < 0.6) else k
    if r.random() < wrong:
        lk = r.choice(["text", "number", "boolean"])
    what = r.random()
    if what < 0.5:
        ops = ["==", "!="] if lk == "boolean" and r.random() < 0.9 else list(OPS)
        return ("cmp", col, r.choice(ops), _literal(r, lk, col), r.random() < 0.3)
    if what < 0.75:
        values = tuple(dict.fromkeys(_literal(r, lk, col) for _ in range(r.randint(0, 4))))
        return ("in", col, values, r.random() < 0.5)
    if what < 0.92 or k != "boolean":
        return ("null", col, r.random() < 0.5, r.choice(["is", "=="]))
    return ("truth", col)


def draw_expr(r: random.Random, kinds: dict[str, str], depth: int, wrong: float) -> tuple:
    x = r.random()
    if depth <= 0 or x < 0.35:
        return draw_leaf(r, kinds, wrong)
    if x < 0.5:
        return ("not", draw_expr(r, kinds, depth - 1, wrong))
    return (r.choice(["and", "or"]), [draw_expr(r, kinds, depth - 1, wrong) for _ in range(r.randint(2, 3))])


def _kw(r: random.Random, word: str) -> str:
    return r.choice([word, word.upper(), word.capitalize()])


def _name(r: random.Random, col: str) -> str:
    if col.isidentifier() and col.lower() not in ("and", "or", "not", "in", "is", "null", "true", "false") \
            and r.random() < 0.7:
        return col
    return "`" + col.replace("`", "``") + "`"


def _render_lit(r: random.Random, v: Any) -> str:
    if isinstance(v, bool):
        return _kw(r, "true" if v else "false")
    if isinstance(v, (int, float)):
        return repr(v)
    q = r.choice(["'", '"'])
    body = v.replace("\\", "\\\\").replace(q, "\\" + q).replace("\n", "\\n")
    return q + body + q


PREC = {"or": 1, "and": 2, "not": 3}


def render(r: random.Random, node: tuple, parent: int = 0) -> str:
    tag = node[0]
    sp = lambda: r.choice([" ", "  ", "\t", " \n "])   # noqa: E731
    if tag == "cmp":
        _, col, op, lit, flip = node
        if flip:
            back = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
            text = f"{_render_lit(r, lit)}{sp()}{back[op]}{sp()}{_name(r, col)}"
        else:
            text = f"{_name(r, col)}{r.choice(['', ' '])}{op}{r.choice(['', ' '])}{_render_lit(r, lit)}"
    elif tag == "in":
        _, col, values, neg = node
        items = ", ".join(_render_lit(r, v) for v in values)
        text = f"{_name(r, col)} {_kw(r, 'not') + ' ' if neg else ''}{_kw(r, 'in')} [{items}]"
    elif tag == "null":
        _, col, neg, style = node
        if style == "is":
            text = f"{_name(r, col)} {_kw(r, 'is')} {_kw(r, 'not') + ' ' if neg else ''}{_kw(r, 'null')}"
        else:
            text = f"{_name(r, col)} {'!=' if neg else '=='} {_kw(r, 'null')}"
    elif tag == "truth":
        text = _name(r, node[1])
    elif tag == "not":
        text = f"{_kw(r, 'not')}{sp()}{render(r, node[1], PREC['not'])}"
    else:
        text = f"{sp()}{_kw(r, tag)}{sp()}".join(render(r, a, PREC[tag]) for a in node[1])
    mine = PREC.get(tag, 4)
    if mine < parent or (mine == parent and tag == "not") or r.random() < 0.1:
        return f"({text})"
    return text


def _recipe(table: str, where: Any, **extra: Any) -> dict:
    inp = {"root": ".", "table": table, "key": "id", "columns": {"w": {"column": "word", "kind": "text"}}}
    if where is not None:
        inp["where"] = where
    inp.update(extra)
    return {"name": "w", "inputs": inp}


def _kept(recipe: dict) -> tuple[list[str], Any]:
    got = read_inputs(load_recipe(recipe))
    return got.table.keys.to_list(), got


# -- the generated expressions against the truth ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_where_keeps_the_rows_pythons_csv_and_json_reading_says(tmp_path, fmt):
    """A seeded fuzzer of expressions over a generated table: the rows kept (and the row numbers they keep) are
    the truth's, and every expected error is raised naming its column (and row)."""
    table, rows, kinds = _table(tmp_path, fmt, seed=7 if fmt == "csv" else 8)
    r = random.Random(35 if fmt == "csv" else 36)
    seen = {"rows": 0, "type": 0, "number": 0, "empty": 0}
    for case in range(120):
        tree = draw_expr(r, kinds, r.randint(0, 3), wrong=0.08)
        text = render(r, tree)
        where = f"case {case}: {text!r} {tree}"
        try:
            want: Any = expected(tree, rows, kinds)
        except Expected as e:
            want = e.args
        try:
            got, inputs = _kept(_recipe(table, text))
        except RecipeError as e:
            msg = str(e)
            assert isinstance(want, tuple), f"{where}: refused: {msg}"
            assert "inputs.where" in msg and f"column {want[1]!r}" in msg, f"{where}: {msg}"
            if want[0] == "number":
                assert f"data row {want[2] + 1} (" in msg and "is not a number" in msg, f"{where}: {msg}"
            else:
                assert "holds " in msg and "at character " in msg, f"{where}: {msg}"
            seen[want[0]] += 1
            continue
        assert not isinstance(want, tuple), f"{where}: kept {got}, expected the error {want}"
        assert got == want, f"{where}: kept {got}, the truth keeps {want}"
        if want:
            by_id = {row["id"]: i for i, row in enumerate(rows)}
            assert inputs.table.row.tolist() == [by_id[k] + 1 for k in got], where   # data rows, 1-based
            seen["rows"] += 1
        else:
            seen["empty"] += 1
    assert seen["rows"] >= 30 and seen["type"] >= 3 and seen["empty"] >= 3, seen   # the draw reaches every outcome
    if fmt == "csv":
        assert seen["number"] >= 3, seen


def test_sql_nulls_blank_cells_and_not(tmp_path):
    """A blank cell makes a comparison unknown, and not unknown is unknown: neither Age > 40 nor not (Age > 40)
    keeps it (SQL's WHERE); is null does. A text cell float() reads as NaN is unknown in a comparison with a
    number, like a NaN number, but it is not blank."""
    path = tmp_path / "t.csv"
    path.write_text("id,Age,Sex,word\nr1,30,Male,x\nr2,,Female,x\nr3,50,Female,x\nr4,  ,Male,x\nr5,nan,Male,x\n")
    t = str(path)
    assert _kept(_recipe(t, "Age > 40"))[0] == ["r3"]
    assert _kept(_recipe(t, "not (Age > 40)"))[0] == ["r1"]
    assert _kept(_recipe(t, "Age is null"))[0] == ["r2", "r4"]   # the text nan is no blank cell...
    assert _kept(_recipe(t, "Age == null or Age < 40"))[0] == ["r1", "r2", "r4"]   # ...but as a number, unknown
    assert _kept(_recipe(t, "Age > 40 or Sex == 'Male'"))[0] == ["r1", "r3", "r4", "r5"]   # true or unknown
    assert _kept(_recipe(t, "Age > 40 and Sex == 'Male'"))[0] == []                          # false and unknown
    assert _kept(_recipe(t, "Age not in [30]"))[0] == ["r3"]


def test_a_where_that_keeps_no_row_says_so(tmp_path):
    """Before, a where leaving every row out read "table 't.csv' has no rows", of a table holding rows."""
    (tmp_path / "a.csv").write_text("id,Age,word\nr1,1,x\nr2,2,y\n")
    from precompile.compiler.plan import make_plan
    from precompile.errors import PlanError

    rec = _recipe(str(tmp_path / "a.csv"), "Age > 5 and word == '" + "y" * 500 + "'")
    assert _kept(rec)[0] == []
    with pytest.raises(PlanError) as e:
        make_plan(load_recipe(rec))
    msg = str(e.value)
    assert msg.startswith(f"table {str(tmp_path / 'a.csv')!r} has no rows that inputs.where keeps (\"Age > 5 and "), msg
    assert msg.endswith("... (522 characters))") and len(msg) < 400, msg
    (tmp_path / "a.csv").write_text("id,Age,word\n")
    with pytest.raises(PlanError, match=r"a\.csv' has no rows$"):   # without where, as before
        make_plan(load_recipe(_recipe(str(tmp_path / "a.csv"), None)))


def test_where_was_refused_for_tables_before(tmp_path):
    """Before issue 35 a table recipe with where was refused (table inputs take no where); now it keeps rows."""
    path = tmp_path / "t.csv"
    path.write_text("id,word\nr1,x\nr2,y\n")
    assert _kept(_recipe(str(path), "word == 'y'"))[0] == ["r2"]


def test_a_column_with_punctuation_in_backquotes_chexpert(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("Path,Frontal/Lateral,AP/PA,word\np1/a.jpg,Frontal,AP,x\np1/b.jpg,Lateral,,x\n"
                    "p2/c.jpg,Frontal,PA,x\n")
    got, _ = _kept({"name": "c", "inputs": {"root": ".", "table": str(path), "key": "Path", "where":
                                           '`Frontal/Lateral` == "Frontal" and `AP/PA` in ["AP", "PA"]',
                                           "columns": {"w": {"column": "word", "kind": "text"}}}})
    assert got == ["p1/a.jpg", "p2/c.jpg"]


# -- what where means for the rest of the plan --------------------------------------------------------------------
def test_labels_keys_and_row_errors_are_over_the_kept_rows(tmp_path):
    """Rows left out are not read further: a blank class and a repeated key there are no error; the label names
    are those of the kept rows; an error in a kept row names its data row in the file."""
    path = tmp_path / "t.csv"
    path.write_text("id,label,Age\nr1,cat,30\nr1,,90\nr2,dog,50\nr3,bird,70\nr4,,20\n")
    rec = _recipe(str(path), "Age >= 30 and Age < 80", columns={"y": {"column": "label", "kind": "label"}})
    got, inputs = _kept(rec)
    assert got == ["r1", "r2", "r3"]
    assert inputs.label_names == ["bird", "cat", "dog"]
    assert inputs.table.label is None or True
    assert inputs.table.row.tolist() == [1, 3, 4]
    assert [inputs.table.values["y"][i] for i in range(3)] == [1, 2, 0]
    rec = _recipe(str(path), "Age < 80", columns={"y": {"column": "label", "kind": "label"}})
    with pytest.raises(RecipeError, match=r"data row 5 \(1-based, header not counted\), column 'label': blank class"):
        _kept(rec)


def test_splits_are_over_the_kept_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,Age,split,word\n" + "".join(f"r{i},{i},{'train' if i % 2 else 'val'},x\n" for i in range(10)))
    rec = _recipe(str(path), "Age >= 5")
    rec["split"] = {"by": "column", "column": "split"}
    from precompile.compiler.plan import make_plan

    plan = make_plan(load_recipe(rec))
    held = {s.split: [plan.items[i].key for i in s.rows] if hasattr(plan, "items") else None for s in plan.shards}
    keys = sorted(k for s in plan.shards for k in s.table.keys.to_list(s.rows))
    assert keys == [f"r{i}" for i in range(5, 10)]
    assert set(held) == {"train", "val"}


def test_where_over_all_rows_of_several_files_names_each_files_row(tmp_path):
    (tmp_path / "a.csv").write_text("id,n,word\nr1,1,x\nr2,2,x\n")
    (tmp_path / "b.csv").write_text("id,n,word\nr3,3,x\nr4,oops,x\n")
    got, inputs = _kept(_recipe(str(tmp_path / "*.csv"), "n != '2' and word == 'x'"))
    assert got == ["r1", "r3", "r4"]
    assert inputs.table.row.tolist() == [1, 1, 2]
    with pytest.raises(RecipeError, match=r"b\.csv: data row 2 \(1-based, header not counted\), column 'n': 'oops' is "
                                          r"not a number"):
        _kept(_recipe(str(tmp_path / "*.csv"), "n > 1"))


def test_a_cell_that_is_no_number_stops_the_plan_whatever_on_error_says(tmp_path):
    """docs/tables.md: like the table's other faults (a non-numeric target, a blank class), found before anything
    is built; on_error governs inputs that fail when they are decoded."""
    (tmp_path / "t.csv").write_text("id,Age,word\nr1,1,x\nr2,n/a,y\n")
    for policy in ("fail", "skip"):
        rec = dict(_recipe(str(tmp_path / "t.csv"), "Age > 0"), on_error=policy)
        with pytest.raises(RecipeError, match=r"^inputs.where: .*t\.csv: data row 2 \(1-based, header not counted\), "
                                              r"column 'Age': 'n/a' is not a number"):
            _kept(rec)


def test_typed_columns_parquet_and_their_type_errors(tmp_path):
    import pyarrow.parquet as pq

    t = pa.table({"id": ["a", "b", "c", "d"], "age": pa.array([30, None, 50, 2 ** 60], pa.int64()),
                  "score": [0.5, float("nan"), 2.0, None], "ok": [True, False, None, True],
                  "when": pa.array([1, 2, 3, 4], pa.timestamp("s")), "word": ["x", "y", "z", "w"],
                  "cat": pa.array(["u", "v", "u", None]).dictionary_encode()})
    pq.write_table(t, tmp_path / "t.parquet")
    p = str(tmp_path / "t.parquet")
    assert _kept(_recipe(p, "age > 40"))[0] == ["c", "d"]
    assert _kept(_recipe(p, f"age == {2 ** 60}"))[0] == ["d"]      # exact for int64 beyond 2**53
    assert _kept(_recipe(p, "age > 2.5e1"))[0] == ["a", "c", "d"]
    assert _kept(_recipe(p, "score is null"))[0] == ["b", "d"]       # NaN is blank
    assert _kept(_recipe(p, "ok"))[0] == ["a", "d"]
    assert _kept(_recipe(p, "not ok"))[0] == ["b"]
    assert _kept(_recipe(p, "ok != true"))[0] == ["b"]
    assert _kept(_recipe(p, "cat in ['u']"))[0] == ["a", "c"]
    with pytest.raises(RecipeError, match=r"inputs.where: at character 8: column 'age' of .*t\.parquet holds int64 "
                                          r"values; it cannot be compared with the text '30'; compare it with a number"):
        _kept(_recipe(p, "age == '30'"))
    with pytest.raises(RecipeError, match=r"column 'ok' of .* holds bool values; booleans compare with == and != only"):
        _kept(_recipe(p, "ok < true"))
    with pytest.raises(RecipeError, match=r"column 'when' of .* holds timestamp\[ms\] values; inputs.where compares "
                                          r"text, numbers and booleans"):
        _kept(_recipe(p, "when > 3"))
    with pytest.raises(RecipeError, match=r"column 'word' of .* holds text values; a column alone is a condition only "
                                          r"when it holds booleans"):
        _kept(_recipe(p, "word"))


def test_numbers_compare_exactly_beyond_2_53(tmp_path):
    """Integers compare exactly with floats, as Python compares them: an int64 column with 2.5 or 9.3e18, a float
    column (text read by float()) with an integer no float holds. Before, a literal beyond 2**53 against a float
    column crashed in pyarrow (ArrowInvalid: "outside of the range exactly representable"), and an int64
    column was rounded to floats against a float literal."""
    import operator
    import pyarrow.parquet as pq

    big = 2 ** 53
    ints = [big, big + 1, big - 1, 5, -7, 2 ** 63 - 1, -2 ** 63 + 1, 0]
    floats = [float(big), 0.5, -2.5, 1e300, float(2 ** 63), 3.0, -0.0]
    texts = ["9007199254740993", "9007199254740992", "1e16", "2.5", "-3", "7"]
    n = max(len(ints), len(floats), len(texts))
    ids = [f"r{i}" for i in range(n)]
    col = {"i": ints + [None] * (n - len(ints)), "f": floats + [None] * (n - len(floats)),
           "t": texts + [None] * (n - len(texts))}
    pq.write_table(pa.table({"id": ids, "i": pa.array(col["i"], pa.int64()), "f": pa.array(col["f"], pa.float64()),
                             "t": col["t"], "word": ["x"] * n}), tmp_path / "t.parquet")
    lits = [big, big + 1, big - 1, 2 ** 63 - 1, -(2 ** 63) + 1, 2.5, -2.5, 9.3e18, 1e300, -1e300, float(big), 5, 0,
            9.007199254740993e15, 3]
    ops = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
           ">=": operator.ge}
    p = str(tmp_path / "t.parquet")
    for c in ("i", "f", "t"):
        cells = [None if v is None else float(v) if c == "t" else v for v in col[c]]
        for lit in lits:
            for op, fn in ops.items():
                want = [k for k, v in zip(ids, cells) if v is not None and fn(v, lit)]
                assert _kept(_recipe(p, f"{c} {op} {lit!r}"))[0] == want, (c, op, lit)
            want = [k for k, v in zip(ids, cells) if v is not None and v in (lit, 3)]
            assert _kept(_recipe(p, f"{c} in [{lit!r}, 3]"))[0] == want, (c, "in", lit)
            want = [k for k, v in zip(ids, cells) if v is not None and v not in (lit, 3)]
            assert _kept(_recipe(p, f"{c} not in [{lit!r}, 3]"))[0] == want, (c, "not in", lit)


def test_unsigned_and_small_integer_columns_compare_exactly(tmp_path):
    """A Parquet uint64 column holding values beyond 2**63 crashed every comparison (pyarrow's ArrowInvalid: "not in
    range: 0 to 9223372036854775807"); uint64, uint32, int8 and float32 columns now compare exactly, as Python's
    own comparisons of the same values say, with literals inside and outside their range."""
    import operator
    import pyarrow.parquet as pq

    data = {"u64": ([0, 2 ** 64 - 1, None, 5, 2 ** 63, 1], pa.uint64()), "u32": ([0, 7, None, 5, 2 ** 32 - 1, 1],
                                                                                  pa.uint32()),
            "i8": ([1, -2, None, 127, -128, 5], pa.int8()), "f32": ([0.5, -1.0, None, 3.0, 1e30, 2.5], pa.float32())}
    ids = [f"r{i}" for i in range(6)]
    pq.write_table(pa.table({"id": ids, "word": ["x"] * 6, **{c: pa.array(v, t) for c, (v, t) in data.items()}}),
                   tmp_path / "t.parquet")
    p = str(tmp_path / "t.parquet")
    ops = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
           ">=": operator.ge}
    for c, (values, typ) in data.items():
        cells = pa.array(values, typ).to_pylist()   # float32 values as the column holds them
        for lit in [-1, 0, 5, 127, 128, 2 ** 63 - 1, 2.5, -0.5, 1e30, 1e300, -1e300, 9.3e18, 1.8446744073709552e19]:
            for op, fn in ops.items():
                want = [k for k, v in zip(ids, cells) if v is not None and fn(v, lit)]
                assert _kept(_recipe(p, f"{c} {op} {lit!r}"))[0] == want, (c, op, lit)
            want = [k for k, v in zip(ids, cells) if v is not None and v in (lit, 1)]
            assert _kept(_recipe(p, f"{c} in [{lit!r}, 1]"))[0] == want, (c, "in", lit)


# -- hostile expressions: each a clear error, never a crash -------------------------------------------------------------
HOSTILE = [
    ("(" * (MAX_DEPTH + 1) + "a == 1" + ")" * (MAX_DEPTH + 1), rf"at character {MAX_DEPTH + 1} .*nested deeper than "
                                                                rf"{MAX_DEPTH} levels"),
    ("not " * (MAX_DEPTH + 1) + "a", rf"nested deeper than {MAX_DEPTH} levels"),
    ("a == 1 or " * 500 + "a == 2", rf"the expression has 5006 characters; at most {MAX_CHARS}"),
    ("a = 1", r"at character 3 \('= 1'\): '=' is no operator: compare with =="),
    ("a == 1 && b == 2", r"at character 8 \('&& b == 2'\): '&&' is no operator: write and, or"),
    ("a ~ 1", r"at character 3 \('~ 1'\): unexpected character '~'"),
    ("a == 'open", r"at character 6 \(\"'open\"\): a string is never closed"),
    ("`open == 1", r"at character 1 .*a backquoted column name is never closed"),
    ("", r"an empty expression"),
    ("a ==", r"at character 5 \(the end of the expression\): expected a value"),
    ("(a == 1", r"at character 8 \(the end of the expression\): expected \) to close the \( at character 1"),
    ("a == 1)", r"at character 7 \('\)'\): expected and, or, or the end of the expression"),
    ("a in [b]", r"a list after in holds literals"),
    ("a in [1, 'x']", r"a list after in holds values of one type, not number and text"),
    ("a < null", r"null compares with == and != only"),
    ("1 == 1", r"a comparison needs a column on one side"),
    ("a == b", r"two columns are not compared"),
    ("a == 1e999", r"a number too large for a 64-bit float"),
    ("a == 'x\\q'", r"an unknown escape in a string"),
    ("in == 1", r"found the keyword in \(a column of that name goes in backquotes: `in`\)"),
    ("a is 3", r"expected null after is"),
    ("a \x00 1", r"unexpected character '\\x00'"),
]


@pytest.mark.parametrize("text,message", HOSTILE)
def test_hostile_expressions_are_clear_recipe_errors(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text("id,a,b,word\nr1,1,2,x\n")
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(_recipe(str(path), text))
    assert str(e.value).startswith("inputs.where: "), str(e.value)
    assert len(str(e.value)) < 400


def test_an_unknown_column_names_the_table_and_its_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,Age,word\nr1,1,x\n")
    with pytest.raises(RecipeError, match=r"inputs.where: .*t\.csv: no column 'Agee' \(columns: id, Age, word\)"):
        _kept(_recipe(str(path), "Agee > 3"))


@pytest.mark.parametrize("header,text,hint", [
    ("id,Age,word", "age > 3", "did you mean 'Age'?"),                       # case
    ("id,Age,word", "Agee > 3", "did you mean 'Age'?"),                      # a typo
    ("id, Age,word", "Age > 3", "did you mean ' Age'?"),                     # a space the header keeps
    ("id,\u00c2ge,word", "`A\u0302ge` > 3", "did you mean '\u00c2ge'?"),   # unicode: NFD in the recipe, NFC in the file
    ("id,Frontal/Lateral,word", "`frontal lateral` == 'x'", "did you mean 'Frontal/Lateral'?"),
])
def test_an_unknown_column_suggests_the_close_ones(tmp_path, header, text, hint):
    path = tmp_path / "t.csv"
    path.write_text(header + "\nr1,1,x\n", encoding="utf-8")
    with pytest.raises(RecipeError) as e:
        _kept(_recipe(str(path), text))
    assert str(e.value).endswith(hint), str(e.value)
    assert "no column " in str(e.value) and "(columns: id, " in str(e.value)


def test_an_unknown_column_far_from_all_suggests_nothing(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,Age,word\nr1,1,x\n")
    with pytest.raises(RecipeError) as e:
        _kept(_recipe(str(path), "zzzz > 3"))
    assert str(e.value).endswith("no column 'zzzz' (columns: id, Age, word)"), str(e.value)


def test_unknown_column_messages_are_bounded(tmp_path):
    """A 3,000-character column name and a 3,000-column header: the message quotes each in bounded length and says
    how many columns there are."""
    long = "x" * 3000
    path = tmp_path / "t.csv"
    path.write_text(f"id,word,{long}," + ",".join(f"c{i}" for i in range(3000)) + "\nr1,a,1" + ",1" * 3000 + "\n")
    with pytest.raises(RecipeError) as e:
        _kept(_recipe(str(path), f"`{long}y` == 1"))
    msg = str(e.value)
    assert len(msg) < 1200 and "no column 'xxxxx" in msg and "'... (3001 characters) (columns: id, word, " in msg, msg
    assert msg.endswith(", ... (3003 columns)); did you mean 'xxxxxxxx" + "x" * 52 + "'... (3000 characters)?"), msg
    with pytest.raises(RecipeError) as e:
        _kept(_recipe(str(path), "zz == 1"))
    msg = str(e.value)
    assert len(msg) < 1200 and msg.endswith(", ... (3003 columns))"), msg
    with pytest.raises(RecipeError, match=r"column 'xxxxx+'\.\.\. \(3000 characters\) of .*t\.csv holds text values; "
                                          r"a column alone is a condition"):
        _kept(_recipe(str(path), f"`{long}`"))
    with pytest.raises(RecipeError) as e:
        _kept(_recipe(str(path), f"`{long}`"))
    assert len(str(e.value)) < 800, len(str(e.value))


def test_unicode_bare_names_are_pythons_identifiers(tmp_path):
    """A bare column name is what Python calls an identifier: combining marks (NFD \u00c2, Devanagari vowel signs)
    continue a name, as str.isidentifier says; before, the tokenizer stopped at the mark ("unexpected character")."""
    names = ["A\u0302ge", "\u0928\u093e\u092e", "\u00e9t\u00e9", "x\u0301"]
    for name in names:
        assert name.isidentifier()
    path = tmp_path / "t.csv"
    path.write_text("id,word," + ",".join(names) + "\nr1,w,1,a,x,5\nr2,w,2,b,y,6\n", encoding="utf-8")
    assert _kept(_recipe(str(path), f"{names[0]} > 1 and {names[1]} == 'b' and {names[2]} != 'x' and {names[3]} >= 6"))[0] \
        == ["r2"]
    with pytest.raises(RecipeError, match=r"at character 2 \('~b == 1'\): unexpected character '~' \(a column name "
                                          r"holding it goes in backquotes: `a~b`\)"):
        load_recipe(_recipe(str(path), "a~b == 1"))


def test_where_on_a_folder_and_a_capture_map_on_a_table_are_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,word\nr1,x\n")
    with pytest.raises(RecipeError, match=r"where: \{capture: regex\}"):
        load_recipe(_recipe(str(path), {"word": "x"}))
    with pytest.raises(RecipeError, match=r"where as an expression is for table inputs"):
        load_recipe({"name": "f", "inputs": {"root": ".", "match": "{a}.png", "where": "a == 1",
                                             "fields": {"image": {"decoder": "image"}}}})


def test_random_garbage_never_crashes_the_parser():
    """Random token soup and random characters: either a tree or a WhereSyntaxError (a ValueError), nothing else,
    and never deeper recursion than the limit allows."""
    r = random.Random(3535)
    pieces = ["a", "`b c`", "'s'", '"t"', "1", "-2.5", "==", "!=", "<", ">=", "(", ")", "[", "]", ",", "and", "or",
              "not", "in", "is", "null", "true", "FALSE", " ", "`", "'", "\\", "=", "!", "-", ".", "e5", "\u00e9"]
    parsed = refused = 0
    for _ in range(3000):
        if r.random() < 0.8:
            text = "".join(r.choice(pieces) + r.choice(["", " "]) for _ in range(r.randint(0, 14)))
        else:
            text = "".join(chr(r.randint(0, 0x2FF)) for _ in range(r.randint(0, 20)))
        try:
            parse_where(text)
            parsed += 1
        except WhereSyntaxError as e:
            assert str(e).startswith(("at character ", "the expression has")), (text, str(e))
            refused += 1
    assert parsed > 50 and refused > 1000, (parsed, refused)
