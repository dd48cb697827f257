"""A seeded generator of hostile tables (CSV, TSV, JSON Lines) against the standard library as the oracle.

Each case writes a table whose structure is drawn at random (quotes opened, closed, doubled and stray;
separators and line breaks inside cells; byte order marks; blank lines; ragged rows; huge and empty
cells; NUL bytes; bytes that are not UTF-8; CRLF and lone CR; cut files; for JSON Lines mixed types,
strings that look like dates, numbers past int64, duplicate keys, objects over several lines, two on a
line, nesting past the limit) and plans a recipe reading every column as text (the key, text fields,
sometimes a label and a path template). The oracle reads the same bytes with ``csv.reader(strict=True)``
or ``json.loads`` per line and says what the rows are, or that the file is broken (then, or when the
rows cannot make samples: a blank or repeated key, a class that is blank), the plan must fail. So each
table either plans rows equal to the oracle's, cell for cell and in order, or fails with a
PrecompileError naming the file, in a message of bounded size; never a traceback, never other rows.

    TABLE_FUZZ_SEED=7 TABLE_FUZZ_CASES=3000 python -m pytest -q tests/test_table_fuzz.py   # explore
"""
from __future__ import annotations

import csv
import io
import json
import os
import random
from pathlib import Path
from typing import Any, Optional

import pytest

from precompile.compiler.plan import make_plan
from precompile.errors import PrecompileError
from precompile.recipe import load_recipe

pa = pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")

SEED = int(os.environ.get("TABLE_FUZZ_SEED", "0"))
CASES = int(os.environ.get("TABLE_FUZZ_CASES", "240"))
COLS = ["id", "a", "b"]

#: cell texts: plain and hostile
ATOMS = ["", " ", "plain", "two words", "with,comma", "with\ttab", 'quote"inside', '"starts', 'ends"', '""',
         '"', "new\nline", "cr\rline", "crlf\r\nline", "\x00nul", "é中🙂", "\u2028sep", "2020-01-01",
         "2021-03-04T10:11:12+02:00", "1", "1.0", "00012", "-0", "nan", "\ufeffbom", "back\\slash", "{x}", "..",
         "a/b", "/abs", "\u00a0"]
#: JSON values
JSON_ATOMS: list[Any] = ["", " ", "plain", "2020-01-01", "2020-01-01 10:11:12", "2021-03-04T10:11:12+02:00",
                         'q"uote', "back\\slash", "\u0000", "é🙂", "new\nline", 0, 1, -7, 1.5, 2.0, -0.0, 1e300,
                         12345678901234567890, True, False, None, [], [1, 2], ["x"], {}, {"k": 1}, {"k": "2020-01-01"}]


# -- the oracle ----------------------------------------------------------------------------------------

class Broken(Exception):
    """The oracle says the file (or its rows as samples) cannot be read."""


def _rows_as_samples(rows: list[dict[str, str]], label: Optional[str], path: bool) -> list[list[str]]:
    """The (key, a, b) of each row, or Broken where a plan must refuse them: a blank, repeated or NUL key,
    a blank class name, a path no file can have."""
    keys = [r["id"] for r in rows]
    for k in keys:
        if not k.strip() or "\x00" in k:
            raise Broken("blank or NUL key")
        if path and (k.startswith("/") or ".." in k.split("/") or len(k) > 4096):
            raise Broken("path leaves the root")
    if len(set(keys)) != len(keys):
        raise Broken("repeated key")
    if label is not None and any(not r[label].strip() for r in rows):
        raise Broken("blank class")
    return [[r[c] for c in COLS] for r in rows]


def csv_oracle(data: bytes, delimiter: str, quoting: bool) -> list[dict[str, str]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise Broken("not UTF-8") from None
    fmt = {"delimiter": delimiter, "quoting": csv.QUOTE_MINIMAL if quoting else csv.QUOTE_NONE, "strict": True}
    limit = csv.field_size_limit(1 << 30)   # cells of any length
    try:
        rows = [r for r in csv.reader(io.StringIO(text, newline=""), **fmt) if r]
    except csv.Error:
        raise Broken("not valid CSV") from None
    finally:
        csv.field_size_limit(limit)
    if not rows or rows[0] != COLS:
        raise Broken("header")
    if any(len(r) != len(COLS) for r in rows[1:]):
        raise Broken("ragged")
    return [dict(zip(COLS, r)) for r in rows[1:]]


def _kind(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(v)]


def _consistent(values: list[Any]) -> bool:
    """Whether pyarrow can hold these values in one column (one JSON type, null anywhere, at every depth)."""
    kinds = {_kind(v) for v in values} - {None}
    if len(kinds) > 1:
        return False
    if kinds == {"list"}:
        return _consistent([x for v in values if v is not None for x in v])
    if kinds == {"object"}:
        keys = {k for v in values if v is not None for k in v}
        return all(_consistent([v.get(k) for v in values if v is not None]) for k in keys)
    return True


def _depth(v: Any) -> int:
    """How deep lists and objects nest in ``v`` (a scalar: 0), without recursion."""
    best, todo = 0, [(v, 0)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (dict, list)):
            best = max(best, d + 1)
            todo.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return best


def _strings(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in [k, *_strings(x)]]
    if isinstance(v, list):
        return [s for x in v for s in _strings(x)]
    return []


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    if len({k for k, _ in pairs}) != len(pairs):
        raise Broken("a key twice in an object")
    return dict(pairs)


def jsonl_oracle(data: bytes) -> list[dict[str, str]]:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    objs = []
    for line in data.split(b"\n"):
        if not line.strip(b" \t\r"):
            continue
        try:
            v = json.loads(line.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise Broken("not one JSON value") from None
        if not isinstance(v, dict) or _depth(v) > 100:
            raise Broken("not an object, or too deep")
        if any(s != s.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for s in _strings(v)):
            raise Broken("a lone surrogate")   # no UTF-8 text can hold it
        objs.append(v)
    names = {k for v in objs for k in v}
    if not objs or not set(COLS) <= names:
        raise Broken("no rows, or a column missing")
    for k in names:
        if not _consistent([v.get(k) for v in objs]):
            raise Broken("a column changes type")
    for k in COLS:
        if any(isinstance(v.get(k), (list, dict)) for v in objs):
            raise Broken("a nested value read as text")
        if any(isinstance(v.get(k), float) and (v[k] != v[k] or abs(v[k]) == float("inf")) for v in objs):
            raise Broken("NaN or infinity")
    return [{c: "" if v.get(c) is None else str(v[c]) for c in COLS} for v in objs]


# -- the generator ---------------------------------------------------------------------------------------

#: cells any writer and reader agree on (no separator, quote, line break)
CLEAN = [a for a in ATOMS if a.strip() and not any(ch in a for ch in ',\t"\r\n\x00\u2028')]


def _cell(rng: random.Random, clean: bool = False) -> str:
    if clean:
        return rng.choice(CLEAN)
    r = rng.random()
    if r < 0.02:
        return "x" * rng.choice([70_000, 1_100_000])   # past the csv module's field limit, past a block
    if r < 0.5:
        return rng.choice(ATOMS)
    return "".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 3)))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One structural change: a byte inserted, deleted or replaced where structure lives, a blank line, a
    BOM, a cut, a duplicated or ragged line."""
    if not data:
        return data
    i = rng.randrange(len(data))
    op = rng.randrange(12)
    if op == 0:
        return data[:i] + rng.choice([b'"', b",", b"\t", b"\n", b"\r", b"\x00", b"\xff", b"{", b"}", b"\\"]) + data[i:]
    if op == 1:
        return data[:i] + data[i + 1:]
    if op == 2:
        marks = [j for j, c in enumerate(data) if c in b'",\t\n\r{}[]:\\']
        j = rng.choice(marks) if marks else i
        return data[:j] + data[j + 1:]
    if op == 3:
        return data[:i] + rng.choice([b"\n\n", b"\r\n\r\n", b"\n \n", b"\n\t\n"]) + data[i:]
    if op == 4:
        return b"\xef\xbb\xbf" + data
    if op == 5:
        return data[:i]
    if op == 6:
        lines = data.split(b"\n")
        k = rng.randrange(len(lines))
        return b"\n".join(lines[:k + 1] + lines[k:])
    if op == 7:
        return data.replace(b"\n", b"\r\n")
    if op == 8 and rng.random() < 0.5:
        return data[:i] + b"\xc3" + data[i:]   # a cut UTF-8 sequence
    return data + rng.choice([b"", b"\n", b"\n\n", b'"'])


def gen_delimited(rng: random.Random, delimiter: str) -> bytes:
    clean = rng.random() < 0.4
    rows = [[f"r{i}", _cell(rng, clean), _cell(rng, clean)] for i in range(rng.randint(0, 8))]
    if rng.random() < 0.2:
        for r in rows:
            r[0] = _cell(rng) if rng.random() < 0.3 else r[0]
    if rng.random() < 0.03:   # many rows past one block, cells holding line breaks
        rows = [[f"r{i}", f'line {i}\n"{i}"' * 3, "x" * 200] for i in range(6000)]
    mode = rng.choice(["minimal", "all", "none", "naive"])
    s = io.StringIO()
    if mode == "naive":   # no quoting at all: what a hand-written join makes
        s.write("\n".join(delimiter.join(r) for r in [COLS, *rows]) + "\n")
    else:
        quoting = {"minimal": csv.QUOTE_MINIMAL, "all": csv.QUOTE_ALL, "none": csv.QUOTE_NONE}[mode]
        w = csv.writer(s, delimiter=delimiter, quoting=quoting, escapechar="\\" if mode == "none" else None,
                       lineterminator=rng.choice(["\n", "\r\n"]))
        w.writerow(COLS)
        w.writerows(rows)
    data = s.getvalue().encode("utf-8", "surrogatepass")
    for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
        data = _mutate(rng, data)
    return data


def _jvalue(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.03:
        d = rng.choice([50, 100, 101, 400])
        v: Any = 1
        for _ in range(d):
            v = [v] if rng.random() < 0.5 else {"k": v}
        return v
    if r < 0.05:
        return "x" * 1_100_000
    return rng.choice(JSON_ATOMS)


def gen_jsonl(rng: random.Random) -> bytes:
    rows = []
    # a column's type is drawn once, then changed in some files: pyarrow refuses the change
    kinds = {c: rng.choice(["str", "str", "str", "num", "num", "any"]) for c in ("a", "b")}
    for i in range(rng.randint(0, 8)):
        row: dict[str, Any] = {"id": f"r{i}" if rng.random() < 0.9 else _jvalue(rng)}
        for c in ("a", "b"):
            if rng.random() < 0.1:
                continue   # missing: null
            v = _jvalue(rng)
            if kinds[c] == "str" and rng.random() < 0.98:
                v = rng.choice([x for x in JSON_ATOMS if isinstance(x, str)])
            elif kinds[c] == "num" and rng.random() < 0.98:
                v = rng.choice([0, 1, -7, 1.5, 2.0, -0.0, 1e300, 12345678901234567890, None])
            row[c] = v
        rows.append(row)
    lines = [json.dumps(r, ensure_ascii=rng.random() < 0.5) for r in rows]
    if lines and rng.random() < 0.1:
        k = rng.randrange(len(lines))
        lines[k] = rng.choice([json.dumps(rows[k], indent=1), lines[k] + " " + lines[k], "[1, 2]", '"s"', "5",
                               lines[k][:-1] + ', "id": "dup"}', lines[k] + ","])
    if lines and rng.random() < 0.02:   # past what pyarrow's recursive parser survives (about 30,000)
        lines[rng.randrange(len(lines))] = '{"id": "deep", "a": ' + "[" * 40000 + "]" * 40000 + "}"
    if rng.random() < 0.02:
        lines = [json.dumps({"id": f"r{i}", "a": f"2020-01-{i % 28 + 1:02d}", "b": "p" * 40}) for i in range(40000)]
        lines[rng.randrange(len(lines))] = json.dumps({"id": "late", "a": rng.choice(["2020-01-01", 5, "x"]), "b": ""})
    data = ("\n".join(lines) + rng.choice(["\n", "", "\r\n"])).encode("utf-8")
    for _ in range(rng.choice([0, 0, 0, 0, 1, 2])):
        data = _mutate(rng, data)
    return data


# -- the run -----------------------------------------------------------------------------------------------

def _plan(path: Path, label: bool, template: bool, quoting: Optional[str]) -> list[list[str]]:
    inp: dict[str, Any] = {"root": str(path.parent), "table": str(path), "key": "id",
                           "columns": {"a": {"column": "a", "kind": "text"}, "b": {"column": "b", "kind": "text"}}}
    if label:
        inp["columns"]["l"] = {"column": "b", "kind": "label"}
    if template:
        inp["path"], inp["fields"] = "{id}", {"image": {"decoder": "image"}}
    if quoting is not None:
        inp["quoting"] = quoting
    plan = make_plan(load_recipe({"name": "f", "inputs": inp}))
    items = sorted(plan.items, key=lambda it: it.row)
    assert [it.row for it in items] == list(range(1, len(items) + 1)), "data rows are numbered 1, 2, ... in order"
    if label:
        assert plan.label_names == sorted({it.values["b"] for it in items})
        assert all(plan.label_names[it.values["l"]] == it.values["b"] for it in items)
    if template:
        assert all(Path(it.paths["image"]) == path.parent / it.key for it in items)
    return [[it.key, it.values["a"], it.values["b"]] for it in items]


def _case(rng: random.Random, folder: Path, n: int) -> tuple[str, Path, Optional[str]]:
    fmt = rng.choice(["csv", "csv", "tsv", "jsonl", "jsonl"])
    quoting = rng.choice([None, None, "csv", "none"]) if fmt != "jsonl" else None
    if fmt == "jsonl":
        data = gen_jsonl(rng)
    else:
        data = gen_delimited(rng, "," if fmt == "csv" else "\t")
    path = folder / f"case{n}.{fmt}"
    path.write_bytes(data)
    return fmt, path, quoting


def test_hostile_tables_read_as_the_standard_library_reads_them_or_fail_naming_the_file(tmp_path):
    rng = random.Random(SEED)
    seen = {"equal": 0, "refused": 0}
    for n in range(CASES):
        fmt, path, quoting = _case(rng, tmp_path, n)
        label, template = rng.random() < 0.3, rng.random() < 0.3
        data = path.read_bytes()
        where = f"seed {SEED} case {n} ({fmt}, quoting {quoting}, label {label}, path {template}): {data[:300]!r}"
        try:
            if fmt == "jsonl":
                rows = jsonl_oracle(data)
            else:
                q = (quoting or ("csv" if fmt == "csv" else "none")) == "csv"
                rows = csv_oracle(data, "," if fmt == "csv" else "\t", q)
            want: Optional[list[list[str]]] = _rows_as_samples(rows, "b" if label else None, template)
            if not want:
                raise Broken("no rows")
        except Broken:
            want = None
        try:
            got = _plan(path, label, template, quoting)
        except PrecompileError as e:
            assert want is None, f"refused a table the oracle reads: {e}\n{where}"
            msg = str(e)
            assert str(path) in msg or "has no rows" in msg, f"the error does not name the file: {msg}\n{where}"
            assert len(msg) < 2000, f"a message of {len(msg)} characters\n{where}"
            seen["refused"] += 1
            continue
        except Exception as e:   # a traceback: the defect this test exists for
            raise AssertionError(f"{type(e).__name__}: {str(e)[:500]}\n{where}") from e
        assert want is not None, f"planned {len(got)} rows of a table the oracle refuses\n{where}"
        assert got == want, f"rows differ from the oracle's\n{where}"
        seen["equal"] += 1
    assert seen["equal"] > CASES // 5 and seen["refused"] > CASES // 10, seen   # both outcomes are exercised
