"""Grouped splits attacked from outside (issue 35): rows whose group cell is blank, checked with Python's csv
and json modules."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from precompile.compiler.plan import make_plan
from precompile.errors import RecipeError
from precompile.recipe import load_recipe

pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")


def _plan(table: Path, split: dict) -> dict[str, str]:
    rec = {"name": "g", "inputs": {"root": ".", "table": str(table), "key": "id",
                                   "columns": {"w": {"column": "id", "kind": "text"}}}, "split": split}
    plan = make_plan(load_recipe(rec))
    return {k: s.split for s in plan.shards for k in s.table.keys.to_list(s.rows)}


@pytest.mark.parametrize("split", [
    {"by": "hash", "group": "grp", "fractions": {"a": 0.5, "b": 0.5}},
    {"by": "hash", "group": "grp", "stratify": "cls", "fractions": {"a": 0.5, "b": 0.5}},
])
@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_row_without_a_group_is_an_error_not_one_group_of_all_such_rows(tmp_path, split, fmt):
    """Rows whose group cell was blank (CSV: empty or spaces; JSON: null) all became one group (``''``, or
    ``'None'``, merged with any row whose group is the text 'None'), so every such row went to one split
    together, with no error: 10 of these 20 rows, whatever the fractions said. A blank group is now an error
    naming the file, the row and the column, as a blank key is."""
    rows = [{"id": f"r{i:02d}", "grp": (None if fmt == "jsonl" else " ") if i % 2 else f"p{i}", "cls": "ab"[i % 2]}
            for i in range(20)]
    path = tmp_path / f"t.{fmt}"
    if fmt == "csv":
        path.write_text("id,grp,cls\n" + "".join(f"{r['id']},{r['grp']},{r['cls']}\n" for r in rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RecipeError, match=rf"t.{fmt}: data row 2 \(1-based, header not counted\), column 'grp': "
                                          r"the group is blank"):
        _plan(path, split)


def test_rows_with_groups_still_split_by_group(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,grp\n" + "".join(f"r{i:02d},p{i % 5}\n" for i in range(20)))
    got = _plan(path, {"by": "hash", "group": "grp", "fractions": {"a": 0.5, "b": 0.5}})
    by_group: dict[str, set] = {}
    for k, s in got.items():
        by_group.setdefault(f"p{int(k[1:]) % 5}", set()).add(s)
    assert len(got) == 20 and all(len(v) == 1 for v in by_group.values())
