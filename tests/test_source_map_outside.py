"""Back to the source attacked from outside (issue 35): ``Dataset.to_source`` and the COCO results helper against
the original COCO file, read by pycocotools and by Python's json module."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

import precompile

pytest.importorskip("pycocotools", reason="COCOeval is the truth here")

CATS = [{"id": 7, "name": "cat", "supercategory": "a"}, {"id": 3, "name": "dog", "supercategory": "a"}]


def _coco(tmp: Path) -> Path:
    """Two small PNGs with two boxes each (one per category) and their COCO file."""
    from PIL import Image

    (tmp / "img").mkdir()
    images, anns = [], []
    for n, (h, w) in enumerate([(20, 24), (18, 30)]):
        Image.fromarray(np.full((h, w, 3), 40 * (n + 1), np.uint8)).save(tmp / "img" / f"{n}.png")
        images.append({"id": 100 + n, "file_name": f"{n}.png", "height": h, "width": w})
        for k, box in enumerate([[2.5, 3.0, 6.0, 5.5], [10.0, 8.25, 7.5, 6.0]]):
            anns.append({"id": len(anns) + 1, "image_id": 100 + n, "category_id": CATS[k]["id"], "bbox": box,
                         "area": box[2] * box[3], "iscrowd": 0})
    path = tmp / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATS}))
    return path


def _build(tmp: Path, ann: Path, **extra):
    r = {"name": "det", "seed": 3, "inputs": {"root": str(tmp / "img"), "coco": {"file": str(ann)}},
         "steps": [{"resize": {"size": [32, 32]}}, {"random_flip": {"horizontal": 0.5, "vertical": 0.5}}],
         "output": {"format": "hdf5", "samples_per_shard": 4}, **extra}
    with contextlib.redirect_stdout(io.StringIO()):
        precompile.build(r, tmp / "out", n_jobs=1)
    return precompile.open(str(tmp / "out" / "det.h5"))


def _truth(ds, i: int) -> dict:
    s = ds[i]
    return {"boxes": s["boxes"], "labels": s["box_labels"], "scores": np.ones(len(s["boxes"]))}


def _ap(ann: Path, records: list, tmp: Path) -> float:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    res = tmp / "res.json"
    res.write_text(json.dumps(records))
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann))
        ev = COCOeval(gt, gt.loadRes(str(res)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[0])


def test_predictions_for_two_copies_of_one_image_are_refused_not_evaluated_twice(tmp_path):
    """A build with copies holds each COCO image several times; predictions for every row gave each image's
    detections once per copy, which COCOeval counts as duplicates (the ground truth itself scored AP 0.75,
    with no error). coco_results now refuses a second row of one image, naming both rows, their copies and the
    image; one copy per image still gives AP 1.0 on the ground truth."""
    ann = _coco(tmp_path)
    ds = _build(tmp_path, ann, copies=2, keep_original=True)
    assert len(ds) == 6
    rows = {ds.meta(i)["coco"]["image_id"]: [] for i in range(len(ds))}
    for i in range(len(ds)):
        rows[ds.meta(i)["coco"]["image_id"]].append(i)
    a, b = rows[100][:2]
    with pytest.raises(ValueError) as e:
        precompile.coco_results(ds, {i: _truth(ds, i) for i in range(len(ds))})
    msg = str(e.value)
    assert (f"rows {a} and {b} are copies {ds.copy(a)} and {ds.copy(b)} of COCO image 100" in msg
            and "one row per image" in msg), msg
    last = len(ds) - 1
    with pytest.raises(ValueError, match=f"prediction for row {last}: row {last} is given twice"):
        precompile.coco_results(ds, [(last, _truth(ds, last)), (-1, _truth(ds, last))])
    for copy in range(3):
        mine = {i: _truth(ds, i) for i in range(len(ds)) if ds.copy(i) == copy}
        assert _ap(ann, precompile.coco_results(ds, mine), tmp_path) == pytest.approx(1.0, abs=1e-12)
