"""Reading a table file as Python's csv and json modules read it (the truth here): TSV without quoting,
`inputs.quoting`, quoted cells spanning lines in files of many pyarrow blocks, unterminated quotes, JSON
Lines strings that look like dates, type changes in a JSON Lines column, cells longer than a block, cells
and paths the plan cannot use, and messages whose echoed input is cut."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from precompile.compiler.plan import make_plan
from precompile.errors import RecipeError
from precompile.recipe import load_recipe

pa = pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")


def _recipe(table: Path, key: str, texts: list[str], **inputs) -> dict:
    cols = {f"c{i}": {"column": c, "kind": "text"} for i, c in enumerate(texts)}
    return {"name": "t", "inputs": {"root": str(table.parent), "table": str(table), "key": key, "columns": cols,
                                    **inputs}}


def _read(table: Path, key: str, texts: list[str], **inputs) -> list[list[str]]:
    """Each row's key and text cells, in data row order (the rows numbered 1, 2, ... with no gap)."""
    plan = make_plan(load_recipe(_recipe(table, key, texts, **inputs)))
    items = sorted(plan.items, key=lambda it: it.row)
    assert [it.row for it in items] == list(range(1, len(items) + 1))
    return [[it.key] + [it.values[f"c{i}"] for i in range(len(texts))] for it in items]


def _csv_truth(data: bytes, cols: list[str], **fmt) -> list[list[str]]:
    """The rows Python's csv module reads (blank lines are no rows, as csv.DictReader), ``cols`` of each."""
    limit = csv.field_size_limit(1 << 30)
    try:
        rows = [r for r in csv.reader(io.StringIO(data.decode("utf-8-sig"), newline=""), **fmt) if r]
    finally:
        csv.field_size_limit(limit)
    header = rows[0]
    return [[r[header.index(c)] for c in cols] for r in rows[1:]]


def _error(r: dict) -> RecipeError:
    with pytest.raises(RecipeError) as ei:
        make_plan(load_recipe(r))
    return ei.value


# -- TSV has no quoting; inputs.quoting --------------------------------------------------------------

TSV = b'p\tc\na.png\t"quoted start\nb.png\tx\nc.png\ty"z\nd.png\t"w"\n'


def test_tsv_reads_quotes_as_text_as_csv_quote_none_does(tmp_path):
    for ext in ("tsv", "tab"):
        t = tmp_path / f"t.{ext}"
        t.write_bytes(TSV)
        truth = _csv_truth(TSV, ["p", "c"], delimiter="\t", quoting=csv.QUOTE_NONE)
        assert len(truth) == 4
        assert _read(t, "p", ["c"]) == truth


def test_quoting_option_reads_quoted_tsv_and_literal_csv(tmp_path):
    quoted = b'p\tc\na.png\t"tab\there, ""quote"", line\nbreak"\nb.png\tplain\n'
    t = tmp_path / "q.tsv"
    t.write_bytes(quoted)
    assert _read(t, "p", ["c"], quoting="csv") == _csv_truth(quoted, ["p", "c"], delimiter="\t") == [
        ["a.png", 'tab\there, "quote", line\nbreak'], ["b.png", "plain"]]
    literal = b'p,c\na.png,"5"" screen\nb.png,x\n'
    c = tmp_path / "l.csv"
    c.write_bytes(literal)
    assert _read(c, "p", ["c"], quoting="none") == _csv_truth(literal, ["p", "c"], quoting=csv.QUOTE_NONE) == [
        ["a.png", '"5"" screen'], ["b.png", "x"]]


def test_quoting_is_checked_at_load(tmp_path):
    t = tmp_path / "t.parquet"
    with pytest.raises(RecipeError, match=r"inputs.quoting: .*CSV and TSV"):
        load_recipe(_recipe(t, "p", [], quoting="csv"))
    with pytest.raises(RecipeError, match=r"inputs.quoting: Input should be 'csv' or 'none'"):
        load_recipe(_recipe(tmp_path / "t.csv", "p", [], quoting="double"))


# -- CSV over many blocks whose quoted cells span lines -----------------------------------------------

def _captions(n: int) -> bytes:
    s = io.StringIO()
    w = csv.writer(s)
    w.writerow(["p", "c", "y"])
    for i in range(n):
        w.writerow([f"img{i:05d}.png", "\n".join(f'row {i} line {k}: "{"x" * 40}", {k}' for k in range(8)), str(i)])
    return s.getvalue().encode()


def test_csv_past_one_block_with_multi_line_cells_reads_every_row(tmp_path):
    data = _captions(2500)
    assert len(data) > 1 << 20   # more than one of pyarrow's blocks
    t = tmp_path / "caps.csv"
    t.write_bytes(data)
    truth = _csv_truth(data, ["p", "c"])
    assert len(truth) == 2500
    assert _read(t, "p", ["c"]) == truth
    # a row far past the first block is named by its data row in the file
    rows = list(csv.reader(io.StringIO(data.decode(), newline="")))
    rows[2001][2] = "forty"
    s = io.StringIO()
    csv.writer(s).writerows(rows)
    t.write_text(s.getvalue())
    r = _recipe(t, "p", ["c"])
    r["inputs"]["columns"]["y"] = {"column": "y", "kind": "target"}
    assert f"{t}: data row 2001 (1-based, header not counted), column 'y': 'forty' is not a number" in str(_error(r))


# -- unterminated and malformed quotes -----------------------------------------------------------------

def test_unterminated_quote_is_an_error_naming_the_row_where_it_opens(tmp_path):
    t = tmp_path / "u.csv"
    t.write_bytes(b'p,q\na.png,"open\nb.png,x\nc.png,y')
    assert list(csv.reader(io.StringIO(t.read_text(), newline="")))[1:] == [["a.png", "open\nb.png,x\nc.png,y"]]
    e = _error(_recipe(t, "p", ["q"]))
    assert e.loc == "inputs.table"
    assert e.detail.startswith(f"{t}: data row 1 (1-based, header not counted): a quote opens a cell in the row that "
                               f"starts on line 2 and is never closed")
    assert "which rows are lost in it cannot be known" in e.detail
    t.write_bytes(b'p,q\n\n\na.png,x\nb.png,"open\n')   # blank lines are no rows, but count as lines
    assert _error(_recipe(t, "p", ["q"])).detail.startswith(
        f"{t}: data row 2 (1-based, header not counted): a quote opens a cell in the row that starts on line 5 and "
        f"is never closed")


def test_quote_closed_inside_a_cell_is_an_error_not_swallowed_rows(tmp_path):
    t = tmp_path / "m.csv"
    t.write_bytes(b'p,q\na.png,"open\nb.png,x\nc.png,"y"z\nd.png,w\n')
    e = _error(_recipe(t, "p", ["q"]))
    assert e.detail.startswith(f"{t}: data row 1 (1-based, header not counted): not valid CSV in the row that starts "
                             f"on line 2: ',' expected after '\"'")


def test_quotes_inside_unquoted_cells_are_text_as_csv_reads_them(tmp_path):
    data = b'p,q\na"b.png,5" tall\n c.png, "x"\n'
    t = tmp_path / "lit.csv"
    t.write_bytes(data)
    assert _read(t, "p", ["q"]) == _csv_truth(data, ["p", "q"], strict=True) == [
        ['a"b.png', '5" tall'], [" c.png", ' "x"']]


def test_ragged_row_names_its_data_row_and_line(tmp_path):
    t = tmp_path / "r.csv"
    t.write_bytes(b'p,q\na.png,"two\nlines"\nb.png,x,extra\n')
    e = _error(_recipe(t, "p", ["q"]))
    assert e.detail == (f"{t}: data row 2 (1-based, header not counted): 3 cells, the header has 2 (the row "
                        f"starts on line 4)")


# -- JSON Lines: a string stays a string; one type per column ----------------------------------------

def test_jsonl_strings_that_look_like_dates_stay_strings(tmp_path):
    rows = [{"d": "2020-01-01", "t": "2021-03-04T10:11:12+02:00", "c": "1999-12-31"},
            {"d": "2020-01-02", "t": "2021-03-04 10:11:12.5", "c": "2000-01-01T00:00:00Z"}]
    t = tmp_path / "d.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _recipe(t, "d", ["t", "c"], path="{d}.png", fields={"image": {"decoder": "image"}})
    r["inputs"]["columns"]["label"] = {"column": "c", "kind": "label"}
    plan = make_plan(load_recipe(r))
    got = sorted(plan.items, key=lambda it: it.row)
    truth = [json.loads(line) for line in t.read_text().splitlines()]
    assert [it.key for it in got] == [x["d"] for x in truth]
    assert [it.values["c0"] for it in got] == [x["t"] for x in truth]
    assert [it.values["c1"] for it in got] == [x["c"] for x in truth]
    assert plan.label_names == sorted(x["c"] for x in truth)
    assert [Path(it.paths["image"]).name for it in got] == [x["d"] + ".png" for x in truth]


def test_jsonl_date_strings_nested_beside_used_columns_do_not_change_them(tmp_path):
    t = tmp_path / "n.jsonl"
    t.write_text('{"k": "a", "meta": {"when": "2020-01-01"}, "t": "2020-01-01"}\n'
                 '{"k": "b", "meta": {"when": "2020-01-02"}, "t": "2020-01-02 03:04:05"}\n')
    assert _read(t, "k", ["t"]) == [["a", "2020-01-01"], ["b", "2020-01-02 03:04:05"]]


def test_jsonl_column_changing_type_names_the_data_row_and_column(tmp_path):
    t = tmp_path / "m.jsonl"
    t.write_text("".join(json.dumps({"k": f"r{i}", "y": i}) + "\n" for i in range(4)) + '{"k": "r4", "y": "a"}\n')
    e = _error(_recipe(t, "k", ["y"]))
    assert e.loc == "inputs.table"
    assert str(e).endswith(f"{t}: data row 5 (1-based, header not counted), column 'y': a string here but a number "
                           f"in data row 1 (a JSON Lines column keeps one JSON type; null is allowed anywhere)")


def test_jsonl_type_change_far_past_the_first_block(tmp_path):
    t = tmp_path / "far.jsonl"
    lines = [json.dumps({"k": f"r{i:06d}", "y": i, "pad": "p" * 20}) for i in range(40000)]
    lines[33332] = json.dumps({"k": "r033332", "y": [1], "pad": ""})
    t.write_text("\n".join(lines) + "\n")
    assert t.stat().st_size > 1 << 20
    assert str(_error(_recipe(t, "k", ["pad"]))).endswith(
        f"{t}: data row 33333 (1-based, header not counted), column 'y': a list here but a number in data row 1 (a "
        f"JSON Lines column keeps one JSON type; null is allowed anywhere)")


# -- cells the plan cannot use: a clear error naming the row and the column -----------------------------

def _image_recipe(table: Path, template: str = "{p}", **inputs) -> dict:
    return {"name": "t", "inputs": {"root": str(table.parent), "table": str(table), "path": template,
                                    "fields": {"image": {"decoder": "image"}}, **inputs}}


def test_nul_byte_in_a_path_or_key_cell_names_row_and_column(tmp_path):
    t = tmp_path / "n.csv"
    t.write_bytes(b"p,k\na.png,a\nb\x00.png,b\n")
    e = _error(_image_recipe(t))
    assert e.loc == "inputs.path"
    assert e.detail == (f"{t}: data row 2 (1-based, header not counted), column 'p': the path 'b\\x00.png' holds a "
                        f"NUL byte, which no file name can")
    t.write_bytes(b"k,c\na,x\nb\x00,y\n")
    e = _error(_recipe(t, "k", ["c"]))
    assert e.loc == "inputs.key"
    assert e.detail == (f"{t}: data row 2 (1-based, header not counted), column 'k': the key 'b\\x00' holds a NUL "
                        f"byte, which a stored key cannot")


def test_a_path_no_file_can_have_fingerprints_as_missing(tmp_path):
    from precompile.storage.files import fingerprint

    assert fingerprint(str(tmp_path / "a\x00b.png")) == ["missing"]   # was ValueError: embedded null byte
    assert fingerprint(str(tmp_path / ("c" * 5000))) == ["missing"]


def _nested(tmp_path: Path, fmt: str) -> Path:
    cols = {"p": ["a.png", "b.png", "c.png"], "s": [None, {"a": 1}, {"a": 2}], "l": [["x"], None, ["y", "z"]]}
    if fmt == "parquet":
        import pyarrow.parquet as pq

        t = tmp_path / "n.parquet"
        pq.write_table(pa.table(cols), t)
    else:
        t = tmp_path / "n.jsonl"
        t.write_text("".join(json.dumps({k: v[i] for k, v in cols.items()}) + "\n" for i in range(3)))
    return t


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("use", ["label", "target", "text", "key", "path", "group"])
def test_struct_or_list_column_used_as_a_value_names_row_and_column(tmp_path, fmt, use):
    t = _nested(tmp_path, fmt)
    item = "element" if fmt == "parquet" else "item"   # how each format names a list's values
    for col, typ, row in (("s", "struct<a: int64>", 2), ("l", f"list<{item}: string>", 1)):
        r = _image_recipe(t)
        inp, loc = r["inputs"], f"inputs.columns.{use}"
        if use in ("label", "target", "text"):
            inp["columns"] = {use: {"column": col, "kind": use}}
        elif use == "key":
            inp["key"], loc = col, "inputs.key"
        elif use == "path":
            inp["path"], loc = "{p}/{" + col + "}", "inputs.path"
        else:
            r["split"], loc = {"group": col, "fractions": {"a": 0.5, "b": 0.5}}, "split.group"
        e = _error(r)
        assert e.loc == loc
        assert e.detail == (f"{t}: data row {row} (1-based, header not counted), column {col!r}: holds {typ} values; "
                            f"a {use if use in ('label', 'target', 'text', 'key', 'group') else 'path'} needs text, "
                            f"numbers or booleans")


def test_cells_longer_than_a_block_are_read(tmp_path):
    big = "x" * 3_000_000
    for name, data, fmt in (("c.csv", f'p,c\na.png,"{big}\nline"\nb.png,{big}\n', {}),
                            ("t.tsv", f"p\tc\na.png\t{big}\nb.png\tshort\n", {"delimiter": "\t",
                                                                               "quoting": csv.QUOTE_NONE})):
        t = tmp_path / name
        t.write_text(data)
        truth = _csv_truth(data.encode(), ["p", "c"], **fmt)
        assert max(len(c) for r in truth for c in r) >= 3_000_000
        assert _read(t, "p", ["c"]) == truth
    t = tmp_path / "j.jsonl"
    t.write_text(json.dumps({"p": "a", "c": big * 10}) + "\n" + json.dumps({"p": "b", "c": "s"}) + "\n")
    assert _read(t, "p", ["c"]) == [["a", big * 10], ["b", "s"]]


def test_jsonl_numbers_as_text_are_what_json_loads_gives(tmp_path):
    rows = [{"k": 1, "t": 1.5}, {"k": 2.5, "t": 3}, {"k": 12345678901234567890, "t": 1e100}, {"k": -0.0, "t": 7}]
    t = tmp_path / "n.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    truth = [json.loads(line) for line in t.read_text().splitlines()]
    assert _read(t, "k", ["t"]) == [[str(x["k"]), str(x["t"])] for x in truth]
    assert _read(t, "k", ["t"], path="{k}/{t}.png", fields={"image": {"decoder": "image"}})[0] == ["1", "1.5"]
    # NaN (which json.dumps writes for a missing float) is a blank cell: as text, the empty string
    for text in ('{"k": 1, "t": 1.5}\n{"k": 2, "t": NaN}\n', '{"k": 1, "t": 1}\n{"k": 2, "t": NaN}\n'):
        t.write_text(text)
        assert _read(t, "k", ["t"]) == [["1", "1.5" if "1.5" in text else "1"], ["2", ""]]


# -- messages of bounded size ------------------------------------------------------------------------------

def test_a_huge_path_cell_is_refused_in_a_short_message(tmp_path):
    t = tmp_path / "h.csv"
    t.write_text("p\na.png\n" + "b" * 20_000_000 + ".png\n")
    e = _error(_image_recipe(t))
    assert len(str(e)) < 1000
    assert e.detail == (f"{t}: data row 2 (1-based, header not counted), column 'p': the path {'b' * 200!r}... "
                        f"(20000004 characters) is longer than 4096 characters, which no file system takes")


def test_absurd_template_widths_are_refused_at_load(tmp_path):
    t = tmp_path / "t.csv"
    for template, loc in (("{p:>100000000}", "inputs.path"), ("{p:.5000f}.png", "inputs.path")):
        with pytest.raises(RecipeError, match="width or precision over 4096") as ei:
            load_recipe(_image_recipe(t, template))
        assert ei.value.loc == loc and len(str(ei.value)) < 400
    r = _image_recipe(t, fields={"image": {"decoder": "image", "path": "{p:0" + "9" * 5000 + "d}"}})
    with pytest.raises(RecipeError, match="width or precision over 4096") as ei:
        load_recipe(r)
    assert ei.value.loc == "inputs.fields.image.path" and len(str(ei.value)) < 400
    load_recipe(_image_recipe(t, "{p:>4096}"))   # the longest a path can be


# -- found by tests/test_table_fuzz.py, kept as fixed cases --------------------------------------------

def test_a_second_byte_order_mark_is_text_as_utf_8_sig_leaves_it(tmp_path):
    t = tmp_path / "b.csv"
    t.write_bytes(b"\xef\xbb\xbf\xef\xbb\xbfid,a\nr0,x\n")   # csv via utf-8-sig: the header is '\ufeffid'
    assert "no column 'id' (columns: \ufeffid, a)" in str(_error(_recipe(t, "id", ["a"])))
    t.write_bytes(b"\xef\xbb\xbfid,a\nr0,x\n")
    assert _read(t, "id", ["a"]) == [["r0", "x"]]
    j = tmp_path / "b.jsonl"
    j.write_bytes(b'\xef\xbb\xbf\xef\xbb\xbf{"id": "r0", "a": "x"}\n')
    assert "data row 1 (1-based, header not counted): not valid JSON: Unexpected UTF-8 BOM" in str(
        _error(_recipe(j, "id", ["a"])))


@pytest.mark.parametrize("depth", [101, 400, 40000])
def test_deep_json_is_refused_naming_the_row(tmp_path, depth):
    t = tmp_path / "d.jsonl"
    t.write_text('{"id": "r0", "a": []}\n{"id": "r1", "a": ' + "[" * depth + "]" * depth + "}\n")
    e = _error(_recipe(t, "id", ["id"]))
    assert e.detail == f"{t}: data row 2 (1-based, header not counted): nested deeper than 100 levels"


@pytest.mark.parametrize("line, what", [
    (b'{"id": "b", "t": "x"} 5', "not valid JSON: Extra data: line 1 column 23 (char 22)"),
    (b'{"id": "b", "t": "x"}\r{"id": "c", "t": "y"}', "not valid JSON: Extra data: line 1 column 23 (char 22)"),
    (b'{"id": "b", "t": "x\ty"}', "not valid JSON: Invalid control character at: line 1 column 20 (char 19)"),
    (b'{"id": "b",\n "t": "x"}', "not valid JSON: Expecting property name enclosed in double quotes: line 1 column "
                                 "12 (char 11)"),
    (b"null", "a JSON Lines row is one object ({...}); this line holds a null"),
    (b"[1]", "a JSON Lines row is one object ({...}); this line holds a list"),
    (b'{"id": "b", "id": "c"}', "key 'id' is given twice in one object"),
    (b'{"id": "b", "t": 1e400}', "the number 1e400 is too large for a 64-bit float"),
    (b'{"id": "b", "t": "\xff"}', "not UTF-8 text (byte 18 of the line)"),
])
def test_a_jsonl_line_that_is_not_one_object_names_its_row(tmp_path, line, what):
    t = tmp_path / "l.jsonl"
    t.write_bytes(b'{"id": "a", "t": "x"}\n' + line + b'\n{"id": "z", "t": "z"}\n')
    assert _error(_recipe(t, "id", ["t"])).detail == f"{t}: data row 2 (1-based, header not counted): {what}"


def test_an_empty_csv_says_it_has_no_header(tmp_path):
    t = tmp_path / "e.csv"
    for data in (b"", b"\n\n", b"\xef\xbb\xbf"):
        t.write_bytes(data)
        assert _error(_recipe(t, "p", ["c"])).detail == f"{t}: no header row (the file is empty or blank)"


def test_a_csv_table_is_planned_without_the_parquet_reader(tmp_path):
    """pyarrow's Parquet reader (15 ms of a build's start) is imported for a Parquet table only: a CSV table's
    plan leaves it out; the same rows from a Parquet file still plan (in a fresh process each)."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    rows = b"p,c\na.png,x\nb.png,y\n"
    (tmp_path / "t.csv").write_bytes(rows)
    pq.write_table(pa.table({"p": ["a.png", "b.png"], "c": ["x", "y"]}), tmp_path / "t.parquet")
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(b"")
    code = ("import sys, yaml\n"
            "from precompile.compiler.plan import make_plan\n"
            "from precompile.recipe import load_recipe\n"
            "p = make_plan(load_recipe(yaml.safe_load(sys.argv[1])))\n"
            "print([it.key for it in p.items], 'pyarrow.parquet' in sys.modules)\n")
    repo = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    seen = []
    for table in ("t.csv", "t.parquet"):
        r = _recipe(tmp_path / table, "p", ["c"])
        out = subprocess.run([sys.executable, "-c", code, json.dumps(r)], capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(out.stdout.strip())
    assert seen == ["['a.png', 'b.png'] False", "['a.png', 'b.png'] True"]
