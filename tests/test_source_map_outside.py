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


PERSON = [{"id": 1, "name": "person", "supercategory": "person", "keypoints": ["nose", "left_eye", "right_eye"],
           "skeleton": [[1, 2], [1, 3]]}]


def _coco_keypoints(tmp: Path) -> Path:
    """Two PNGs with people: boxes and three keypoints each (one not labelled), an image turned by EXIF
    orientation 6 among them (its annotations are on the stored pixels)."""
    from PIL import Image

    (tmp / "img").mkdir()
    images, anns = [], []
    for n, (h, w, o) in enumerate([(24, 32, 1), (30, 20, 6)]):
        im = Image.fromarray(np.full((h, w, 3), 50, np.uint8))
        if o == 1:
            im.save(tmp / "img" / f"{n}.png")
        else:
            exif = Image.Exif()
            exif[0x0112] = o
            im.save(tmp / "img" / f"{n}.jpg", exif=exif.tobytes(), quality=95)
        images.append({"id": 200 + n, "file_name": f"{n}.png" if o == 1 else f"{n}.jpg", "height": h, "width": w})
        for k, (x, y) in enumerate([(2.5, 3.0), (9.0, 11.5)]):
            kp = [x + 1.0, y + 1.5, 2, x + 3.25, y + 2.0, 1, 0, 0, 0]
            anns.append({"id": len(anns) + 1, "image_id": 200 + n, "category_id": 1, "bbox": [x, y, 6.0, 7.5],
                         "area": 45.0, "iscrowd": 0, "keypoints": kp, "num_keypoints": 2})
    path = tmp / "people.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": PERSON}))
    return path


def test_keypoint_predictions_map_back_to_coco_keypoint_ap_1(tmp_path):
    """Ground-truth keypoints stored through resize + flip (with flip_pairs) on an upright and an EXIF-turned
    image, given to coco_results as predictions with keypoints, come back on the source images' pixels: COCOeval
    of keypoints (and of boxes) against the original file gives AP 1.0, and each record's keypoints are the
    file's within float32 rounding. Before, coco_results left keypoints out (COCOeval of keypoints failed)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    ann = _coco_keypoints(tmp_path)
    r = {"name": "kp", "seed": 2, "inputs": {"root": str(tmp_path / "img"),
                                              "coco": {"file": str(ann), "keypoints": True}},
         "steps": [{"resize": {"size": [40, 36]}},
                   {"random_flip": {"horizontal": 1.0, "vertical": 0.0, "flip_pairs": [[1, 2]]}}],
         "output": {"format": "hdf5"}}
    with contextlib.redirect_stdout(io.StringIO()):
        precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "kp.h5"))
    preds = {}
    for i in range(len(ds)):
        s = ds[i]
        preds[i] = {"boxes": s["boxes"], "labels": s["box_labels"], "scores": np.ones(len(s["boxes"])),
                    "keypoints": s["keypoints"]}
    for i in range(len(ds)):   # to_source itself puts each keypoint back in its own slot
        back = ds.to_source(i, keypoints=preds[i]["keypoints"])
        assert ds.meta(i)["keypoints"]["source_order"] == [0, 2, 1]
        boxes = ds.to_source(i, boxes=preds[i]["boxes"])
        for j, a in enumerate(x for x in json.loads(ann.read_text())["annotations"]
                              if x["image_id"] == ds.meta(i)["coco"]["image_id"]):
            np.testing.assert_allclose(boxes[j], [a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2],
                                                  a["bbox"][1] + a["bbox"][3]], atol=1e-4)
            truth = np.reshape(a["keypoints"], (3, 3))
            np.testing.assert_allclose(back[j][truth[:, 2] > 0], truth[truth[:, 2] > 0], atol=1e-4)
            np.testing.assert_array_equal(back[j][:, 2], truth[:, 2])
    records = precompile.coco_results(ds, preds)
    original = json.loads(ann.read_text())
    want = {(a["image_id"], tuple(a["bbox"][:2])): a for a in original["annotations"]}
    assert len(records) == len(want)
    for rec in records:
        a = want[(rec["image_id"], tuple(round(v, 3) for v in rec["bbox"][:2]))]
        got, truth = np.reshape(rec["keypoints"], (3, 3)), np.reshape(a["keypoints"], (3, 3))
        labelled = truth[:, 2] > 0
        np.testing.assert_allclose(got[labelled, :2], truth[labelled, :2], atol=1e-4)
    res = tmp_path / "res.json"
    res.write_text(json.dumps(records))
    for kind in ("keypoints", "bbox"):
        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO(str(ann))
            ev = COCOeval(gt, gt.loadRes(str(res)), kind)
            ev.params.kpt_oks_sigmas = np.array([0.026, 0.025, 0.025])   # COCO's nose and eyes
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        assert ev.stats[0] == pytest.approx(1.0, abs=1e-12), kind


def test_keypoint_slots_follow_each_copys_own_mirrors(tmp_path):
    """Copies mirrored or not, by one flip or by two (left-right then up-down: no mirror, a half turn) each carry
    their own order: every copy's keypoints come back to the file's slots."""
    ann = _coco_keypoints(tmp_path)
    r = {"name": "kp", "seed": 5, "copies": 5, "keep_original": True,
         "inputs": {"root": str(tmp_path / "img"), "coco": {"file": str(ann), "keypoints": True}},
         "steps": [{"random_flip": {"horizontal": 0.5, "vertical": 0.0, "flip_pairs": [[1, 2]]}},
                   {"random_flip": {"horizontal": 0.0, "vertical": 0.5, "flip_pairs": [[1, 2]]}}],
         "output": {"format": "hdf5"}}
    with contextlib.redirect_stdout(io.StringIO()):
        precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "kp.h5"))
    original = json.loads(ann.read_text())["annotations"]
    mirrors = set()
    for i in range(len(ds)):
        flips = [a["horizontal"] or a["vertical"] for a in ds.meta(i).get("augment", [])]
        mirrors.add(sum(flips) % 2)
        assert ("source_order" in ds.meta(i).get("keypoints", {})) == (sum(flips) % 2 == 1)
        back = ds.to_source(i, keypoints=ds[i]["keypoints"])
        mine = [a for a in original if a["image_id"] == ds.meta(i)["coco"]["image_id"]]
        for j, a in enumerate(mine):
            truth = np.reshape(a["keypoints"], (3, 3))
            np.testing.assert_allclose(back[j][truth[:, 2] > 0], truth[truth[:, 2] > 0], atol=1e-4)
    assert mirrors == {0, 1}


def test_flip_pairs_move_the_recipe_key_and_only_they():
    """The keypoints' source_order is new meta in the shards of a recipe whose random_flip has flip_pairs: those
    shards rebuild (random_flip's output_version 3 in the key); a random_flip without pairs keeps version 2."""
    from precompile.recipe import load_recipe

    def versions(flip: dict) -> dict:
        return load_recipe({"name": "x", "inputs": {"root": ".", "match": "{a}.png",
                                                    "fields": {"image": {"decoder": "image"}}},
                            "steps": [{"random_flip": flip}]}).content_dict()["output_versions"]

    assert versions({"flip_pairs": [[0, 1]]})["steps[0]"] == 3
    assert versions({"flip_pairs": []})["steps[0]"] == 2
    assert versions({})["steps[0]"] == 2


def test_real_exif_photos_map_back_to_the_files_stored_pixels(tmp_path):
    """Real files with EXIF orientations (a 3072x2304 camera photo and a small JPEG turned by orientation 6, a PNG
    with an eXIf chunk, orientation 3), boxes given on their stored pixels (as docs/coco.md says COCO's are),
    decoded upright at a reduced scale, resized and mirrored: every box maps back to the file's within 1e-3
    source pixels, and COCOeval gives AP 1.0."""
    from PIL import Image

    from conftest import realdata

    (tmp_path / "img").mkdir()
    images, anns = [], []
    for n, name in enumerate(["hopper_orientation_6.jpg", "exif_imagemagick_orientation.png", "rommel.jpg"]):
        path = realdata("images", name)   # (skips when ../shared/realdata is absent)
        (tmp_path / "img" / name).symlink_to(path)
        with Image.open(path) as im:
            w, h = im.size
            assert im.getexif().get(0x0112) in (3, 6)
        images.append({"id": n + 1, "file_name": name, "height": h, "width": w})
        for k, (fx, fy, fw, fh) in enumerate([(0.1, 0.2, 0.3, 0.25), (0.55, 0.5, 0.4, 0.45)]):
            b = [round(fx * w, 2), round(fy * h, 2), round(fw * w, 2), round(fh * h, 2)]
            anns.append({"id": len(anns) + 1, "image_id": n + 1, "category_id": CATS[k]["id"], "bbox": b,
                         "area": b[2] * b[3], "iscrowd": 0})
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATS}))
    r = {"name": "r", "inputs": {"root": str(tmp_path / "img"), "coco": {"file": str(ann)}, "follow_links": "outside",
                                 "fields": {"image": {"decoder": "image", "mode": "rgb8", "reduce": "auto"}}},
         "steps": [{"resize": {"size": [64, 80]}}, {"random_flip": {"horizontal": 1.0}}], "output": {"format": "hdf5"}}
    with contextlib.redirect_stdout(io.StringIO()):
        precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "r.h5"))
    assert sorted(ds.meta(i)["image"]["orientation"] for i in range(len(ds))) == [3, 6, 6]
    for i in range(len(ds)):
        want = [[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                for a in anns if a["image_id"] == ds.meta(i)["coco"]["image_id"]]
        np.testing.assert_allclose(ds.to_source(i, boxes=ds[i]["boxes"]), want, atol=1e-3)
    records = precompile.coco_results(ds, {i: _truth(ds, i) for i in range(len(ds))})
    assert _ap(ann, records, tmp_path) == pytest.approx(1.0, abs=1e-12)


def test_keypoints_of_a_device_mirrored_batch_need_the_loaders_flip_pairs(tmp_path):
    """The Loader's device random_flip swaps the batch's keypoint slots by its flip_pairs, and batch_maps gives
    only the map: to_source(device_map=...) put the left eye's prediction back at the right eye's slot, with no
    error. A mirroring device_map with keypoints now needs the Loader's flip_pairs (flip_pairs=[] when none
    swap), which put each point back in its source slot; without them it is an error saying so."""
    pytest.importorskip("torch", reason="the Loader needs torch")
    from precompile.errors import SourceMapError

    ann = _coco_keypoints(tmp_path)
    r = {"name": "kp", "seed": 2, "inputs": {"root": str(tmp_path / "img"),
                                              "coco": {"file": str(ann), "keypoints": True}},
         "steps": [{"resize": {"size": [40, 36]}}], "output": {"format": "hdf5"}}
    with contextlib.redirect_stdout(io.StringIO()):
        precompile.build(r, tmp_path / "out", n_jobs=1)
    path = str(tmp_path / "out" / "kp.h5")
    ds = precompile.open(path)
    loader = precompile.Loader(path, batch_size=2, shuffle=False, device="cpu",
                               gpu_steps=[{"random_flip": {"horizontal": 1.0, "flip_pairs": [[1, 2]]}}])
    batch = next(iter(loader))
    rows, device = loader.batch_maps(0)
    original = json.loads(ann.read_text())["annotations"]
    for j, row in enumerate(rows.tolist()):
        kp = np.asarray(batch["keypoints"][j])
        with pytest.raises(SourceMapError, match="device_map mirrors the image: pass the Loader's flip_pairs"):
            ds.to_source(row, keypoints=kp, device_map=device[j])
        back = ds.to_source(row, keypoints=kp, device_map=device[j], flip_pairs=[[1, 2]])
        mine = [a for a in original if a["image_id"] == ds.meta(row)["coco"]["image_id"]]
        for n, a in enumerate(mine):
            truth = np.reshape(a["keypoints"], (3, 3))
            np.testing.assert_allclose(back[n][truth[:, 2] > 0], truth[truth[:, 2] > 0], atol=1e-4)
            np.testing.assert_array_equal(back[n][:, 2], truth[:, 2])
        boxes = ds.to_source(row, boxes=np.asarray(batch["boxes"][j]), device_map=device[j])   # boxes need none
        np.testing.assert_allclose(boxes[0], [mine[0]["bbox"][0], mine[0]["bbox"][1],
                                              mine[0]["bbox"][0] + 6.0, mine[0]["bbox"][1] + 7.5], atol=1e-4)
    preds = {row: {"boxes": np.asarray(batch["boxes"][j]), "labels": np.asarray(batch["box_labels"][j]),
                   "scores": np.ones(2), "keypoints": np.asarray(batch["keypoints"][j]), "device_map": device[j]}
             for j, row in enumerate(rows.tolist())}
    records = precompile.coco_results(ds, preds, flip_pairs=[[1, 2]])
    for rec in records:
        a = next(a for a in original if a["image_id"] == rec["image_id"]
                 and abs(a["bbox"][0] - rec["bbox"][0]) < 1e-3)
        np.testing.assert_allclose(np.reshape(rec["keypoints"], (3, 3))[:2, :2],
                                   np.reshape(a["keypoints"], (3, 3))[:2, :2], atol=1e-4)


def test_a_build_from_before_keypoint_slots_were_recorded_is_refused_for_keypoints(tmp_path, monkeypatch):
    """A build made before the keypoints' source_order was recorded (index attribute source_maps 1) whose recipe
    mirrors with flip_pairs cannot say which samples' slots were swapped: to_source refuses its keypoints, saying
    to rebuild, rather than give some back swapped; its boxes still map back. A new build writes 2."""
    from precompile.errors import SourceMapError

    ann = _coco_keypoints(tmp_path)
    r = {"name": "kp", "seed": 2, "inputs": {"root": str(tmp_path / "img"),
                                              "coco": {"file": str(ann), "keypoints": True}},
         "steps": [{"random_flip": {"horizontal": 1.0, "flip_pairs": [[1, 2]]}}], "output": {"format": "hdf5"}}
    with contextlib.redirect_stdout(io.StringIO()):
        precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "kp.h5"))
    assert ds.attrs["source_maps"] == 2
    s = ds[0]
    ds.to_source(0, keypoints=s["keypoints"])
    monkeypatch.setattr(ds, "attrs", {**ds.attrs, "source_maps": 1})
    with pytest.raises(SourceMapError, match="built before precompile recorded which keypoint slots a random_flip "
                                             "with flip_pairs swapped .*; rebuild it"):
        ds.to_source(0, keypoints=s["keypoints"])
    assert ds.to_source(0, boxes=s["boxes"]).shape == (2, 4)
