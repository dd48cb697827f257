"""Stratified splits (``split.stratify``, issue 35): every split holds each class in the fractions' proportions,
within one row per class and split, or with ``group`` within the largest group of the class; groups never
straddle splits; deterministic from the seed; adding a row moves at most one old row of its class per cut.

The reference is computed here: the table is read back with Python's csv module, the class counts and the
ideal shares (fraction x class count) come from those rows, and the plan's splits are compared with them."""
from __future__ import annotations

import collections
import csv
import json
import random
from pathlib import Path

import pytest

from precompile.compiler.plan import make_plan
from precompile.errors import RecipeError
from precompile.recipe import load_recipe

pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")

FRACTIONS = [{"train": 0.7, "val": 0.2, "test": 0.1}, {"a": 0.5, "b": 0.5}, {"x": 0.6, "y": 0.25, "z": 0.15},
             {"one": 0.34, "two": 0.33, "three": 0.33}]


def _write(path: Path, rows: list[dict]) -> list[dict]:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _rows(r: random.Random, n: int, groups: bool) -> list[dict]:
    """Imbalanced classes (one with a handful of rows, a blank class among them); with ``groups``, patients of
    one class each, of 1 to 12 rows."""
    classes = ["cat"] * 20 + ["dog"] * 9 + ["bird"] * 3 + ["", "rare"]
    rows = []
    while len(rows) < n:
        c = r.choice(classes)
        size = r.randint(1, 12) if groups else 1
        g = f"patient{len(rows):05d}"
        for _ in range(size):
            rows.append({"id": f"r{len(rows):05d}", "cls": c, "grp": g})
    return rows[:n]


def _splits(table: Path, split: dict, tmp: Path) -> dict[str, str]:
    rec = {"name": "s", "inputs": {"root": ".", "table": str(table), "key": "id",
                                   "columns": {"c": {"column": "cls", "kind": "text"}}}, "split": split}
    plan = make_plan(load_recipe(rec))
    out: dict[str, str] = {}
    for s in plan.shards:
        for k in s.table.keys.to_list(s.rows):
            assert k not in out, f"{k} in two splits"
            out[k] = s.split
    return out


@pytest.mark.parametrize("case", range(8))
def test_each_split_holds_each_class_within_one_row_of_its_share(tmp_path, case):
    r = random.Random(case)
    fractions = FRACTIONS[case % len(FRACTIONS)]
    rows = _write(tmp_path / "t.csv", _rows(r, r.randint(50, 400), groups=False))
    got = _splits(tmp_path / "t.csv", {"by": "hash", "fractions": fractions, "stratify": "cls", "seed": case}, tmp_path)
    assert set(got) == {row["id"] for row in rows}
    per_class = collections.Counter(row["cls"] for row in rows)
    held = collections.Counter((row["cls"], got[row["id"]]) for row in rows)
    for c, n in per_class.items():
        for s, f in fractions.items():
            assert abs(held[(c, s)] - f * n) <= 1 + 1e-9, (c, s, held[(c, s)], f * n)


@pytest.mark.parametrize("case", range(6))
def test_with_groups_no_group_straddles_and_classes_hold_within_the_largest_group(tmp_path, case):
    r = random.Random(100 + case)
    fractions = FRACTIONS[case % len(FRACTIONS)]
    rows = _write(tmp_path / "t.csv", _rows(r, r.randint(100, 600), groups=True))
    got = _splits(tmp_path / "t.csv", {"by": "hash", "fractions": fractions, "stratify": "cls", "group": "grp"},
                  tmp_path)
    where: dict[str, str] = {}
    for row in rows:   # no leak: every row of a group in one split
        assert where.setdefault(row["grp"], got[row["id"]]) == got[row["id"]], row["grp"]
    sizes = collections.Counter(row["grp"] for row in rows)
    largest = collections.defaultdict(int)
    for row in rows:
        largest[row["cls"]] = max(largest[row["cls"]], sizes[row["grp"]])
    per_class = collections.Counter(row["cls"] for row in rows)
    held = collections.Counter((row["cls"], got[row["id"]]) for row in rows)
    for c, n in per_class.items():
        for s, f in fractions.items():
            assert abs(held[(c, s)] - f * n) <= largest[c] + 1e-9, (c, s, held[(c, s)], f * n, largest[c])


def test_groups_of_mixed_classes_never_leak(tmp_path):
    r = random.Random(5)
    rows = _write(tmp_path / "t.csv", [{"id": f"r{i:04d}", "cls": r.choice("abc"), "grp": f"g{r.randint(0, 40)}"}
                                       for i in range(500)])
    got = _splits(tmp_path / "t.csv", {"by": "hash", "fractions": {"train": 0.8, "test": 0.2}, "stratify": "cls",
                                       "group": "grp"}, tmp_path)
    where: dict[str, str] = {}
    for row in rows:
        assert where.setdefault(row["grp"], got[row["id"]]) == got[row["id"]]
    assert set(where.values()) == {"train", "test"}


def test_deterministic_from_the_seed_and_closer_than_the_plain_hash(tmp_path):
    r = random.Random(9)
    rows = _write(tmp_path / "t.csv", _rows(r, 300, groups=False))
    sp = {"by": "hash", "fractions": {"train": 0.5, "val": 0.3, "test": 0.2}, "stratify": "cls"}
    a = _splits(tmp_path / "t.csv", sp, tmp_path)
    assert _splits(tmp_path / "t.csv", sp, tmp_path) == a
    other = _splits(tmp_path / "t.csv", dict(sp, seed=1), tmp_path)
    assert other != a
    plain = _splits(tmp_path / "t.csv", {k: v for k, v in sp.items() if k != "stratify"}, tmp_path)

    def worst(got: dict) -> float:
        per_class = collections.Counter(row["cls"] for row in rows)
        held = collections.Counter((row["cls"], got[row["id"]]) for row in rows)
        return max(abs(held[(c, s)] - f * n) for c, n in per_class.items() for s, f in sp["fractions"].items())

    assert worst(a) <= 1 < worst(plain)   # the plain hash split is off by more on these classes


def test_adding_a_row_moves_at_most_one_old_row_of_its_class_per_cut(tmp_path):
    """The guarantee docs/tables.md states for stratify (the plain hash split moves none)."""
    r = random.Random(11)
    rows = _rows(r, 120, groups=False)
    sp = {"by": "hash", "fractions": {"train": 0.6, "val": 0.25, "test": 0.15}, "stratify": "cls"}
    _write(tmp_path / "t.csv", rows)
    before = _splits(tmp_path / "t.csv", sp, tmp_path)
    cls = {row["id"]: row["cls"] for row in rows}
    moved_any = 0
    for k in range(12):
        new = {"id": f"n{k:03d}", "cls": r.choice(["cat", "dog", "bird"]), "grp": "x"}
        _write(tmp_path / "t.csv", rows + [new])
        after = _splits(tmp_path / "t.csv", sp, tmp_path)
        moved = [i for i in before if after[i] != before[i]]
        assert len(moved) <= len(sp["fractions"]) - 1, moved
        assert all(cls[i] == new["cls"] for i in moved), (moved, new)
        moved_any += bool(moved)
    assert moved_any   # the draw does reach a move (the guarantee is not vacuous)


def test_blank_cells_are_one_class_and_where_counts_kept_rows(tmp_path):
    rows = [{"id": f"r{i:03d}", "cls": ["", " ", "a"][i % 3], "keep": "y" if i < 60 else "n"} for i in range(90)]
    _write(tmp_path / "t.csv", rows)
    rec = {"name": "s", "inputs": {"root": ".", "table": str(tmp_path / "t.csv"), "key": "id", "where": "keep == 'y'",
                                   "columns": {"c": {"column": "cls", "kind": "text"}}},
           "split": {"by": "hash", "fractions": {"a": 0.5, "b": 0.5}, "stratify": "cls"}}
    plan = make_plan(load_recipe(rec))
    held = collections.Counter()
    for s in plan.shards:
        for k in s.table.keys.to_list(s.rows):
            held[(rows[int(k[1:])]["cls"].strip(), s.split)] += 1
    assert held == {("", "a"): 20, ("", "b"): 20, ("a", "a"): 10, ("a", "b"): 10}


def test_stratify_by_a_folder_capture(tmp_path):
    for c, n in (("cat", 9), ("dog", 4), ("emu", 1)):
        (tmp_path / c).mkdir()
        for i in range(n):
            (tmp_path / c / f"{i}.png").write_bytes(b"x")
    rec = {"name": "f", "inputs": {"root": str(tmp_path), "match": "{label}/{name}.png",
                                   "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
           "split": {"by": "hash", "fractions": {"train": 0.75, "val": 0.25}, "stratify": "label"}}
    plan = make_plan(load_recipe(rec))
    held = collections.Counter((k.split("/")[0], s.split) for s in plan.shards for k in s.table.keys.to_list(s.rows))
    assert held == {("cat", "train"): 7, ("cat", "val"): 2, ("dog", "train"): 3, ("dog", "val"): 1,
                    ("emu", "train"): 1}


def test_stratify_errors(tmp_path):
    _write(tmp_path / "t.csv", [{"id": "r1", "cls": "a", "split": "train"}])
    base = {"name": "s", "inputs": {"root": ".", "table": str(tmp_path / "t.csv"), "key": "id",
                                    "columns": {"c": {"column": "cls", "kind": "text"}}}}
    with pytest.raises(RecipeError, match=r"split: stratify is for by: hash"):
        load_recipe(dict(base, split={"by": "column", "column": "split", "stratify": "cls"}))
    with pytest.raises(RecipeError, match=r"split.stratify: .*t\.csv: no column 'klass' \(columns: id, cls, split\)"):
        make_plan(load_recipe(dict(base, split={"by": "hash", "fractions": {"a": 1.0}, "stratify": "klass"})))


def test_adding_a_group_moves_only_groups_of_its_class_and_few_rows_per_cut(tmp_path):
    """With groups the promise is weaker (docs/tables.md): adding a group moves only groups of its class, and across
    each cut fewer rows than the new group and the class's largest group hold together. Checked per cut against
    the rows read back with Python's csv module."""
    r = random.Random(12)
    rows = _rows(r, 300, groups=True)
    sp = {"by": "hash", "fractions": {"train": 0.6, "val": 0.25, "test": 0.15}, "stratify": "cls", "group": "grp"}
    names = list(sp["fractions"])
    _write(tmp_path / "t.csv", rows)
    before = _splits(tmp_path / "t.csv", sp, tmp_path)
    cls = {row["grp"]: row["cls"] for row in rows}
    size = collections.Counter(row["grp"] for row in rows)
    group_of = {row["id"]: row["grp"] for row in rows}
    moved_any = 0
    for k in range(10):
        c, n = r.choice(["cat", "dog", "bird"]), r.randint(1, 12)
        new = [{"id": f"n{k:02d}_{j}", "cls": c, "grp": f"new{k:02d}"} for j in range(n)]
        _write(tmp_path / "t.csv", rows + new)
        after = _splits(tmp_path / "t.csv", sp, tmp_path)
        largest = max(size[g] for g in size if cls[g] == c)
        crossed = [0] * (len(names) - 1)
        moved = {group_of[i]: (before[i], after[i]) for i in before if after[i] != before[i]}
        for g, (was, now) in moved.items():
            assert cls[g] == c, (g, cls[g], c)
            a, b = sorted((names.index(was), names.index(now)))
            for cut in range(a, b):
                crossed[cut] += size[g]
        assert all(x < n + largest for x in crossed), (crossed, n, largest)
        moved_any += bool(moved)
    assert moved_any


def test_stratify_a_json_lines_number_column_with_a_group_pattern(tmp_path):
    """Classes from a typed column (JSON Lines numbers, nulls one blank class), groups cut from the key by
    split.group.pattern: no patient in two splits, each class within its largest patient of its share (truth from
    the rows json.loads reads back)."""
    r = random.Random(21)
    rows, i = [], 0
    for p in range(80):
        c = r.choice([0, 1, 1, 2, 2, 2, None])
        for _ in range(r.randint(1, 5)):
            rows.append({"id": f"patient{p:03d}/study{i:04d}", "cls": c})
            i += 1
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    back = [json.loads(line) for line in path.read_text().splitlines()]
    rec = {"name": "s", "inputs": {"root": ".", "table": str(path), "key": "id",
                                   "columns": {"k": {"column": "id", "kind": "text"}}},
           "split": {"by": "hash", "fractions": {"train": 0.6, "val": 0.2, "test": 0.2}, "stratify": "cls",
                     "group": {"column": "id", "pattern": r"^patient(\d+)/"}}}
    plan = make_plan(load_recipe(rec))
    got = {k: s.split for s in plan.shards for k in s.table.keys.to_list(s.rows)}
    assert sorted(got) == sorted(row["id"] for row in back)
    patient = {row["id"]: row["id"].split("/")[0] for row in back}
    where: dict[str, str] = {}
    for k, s in got.items():
        assert where.setdefault(patient[k], s) == s, k
    sizes = collections.Counter(patient.values())
    per_class = collections.Counter(row["cls"] for row in back)
    largest = {c: max(sizes[patient[row["id"]]] for row in back if row["cls"] == c) for c in per_class}
    held = collections.Counter((row["cls"], got[row["id"]]) for row in back)
    for c, n in per_class.items():
        for s, f in rec["split"]["fractions"].items():
            assert abs(held[(c, s)] - f * n) <= largest[c], (c, s, held[(c, s)], f * n, largest[c])
    assert {c for c, _ in held} == {0, 1, 2, None}


def test_stratify_by_an_unknown_capture_suggests_the_close_one(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "0.png").write_bytes(b"x")
    rec = {"name": "f", "inputs": {"root": str(tmp_path), "match": "{label}/{name}.png",
                                   "fields": {"image": {"decoder": "image"}}},
           "split": {"by": "hash", "fractions": {"train": 0.75, "val": 0.25}, "stratify": "lable"}}
    with pytest.raises(RecipeError) as e:
        make_plan(load_recipe(rec))
    assert str(e.value) == "split: 'lable' is neither a table column nor a capture of match; did you mean 'label'?"


def test_the_order_of_the_rows_changes_nothing(tmp_path):
    """docs/tables.md: same inputs, same seed, same splits, whatever the order of the rows (with and without
    groups; groups mixing classes too)."""
    r = random.Random(31)
    rows = [{"id": f"r{i:04d}", "cls": r.choice(["a", "b", "c", ""]), "grp": f"g{r.randint(0, 60)}"}
            for i in range(400)]
    for sp in ({"by": "hash", "fractions": {"train": 0.7, "val": 0.2, "test": 0.1}, "stratify": "cls"},
               {"by": "hash", "fractions": {"train": 0.7, "val": 0.2, "test": 0.1}, "stratify": "cls", "group": "grp"}):
        _write(tmp_path / "t.csv", rows)
        first = _splits(tmp_path / "t.csv", sp, tmp_path)
        for k in range(3):
            shuffled = rows[:]
            random.Random(k).shuffle(shuffled)
            _write(tmp_path / "t.csv", shuffled)
            assert _splits(tmp_path / "t.csv", sp, tmp_path) == first


@pytest.mark.parametrize("groups", [False, True])
def test_small_classes_do_not_all_fall_into_the_largest_split(tmp_path, groups):
    """A long tail (many classes of one or two rows, or of one patient each): each class is within one row (one
    group) of its share, and the splits still get their fractions overall. Before, every class's line started at
    0 and each input went where its middle fell: a class of 1 or 2 rows split 0.8/0.1/0.1 was all train, so val
    and test got none of 2,000 rows."""
    r = random.Random(41)
    rows = []
    for c in range(1000):
        size = r.choice([1, 2]) if not groups else 1
        for j in range(size if not groups else r.randint(1, 4)):
            rows.append({"id": f"r{len(rows):05d}", "cls": f"c{c:04d}", "grp": f"g{c:04d}"})
    _write(tmp_path / "t.csv", rows)
    fractions = {"train": 0.8, "val": 0.1, "test": 0.1}
    sp = {"by": "hash", "fractions": fractions, "stratify": "cls", **({"group": "grp"} if groups else {})}
    got = _splits(tmp_path / "t.csv", sp, tmp_path)
    split_of_unit = {row["grp"] if groups else row["id"]: got[row["id"]] for row in rows}
    per_unit = collections.Counter(split_of_unit.values())
    n = len(split_of_unit)
    for s, f in fractions.items():   # 1,000 draws at odds f: 6 sigma is about 6 * sqrt(1000 * 0.1 * 0.9) = 57
        assert abs(per_unit[s] - f * n) <= 6 * (n * f * (1 - f)) ** 0.5, (s, per_unit, n)
    per_class = collections.Counter(row["cls"] for row in rows)
    cls_held = collections.Counter((row["cls"], got[row["id"]]) for row in rows)
    for c, k in per_class.items():
        for s, f in fractions.items():
            assert abs(cls_held[(c, s)] - f * k) <= (k if groups else 1) + 1e-9


def test_a_split_without_stratify_keeps_its_recipe_key(tmp_path):
    """stratify absent is left out of the resolved recipe (its key as before the option existed, on every pydantic
    the project takes); given, it is in the key."""
    _write(tmp_path / "t.csv", [{"id": "r1", "cls": "a"}])
    rec = {"name": "s", "inputs": {"root": ".", "table": str(tmp_path / "t.csv"), "key": "id",
                                   "columns": {"c": {"column": "cls", "kind": "text"}}},
           "split": {"by": "hash", "fractions": {"a": 0.5, "b": 0.5}}}
    plain = load_recipe(rec)
    assert plain.resolved()["split"] == {"by": "hash", "column": None, "group": None, "fractions": {"a": 0.5, "b": 0.5},
                                         "seed": None}
    strat = load_recipe(dict(rec, split=dict(rec["split"], stratify="cls")))
    assert strat.resolved()["split"]["stratify"] == "cls" and strat.content_hash() != plain.content_hash()


def test_a_stratified_build_round_trip(tmp_path):
    """Build -> read: each split's output holds the kept rows the plan gave it, every sample's label is its row's
    class (read back with Python's csv module), each class within one row of its share in every split, and a
    second build writes nothing."""
    import precompile

    r = random.Random(51)
    rows = _write(tmp_path / "t.csv", [{"id": f"r{i:03d}", "cls": r.choice(["cat", "cat", "dog", "emu"]),
                                        "age": str(r.randint(1, 99))} for i in range(150)])
    rec = {"name": "t", "inputs": {"root": ".", "table": str(tmp_path / "t.csv"), "key": "id", "where": "age >= 10",
                                   "columns": {"y": {"column": "cls", "kind": "label"}}},
           "split": {"by": "hash", "fractions": {"train": 0.6, "val": 0.3, "test": 0.1}, "stratify": "cls"}}
    rep = precompile.build(rec, tmp_path / "out")
    kept = {row["id"]: row["cls"] for row in rows if int(row["age"]) >= 10}
    got: dict[str, str] = {}
    for name, info in rep["splits"].items():
        ds = precompile.open(info["output"])
        for i, k in enumerate(ds.keys):
            assert k not in got
            got[k] = name
            assert ds.label_names[int(ds[i]["y"])] == kept[k], k
    assert sorted(got) == sorted(kept)
    per_class = collections.Counter(kept.values())
    held = collections.Counter((kept[k], s) for k, s in got.items())
    for c, n in per_class.items():
        for s, f in rec["split"]["fractions"].items():
            assert abs(held[(c, s)] - f * n) < 1, (c, s, held[(c, s)], f * n)
    again = precompile.build(rec, tmp_path / "out")
    assert again["shards"]["built"] == 0, again["shards"]
