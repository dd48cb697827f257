"""The columnar plan (inputs/items.py, inputs/listing.py, inputs/table/columns.py): the same items, order and shard
keys as the row-by-row plan gave, in a fraction of the memory.

References here are the row-by-row rules themselves: ``os.walk`` + ``sorted`` for the listing,
:func:`keys.item_text` over :func:`keys.fingerprint` of each built Item for the shard-key texts, and the
per-row template/option code (:func:`precompile.inputs.table.cells.fill_row_template`, ``path_filler``) for tables.
"""
from __future__ import annotations

import csv
import math
import os
import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, write_recipe
from precompile.compiler import keys as K
from precompile.inputs.items import Items, Strings
from precompile.inputs.listing import Listed, walk
from precompile.compiler.plan import make_plan
from precompile.errors import PlanError, RecipeError
from precompile.formats import names as fmt
from precompile.recipe import load_recipe, parse_recipe

NAMES = ["a/1.png", "a-b/1.png", "a.b/2.png", "a b/3.png", "ab/4.png", "a/.hidden.png", ".hid/5.png", "a/sub/6.png",
         "Z/7.png", "\u00e9t\u00e9/8.png", "a/1.png.bak", "a/sub-x.png", "a0/9.png", "a/sub.png", "a/sub/deeper/10.png",
         "a!/11.png", "a~/12.png", "a/sub/!.png"]


def _tree(root: Path) -> Path:
    for i, rel in enumerate(NAMES):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * (i + 1))
    (root / "empty-dir" / "nested").mkdir(parents=True)
    os.symlink(root / "a", root / "link-to-a")          # a symlinked folder: listed, never walked into
    os.symlink(root / "gone.png", root / "a" / "broken.png")   # a broken link: listed, fingerprint "missing"
    return root


def _os_walk(root: Path, dirs: bool) -> list[str]:
    """The listing as the row-by-row plan made it: os.walk, names starting with '.' left out, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for n in dirnames if dirs else filenames:
            if not n.startswith("."):
                found.append(n if rel == "." else f"{rel}/{n}".replace(os.sep, "/"))
    return sorted(found)


@pytest.mark.parametrize("dirs", [False, True])
def test_walk_lists_what_os_walk_did_and_files_come_sorted(tmp_path, dirs):
    root = _tree(tmp_path / "in")
    rels = [r for b in walk(str(root), dirs) for r in b.rels]
    assert sorted(rels) == _os_walk(root, dirs)
    if not dirs:   # files stream in sorted path order: no sort at the end
        assert rels == sorted(rels)
        assert "link-to-a/1.png" not in rels and "a/broken.png" in rels and ".hid/5.png" in rels


def _reference_text(plan, shard, content: bool = False) -> str:
    """What a shard key hashed per item before the plan was columnar: item_text over each path's
    fingerprint, then a row's values and options, then a COCO image's annotations digest."""
    out = []
    for it in shard.items:
        out.append(K.item_text(it.key, it.label, [(f, K.fingerprint(p, content)) for f, p in sorted(it.paths.items())]))
        if it.values or it.options:
            out.append(fmt.dumps([it.values, it.options]))
        if it.annotations is not None:
            out.append(it.annotations.digest)
    return "".join(out)


def _folder_recipe(root: Path, **over) -> dict:
    r = {"name": "t", "inputs": {"root": str(root), "match": "{rel}.png", "where": {"rel": ".+"},
                                 "fields": {"image": {"decoder": "image"}}}, "output": {"samples_per_shard": 4}}
    r["inputs"].update(over)
    return r


def test_listing_fingerprints_are_those_a_stat_gives(tmp_path):
    root = _tree(tmp_path / "in")
    plan = make_plan(parse_recipe(_folder_recipe(root)))
    t = plan.table
    assert t.listed == ("image",) and t.size is not None
    assert [it.key for it in plan.items] == [r for r in _os_walk(root, False) if r.endswith(".png")]
    for s in plan.shards:
        for content in (False, True):
            assert K.items_text(t, s.rows, content) == _reference_text(plan, s, content)
    broken = next(it for it in plan.items if it.key == "a/broken.png")
    assert K.fingerprint(broken.paths["image"]) == ["missing"]


def test_template_fields_two_listed_fields_and_labels_key_like_before(tmp_path):
    root = _tree(tmp_path / "in")
    for rel in NAMES:
        if rel.endswith(".png") and "/" in rel:
            (root / (rel[:-4] + ".png.bak")).write_bytes(b"yy")
    r = {"name": "t", "inputs": {"root": str(root), "match": "{label}/{name}.png",
                                 "fields": {"image": {"decoder": "image"}, "again": {"decoder": "image"},
                                            "bak": {"decoder": "image", "path": "{label}/{name}.png.bak"}},
                                 "label": {"capture": "label"}}, "output": {"samples_per_shard": 3}}
    plan = make_plan(parse_recipe(r))
    assert plan.label_names == sorted({k.split("/")[0] for k in (it.key for it in plan.items)})
    assert plan.items[0].paths["bak"] == os.path.join(str(root), *(plan.items[0].key + ".bak").split("/"))
    for s in plan.shards:
        assert K.items_text(plan.table, s.rows) == _reference_text(plan, s)
    r["inputs"]["fields"].pop("bak")   # both fields listed: the fast formatting with two fingerprints
    plan = make_plan(parse_recipe(r))
    assert plan.table.listed == ("image", "again")
    for s in plan.shards:
        assert K.items_text(plan.table, s.rows) == _reference_text(plan, s)


def test_sample_recipes_key_texts_match_the_row_by_row_rules(tmp_path):
    """Tables (values, row options, a split), COCO (annotations), DICOM folders: the columnar texts equal
    the reference built from each Item."""
    for name in ("kinetics.yaml", "chexpert.yaml", "coco.yaml", "ct_lung.yaml", "flow.yaml", "audio.yaml"):
        plan = make_plan(load_recipe(str(REPO / "recipes" / name)))
        for s in plan.shards:
            assert K.items_text(plan.table, s.rows) == _reference_text(plan, s), name


def test_a_listing_given_in_place_of_the_walk(tmp_path):
    """The seam a benchmark feeds: batches in any order are sorted; their (size, mtime) are the fingerprints."""
    rels = [f"c{c}/{i:03d}.png" for c in (2, 0, 1) for i in range(5)]
    batches = [Listed(rels[i:i + 5], size=np.arange(i, i + 5) + 100, mtime=np.arange(i, i + 5) + 10**18)
               for i in range(0, 15, 5)]
    r = parse_recipe({"name": "t", "inputs": {"root": str(tmp_path), "match": "{label}/{name}.png",
                                              "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
                      "output": {"samples_per_shard": 4}})
    plan = make_plan(r, listing=batches)
    assert [it.key for it in plan.items] == sorted(rels)
    assert [it.label for it in plan.items] == [0] * 5 + [1] * 5 + [2] * 5
    first = plan.shards[0]
    # c0/000.png was the 6th listed name: size 105, mtime 10**18 + 5
    assert K.items_text(plan.table, first.rows).startswith(f'["c0/000.png",0,{{"image":[105,{10**18 + 5}]}}]')


def test_a_shard_pickles_only_its_own_rows(tmp_path):
    rels = [f"c{c:03d}/{i:05d}_with_a_longer_name.png" for c in range(20) for i in range(500)]
    r = parse_recipe(_folder_recipe(tmp_path, match="{label}/{name}.png", where={}, label={"capture": "label"}))
    plan = make_plan(r, listing=[Listed(rels[i:i + 500], size=np.ones(500, np.int64), mtime=np.ones(500, np.int64))
                                 for i in range(0, len(rels), 500)])
    s = plan.shards[7]
    small, whole = pickle.dumps(s), pickle.dumps(plan.table)
    assert len(small) * 100 < len(whole)
    back = pickle.loads(small)
    assert back.index == 7 and list(back.items) == list(s.items) and len(back) == 4
    assert [it.key for it in back.items] == rels[28:32]


def test_items_view_reads_like_a_list(tmp_path):
    rels = [f"x/{i:03d}.png" for i in range(10)]
    plan = make_plan(parse_recipe(_folder_recipe(tmp_path)), listing=[Listed(rels)])
    items = plan.items
    assert isinstance(items, Items) and len(items) == 10
    everything = list(items)
    assert [it.key for it in everything] == rels
    assert items[-1] == everything[-1] and items[2:5] == everything[2:5]
    with pytest.raises(IndexError):
        items[10]
    assert everything[3].paths == {"image": os.path.join(str(tmp_path), "x", "003.png")}


def test_strings_round_trip_take_and_sort():
    words = ["b", "", "ä/ß", "a", "🙂", "a/b", "a-b", "a\x00z"[:1], "zz" * 40]
    s = Strings.from_list(words)
    assert s.to_list() == words and [s[i] for i in range(len(words))] == words and s[-1] == words[-1]
    with pytest.raises(IndexError):
        s[len(words)]
    rows = np.array([4, 0, 0, 8])
    assert s.take(rows).to_list() == [words[i] for i in rows]
    assert s.take(range(2, 5)).to_list() == words[2:5]
    assert [words[i] for i in s.argsort()] == sorted(words)
    assert pickle.loads(pickle.dumps(s.take(range(2, 4)))).to_list() == words[2:4]


def test_strings_sort_without_pyarrow(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)   # import pyarrow now raises ImportError
    words = ["b", "", "ä/ß", "a", "🙂", "a/b", "a-b", "b", "zz" * 40, "a"]
    order = Strings.from_list(words).argsort()
    assert [words[i] for i in order] == sorted(words)
    assert list(order[:3]) == [1, 3, 9]   # stable: the two "a" keep their order


def test_a_plan_holds_about_a_hundred_bytes_per_input(tmp_path):
    """200k inputs of 26-byte keys: the key blob, its offsets, label, size and mtime (58 bytes an input), not an
    object per input (a list of 200k str alone is ~16 MB, 80 bytes an input)."""
    n, per = 200_000, 1000
    r = _folder_recipe(tmp_path, match="{label}/{name}.png", where={}, label={"capture": "label"})
    r = parse_recipe(dict(r, output={"samples_per_shard": 256}))

    def listing():
        for c in range(n // per):
            rels = [f"n{c:08d}/n{c:08d}_{i:06d}.png" for i in range(per)]
            yield Listed(rels, size=np.full(per, 1000, np.int64), mtime=np.full(per, 10**18, np.int64))
    tracemalloc.start()
    plan = make_plan(r, listing())
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(plan.items) == n
    assert now / n < 80 and peak / n < 120, (now / n, peak / n)


# ---- tables: the columnar reading against the per-row rules ----------------------------------------

pa = pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")


def _row_by_row(recipe) -> list[tuple[str, dict]]:
    """(key, {field: path}) per row in key order, by the per-row template code."""
    from precompile.inputs.table.cells import path_filler
    from precompile.inputs.table.files import read_table, table_files

    rows = read_table(table_files(recipe)[0]).to_pylist()
    fill = path_filler(recipe, recipe.input_root)

    def where(col, what, loc):
        raise AssertionError((col, what))
    out = []
    for row in rows:
        rel, paths = fill(row, where)
        out.append((rel if recipe.model.inputs.key is None else str(row[recipe.model.inputs.key]), paths))
    return sorted(out, key=lambda kv: kv[0])


CELLS = {"s": ["a", "b c", "ü", "d/e", "f"], "n": [5, 12, 0, 123456, 7], "neg": [-3, 4, 5, 6, 7],
         "big": [2**60 + 1, 1, 2, 3, 4], "f": [1.5, 2.0, -0.25, 3.0, 4.125], "ds": ["007", "12", "0", "3", "99999"],
         "sp": [" 7", "8", "9", "10", "11"], "b": [True, False, True, False, True]}
TEMPLATES = ["{s}/{n}.png", "{s}_{n:06d}.png", "{n:d}-{ds:04d}", "{neg:03d}/{n:5d}", "{big:d}", "{f:.1f}/{f}",
             "{ds:06d}", "{sp:03d}", "{b}/{s}", "x/{f:e}", "const-{n}"]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_table_paths_by_column_equal_the_per_row_rules(tmp_path, template, kind):
    import pyarrow.parquet

    table = pa.table({k: v for k, v in CELLS.items()})
    path = tmp_path / f"t.{kind}"
    if kind == "parquet":
        pyarrow.parquet.write_table(table, str(path))
    else:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(list(CELLS))
            w.writerows(zip(*CELLS.values()))
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", {
        "name": "t", "inputs": {"root": "in", "table": str(path), "path": template, "key": "s",
                                "fields": {"image": {"decoder": "image"}}}})))
    plan = make_plan(recipe)
    assert [(it.key, it.paths) for it in plan.items] == _row_by_row(recipe)
    assert [it.row for it in plan.items] == sorted(range(1, 6), key=lambda i: CELLS["s"][i - 1])


def _csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


@pytest.mark.parametrize("rows, message", [
    # row 2 repeats row 1's key, row 3 has a blank cell: the first row with an error is named
    ([["a", "1"], ["a", "2"], ["", "3"]], r"data row 2 \(1-based, header not counted\), column 'p': key 'a' repeats "
                                          r"data row 1"),
    ([["a", "1"], ["", "2"], ["a", "3"]], r"data row 2 \(1-based, header not counted\), column 'p': blank cell"),
    ([["a", "1"], ["b", "x"], ["../c", "3"]], r"data row 2 .*column 'v': decoder option start_s of field 'video'"),
    ([["a", "1"], ["../b", "x"]], r"data row 2 .*path '../b' leaves inputs.root"),
    ([["b", "1"], ["a", " "]], r"data row 2 .*column 'v': blank cell \(decoder option start_s"),
])
def test_table_errors_name_the_first_bad_row_in_the_per_row_order(tmp_path, rows, message):
    table = _csv(tmp_path / "t.csv", ["p", "v"], rows)
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", {
        "name": "t", "inputs": {"root": "in", "table": str(table), "path": "{p}",
                                "fields": {"video": {"decoder": "video", "start_s": {"column": "v"}}}}})))
    with pytest.raises(RecipeError, match=message):
        make_plan(recipe)


def test_a_folder_split_by_capture_names_the_first_bad_input(tmp_path):
    rels = ["a/x.png", "b/y.png", "b/z.png"]
    r = _folder_recipe(tmp_path, match="{grp}/{name}.png", where={})
    r["split"] = {"by": "column", "column": "name", "group": "grp"}
    with pytest.raises(RecipeError, match=r"input 'b/z.png': group 'b' is in split 'z' here and in 'y' at "
                                          r"input 'b/y.png'"):
        make_plan(parse_recipe(r), listing=[Listed(rels)])
    plan = make_plan(parse_recipe(dict(r, split={"by": "column", "column": "grp"})), listing=[Listed(rels)])
    assert plan.split_counts() == {"a": 1, "b": 2}
    assert [it.key for it in plan.split_view("b").items] == ["b/y.png", "b/z.png"]
    assert [s.split for s in plan.shards] == ["a", "b"]


def test_a_file_name_that_is_not_utf8_is_a_plan_error_naming_it(tmp_path):
    root = tmp_path / "in"
    (root / "a").mkdir(parents=True)
    (root / "a" / "ok.png").write_bytes(b"x")
    bad = os.path.join(os.fsencode(root / "a"), b"\xff.png")
    try:
        open(bad, "wb").close()
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    with pytest.raises(PlanError) as e:
        make_plan(parse_recipe(_folder_recipe(root)))
    assert str(e.value) == (f"input file {bad!r} has a name that is not valid UTF-8 (sample keys and paths are stored "
                            f"as UTF-8): rename it, or leave it out with inputs.where (a capture's pattern that does "
                            f"not match it)")
    plan = make_plan(parse_recipe(_folder_recipe(root, where={"rel": "[ -~]+"})))   # as the message says
    assert [it.key for it in plan.items] == ["a/ok.png"]


# ---- tables: every arrow type a file can hold reads as the per-row code read its cells ---------------

def _table_plan(tmp: Path, columns: dict, inputs: dict, **top):
    """The plan of a Parquet table of ``columns`` (arrow arrays or lists), ``path: "{p}"``, an image field."""
    import pyarrow.parquet

    tmp.mkdir(parents=True, exist_ok=True)
    pyarrow.parquet.write_table(pa.table(columns), str(tmp / "t.parquet"))
    recipe = {"name": "t", "seed": 1, "inputs": {"root": "in", "table": str(tmp / "t.parquet"), "path": "{p}",
                                                  "fields": {"image": {"decoder": "image"}}, **inputs}, **top}
    return make_plan(load_recipe(str(write_recipe(tmp / "r.yaml", recipe))))


def _categorical(values: list, categories: list[str]):
    """``values`` as pandas writes a categorical column: a dictionary of ``categories`` (unused ones too)."""
    codes = pa.array([None if v is None else categories.index(v) for v in values], pa.int8())
    return pa.DictionaryArray.from_arrays(codes, pa.array(categories))


def _typed(kind: str, values: list):
    if kind == "categorical":
        return _categorical(values, sorted({v for v in values if v is not None}))
    if not hasattr(pa, "string_view"):
        pytest.skip("pyarrow < 16 has no string_view type")
    return pa.array(values, pa.string_view())


P4 = ["a.png", "b.png", "c.png", "d.png"]


def test_a_categorical_label_column_names_only_the_classes_its_rows_have(tmp_path):
    lab = _categorical(["dog", "cat", "dog"], ["bird", "cat", "dog", "eel"])
    plan = _table_plan(tmp_path, {"p": P4[:3], "lab": lab}, {"columns": {"lab": {"kind": "label", "column": "lab"}}})
    assert plan.label_names == ["cat", "dog"]
    assert [it.values["lab"] for it in plan.items] == [1, 0, 1]


@pytest.mark.parametrize("kind", ["categorical", "string_view"])
@pytest.mark.parametrize("use, what", [("key", "blank key"), ("label", "blank class name")])
def test_blank_keys_and_class_names_of_categorical_and_view_columns_are_refused(tmp_path, kind, use, what):
    inputs = {"key": "c"} if use == "key" else {"columns": {"lab": {"kind": "label", "column": "c"}}}
    with pytest.raises(RecipeError) as e:
        _table_plan(tmp_path, {"p": P4[:3], "c": _typed(kind, ["k1", " \t", "k3"])}, inputs)
    assert e.value.detail == f"{tmp_path / 't.parquet'}: data row 2 (1-based, header not counted), column 'c': {what}"


def test_nulls_in_categorical_columns_read_as_in_text_columns(tmp_path):
    """A null cell: a NaN target, as a group an error naming its row (a blank group: it was the group "None",
    ``str`` of the cell, which put every row without a group in one group), and as a split name an error
    naming its row."""
    from precompile.inputs.splits import hash_split

    cells = {"num": ["1.5", None, "2", "1.5"], "g": ["p1", "p3", "p2", "p1"]}
    split = {"by": "hash", "group": "g", "fractions": {"a": 0.5, "b": 0.5}}
    got = {}
    for kind in ("text", "categorical"):
        cols = {"p": P4, **{c: (v if kind == "text" else _typed(kind, v)) for c, v in cells.items()}}
        plan = _table_plan(tmp_path / kind, cols, {"columns": {"t": {"kind": "target", "column": "num"}}}, split=split)
        got[kind] = [(it.key, "nan" if math.isnan(it.values["t"]) else it.values["t"], it.split) for it in plan.items]
    assert got["categorical"] == got["text"] == [
        (p, t, hash_split(split["fractions"], 1, g)) for p, t, g in zip(P4, [1.5, "nan", 2.0, 1.5], cells["g"])]
    for kind in ("text", "categorical"):
        g = ["p1", None, "p2", "p1"]
        with pytest.raises(RecipeError) as e:
            _table_plan(tmp_path / f"g{kind}", {"p": P4, "g": g if kind == "text" else _typed(kind, g)}, {},
                        split=split)
        assert e.value.detail.startswith(f"{tmp_path / f'g{kind}' / 't.parquet'}: data row 2 (1-based, header not "
                                         f"counted), column 'g': the group is blank (None)"), e.value.detail
    with pytest.raises(RecipeError) as e:
        _table_plan(tmp_path / "c", {"p": P4, "g": _typed("categorical", ["p1", None, "p2", "p1"])}, {},
                    split={"by": "column", "column": "g"})
    assert e.value.detail == (f"{tmp_path / 'c' / 't.parquet'}: data row 2 (1-based, header not counted), column 'g': "
                              f"split name None must be letters, digits, '_', '.', '-'")


def test_text_columns_are_widened_to_large_strings_chunk_by_chunk(tmp_path):
    """A text column of more than 2 GiB (24M paths) overflowed string's int32 offsets when its chunks were
    joined; each chunk is now widened to large_string first. Shown on a file of several row groups, each
    read as its own chunk (a multi-GB file has no place in the suite)."""
    import pyarrow.parquet

    from precompile.inputs.table.columns import _Columns

    n = 10
    table = pa.table({"p": [f"{i}.png" for i in range(n)], "k": [f"k{i:02d}" for i in range(n)],
                      "lab": _categorical([["x", "y"][i % 2] for i in range(n)], ["x", "y", "z"])})
    pyarrow.parquet.write_table(table, str(tmp_path / "t.parquet"), row_group_size=3)
    assert pyarrow.parquet.read_table(str(tmp_path / "t.parquet")).column("p").num_chunks == 4
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", {
        "name": "t", "inputs": {"root": "in", "table": str(tmp_path / "t.parquet"), "path": "{p}", "key": "k",
                                "fields": {"image": {"decoder": "image"}},
                                "columns": {"lab": {"kind": "label", "column": "lab"}}}})))
    cols = _Columns(recipe)
    assert {c: str(cols.col(c).type) for c in ("p", "k", "lab")} == dict.fromkeys(("p", "k", "lab"), "large_string")
    plan = make_plan(recipe)
    assert [(it.key, it.paths["image"], it.values["lab"]) for it in plan.items] == [
        (f"k{i:02d}", os.path.join(str(tmp_path / "in"), f"{i}.png"), i % 2) for i in range(n)]


def test_a_categorical_in_one_file_and_text_in_another_join(tmp_path):
    import pyarrow.parquet

    pyarrow.parquet.write_table(pa.table({"p": ["a.png", "b.png"], "lab": _categorical(["x", "y"], ["w", "x", "y"])}),
                                str(tmp_path / "1.parquet"))
    pyarrow.parquet.write_table(pa.table({"p": ["c.png"], "lab": ["w"]}), str(tmp_path / "2.parquet"))
    recipe = {"name": "t", "inputs": {"root": "in", "table": "*.parquet", "path": "{p}",
                                      "fields": {"image": {"decoder": "image"}},
                                      "columns": {"lab": {"kind": "label", "column": "lab"}}}}
    plan = make_plan(load_recipe(str(write_recipe(tmp_path / "r.yaml", recipe))))
    assert plan.label_names == ["w", "x", "y"]
    assert [(it.key, it.values["lab"], it.row_file, it.row) for it in plan.items] == [
        ("a.png", 1, str(tmp_path / "1.parquet"), 1), ("b.png", 2, str(tmp_path / "1.parquet"), 2),
        ("c.png", 0, str(tmp_path / "2.parquet"), 1)]


def test_files_whose_column_types_do_not_join_name_that_column_and_its_types_as_stored(tmp_path):
    import pyarrow.parquet

    pyarrow.parquet.write_table(pa.table({"n": pa.array([1], pa.int32()), "p": ["a.png"], "lab": [1]}),
                                str(tmp_path / "1.parquet"))
    pyarrow.parquet.write_table(pa.table({"n": [2], "p": ["b.png"], "lab": ["x"]}), str(tmp_path / "2.parquet"))
    recipe = {"name": "t", "inputs": {"root": "in", "table": "*.parquet", "path": "{p}_{n}",
                                      "fields": {"image": {"decoder": "image"}},
                                      "columns": {"lab": {"kind": "label", "column": "lab"}}}}
    with pytest.raises(RecipeError) as e:   # n, int32 and int64, joins: lab does not
        make_plan(load_recipe(str(write_recipe(tmp_path / "r.yaml", recipe))))
    assert e.value.detail == (f"column 'lab' is int64 in {tmp_path / '1.parquet'} but string in "
                              f"{tmp_path / '2.parquet'}: the table files must agree")


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_column_the_recipe_reads_twice_in_the_header_is_a_recipe_error(tmp_path, kind):
    import pyarrow.parquet

    path = tmp_path / f"t.{kind}"
    if kind == "csv":
        _csv(path, ["p", "x", "p", "x"], [["a.png", "1", "b.png", "2"]])
    else:
        pyarrow.parquet.write_table(pa.Table.from_arrays([pa.array([v]) for v in ("a.png", "1", "b.png", "2")],
                                                         names=["p", "x", "p", "x"]), str(path))
    recipe = {"name": "t", "inputs": {"root": "in", "table": str(path), "path": "{p}",
                                      "fields": {"image": {"decoder": "image"}}}}
    with pytest.raises(RecipeError) as e:
        make_plan(load_recipe(str(write_recipe(tmp_path / "r.yaml", recipe))))
    assert str(e.value) == (f"{tmp_path / 'r.yaml'}: inputs.path: {path}: column 'p' is in the header 2 times "
                            f"(columns: p, x, p, x): give each column its own name")
    if kind == "csv":   # a repeated column the recipe does not read is no error
        _csv(path, ["p", "x", "x"], [["a.png", "1", "2"]])
        assert [it.key for it in make_plan(load_recipe(str(tmp_path / "r.yaml"))).items] == ["a.png"]


def test_minus_zero_and_zero_stay_apart_in_row_options_and_targets(tmp_path):
    """Each distinct combination of option cells is checked once: -0.0 and 0.0 are two (a 0.0 row took
    the options of an earlier -0.0 row). Targets keep their sign too (the row-by-row code made a 0.0 after
    a -0.0 -0.0: see tests/test_plan_golden.py)."""
    plan = _table_plan(tmp_path, {"p": ["a.mp4", "b.mp4", "c.mp4", "d.mp4"], "s": [-0.0, 0.0, 1.0, -0.0]},
                       {"fields": {"video": {"decoder": "video", "start_s": {"column": "s"}}},
                        "columns": {"t": {"kind": "target", "column": "s"}}})
    assert [math.copysign(1, it.options["video"]["start_s"]) for it in plan.items] == [-1, 1, 1, -1]
    assert [math.copysign(1, it.values["t"]) for it in plan.items] == [-1, 1, 1, -1]
