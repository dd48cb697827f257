"""Back to the source (issue 35): each image's map to its source file's pixels, recorded per sample by the build
(decode scale, EXIF turn, every 2D step as applied to that copy), the Loader's device maps, ``Dataset.to_source``
and the COCO results helper, checked against COCOeval on the original annotation file.

Truths the code does not compute: maps worked out by hand per step; pixels whose values name their source pixel
(an id image: each output pixel's centre, mapped back, lands on the source pixel holding its id); painted
rectangles; the original COCO file read by pycocotools.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.errors import SourceMapError
from precompile.kinds import Kind
from precompile.sample import Sample
from precompile.transforms import colour, geometry
from precompile.transforms.base import Step
from precompile.transforms.kernels import maps

H, W = 30, 40
IDS = np.arange(H * W, dtype=np.uint16).reshape(H, W, 1)   # pixel (i, j) holds i * W + j


def _sample(image: np.ndarray = IDS, meta: dict | None = None) -> Sample:
    return Sample(key="k", fields={"image": image}, kinds={"image": Kind.IMAGE}, meta=dict(meta or {}))


def _run(sample: Sample, step, params: dict | None = None) -> Sample:
    if params is None:
        return step.run(sample, np.random.default_rng(0))[0]
    return step.replay(sample, params)


def _T(sample: Sample) -> np.ndarray:
    return np.array(sample.meta["image"]["to_source"])


def _pixels_follow(T: np.ndarray, out: np.ndarray, src: np.ndarray = IDS) -> None:
    """Every output pixel of ``out`` whose centre maps into the source holds the id of the source pixel there (a
    centre that lands on a pixel edge, within rounding, may hold either neighbour: nearest-neighbour resampling
    breaks such ties its own way)."""
    h, w = out.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w]
    fx, fy = T[:, :2] @ np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5]) + T[:, 2:]
    got = out[..., 0].ravel()
    hits = np.zeros(got.shape, bool)
    inside = np.zeros(got.shape, bool)
    for dx in (0, -1):
        for dy in (0, -1):
            sx, sy = np.floor(fx).astype(int), np.floor(fy).astype(int)
            tie_x, tie_y = np.abs(fx - np.round(fx)) < 1e-9, np.abs(fy - np.round(fy)) < 1e-9
            sx, sy = sx + dx * tie_x, sy + dy * tie_y
            ok = (sx >= 0) & (sx < src.shape[1]) & (sy >= 0) & (sy < src.shape[0])
            inside |= ok & (dx == 0) & (dy == 0)
            hits |= ok & (got == src[np.clip(sy, 0, src.shape[0] - 1), np.clip(sx, 0, src.shape[1] - 1), 0])
    assert inside.any() and hits[inside].all()


# -- the composed map against hand-computed maps, per step ------------------------------------------------------

def P(cls, **kw):
    return cls(cls.Params(**kw))


@pytest.mark.parametrize("step, params, want", [
    (P(geometry.Resize, size=[15, 20], interpolation="nearest"), None, [[2, 0, 0], [0, 2, 0]]),
    (P(geometry.Resize, shorter=20, interpolation="nearest"), None, [[40 / 27, 0, 0], [0, 1.5, 0]]),   # 20 x 27
    (P(geometry.Resize, longer=80, interpolation="nearest"), None, [[0.5, 0, 0], [0, 0.5, 0]]),
    # letterbox: 30x40 fits 20x30 as 20x27 (scale 2/3), padded 1 column on the left
    (P(geometry.Resize, size=[20, 30], keep_aspect=True, interpolation="nearest"), None,
     [[40 / 27, 0, -40 / 27], [0, 1.5, 0]]),
    (P(geometry.CenterCrop, size=[20, 24]), None, [[1, 0, 8], [0, 1, 5]]),
    (P(geometry.CenterCrop, size=[36, 44], pad=True), None, [[1, 0, -2], [0, 1, -3]]),   # padded 2, 3 per side
    # padding 4 on every side (38 x 48), window at (1, 7) of it
    (P(geometry.RandomCrop, size=20, padding=4), {"top": 1, "left": 7}, [[1, 0, 3], [0, 1, -3]]),
    (P(geometry.RandomResizedCrop, size=[10, 10], interpolation="nearest"),
     {"top": 4, "left": 6, "height": 20, "width": 10}, [[1, 0, 6], [0, 2, 4]]),
    (P(geometry.RandomFlip, horizontal=1.0), {"horizontal": True, "vertical": False}, [[-1, 0, 40], [0, 1, 0]]),
    (P(geometry.RandomFlip), {"horizontal": False, "vertical": True}, [[1, 0, 0], [0, -1, 30]]),
    (P(geometry.RandomFlip), {"horizontal": False, "vertical": False}, [[1, 0, 0], [0, 1, 0]]),
    # a quarter turn about the centre (20, 15): x = -(y' - 15) + 20, y = (x' - 20) + 15
    (P(geometry.RandomAffine, degrees=90, interpolation="nearest"), {"angle": 90.0, "scale": 1.0, "tx": 0.0,
                                                                      "ty": 0.0}, [[0, -1, 35], [1, 0, -5]]),
    # scale 2 about the centre, shifted by (3, -1): x = (x' - 3 - 20) / 2 + 20, y = (y' + 1 - 15) / 2 + 15
    (P(geometry.RandomAffine, scale=2.0, interpolation="nearest"), {"angle": 0.0, "scale": 2.0, "tx": 3.0,
                                                                     "ty": -1.0}, [[0.5, 0, 8.5], [0, 0.5, 8]]),
])
def test_each_step_composes_its_hand_computed_map_and_the_pixels_follow_it(step, params, want):
    out = _run(_sample(), step, params)
    T = _T(out)
    np.testing.assert_allclose(T, want, rtol=0, atol=1e-12)
    assert out.meta["image"]["source_size"] == [H, W]
    _pixels_follow(T, out.fields["image"])


def test_a_chain_composes_in_order():
    """resize to 15x20 (x2), the central 10x10 (at (2, 5)), a left-right mirror: x = 2 (10 - x' + 5), y = 2 (y' + 2);
    the colour steps in between change values only and leave the map."""
    s = _run(_sample(), P(geometry.Resize, size=[15, 20], interpolation="nearest"))
    s = _run(s, P(colour.GaussianNoise, std=0.0))
    s = _run(s, P(geometry.CenterCrop, size=10))
    s = _run(s, P(geometry.RandomFlip), {"horizontal": True, "vertical": False})
    np.testing.assert_allclose(_T(s), [[-2, 0, 30], [0, 2, 4]], rtol=0, atol=1e-12)
    _pixels_follow(_T(s), s.fields["image"])


def test_the_un_augmented_original_records_the_neutral_map():
    """Copy 0 of an augmented build: random steps run with neutral parameters (the centred window, no flip)."""
    s = geometry.RandomCrop(geometry.RandomCrop.Params(size=[20, 30])).run_original(_sample())[0]
    np.testing.assert_allclose(_T(s), [[1, 0, 5], [0, 1, 5]], rtol=0, atol=0)


class _Swirl(Step):
    """A user step that moves pixels with no coord_map: its move is unknown."""

    name = "swirl_test"
    applies = frozenset({Kind.IMAGE})

    def apply_image(self, a, **_):
        return a[::-1].copy()


def test_a_step_without_a_map_leaves_the_image_unmapped_and_names_itself():
    s = _run(_run(_sample(), _Swirl()), P(geometry.CenterCrop, size=10))
    assert s.meta["image"] == {"source_size": [H, W], "unmapped": (
        "step 'swirl_test' moved field 'image' and it has no coord_map: its move is not known to be a 2D affine "
        "map (a step that changes values only says keeps_grid = True)")}


# -- the decode's map: EXIF orientation and the decode scale ---------------------------------------------------

@pytest.mark.parametrize("o", range(1, 9))
def test_decode_map_of_each_orientation_matches_pillows_exif_transpose(o):
    """An id image (5 x 7 stored) turned by Pillow's exif_transpose: each turned pixel's centre, mapped back,
    lands on the stored pixel holding its id."""
    from PIL import Image, ImageOps

    stored = np.arange(35, dtype=np.uint8).reshape(5, 7)
    img = Image.fromarray(stored)
    exif = Image.Exif()
    exif[0x0112] = o
    img.info["exif"] = exif.tobytes()
    turned = np.asarray(ImageOps.exif_transpose(img))
    T, size = maps.decode_map(turned.shape, 1, o)
    assert size == (5, 7)
    _pixels_follow(T, turned[..., None], stored[..., None])


def test_decode_map_of_a_reduced_decode_covers_the_whole_source():
    """A 37 x 50 source read at 1/4 is 10 x 13 (ceil) and covers the whole source: each axis scales by its own
    ratio; turned by orientation 6 (a quarter turn) the decoded image is 13 x 10."""
    T, size = maps.decode_map((10, 13), 4, 1, [37, 50])
    assert size == (37, 50)
    np.testing.assert_allclose(T, [[50 / 13, 0, 0], [0, 3.7, 0]], rtol=0, atol=1e-12)
    T6, _ = maps.decode_map((13, 10), 4, 6, [37, 50])
    # orientation 6 puts stored (x, y) at (h - y, x): decoded (x', y') is stored-reduced (y', 10 - x')
    np.testing.assert_allclose(T6, [[0, 50 / 13, 0], [-3.7, 0, 37]], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="decoded at 1/4 scale and the source's size is not recorded"):
        maps.decode_map((10, 13), 4, 1)


def _folder_recipe(root: Path, steps: list, **image) -> dict:
    return {"name": "imgs", "seed": 5, "inputs": {"root": str(root), "match": "{name}.{ext}",
                                                  "fields": {"image": {"decoder": "image", **image}}},
            "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 4}}


@pytest.mark.parametrize("fmt", ["jpg", "png"])
def test_a_reduced_decode_records_the_source_size_and_maps_a_painted_rectangle_back(tmp_path, fmt):
    """A 74 x 100 image (not a multiple of 4) with a white rectangle at x 40..88, y 16..56, decoded at 1/4
    (JPEG: scaled IDCT; PNG: an area resize to the same size) and resized: the meta holds the decode scale and
    the source's size, and the rectangle found in the stored pixels maps back onto the painted one (within a
    reduced pixel)."""
    from PIL import Image

    (tmp_path / "in").mkdir()
    a = np.zeros((74, 100, 3), np.uint8)
    a[16:56, 40:88] = 255
    Image.fromarray(a).save(tmp_path / "in" / f"r.{fmt}", quality=95)
    precompile.build(_folder_recipe(tmp_path / "in", [{"resize": {"size": [19, 25]}}], reduce=4),
                     tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "imgs.h5"))
    m = ds.meta(0)["image"]
    assert m["reduce"] == 4 and m["source_size"] == [74, 100]
    img = ds[0]["image"][..., 0]
    ys, xs = np.nonzero(img > 127)
    box = ds.to_source(0, boxes=[[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]])[0]
    np.testing.assert_allclose(box, [40, 16, 88, 56], atol=4)
    # the stored image's extent is the source's
    assert ds.to_source(0, boxes=[[0, 0, 25, 19]], clip=False).tolist() == [[0, 0, 100, 74]]
    # clip is True or False: bool() took clip="no" as True (clipped) without a word
    with pytest.raises(ValueError, match=r"^clip must be True or False, got 'no'$"):
        ds.to_source(0, boxes=[[0, 0, 25, 19]], clip="no")


# -- the test: COCO ground truth through resize + center_crop + random_flip, back, COCOeval AP = 1 -----

CATS = [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}, {"id": 11, "name": "bird"}]   # ids with gaps


def _window(h: int, w: int, shorter: int, crop: int) -> tuple[float, float, float, float]:
    """The source region (x1, y1, x2, y2) that resize shorter + center_crop keep, worked out by hand."""
    s = shorter / min(h, w)
    rh, rw = (shorter, round(w * s)) if h <= w else (round(h * s), shorter)
    top, left = (rh - crop) // 2, (rw - crop) // 2
    return left * w / rw, top * h / rh, (left + crop) * w / rw, (top + crop) * h / rh


def _coco_file(tmp_path: Path, sizes, inside: bool, seed: int = 0, margin: float = 1) -> Path:
    """Images of ``sizes`` with painted boxes and their COCO file. ``inside``: every box within the region the
    build keeps (resize shorter 48, center_crop 40), ``margin`` source pixels from its edges; else every box cut by
    that region's left, top or right edge."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (tmp_path / "img").mkdir()
    images, anns = [], []
    for n, (h, w) in enumerate(sizes):
        x1, y1, x2, y2 = _window(h, w, 48, 40)
        a = np.zeros((h, w, 3), np.uint8)
        for k in range(3):
            if inside:
                bx, by = rng.uniform(x1 + margin, x2 - margin - 10), rng.uniform(y1 + margin, y2 - margin - 10)
                bw, bh = rng.uniform(4, x2 - margin - bx), rng.uniform(4, y2 - margin - by)
            else:   # across the left, top or right edge of the region, half in and half out (within the image)
                half = [rng.uniform(2, min(7, x1)), rng.uniform(2, min(7, y1)), rng.uniform(2, min(7, w - x2))][k]
                other = rng.uniform(3, 7)
                cx = [x1, (x1 + x2) / 2, x2][k]
                cy = [(y1 + y2) / 2, y1, (y1 + y2) / 2][k]
                (hx, hy) = (other, half) if k == 1 else (half, other)
                bx, by, bw, bh = cx - hx, cy - hy, 2 * hx, 2 * hy
            bx, by, bw, bh = (round(float(v), 2) for v in (bx, by, bw, bh))
            a[int(by):int(by + bh), int(bx):int(bx + bw)] = 60 + 60 * k
            anns.append({"id": len(anns) + 1, "image_id": 100 + n, "category_id": CATS[k]["id"],
                         "bbox": [bx, by, bw, bh], "area": bw * bh, "iscrowd": 0})
        Image.fromarray(a).save(tmp_path / "img" / f"{n}.png")
        images.append({"id": 100 + n, "file_name": f"{n}.png", "height": h, "width": w})
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATS}))
    return path


def _coco_build(tmp_path: Path, ann: Path, copies: int = 3):
    r = {"name": "det", "seed": 11, "copies": copies, "keep_original": True,
         "inputs": {"root": str(tmp_path / "img"), "coco": {"file": str(ann)}},
         "steps": [{"resize": {"shorter": 48}}, {"center_crop": {"size": 40}},
                   {"random_flip": {"horizontal": 0.5, "vertical": 0.5}}],
         "output": {"format": "hdf5", "samples_per_shard": 5}}
    precompile.build(r, tmp_path / "out", n_jobs=1)
    return precompile.open(str(tmp_path / "out" / "det.h5"))


def _evaluate(ann: Path, results: Path) -> np.ndarray:
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann))
        ev = COCOeval(gt, gt.loadRes(str(results)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats


def _truth(ds, i: int) -> dict:
    s = ds[i]
    return {"boxes": s["boxes"], "labels": s["box_labels"], "scores": np.ones(len(s["boxes"]))}


SIZES = [(64, 80), (72, 96), (60, 60), (90, 70), (48, 100)]


def test_ground_truth_through_resize_crop_flip_maps_back_to_coco_ap_1(tmp_path):
    ann = _coco_file(tmp_path, SIZES, inside=True)
    ds = _coco_build(tmp_path, ann)
    assert len(ds) == 4 * len(SIZES)
    flips = [tuple(r[k] for k in ("horizontal", "vertical")) for i in range(len(ds))
             for r in ds.meta(i)["augment"]]
    assert {(True, False), (False, True), (True, True)} <= set(flips)   # the copies really were mirrored
    original = json.loads(ann.read_text())
    by_image = {}
    for a in original["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    for copy in range(4):   # one copy of each image per evaluation: a second copy's boxes would be duplicates
        rows = [i for i in range(len(ds)) if ds.copy(i) == copy]
        out = tmp_path / f"results{copy}.json"
        n = precompile.write_coco_results(str(out), ds, {i: _truth(ds, i) for i in rows})
        assert n == len(original["annotations"])
        records = json.loads(out.read_text())
        for rec in records:   # each record is its annotation: image, COCO category id, bbox (float32 slack)
            match = [a for a in by_image[rec["image_id"]] if a["category_id"] == rec["category_id"]]
            assert len(match) == 1 and rec["score"] == 1.0
            np.testing.assert_allclose(rec["bbox"], match[0]["bbox"], atol=2e-4)
        stats = _evaluate(ann, out)
        assert stats[0] == pytest.approx(1.0, abs=1e-12) and stats[1] == pytest.approx(1.0, abs=1e-12)


def test_boxes_the_crop_cuts_map_back_to_their_visible_part(tmp_path):
    """Boxes across the kept region's edge: stored clipped to the crop, they map back to the part of the original
    box inside the region (worked out by hand), in every copy, mirrored or not."""
    ann = _coco_file(tmp_path, SIZES, inside=False)
    ds = _coco_build(tmp_path, ann, copies=2)
    original = json.loads(ann.read_text())
    sizes = {im["id"]: (im["height"], im["width"]) for im in original["images"]}
    for i in range(len(ds)):
        image_id = ds.meta(i)["coco"]["image_id"]
        x1, y1, x2, y2 = _window(*sizes[image_id], 48, 40)
        want = []
        for a in (a for a in original["annotations"] if a["image_id"] == image_id):
            bx, by, bw, bh = a["bbox"]
            want.append([max(bx, x1), max(by, y1), min(bx + bw, x2), min(by + bh, y2)])
        got = ds.to_source(i, boxes=ds[i]["boxes"])
        assert got.shape == (3, 4)
        np.testing.assert_allclose(got, want, atol=2e-4)
        assert (np.array(want)[:, 2] - np.array(want)[:, 0] < np.array(
            [a["bbox"][2] for a in original["annotations"] if a["image_id"] == image_id]) - 1).any()


def test_the_sample_coco_set_through_resize_and_flip_gives_ap_1(tmp_path):
    """The repository's sample COCO set (recipes/coco.yaml: resize to 96x128) with a random flip per copy."""
    import yaml

    repo = Path(__file__).resolve().parents[1]
    r = yaml.safe_load((repo / "recipes" / "coco.yaml").read_text())
    r["inputs"]["root"] = str(repo / "sample_data" / "coco" / "images")
    r["inputs"]["coco"]["file"] = ann = str(repo / "sample_data" / "coco" / "annotations" / "instances.json")
    r["steps"].append({"random_flip": {"horizontal": 0.5}})
    r["copies"] = 1
    r["keep_original"] = False
    precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "coco.h5"))
    assert any(ds.meta(i)["augment"][0]["horizontal"] for i in range(len(ds)))
    results = precompile.coco_results(ds, [(i, _truth(ds, i)) for i in range(len(ds))])
    assert results and {r["category_id"] for r in results} <= {c["id"] for c in ds.coco["categories"]}
    (tmp_path / "res.json").write_text(json.dumps(results))
    assert _evaluate(Path(ann), tmp_path / "res.json")[0] == pytest.approx(1.0, abs=1e-12)


# -- the Loader's device steps -----------------------------------------------------------------------------------

def test_loader_batch_maps_take_device_augmented_boxes_and_pixels_back(tmp_path):
    """Boxes moved by the Loader's random_crop + random_flip, mapped back through ``batch_maps`` and the build's map,
    are the original COCO boxes; and each batch pixel's centre lands on the stored pixel it came from."""
    import torch

    from precompile import Loader

    ann = _coco_file(tmp_path, SIZES, inside=True, margin=6)   # 6 source pixels: over 4 stored ones
    ds = _coco_build(tmp_path, ann, copies=0)
    original = json.loads(ann.read_text())
    want = {}
    for a in original["annotations"]:
        x, y, w, h = a["bbox"]
        want.setdefault(a["image_id"], []).append([x, y, x + w, y + h])
    index = str(tmp_path / "out" / "det.h5")
    # a 40 x 40 window of the 40 x 40 images padded by 3: it moves them by at most 3 pixels, the boxes stay whole
    loader = Loader(index, batch_size=2, shuffle=True, seed=4, device="cpu", num_threads=0,
                    gpu_steps=[{"random_flip": {"horizontal": 0.5, "vertical": 0.5}},
                               {"random_crop": {"size": 40, "padding": 3}}])
    seen, flipped = 0, 0
    for b, batch in enumerate(loader):
        rows, M = loader.batch_maps(b, epoch=0)
        assert M.shape == (len(rows), 2, 3)
        flipped += int((M[:, 0, 0] < 0).sum() + (M[:, 1, 1] < 0).sum())
        for j, i in enumerate(rows):
            n = int(batch["boxes__count"][j])
            got = ds.to_source(int(i), boxes=batch["boxes"][j, :n], device_map=M[j])
            np.testing.assert_allclose(got, want[ds.meta(int(i))["coco"]["image_id"]], atol=2e-4)
            stored = ds[int(i)]["image"].astype(np.int64)
            img = batch["image"][j].numpy().astype(np.int64)
            h, w = img.shape[:2]
            ys, xs = np.mgrid[0:h, 0:w]
            sx, sy = np.floor(M[j][:, :2] @ np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5]) + M[j][:, 2:]).astype(int)
            inside = (sx >= 0) & (sx < stored.shape[1]) & (sy >= 0) & (sy < stored.shape[0])
            assert np.array_equal(img.reshape(-1, 3)[inside], stored[sy[inside], sx[inside]])
            assert (img.reshape(-1, 3)[~inside] == 0).all()   # the padding
            seen += 1
    assert seen == len(ds) and flipped > 0
    assert isinstance(batch["image"], torch.Tensor)
    plain = Loader(index, batch_size=3, shuffle=False, device="cpu", num_threads=0)
    rows, M = plain.batch_maps(0)
    assert rows.tolist() == [0, 1, 2] and np.array_equal(M, np.repeat(maps.IDENTITY[None], 3, axis=0))
    with pytest.raises(IndexError, match="batch 9 out of range: epoch 0 has 2 batches on this rank"):
        plain.batch_maps(9)


# -- refusals ----------------------------------------------------------------------------------------------------

def test_to_source_refuses_a_build_without_maps_and_a_step_it_cannot_invert(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plugin_pkg.steps import write_r8

    (tmp_path / "in").mkdir()
    write_r8(tmp_path / "in" / "a.r8", np.arange(35).reshape(5, 7))
    r = {"name": "r8", "imports": ["plugin_pkg.steps"],
         "inputs": {"root": str(tmp_path / "in"), "match": "{name}.r8", "fields": {"image": {"decoder": "r8_test"}}},
         "steps": [{"resize": {"size": [10, 14]}}, {"posterize_test": {"bits": 3}}],
         "output": {"samples_per_shard": 2}}
    precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "r8.h5"))
    assert ds.meta(0)["image"]["r8_size"] == [5, 7]   # the decoder's own meta kept beside the map's
    with pytest.raises(SourceMapError) as e:
        ds.to_source(0, boxes=[[0, 0, 1, 1]])
    assert str(e.value) == (f"{ds.path}: sample 0 (key 'a.r8'), field 'image': no map back to the source: step "
                            f"'posterize_test' moved field 'image' and it has no coord_map: its move is not known to "
                            f"be a 2D affine map (a step that changes values only says keeps_grid = True)")
    # a build from before maps were recorded: its meta has none, and its index no source_maps attribute
    monkeypatch.setattr(type(ds), "meta", lambda self, i: {"image": {"r8_size": [5, 7]}})
    monkeypatch.setattr(ds, "attrs", {k: v for k, v in ds.attrs.items() if k != "source_maps"})
    with pytest.raises(SourceMapError) as e:
        ds.to_source(0, keypoints=np.zeros((1, 2, 3)))
    assert str(e.value) == (f"{ds.path}: sample 0 (key 'a.r8'), field 'image': the build recorded no map back to "
                            f"the source (built before precompile recorded one); rebuild it to record the map")
    monkeypatch.setattr(ds, "field_specs", {"ct": {"kind": "volume", "shape": [4, 4, 4], "dtype": "int16"}})
    with pytest.raises(SourceMapError, match=r"no 2D image field \(fields: ct \(volume\)\); to_source maps "):
        ds.to_source(0, boxes=np.zeros((0, 4)))


def test_to_source_moves_keypoints_exactly_and_keeps_nan_padding(tmp_path):
    ann = _coco_file(tmp_path, SIZES[:1], inside=True)
    ds = _coco_build(tmp_path, ann, copies=0)
    T, size = ds.source_map(0)
    assert size == (64, 80)
    kp = np.array([[[0, 0, 2], [40, 40, 1]], [[np.nan, np.nan, 0], [10, 20, 0]]])
    got = ds.to_source(0, keypoints=kp)
    assert got.shape == (2, 2, 3) and np.isnan(got[1, 0, :2]).all()
    np.testing.assert_allclose(got[..., 2], kp[..., 2])
    np.testing.assert_allclose(got[0, 1, :2], T[:, :2] @ [40, 40] + T[:, 2], rtol=0, atol=0)
    b, k = ds.to_source(0, boxes=[[0, 0, 40, 40], [np.nan] * 4], keypoints=kp[..., :2])
    assert np.isnan(b[1]).all() and k.shape == (2, 2, 2)
    np.testing.assert_allclose(b[0], _window(64, 80, 48, 40), atol=1e-12)
    with pytest.raises(ValueError, match=r"keypoints must be \(N, K, 2\) x, y or \(N, K, 3\)"):
        ds.to_source(0, keypoints=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="give boxes=, keypoints= or both"):
        ds.to_source(0)
    with pytest.raises(ValueError, match=r"prediction for row 0: 2 boxes, 1 labels and 2 scores"):
        precompile.coco_results(ds, {0: {"boxes": np.zeros((2, 4)), "labels": [0], "scores": [1, 1]}})
    with pytest.raises(ValueError, match=r"prediction for row 0: label 3 is not a label id of the build \(0..2\)"):
        precompile.coco_results(ds, {0: {"boxes": [[1, 1, 2, 2]], "labels": [3], "scores": [0.5]}})


def test_the_remembered_maps_are_the_computed_ones_and_fresh_lists():
    """``maps.decode_map_json`` and ``maps.back_through`` (the build's per-sample calls, remembered per input)
    give exactly what the functions they wrap give, for keys equal but not identical (-0.0 and 0.0, 1 and 1.0),
    and lists a caller may change without changing the next answer."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        T = maps.to_json(np.column_stack([rng.normal(size=(2, 2)), rng.normal(size=2) * 50]))
        F = np.column_stack([rng.normal(size=(2, 2)), rng.normal(size=2) * 50])
        assert maps.back_through(T, F) == maps.to_json(maps.compose(T, maps.invert(F)))
    F = np.array([[-0.0, 2.0, 0.0], [0.5, 0.0, -3.0]])
    T = [[1, 0, 0], [0, 1, 0]]
    first = maps.back_through(T, F)
    assert first == maps.to_json(maps.compose(T, maps.invert(F)))
    first[0][0] = 99.0
    again = maps.back_through([[1.0, 0.0, -0.0], [0.0, 1.0, 0.0]], np.abs(F) * np.sign(F + 0.0))
    assert again == maps.to_json(maps.compose(T, maps.invert(F))) and again[0][0] != 99.0
    for args in [((188, 250), 2, 1, [375, 500], None), ((188, 250), 2, 1, [375, 500], [187.5, 250.0]),
                 ((250, 188), 2, 6, [375, 500], None), ((30, 40), 1, 1, None, None)]:
        T, hw = maps.decode_map(*args)
        got, hw2 = maps.decode_map_json(*args)
        assert got == maps.to_json(T) and hw2 == hw
        got[0][0] = -1.0
        assert maps.decode_map_json(*args)[0] == maps.to_json(T)
    with pytest.raises(ValueError, match="not recorded"):
        maps.decode_map_json((188, 250), 2, 1, None, None)


def test_an_identity_map_is_left_out_and_reads_as_the_identity(tmp_path):
    """A PNG stored at its own size with no step records no map (the meta stays {} for tiny images); to_source
    reads the identity over the stored size from the index's source_maps attribute."""
    from PIL import Image

    (tmp_path / "in").mkdir()
    Image.fromarray(np.zeros((6, 9, 3), np.uint8)).save(tmp_path / "in" / "a.png")
    r = {"name": "p", "inputs": {"root": str(tmp_path / "in"), "match": "{name}.png",
                                 "fields": {"image": {"decoder": "image"}}}}
    precompile.build(r, tmp_path / "out", n_jobs=1)
    ds = precompile.open(str(tmp_path / "out" / "p.h5"))
    assert ds.meta(0) == {}
    T, hw = ds.source_map(0)
    assert hw == (6, 9) and np.array_equal(T, [[1, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(ds.to_source(0, boxes=[[1, 2, 3, 4]]), [[1, 2, 3, 4]])
    # a resize moves it: the map is recorded, its numbers short (7.000000000000001 is stored as 7.0)
    r["steps"] = [{"resize": {"size": [2, 3]}}]
    precompile.build(r, tmp_path / "out2", n_jobs=1)
    ds2 = precompile.open(str(tmp_path / "out2" / "p.h5"))
    assert ds2.meta(0) == {"image": {"source_size": [6, 9], "to_source": [[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]]}}
