"""``inputs.where`` attacked from outside (issue 35): the rows a plan keeps against the same filter written by hand
in plain Python over the rows Python's ``json`` module reads, on tables where pyarrow's reading and Python's
disagree."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from precompile.errors import RecipeError
from precompile.inputs import read_inputs
from precompile.recipe import load_recipe

pytest.importorskip("pyarrow", reason="table inputs need pyarrow (the tables extra)")


def _kept(table: Path, where: str, **extra) -> list[str]:
    inp = {"root": ".", "table": str(table), "key": "id", "columns": {"w": {"column": "id", "kind": "text"}},
           "where": where}
    inp.update(extra)
    return read_inputs(load_recipe({"name": "w", "inputs": inp})).table.keys.to_list()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BIG = 2 ** 53 + 1   # 9007199254740993: an integer no 64-bit float holds


@pytest.mark.parametrize("rows", [
    [{"id": "r0", "x": BIG}, {"id": "r1", "x": 0.5}, {"id": "r2", "x": BIG - 1}],          # int beside a decimal
    [{"id": "r0", "x": BIG}, {"id": "r1", "x": 2 ** 64 - 1}, {"id": "r2", "x": BIG - 1}],  # int beside a uint64
])
def test_a_json_integer_no_float_holds_is_never_compared_as_its_rounded_float(tmp_path, rows):
    """pyarrow reads a JSON Lines column of integers as 64-bit floats when one of them is a decimal or lies
    beyond int64; then 9007199254740993 read as 9007199254740992.0 matched ``x == 9007199254740992`` (Python,
    reading the line with json.loads, says it does not). Such a column is refused by inputs.where, naming the
    file, the row and the value, rather than filtered on rounded values."""
    table = _jsonl(tmp_path / "t.jsonl", rows)
    with open(table) as f:
        back = [json.loads(line) for line in f]
    truth = [r["id"] for r in back if r["x"] == BIG - 1]
    assert truth == ["r2"]
    with pytest.raises(RecipeError) as e:
        _kept(table, f"x == {BIG - 1}")
    msg = str(e.value)
    assert "t.jsonl: data row 1 (1-based, header not counted), column 'x'" in msg, msg
    assert f"the integer {BIG}" in msg and "inputs.where" in msg, msg
    assert _kept(table, "x is not null and id != \"r1\"") == ["r0", "r2"]   # not compared with a number: read


def test_json_integers_floats_hold_still_compare_exactly(tmp_path):
    """The refusal is only for integers a float cannot hold: a column of small integers beside decimals, and a
    column of large integers pyarrow reads as int64, compare as Python compares them."""
    mixed = _jsonl(tmp_path / "m.jsonl", [{"id": "r0", "x": 3}, {"id": "r1", "x": 0.5}, {"id": "r2", "x": 2 ** 53}])
    assert _kept(mixed, "x >= 3") == ["r0", "r2"]
    ints = _jsonl(tmp_path / "i.jsonl", [{"id": "r0", "x": BIG}, {"id": "r1", "x": BIG - 1}, {"id": "r2", "x": -1}])
    assert _kept(ints, f"x == {BIG - 1}") == ["r1"]
    assert _kept(ints, f"x > {BIG - 1}") == ["r0"]
    # read as text (the key here), the same column keeps json.loads' digits and is not refused
    both = _jsonl(tmp_path / "b.jsonl", [{"id": "r0", "x": BIG, "k": "a"}, {"id": "r1", "x": 0.5, "k": "b"}])
    assert _kept(both, 'k == "a"') == ["r0"]


def test_a_json_number_column_read_as_text_too_is_refused_the_same_way(tmp_path):
    """A JSON Lines number column that is also the key holds its numbers' texts ("9007199254740993"), and
    inputs.where read them with float() again: 'x == 9007199254740992' kept the row holding 9007199254740993."""
    table = _jsonl(tmp_path / "k.jsonl", [{"id": "r0", "x": BIG}, {"id": "r1", "x": 0.5}])
    with pytest.raises(RecipeError, match=r"k.jsonl: data row 1 \(1-based, header not counted\), column 'x': "
                                          f"the integer {BIG} is no 64-bit float"):
        _kept(table, f"x == {BIG - 1}", key="x")
    assert _kept(table, 'x == "9007199254740993"', key="x") == [str(BIG)]   # compared as text: exact
