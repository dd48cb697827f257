"""What a build stores as annotations holds what their readers assume (docs/annotations.md), whatever made them:
a plugin decoder's boxes, rows tied to them and an instance mask, with no step that would check them. Before,
a build with no step that drops a box stored a box with x2 < x1, a NaN box, an instance id naming no box or a
label row too many without a word, and the Loader's device steps later moved the wrong pixels or failed far
from the input (attack2's finding). Now each is the input's error at stage write, naming the file and field,
and ``on_error`` decides as for any bad input."""
from __future__ import annotations

import os

import numpy as np
import pytest

import precompile
from precompile.errors import PrecompileError

from pixel_truth_decoder import K  # noqa: F401  (registers the test decoders)


def _inputs(root, bad: dict) -> None:
    os.makedirs(root / "a")
    for k in range(4):
        f = {"image": np.zeros((20, 30, 3), np.uint8), "instances": np.zeros((20, 30, 1), np.uint16),
             "semantic": np.zeros((20, 30, 1), np.uint8), "flow": np.zeros((20, 30, 2), np.float32),
             "boxes": np.array([[0, 0, 6, 6], [20, 10, 28, 18]], np.float32), "box_labels": np.arange(2),
             "keypoints": np.zeros((2, 3, 3), np.float32)}
        f["instances"][0:6, 0:6] = 1
        f["instances"][10:18, 20:28] = 2
        f["instances"][19, 29] = 65535            # the ignore id: allowed
        if k == 2:
            f.update(bad)
        np.savez(root / "a" / f"s{k}.npz", **f)


def _recipe(root, on_error: str) -> dict:
    return {"name": "notes", "seed": 1, "on_error": on_error,
            "inputs": {"root": str(root), "match": "{label}/{name}.npz",
                       "fields": {"image": {"decoder": "_pixel_truth_fixed_test"}}},
            "steps": [], "output": {"format": "hdf5", "samples_per_shard": 4}}


def _stray() -> np.ndarray:
    m = np.zeros((20, 30, 1), np.uint16)
    m[0:6, 0:6] = 1
    m[2, 2] = 3                                   # id 3 with 2 boxes
    return m


CASES = [
    ({"boxes": np.array([[0, 0, 6, 6], [28, 10, 20, 18]], np.float32)}, "boxes",
     "box 1 [28.0, 10.0, 20.0, 18.0] has x2 < x1 or y2 < y1 (boxes are x1, y1, x2, y2)"),
    ({"boxes": np.array([[0, 0, 6, 6], [20, np.nan, 28, 18]], np.float32)}, "boxes",
     "box 1 [20.0, nan, 28.0, 18.0] holds a non-finite value (boxes are x1, y1, x2, y2)"),
    ({"instances": _stray()}, "instances",
     "instance id 3 names no box of 'boxes' (2 boxes: mask == i + 1 is box i, 65535 is ignored)"),
    ({"box_labels": np.arange(3)}, "box_labels", "has 3 rows for the 2 boxes of 'boxes' (one row per box)"),
]


@pytest.mark.parametrize("bad,field,says", CASES, ids=["x2<x1", "nan", "stray-id", "rows"])
def test_a_build_refuses_bad_stored_annotations(tmp_path, bad, field, says):
    root = tmp_path / "in"
    _inputs(root, bad)
    rep = precompile.build(_recipe(root, "skip"), tmp_path / "skip")
    f, = rep["failures"]
    assert f["path"] == str(root / "a" / "s2.npz") and f["stage"] == "write" and f["field"] == field, f
    assert says in f["message"], f["message"]
    ds = precompile.open(rep["output"])
    assert ds.keys == ["a/s0.npz", "a/s1.npz", "a/s3.npz"]      # the others kept, as they were
    np.testing.assert_array_equal(ds[0]["boxes"], [[0, 0, 6, 6], [20, 10, 28, 18]])
    with pytest.raises(PrecompileError) as e:
        precompile.build(_recipe(root, "fail"), tmp_path / "fail")
    assert str(root / "a" / "s2.npz") in str(e.value) and says in str(e.value), str(e.value)


def test_good_annotations_with_the_ignore_id_and_no_boxes_are_stored(tmp_path):
    root = tmp_path / "in"
    _inputs(root, {"boxes": np.zeros((0, 4), np.float32), "box_labels": np.zeros(0, np.int64),
                   "keypoints": np.zeros((0, 3, 3), np.float32), "instances": np.full((20, 30, 1), 65535, np.uint16)})
    rep = precompile.build(_recipe(root, "fail"), tmp_path / "out")
    assert not rep["failures"]
    ds = precompile.open(rep["output"])
    assert len(ds) == 4 and ds[ds.keys.index("a/s2.npz")]["boxes"].shape == (0, 4)
