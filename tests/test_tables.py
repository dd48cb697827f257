"""Tables as inputs (inputs.table): rows -> samples with label/target/text fields, per-row decoder options,
plan-time errors naming file/row/column, per-row fingerprints, and splits that cannot leak."""
from __future__ import annotations

import copy
import csv
import json
import math
import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

import precompile
from precompile.compiler.plan import make_plan
from precompile.inputs.splits import hash_split
from precompile.inputs.table.cells import fill_row_template
from precompile.errors import BuildError, RecipeError
from precompile.recipe import load_recipe
from conftest import shard_file

pa = pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")

TEXTS = ["héllo, wörld", "", "line one\nline two", "🙂🚀 emoji", "中文字符", "שלום עולם", "plain"]
FINDINGS = ["1.0", "-1.0", "", "0.0", "1", "-1.0", "0.0"]


def _images(root: Path, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        a = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
        (root / f"p{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(a).save(root / f"p{i % 3}" / f"s{i}.png")
        out.append(a)
    return out


def _rows(n: int = 7) -> list[dict[str, str]]:
    return [{"Path": f"p{i % 3}/s{i}.png", "Finding": FINDINGS[i], "Age": str(20 + i), "Caption": TEXTS[i],
             "Label": ["cat, big", "dog"][i % 2], "Patient": f"patient{i % 3:05d}"} for i in range(n)]


def _write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        w.writeheader()
        w.writerows(rows)
    return path


def _recipe(table: str, **inputs) -> dict:
    inp = {"root": ".", "table": table, "path": "{Path}", "fields": {"image": {"decoder": "image"}},
           "columns": {"y": {"columns": ["Finding", "Age"], "kind": "target", "map": {-1: "nan"}},
                       "caption": {"column": "Caption", "kind": "text"},
                       "label": {"column": "Label", "kind": "label"}}}
    inp.update(inputs)
    return {"name": "t", "inputs": inp, "output": {"samples_per_shard": 3}}


def _expected_target(row: dict) -> list[float]:
    f = row["Finding"]
    first = math.nan if f == "" or float(f) == -1 else float(f)
    return [first, float(row["Age"])]


@pytest.fixture()
def table_tree(tmp_path: Path, monkeypatch) -> tuple[Path, list[dict], list[np.ndarray]]:
    monkeypatch.chdir(tmp_path)
    imgs = _images(tmp_path, 7)
    rows = _rows()
    _write_csv(tmp_path / "t.csv", rows)
    return tmp_path, rows, imgs


def _check_output(ds, rows: list[dict], imgs: list[np.ndarray]) -> None:
    by_key = {r["Path"]: (r, imgs[i]) for i, r in enumerate(rows)}
    assert sorted(ds.keys) == sorted(by_key)
    assert ds.label_names == ["cat, big", "dog"]
    for i in range(len(ds)):
        row, img = by_key[ds.key(i)]
        s = ds[i]
        assert isinstance(s["caption"], str) and s["caption"] == row["Caption"]
        np.testing.assert_array_equal(s["image"], img)
        np.testing.assert_array_equal(s["y"], np.asarray(_expected_target(row), np.float32))
        assert s["y"].dtype == np.float32
        assert ds.label_names[int(s["label"])] == row["Label"]
    b = ds.batch([3, 0, 5])
    assert b["caption"] == [by_key[ds.key(i)][0]["Caption"] for i in (3, 0, 5)]
    assert b["y"].shape == (3, 2)


@pytest.mark.parametrize("fmt", ["hdf5", "png", "bmp"])
def test_csv_round_trip_targets_text_labels(table_tree, fmt):
    root, rows, imgs = table_tree
    r = _recipe("t.csv")
    r["output"]["format"] = fmt
    rep = precompile.build(r, "out")
    assert rep["status"] == "ok" and rep["num_samples"] == 7
    ds = precompile.open(rep["output"])
    _check_output(ds, rows, imgs)
    specs = ds.field_specs
    assert specs["y"]["kind"] == "target" and specs["y"]["shape"] == [2]
    assert specs["caption"]["kind"] == "text"


def test_text_is_plain_h5py_readable_utf8(table_tree):
    root, rows, _ = table_tree
    rep = precompile.build(_recipe("t.csv"), "out")
    with h5py.File(rep["output"], "r") as f:
        g = f["caption"]
        o = g["offsets"][:]
        keys = [k.decode() for k in f["__key__"][:]]
        got = {k: g["data"][o[i]:o[i + 1]].tobytes().decode("utf-8") for i, k in enumerate(keys)}
    assert got == {r["Path"]: r["Caption"] for r in rows}


@pytest.mark.parametrize("kind", ["tsv", "jsonl", "parquet"])
def test_other_table_formats_give_the_same_samples(table_tree, kind):
    root, rows, imgs = table_tree
    if kind == "tsv":
        _write_csv(root / "t.tsv", rows, "\t")
    elif kind == "jsonl":
        with open(root / "t.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                d = dict(r, Age=int(r["Age"]), Finding=float(r["Finding"]) if r["Finding"] else None)
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
    else:
        import pyarrow.parquet as pq

        t = pa.table({k: [r[k] for r in rows] for k in rows[0]} |
                     {"Finding": pa.array([float(r["Finding"]) if r["Finding"] else None for r in rows]),
                      "Age": pa.array([int(r["Age"]) for r in rows])})
        pq.write_table(t, root / "t.parquet")
    # csv.writer quotes the caption with a line break: a quoted TSV, read with quoting: csv (TSV has none)
    rep = precompile.build(_recipe(f"t.{kind}", **({"quoting": "csv"} if kind == "tsv" else {})), "out")
    _check_output(precompile.open(rep["output"]), rows, imgs)


def test_key_column_when_paths_repeat_and_field_path_templates(table_tree):
    root, rows, imgs = table_tree
    rows = [dict(r, Id=f"row{i:02d}", Dir=r["Path"].split("/")[0], Num=str(i)) for i, r in enumerate(rows)]
    rows.append(dict(rows[0], Id="again"))           # the same image a second time, under another key
    _write_csv(root / "k.csv", rows)
    r = _recipe("k.csv", key="Id", fields={"image": {"decoder": "image", "path": "{Dir}/s{Num:d}.png"}})
    del r["inputs"]["path"]
    ds = precompile.open(precompile.build(r, "out")["output"])
    assert ds.keys == sorted(x["Id"] for x in rows)
    i = ds.keys.index("again")
    np.testing.assert_array_equal(ds[i]["image"], imgs[0])


def test_template_format_specs():
    assert fill_row_template("{id}_{s:06d}_{e:06d}.mp4", {"id": "ab", "s": "12", "e": 22}) == "ab_000012_000022.mp4"
    assert fill_row_template("{x:.1f}/{n}", {"x": "2", "n": "007"}) == "2.0/007"
    assert fill_row_template("{n:d}", {"n": "12345678901234567890"}) == "12345678901234567890"
    assert fill_row_template("{n:03d}", {"n": 7.0}) == "007"
    with pytest.raises(ValueError, match="not an integer") as ei:
        fill_row_template("a/{s:06d}", {"s": "1.5"})
    assert ei.value.column == "s"


def test_a_cell_the_path_template_cannot_use_names_row_and_column(table_tree):
    root, rows, _ = table_tree
    rows = [dict(r, Num=str(i)) for i, r in enumerate(rows)]
    rows[5]["Num"] = "five"
    _write_csv(root / "n.csv", rows)
    e = _plan_error(_recipe("n.csv", path="p{Num:d}.png"))
    assert e.loc == "inputs.path"
    assert "n.csv: data row 6 (1-based, header not counted), column 'Num': 'five' is not an integer" in str(e)


# -- bad tables: one clear error naming file, row and column ------------------------------------------

def _plan_error(r: dict) -> RecipeError:
    with pytest.raises(RecipeError) as ei:
        make_plan(load_recipe(r))
    return ei.value


def test_missing_table_file(table_tree):
    e = _plan_error(_recipe("nope.csv"))
    assert e.loc == "inputs.table" and "nope.csv' does not exist" in str(e)


def test_unknown_table_extension():
    with pytest.raises(RecipeError, match=r"inputs.table: .*unknown table extension '.xlsx'"):
        load_recipe(_recipe("t.xlsx"))


def test_duplicate_key_names_both_rows(table_tree):
    root, rows, _ = table_tree
    _write_csv(root / "d.csv", rows + [rows[2]])
    e = _plan_error(_recipe("d.csv"))
    assert str(e).endswith(f"d.csv: data row 8 (1-based, header not counted), column 'Path': key 'p2/s2.png' "
                           f"repeats data row 3 "
                           f"(give inputs.key a column whose values are unique when paths repeat)")
    assert e.loc == "inputs.path"


@pytest.mark.parametrize("spelling", ["./p2/s2.png", "p2/./s2.png", "p2//s2.png"])
def test_one_file_written_two_ways_is_a_repeated_key(table_tree, spelling):
    # each spelling was a sample of its own: the same image twice, in two splits when the split hashes the key
    root, rows, _ = table_tree
    _write_csv(root / "d.csv", rows + [dict(rows[5], Path=spelling)])
    e = _plan_error(_recipe("d.csv"))
    assert str(e).endswith(f"d.csv: data row 8 (1-based, header not counted), column 'Path': path {spelling!r} "
                           f"names the file of data row 3 ('p2/s2.png'), written another way: a file enters a build "
                           f"once (give inputs.key a column whose values are unique when paths repeat)"), str(e)
    assert e.loc == "inputs.path"
    _write_csv(root / "e.csv", [dict(r, Path="./" + r["Path"]) if i == 2 else r for i, r in enumerate(rows)])
    rep = precompile.build(_recipe("e.csv"), root / "out")   # one spelling of each file: kept as written
    assert sorted(precompile.open(rep["output"]).keys) == sorted(["./p2/s2.png"] + [r["Path"] for r in rows[:2] + rows[3:]])
    _write_csv(root / "k.csv", [dict(r, Id=f"k{i}") for i, r in enumerate(rows + [dict(rows[5], Path=spelling)])])
    assert len(precompile.open(precompile.build(_recipe("k.csv", key="Id"), root / "k")["output"])) == 8


def test_schema_covers_the_table_and_split_keys(table_tree):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the floors job leaves it out)")

    from precompile.tools.schema import recipe_schema

    v = jsonschema.Draft202012Validator(recipe_schema())
    good = _recipe("t.csv", key="Path")
    good["inputs"]["fields"]["image"]["mode"] = {"column": "Mode"}
    good["split"] = {"by": "hash", "group": {"column": "Path", "pattern": "p(\\d)"}, "fractions": {"a": 0.5, "b": 0.5},
                     "seed": 3}
    assert [e.message for e in v.iter_errors(good)] == []
    load_recipe(good)
    for bad in ({"inputs": {"tabel": "t.csv"}}, {"inputs": {"columns": {"y": {"colum": "A", "kind": "target"}}}},
                {"inputs": {"columns": {"y": {"column": "A", "kind": "score"}}}},
                {"split": {"by": "hash", "fractons": {"a": 1.0}}}, {"split": {"by": "random"}},
                {"inputs": {"fields": {"image": {"decoder": "image", "mode": {"col": "Mode"}}}}}):
        data = copy.deepcopy(good)
        for k, sub in bad.items():
            for kk, vv in sub.items():
                if isinstance(vv, dict) and isinstance(data[k].get(kk), dict):
                    data[k][kk] = {**data[k][kk], **vv}
                else:
                    data[k][kk] = vv
        assert list(v.iter_errors(data)), bad
        with pytest.raises(RecipeError):
            load_recipe(data)


def test_unknown_column_names_it_and_lists_the_columns(table_tree):
    r = _recipe("t.csv")
    r["inputs"]["columns"]["y"]["columns"] = ["Finding", "Agee"]
    e = _plan_error(r)
    assert e.loc == "inputs.columns.y"
    assert "t.csv: no column 'Agee' (columns: Path, Finding, Age, Caption, Label, Patient)" in str(e)


def test_non_numeric_target_names_row_and_column(table_tree):
    root, rows, _ = table_tree
    rows[4]["Age"] = "forty"
    _write_csv(root / "bad.csv", rows)
    e = _plan_error(_recipe("bad.csv"))
    assert e.loc == "inputs.columns.y"
    assert "bad.csv: data row 5 (1-based, header not counted), column 'Age': 'forty' is not a number" in str(e)


def test_unknown_class_and_blank_label(table_tree):
    root, rows, _ = table_tree
    r = _recipe("t.csv")
    r["inputs"]["columns"]["label"]["classes"] = ["dog"]
    e = _plan_error(r)
    assert "data row 1 (1-based, header not counted), column 'Label': class 'cat, big' is not in classes" in str(e)
    rows[6]["Label"] = ""
    _write_csv(root / "b.csv", rows)
    assert "data row 7 (1-based, header not counted), column 'Label': blank class name" in str(_plan_error(_recipe("b.csv")))


def test_row_whose_file_is_missing_is_a_per_input_failure(table_tree):
    root, rows, imgs = table_tree
    os.remove(root / rows[3]["Path"])
    with pytest.raises(BuildError, match=r"first error: .*p0/s3.png.*input file is missing"):
        precompile.build(_recipe("t.csv"), "out")
    rep = precompile.build(_recipe("t.csv"), "out", on_error="skip")
    assert rep["num_samples"] == 6 and rep["skipped_inputs"] == 1
    (f,) = rep["failures"]
    assert f["key"] == "p0/s3.png" and f["stage"] == "decode" and f["path"].endswith("p0/s3.png")
    assert f["message"].endswith("input file is missing (the recipe's path for this field points to nothing, "
                                 f"from data row 4 of {root / 't.csv'})")
    ds = precompile.open(rep["output"])
    _check_output(ds, [r for i, r in enumerate(rows) if i != 3], [a for i, a in enumerate(imgs) if i != 3])


def test_changed_row_rebuilds_only_its_shard(table_tree):
    root, rows, _ = table_tree
    r = _recipe("t.csv")
    first = precompile.build(r, "out")
    assert first["shards"]["built"] == 3
    assert precompile.build(r, "out")["up_to_date"]
    rows[6]["Caption"] = "changed"        # p0/s6.png: the last key in order -> the last shard
    _write_csv(root / "t.csv", rows)
    rep = precompile.build(r, "out")
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 2
    ds = precompile.open(rep["output"])
    assert ds[ds.keys.index("p0/s6.png")]["caption"] == "changed"


def test_decoder_option_from_a_row_is_checked_per_row(table_tree):
    root, rows, _ = table_tree
    rows = [dict(r, Mode="rgb8" if i else "bogus") for i, r in enumerate(rows)]
    _write_csv(root / "m.csv", rows)
    r = _recipe("m.csv")
    r["inputs"]["fields"]["image"]["mode"] = {"column": "Mode"}
    e = _plan_error(r)
    assert e.loc == "inputs.fields.image.mode"
    assert "m.csv: data row 1 (1-based, header not counted), column 'Mode': decoder option mode of field 'image'" in str(e)
    with pytest.raises(RecipeError, match="needs table inputs"):
        load_recipe({"name": "t", "inputs": {"root": ".", "match": "{n}.png",
                                             "fields": {"image": {"decoder": "image", "mode": {"column": "m"}}}}})


# -- video clips per row: start_s / end_s -----------------------------------------------------------

VIDEO = Path(__file__).resolve().parents[1] / "sample_data" / "video" / "balls.mp4"


def _pyav_frames(path: Path) -> list[tuple[float, np.ndarray]]:
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        t0 = s.start_time * s.time_base
        return [(float(f.pts * s.time_base - t0), f.to_ndarray(format="rgb24")) for f in c.decode(s)]


def test_video_window_per_row_matches_pyav(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v.mp4").write_bytes(Path(VIDEO).read_bytes())   # a copy: a link out of the root is refused
    windows = [(0.0, 0.4), (0.5, 1.0), (0.2, 0.21)]
    with open(tmp_path / "k.csv", "w") as f:
        f.write("id,label,time_start,time_end\n")
        for i, (a, b) in enumerate(windows):
            f.write(f"c{i},\"run, fast\",{a},{b}\n")
    r = {"name": "k", "inputs": {"root": ".", "table": "k.csv", "path": "v.mp4", "key": "id",
                                 "fields": {"video": {"decoder": "video", "start_s": {"column": "time_start"},
                                                      "end_s": {"column": "time_end"}}},
                                 "columns": {"label": {"column": "label", "kind": "label"}}}}
    ds = precompile.open(precompile.build(r, "out")["output"])
    frames = _pyav_frames(VIDEO)
    for i, (a, b) in enumerate(windows):
        ref = np.stack([x for t, x in frames if a - 1e-6 <= t < b - 1e-6])
        np.testing.assert_array_equal(ds[ds.keys.index(f"c{i}")]["video"], ref)
    assert ds.label_names == ["run, fast"]
    # decoded in the isolated helper process (timeout_s): the row's options and values travel with the input
    iso = precompile.open(precompile.build(dict(r, timeout_s=60), "iso")["output"])
    for i in range(len(ds)):
        np.testing.assert_array_equal(iso[i]["video"], ds[i]["video"])
        assert int(iso[i]["label"]) == int(ds[i]["label"])
    bad = copy.deepcopy(r)
    with open(tmp_path / "k.csv", "a") as f:
        f.write("c9,x,2.0,1.0\n")
    e = _plan_error(bad)
    assert "data row 4 (1-based, header not counted)" in str(e) and "end_s (1.0) must be after start_s (2.0)" in str(e)


# -- splits -----------------------------------------------------------------------------------------

def test_split_writes_one_output_per_split_grouped_by_patient(table_tree):
    root, rows, imgs = table_tree
    r = _recipe("t.csv")
    r["split"] = {"fractions": {"train": 0.5, "val": 0.25, "test": 0.25},
                  "group": {"column": "Path", "pattern": r"^(p\d+)/"}}
    rep = precompile.build(r, "out")
    seen, files = {}, []
    total = 0
    for name, info in rep["splits"].items():
        assert info["output"].endswith(f"t.{name}.h5")
        ds = precompile.open(info["output"])
        files += [s["file"] for s in ds.shards]
        assert len(ds) == info["samples"] == info["inputs"]
        total += len(ds)
        for k in ds.keys:
            assert seen.setdefault(k.split("/")[0], name) == name   # a group in one split only
    assert total == 7 and len(files) == len(set(files))    # shards never mix splits
    for name, info in rep["splits"].items():                   # each split's own report beside its index
        with open(root / "out" / f"t.{name}.report.json") as f:
            assert json.load(f)["num_samples"] == info["samples"]
    with open(root / "out" / "t.report.json") as f:
        assert json.load(f)["splits"] == rep["splits"]
    # the same build again: nothing to do, nothing written
    before = {p: p.stat().st_mtime_ns for p in (root / "out").iterdir()}
    again = precompile.build(r, "out")
    assert again["up_to_date"] and again["shards"]["skipped"] == again["shards"]["total"]
    assert again["splits"] == rep["splits"] and again["num_samples"] == 7
    assert {p: p.stat().st_mtime_ns for p in (root / "out").iterdir()} == before


def test_split_of_a_folder_format_and_the_cli_lines(table_tree):
    from click.testing import CliRunner

    from precompile.cli import main

    root, rows, imgs = table_tree
    r = _recipe("t.csv")
    r["output"]["format"] = "png"
    r["split"] = {"fractions": {"train": 0.5, "test": 0.5}, "seed": 1}
    (root / "r.yaml").write_text(json.dumps(r))
    res = CliRunner().invoke(main, ["build", str(root / "r.yaml"), "-o", str(root / "out")])
    assert res.exit_code == 0, res.output
    want = {n: sum(hash_split(r["split"]["fractions"], 1, x["Path"]) == n for x in rows) for n in ("train", "test")}
    for name, n in want.items():
        line = f"split {name}: {root / 'out' / f't.{name}.json'}: {n} input(s) ({n / 7:.1%} of inputs), {n} samples"
        assert line in res.output
        ds = precompile.open(root / "out" / f"t.{name}.json")
        assert len(ds) == n and ds.output_format == "png"
    assert "wrote 2 splits (below): 7 samples" in res.output
    plan = CliRunner().invoke(main, ["plan", str(root / "r.yaml")])
    assert f"splits    train {want['train']} ({want['train'] / 7:.1%}), test {want['test']} ({want['test'] / 7:.1%})" \
        in plan.output


def test_split_by_column_and_group_conflict(table_tree):
    root, rows, _ = table_tree
    rows = [dict(r, Split=["train", "val"][i % 2]) for i, r in enumerate(rows)]
    _write_csv(root / "s.csv", rows)
    r = _recipe("s.csv")
    r["split"] = {"by": "column", "column": "Split"}
    rep = precompile.build(r, "out")
    assert {k: v["inputs"] for k, v in rep["splits"].items()} == {"train": 4, "val": 3}
    ds = precompile.open(rep["splits"]["val"]["output"])
    assert sorted(ds.keys) == sorted(x["Path"] for x in rows if x["Split"] == "val")
    r["split"]["group"] = "Patient"
    e = _plan_error(r)
    assert "s.csv: data row 4 (1-based, header not counted): group 'patient00000' is in split 'val' here and in " \
           "'train' at" in str(e) and e.loc == "split.group"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 300), groups=st.integers(1, 40),
       extra=st.integers(1, 100))
def test_hash_split_properties(seed, n, groups, extra):
    fr = {"train": 0.7, "val": 0.2, "test": 0.1}
    rng = np.random.default_rng(seed)
    keys = [f"k{rng.integers(1 << 40)}" for _ in range(n)]
    group_of = {k: f"g{rng.integers(groups)}" for k in keys}
    by_key = {k: hash_split(fr, seed, k) for k in keys}
    more = [f"m{rng.integers(1 << 40)}" for _ in range(extra)]
    by_key2 = {k: hash_split(fr, seed, k) for k in keys + more}
    assert all(by_key2[k] == by_key[k] for k in keys)           # adding inputs never moves an old one
    split_of_group = {}
    for k in keys:                                              # a group is never in two splits
        s = hash_split(fr, seed, group_of[k])
        assert split_of_group.setdefault(group_of[k], s) == s


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), n=st.integers(1, 120), groups=st.integers(1, 30), extra=st.integers(1, 60))
def test_planned_splits_of_random_tables_never_leak_a_group_nor_move_an_old_row(seed, n, groups, extra):
    import tempfile

    rng = np.random.default_rng(seed)
    rows = [{"id": f"r{rng.integers(1 << 40):012d}", "pid": f"patient{rng.integers(groups)}/x"} for _ in range(n)]
    rows = list({x["id"]: x for x in rows}.values())
    more = [{"id": f"m{rng.integers(1 << 40):012d}", "pid": f"patient{rng.integers(groups * 2)}/y"}
            for _ in range(extra)]
    more = [x for x in {x["id"]: x for x in more}.values()]

    def plan(table_rows: list[dict], d: str) -> dict[str, str]:
        _write_csv(Path(d) / "t.csv", table_rows)
        r = {"name": "p", "seed": seed, "inputs": {"root": d, "table": str(Path(d) / "t.csv"), "key": "id",
                                                   "columns": {"g": {"column": "pid", "kind": "text"}}},
             "split": {"group": {"column": "pid", "pattern": r"patient(\d+)/"},
                       "fractions": {"train": 0.6, "val": 0.3, "test": 0.1}}}
        p = make_plan(load_recipe(r))
        for s in p.shards:
            assert {it.split for it in s.items} == {s.split}        # shards never mix splits
        return {it.key: it.split for it in p.items}

    with tempfile.TemporaryDirectory() as d:
        first = plan(rows, d)
        group_of = {x["id"]: x["pid"].split("/")[0] for x in rows + more}
        where: dict[str, str] = {}
        for k, s in first.items():
            assert where.setdefault(group_of[k], s) == s
        second = plan(rows + more, d)
        assert all(second[k] == first[k] for k in first)              # adding rows never moves an old one
        for k, s in second.items():
            assert where.setdefault(group_of[k], s) == s


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_hash_split_fractions_near_the_asked_ones(seed):
    fr = {"train": 0.8, "val": 0.1, "test": 0.1}
    n = 20000
    got = [hash_split(fr, seed, f"key{i}") for i in range(n)]
    for name, f in fr.items():
        share = got.count(name) / n
        assert abs(share - f) < 4 * math.sqrt(f * (1 - f) / n), (name, share)


def test_split_of_folder_inputs_by_capture(tmp_path):
    from conftest import shard_file, image_recipe, make_image_tree

    make_image_tree(tmp_path / "imgs", per_class=6)
    r = image_recipe(tmp_path / "imgs")
    r["split"] = {"fractions": {"a": 0.5, "b": 0.5}, "group": "label", "seed": 3}
    rep = precompile.build(r, tmp_path / "out")
    where = {}
    for name, info in rep["splits"].items():
        for k in precompile.open(info["output"]).keys:
            assert where.setdefault(k.split("/")[0], name) == name
    assert sorted(where) == ["cat", "dog"]
    assert {n: i["inputs"] for n, i in rep["splits"].items()} == {
        n: 6 * sum(hash_split({"a": 0.5, "b": 0.5}, 3, c) == n for c in ("cat", "dog")) for n in ("a", "b")}
    r["split"]["group"] = "nope"
    with pytest.raises(RecipeError, match="'nope' is neither a table column nor a capture of match"):
        make_plan(load_recipe(r))


def test_missing_pyarrow_names_the_extra(table_tree, monkeypatch):
    import sys

    from precompile.errors import MissingDependencyError

    for m in ("pyarrow", "pyarrow.csv", "pyarrow.json", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, m, None)   # import fails as if it were not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'precompile\[tables\]'"):
        make_plan(load_recipe(_recipe("t.csv")))


def test_loader_gives_text_as_a_list_of_str(table_tree):
    torch = pytest.importorskip("torch", reason="the Loader needs torch")
    from precompile import Loader

    root, rows, _ = table_tree
    r = _recipe("t.csv")
    r["steps"] = [{"resize": {"size": [6, 5]}}]   # the Loader gathers fixed shapes
    rep = precompile.build(r, "out")
    ds = precompile.open(rep["output"])
    loader = Loader(rep["output"], batch_size=3, shuffle=True, seed=1, device="cpu", num_threads=0)
    by_key = {r["Path"]: r for r in rows}
    n = 0
    for b, idx in zip(loader, loader.batch_indices(0)):
        assert isinstance(b["caption"], list) and all(isinstance(t, str) for t in b["caption"])
        assert b["caption"] == [by_key[ds.key(int(i))]["Caption"] for i in idx]
        assert isinstance(b["y"], torch.Tensor) and tuple(b["y"].shape) == (len(idx), 2)
        n += len(idx)
    assert n == 7


# -- the example recipes ----------------------------------------------------------------------------

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_example_chexpert_builds_with_a_patient_grouped_split(tmp_path):
    rep = precompile.build(RECIPES / "chexpert.yaml", tmp_path)
    with open(RECIPES.parent / "sample_data" / "chexpert" / "train.csv", newline="") as f:
        rows = {r["Path"]: r for r in csv.DictReader(f)}
    findings = list(rows[next(iter(rows))])[5:]
    assert len(findings) == 14
    patients, n = {}, 0
    for name, info in rep["splits"].items():
        ds = precompile.open(info["output"])
        n += len(ds)
        for i in range(len(ds)):
            row, s = rows[ds.key(i)], ds[i]
            want = [math.nan if row[c] in ("", "-1.0") else float(row[c]) for c in findings]
            np.testing.assert_array_equal(s["findings"], np.asarray(want, np.float32))
            assert s["age"] == float(row["Age"]) and ds.label_names[int(s["sex"])] == row["Sex"]
            p = ds.key(i).split("/")[2]
            assert patients.setdefault(p, name) == name
    assert n == len(rows)


def test_example_kinetics_builds_clips_per_row_and_skips_the_missing_video(tmp_path):
    rep = precompile.build(RECIPES / "kinetics.yaml", tmp_path)
    assert [f["key"] for f in rep["failures"]] == ["Kk7jJ8hH9gG"]
    train = precompile.open(rep["splits"]["train"]["output"])
    assert train.label_names == ["dancing, ballet", "playing guitar", "riding a bike"]
    i = train.keys.index("Zz9_yY8-xX7#clip0")        # time_start 1, time_end 3: frames 10..29 at 10 fps
    frames = _pyav_frames(RECIPES.parent / "sample_data/kinetics/videos/Zz9_yY8-xX7_000001_000003.mp4")
    ref = np.stack([x for t, x in frames if 1 - 1e-6 <= t < 3 - 1e-6][0:16:2])
    np.testing.assert_array_equal(train[i]["video"], ref)
    assert train.meta(i)["clip"]["pts"][0] == pytest.approx(1.0)
    assert train.label_names[int(train[i]["label"])] == "dancing, ballet"


def test_example_lung_ct_table_builds_one_series_per_row(tmp_path):
    rep = precompile.build(RECIPES / "lung_ct_table.yaml", tmp_path)
    ds = precompile.open(rep["output"])
    assert ds.keys == ["chest_a", "chest_b"] and ds.label_names == ["0", "1"]
    assert [int(ds[i]["cancer"]) for i in range(2)] == [0, 1]
    assert ds[0]["ct"].ndim == 3


# -- stats and preview ------------------------------------------------------------------------------

def test_stats_summarise_targets_per_column_and_text_lengths(table_tree):
    from precompile.tools.stats import describe, stats

    root, rows, _ = table_tree
    rep = precompile.build(_recipe("t.csv"), "out")
    res = stats(rep["output"])
    y = np.asarray([_expected_target(r) for r in rows], np.float64)
    got = res["fields"]["y"]
    assert got["kind"] == "target" and got["columns"] == ["Finding", "Age"] and got["channels"] == 2
    np.testing.assert_allclose(got["mean"], np.nanmean(y, axis=0), rtol=1e-12)
    np.testing.assert_allclose(got["std"], np.nanstd(y, axis=0), rtol=1e-12)
    assert got["min"] == np.nanmin(y, axis=0).tolist() and got["max"] == np.nanmax(y, axis=0).tolist()
    assert got["nonfinite"] == np.isnan(y).sum(axis=0).tolist() == [3, 0]   # blank and -1 (mapped) are NaN
    cap = res["fields"]["caption"]
    lengths = np.asarray([len(r["Caption"]) for r in rows], np.float64)
    assert cap["empty"] == 1 and cap["max"] == [lengths.max()] and cap["mean"] == pytest.approx([lengths.mean()])
    text = describe(res)
    assert "Finding" in text and "caption (text, str, 1 channel(s), length in characters, 1 empty)" in text


def test_preview_shows_text_and_targets_in_the_header(table_tree):
    from precompile.tools.preview import Item, header_lines, render

    root, rows, _ = table_tree
    rep = precompile.build(_recipe("t.csv"), "out")
    ds = precompile.open(rep["output"])
    p = render(rep["output"], n=7)
    assert len(p.rows) == 7
    by_key = {r["Path"]: r for r in rows}
    opts = {"target_columns": {"y": ["Finding", "Age"]}}
    for i in range(len(ds)):
        row = by_key[ds.key(i)]
        lines = header_lines(Item(ds.key(i), [ds[i]], [ds.meta(i)], [0], ds.field_specs, ds.label_names, opts))
        assert f'caption: "{row["Caption"].replace(chr(10), " ⏎ ")}"' in lines
        y = _expected_target(row)
        want = ", ".join(f"{n}={v:.3g}" for n, v in zip(["Finding", "Age"], y) if not math.isnan(v))
        assert f"y: {want}" + (", 1 blank (NaN)" if math.isnan(y[0]) else "") in lines
        assert f"label: {row['Label']} ({ds.label_names.index(row['Label'])})" in lines


def test_static_decoder_options_beside_row_options_are_checked_at_load():
    with pytest.raises(RecipeError, match=r"inputs.fields.v.mode: Input should be 'rgb8' or 'gray8', got 'bogus'"):
        load_recipe({"name": "t", "inputs": {"root": ".", "table": "x.csv", "path": "{a}", "fields": {
            "v": {"decoder": "video", "mode": "bogus", "start_s": {"column": "a"}}}}})
    with pytest.raises(RecipeError, match=r"inputs.fields.v.start: unknown option\(s\) \['start'\] of decoder 'video'"):
        load_recipe({"name": "t", "inputs": {"root": ".", "table": "x.csv", "path": "{a}", "fields": {
            "v": {"decoder": "video", "start": {"column": "a"}}}}})


def test_a_table_of_columns_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "x": i / 4, "t": "ab" * i}) + "\n"
                                              for i in range(5)))
    r = {"name": "c", "inputs": {"root": ".", "table": "t.jsonl", "key": "id",
                                 "columns": {"x": {"column": "x", "kind": "target"},
                                             "t": {"column": "t", "kind": "text"}}}}
    ds = precompile.open(precompile.build(r, "out")["output"])
    assert ds.keys == [f"r{i}" for i in range(5)]
    assert [float(ds[i]["x"]) for i in range(5)] == [i / 4 for i in range(5)]
    assert [ds[i]["t"] for i in range(5)] == ["ab" * i for i in range(5)]


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_verify_checks_text_and_catches_a_flipped_text_byte(table_tree, fmt):
    from precompile.tools.verify import verify

    root, rows, _ = table_tree
    r = _recipe("t.csv")
    r["output"]["format"] = fmt
    rep = precompile.build(r, "out")
    assert verify(rep["output"]).ok
    shard = shard_file(rep["output"], 0)
    if fmt == "hdf5":
        with h5py.File(str(shard), "r+") as f:
            d = f["caption"]["data"]
            d[0] = d[0] ^ 1
    else:
        p = shard / "caption.npy"
        a = np.load(p)
        a[0] ^= 1
        np.save(p, a)
    res = verify(rep["output"])
    assert not res.ok and res.bad_shards == [f"t.shards/{shard.name}"]
    assert any("'caption'" in p and "checksum" in p for p in res.problems), res.problems


def test_a_split_that_gets_no_input_is_an_empty_output(table_tree):
    root, rows, _ = table_tree
    fr = {"big": 0.999, "tiny": 0.001}
    r = _recipe("t.csv")
    r["split"] = {"fractions": fr}
    want = {n: sum(hash_split(fr, 0, x["Path"]) == n for x in rows) for n in fr}
    assert want["tiny"] == 0        # with 7 keys and 0.1 %: the case this test is about
    rep = precompile.build(r, "out")
    assert {n: i["inputs"] for n, i in rep["splits"].items()} == want
    empty = precompile.open(rep["splits"]["tiny"]["output"])
    assert len(empty) == 0 and list(empty.field_specs) == list(precompile.open(rep["splits"]["big"]["output"]).field_specs)
    assert precompile.build(r, "out")["up_to_date"]


def test_every_copy_keeps_its_rows_text_and_target(table_tree):
    root, rows, _ = table_tree
    r = _recipe("t.csv")
    r["steps"] = [{"random_flip": {"horizontal": 1.0}}, {"random_crop": {"size": [4, 4]}}]
    r["copies"] = 2
    ds = precompile.open(precompile.build(r, "out")["output"])
    assert len(ds) == 3 * 7
    by_key = {x["Path"]: x for x in rows}
    for i in range(len(ds)):
        row, s = by_key[ds.key(i)], ds[i]
        assert s["caption"] == row["Caption"] and s["image"].shape == (4, 4, 3)
        np.testing.assert_array_equal(s["y"], np.asarray(_expected_target(row), np.float32))


def test_a_row_decoder_keeps_what_the_recipe_configured(table_tree):
    root, rows, _ = table_tree
    rows = [dict(r, Mode="rgb8") for r in rows]
    _write_csv(root / "m.csv", rows)
    r = _recipe("m.csv", fields={"image": {"decoder": "image", "mode": {"column": "Mode"}, "reduce": "auto"}})
    r["steps"] = [{"resize": {"size": [3, 2]}}]
    rec = load_recipe(r)
    base = rec.decoders["image"]
    dec = rec.decoder_for("image", {"mode": "rgb8"})
    assert dec is not base and dec.params.mode == "rgb8" and dec.params.reduce == "auto"
    assert dec.need == base.need and dec.need_reason == base.need_reason and base.need is not None
    assert rec.decoder_for("image", {"mode": "rgb8"}) is dec     # one decoder per distinct row value


def test_target_map_rules():
    from precompile.inputs.table.cells import number as _number

    m = {-1.0: "nan", "2": 0.5, "": 0.0, "positive": 1.0, "unsure": None}
    assert math.isnan(_number("-1.0", m)) and math.isnan(_number(-1, m)) and math.isnan(_number("-1", m))
    assert _number("2.0", m) == 0.5 and _number(2, m) == 0.5             # numeric keys match the number
    assert _number("", m) == 0.0 and _number(None, m) == 0.0              # '' gives blank cells a value
    assert math.isnan(_number("", {})) and math.isnan(_number(float("nan"), {}))  # blank -> NaN by default
    assert _number(" positive ", m) == 1.0 and math.isnan(_number("unsure", m))
    assert _number("3.5", m) == 3.5
    with pytest.raises(ValueError, match="'maybe' is not a number"):
        _number("maybe", m)
    with pytest.raises(ValueError, match="is a boolean"):
        _number(True, m)


@pytest.mark.parametrize("cell, msg", [
    ("1e39", r"'1e39' is beyond float32's range \(\+-3\.4e38\), which targets are stored in"),
    ("-1e400", r"'-1e400' is beyond float32's range"),
    ("1_000", r"'1_000' is not a number"),
    ("12_3", r"'12_3' is not a number"),
])
def test_target_cells_float32_cannot_hold_or_python_alone_reads_are_refused(table_tree, cell, msg):
    """A target is float32: 1e39 (and 1e400, which is inf already as a float64) was stored as inf with only a numpy
    RuntimeWarning, and Python's float() read '1_000' as 1000 and '12_3' as 123 (pandas and Arrow read them as text;
    Unicode digits stay numbers, as docs/tables.md says float() reads a cell). Each is the plan's TableError naming the row and column; an explicit inf and NaN stay values."""
    root, rows, _ = table_tree
    rows[2]["Age"] = cell
    _write_csv(root / "bad.csv", rows)
    e = _plan_error(_recipe("bad.csv"))
    assert e.loc == "inputs.columns.y" and "data row 3 (1-based, header not counted), column 'Age'" in str(e)
    assert re.search(msg, str(e)), str(e)
    from precompile.inputs.table.cells import number
    assert number("+inf", {}) == math.inf and number("-Infinity", {}) == -math.inf and math.isnan(number("nan", {}))
    assert number(" 3.4e38 ", {}) == 3.4e38


def test_where_and_template_numbers_are_read_as_tables_read_them(tmp_path):
    """inputs.where and a `{col:06d}` slot read a text cell through Python's float()/int(), which take '1_000' as
    1000 and '0_0' as 0 (a row kept by `n > 6`, a file '000000.png' read for id '0_0'); csv, pandas and Arrow read
    those cells as text. Both are now the plan's error naming the row and column."""
    root = tmp_path / "in"
    root.mkdir()
    for name in ("a.png", "b.png", "000000.png", "000001.png"):
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / name)
    (tmp_path / "w.csv").write_text("file,n\na.png,1_000\nb.png,7\n")
    r = {"name": "w", "inputs": {"root": str(root), "table": str(tmp_path / "w.csv"), "path": "{file}", "where": "n > 6",
                                 "fields": {"image": {"decoder": "image"}}}}
    e = _plan_error(r)
    assert "data row 1 (1-based, header not counted), column 'n': '1_000' is not a number" in str(e), str(e)
    (tmp_path / "i.csv").write_text("id\n0_0\n1\n")
    r = {"name": "i", "inputs": {"root": str(root), "table": str(tmp_path / "i.csv"), "path": "{id:06d}.png",
                                 "fields": {"image": {"decoder": "image"}}}}
    e = _plan_error(r)
    assert "data row 1 (1-based, header not counted), column 'id': '0_0' is not an integer (format {id:06d})" in str(e)
