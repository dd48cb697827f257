"""Property tests: boxes and keypoints through every step that moves them, checked against the pixels.

A scene is an image with up to 9 filled rectangles ("objects", distinct colours, never
overlapping), an instance mask ``objects`` (object i has id i + 1; a plain mask, so its ids stay
the objects' own: the reference), the same ids in ``instances``, an instance mask tied to the
boxes (so ``instances == i + 1`` must stay box i's pixels; a crowd patch in it holds the ignore
id 65535, also drawn in the plain mask ``crowd``), the objects' boxes
(x1, y1, x2, y2: the rectangles' pixel edges), a class label per box, and 3 keypoints
per object at pixel centres (its top-left pixel, top-right pixel, a middle pixel) whose
pixels are marked in the mask ``marks`` (keypoint j of object i has id 3 i + j + 1).
The masks move with nearest neighbour, so after a step the reference for a box is the
bounding box of its object's pixels and the reference for a keypoint is its marker pixel;
neither is computed by the code under test.

After each step, over many seeds and sizes (hypothesis):

- crops and flips (pixels moved exactly): a kept box equals its object's pixel box; resizes
  and random resized crops (nearest neighbour): within half a pixel; affines: the object's
  pixels lie inside the box (pixel centres inside: half a pixel of slack), and a box that was
  not clipped is tight (within 1.5 pixels: a corner of a rotated rectangle need not hold a
  pixel centre), and the box equals the enclosing box of the 4 corners moved by an
  independent rotation formula;
- the boxes dropped are exactly those whose visible fraction (object pixels left / object
  pixels, from the masks) is 0 or under ``min_visibility``; labels and keypoint rows follow;
- the tied instance mask: ``instances == row + 1`` is exactly the pixels of the object of box
  ``row`` (and, for steps that move pixels exactly, of its painted colour); a dropped object's
  pixels are 0; the crowd patch keeps the ignore id;
- a keypoint has visibility 0 exactly when it left the grid, and otherwise lands on its marker
  pixel (exact steps), or within a pixel of it (resampling steps: a 1-pixel marker may vanish);
  a mirror swaps the declared ``flip_pairs``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from precompile.errors import StepError
from precompile.kinds import ANNOTATIONS, Kind
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample, Tied, link_fields
from precompile.seeding import rng_for

load_builtins()

K = 3                      # keypoints per object: top-left, top-right, middle pixel centre
PAIRS = [[0, 1]]           # top-left and top-right swap in a mirror

CASES: dict[str, list[dict]] = {
    "resize": [{"size": [40, 56]}, {"size": [30, 34]}, {"shorter": 40}, {"size": [48, 48], "keep_aspect": True}],
    "center_crop": [{"size": [24, 28]}, {"size": [56, 30], "pad": True, "min_visibility": 0.5},
                    {"size": [24, 28], "min_area": 30, "min_width": 4, "min_height": 5}],
    "random_crop": [{"size": [24, 28]}, {"size": [32, 32], "padding": 6, "min_visibility": 0.3},
                    {"size": [60, 20], "pad": True}, {"size": [26, 30], "padding": 4, "min_area": 24, "min_width": 6},
                    {"size": [24, 28], "min_height": 7, "min_visibility": 0.2}],
    "random_resized_crop": [{"size": [40, 40], "scale": [0.3, 1.0]},
                            {"size": [48, 40], "scale": [0.2, 0.8], "min_visibility": 0.4},
                            {"size": [40, 44], "scale": [0.2, 0.7], "min_area": 60, "min_width": 5, "min_height": 6}],
    "random_flip": [{"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}, {"horizontal": 1.0, "flip_pairs": PAIRS},
                    {"vertical": 1.0, "flip_pairs": []}],
    "random_affine": [{"degrees": 40, "scale": [0.8, 1.3], "translate": 0.2},
                      {"degrees": [85, 95], "min_visibility": 0.6},
                      {"degrees": 30, "translate": 0.2, "min_area": 50, "min_width": 6, "min_height": 5}],
}
#: albumentations' box filters (BboxParams): a box whose visible (clipped) area, width or height in output pixels
#: after the step is under the threshold is dropped; min_visibility the fraction of its area left
FILTERS = ("min_visibility", "min_area", "min_width", "min_height")
EXACT = {"center_crop", "random_crop", "random_flip"}     # pixels moved without resampling


def _make(name: str, params: dict):
    cls = STEPS.get(name)
    return cls(cls.Params.model_validate(params))


def scene(seed: int, H: int, W: int) -> Sample:
    """Objects in a 3x3 grid of cells (each cell holds at most one, at least 4x4 pixels)."""
    r = np.random.default_rng(seed)
    image = np.zeros((H, W, 3), np.uint8)
    objects = np.zeros((H, W, 1), np.uint8)
    marks = np.zeros((H, W, 1), np.uint8)
    boxes, kps, empty = [], [], []
    ch, cw = H // 3, W // 3
    for cy in range(3):
        for cx in range(3):
            if r.random() < 0.25:
                empty.append((cy * ch + 1, cx * cw + 1))
                continue
            h, w = int(r.integers(4, ch + 1)), int(r.integers(4, cw + 1))
            y1, x1 = cy * ch + int(r.integers(0, ch - h + 1)), cx * cw + int(r.integers(0, cw - w + 1))
            i = len(boxes)
            objects[y1:y1 + h, x1:x1 + w] = i + 1
            image[y1:y1 + h, x1:x1 + w] = r.integers(40, 256, 3)
            pts = [(x1, y1), (x1 + w - 1, y1), (x1 + w // 2, y1 + h // 2)]
            for j, (px, py) in enumerate(pts):
                marks[py, px] = 3 * i + j + 1
            boxes.append([x1, y1, x1 + w, y1 + h])
            kps.append([[px + 0.5, py + 0.5, 2.0] for px, py in pts])
    boxes_a = np.asarray(boxes, np.float32).reshape(-1, 4)
    crowd = np.zeros((H, W, 1), np.uint8)
    for y, x in empty[:1]:   # a crowd region: the ignore id in the instance mask
        crowd[y:y + 3, x:x + 3] = 1
    instances = np.where(crowd == 1, np.uint16(IGNORE), objects.astype(np.uint16))
    fields = {"image": image, "objects": objects, "marks": marks, "instances": instances, "crowd": crowd,
              "boxes": boxes_a, "box_labels": r.integers(0, 5, len(boxes)).astype(np.int64),
              "keypoints": np.asarray(kps, np.float32).reshape(-1, K, 3)}
    kinds = {"image": "image", "objects": "mask", "marks": "mask", "instances": Tied("mask", "boxes"), "crowd": "mask",
             "boxes": "boxes", "box_labels": "box_labels", "keypoints": "keypoints"}
    return Sample(f"scene/{seed}", fields, kinds)


IGNORE = 65535   # the instance mask's ignore id: uint16's largest value
GRIDS = ("image", "objects", "marks", "instances", "crowd")


def pixel_box(mask: np.ndarray, v: int) -> np.ndarray | None:
    ys, xs = np.nonzero(mask[..., 0] == v)
    if ys.size == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)


def _window_fraction(before: Sample, i: int, rec: dict) -> float:
    """Visible fraction of object i inside a random resized crop's window (from the input mask)."""
    m = before.fields["objects"][..., 0] == i + 1
    t, l_, h, w = rec["top"], rec["left"], rec["height"], rec["width"]
    return m[t:t + h, l_:l_ + w].sum() / m.sum()


def _window_extent(before: Sample, i: int, rec: dict) -> tuple[int, int, int]:
    """Object i's pixels inside a random resized crop's window (from the input mask): their count, and the
    columns and rows they span (the objects are rectangles)."""
    m = before.fields["objects"][..., 0] == i + 1
    t, l_, h, w = rec["top"], rec["left"], rec["height"], rec["width"]
    inside = m[t:t + h, l_:l_ + w]
    return int(inside.sum()), int(inside.any(0).sum()), int(inside.any(1).sum())


def passes(params: dict, frac: float, area: float, width: float, height: float) -> bool:
    """The keep rule of docs/annotations.md and albumentations' BboxParams: something visible, and the visible
    fraction, area, width and height (output pixels, after the step) each at least its threshold (inclusive)."""
    return (frac > 0 and area > 0 and frac >= params.get("min_visibility", 0.0) and area >= params.get("min_area", 0.0)
            and width >= params.get("min_width", 0.0) and height >= params.get("min_height", 0.0))


def expected_kept(name: str, before: Sample, after: Sample, params: dict) -> list[int] | None:
    """The objects whose boxes must survive, from the masks; None where pixels cannot decide (affine). The objects
    are rectangles: their visible pixels after a crop are their clipped box (area = pixel count, width and height
    = the columns and rows they span); after a random resized crop, the window's share of the input object scaled
    by the resize (output pixels per window pixel)."""
    n = len(before.fields["boxes"])
    if name == "resize":
        return list(range(n))
    if name == "random_affine":
        return None
    rec = after.meta["augment"][-1] if name == "random_resized_crop" else None
    kept = []
    for i in range(n):
        total = (before.fields["objects"] == i + 1).sum()
        if rec is not None:
            count, cols, rows = _window_extent(before, i, rec)
            oh, ow = after.fields["image"].shape[:2]
            sx, sy = ow / rec["width"], oh / rec["height"]
            frac, area, width, height = count / total, count * sx * sy, cols * sx, rows * sy
            for v, key in ((area, "min_area"), (width, "min_width"), (height, "min_height")):
                assume(key not in params or abs(v - params[key]) > 1e-6)   # no float ties at the boundary
        else:
            seen = after.fields["objects"][..., 0] == i + 1
            frac, area = seen.sum() / total, float(seen.sum())
            width, height = float(seen.any(0).sum()), float(seen.any(1).sum())
        if passes(params, frac, area, width, height):
            kept.append(i)
    return kept


def affine_reference(before: Sample, rec: dict, H: int, W: int) -> np.ndarray:
    """Each box's 4 corners rotated, scaled about the image centre (W/2, H/2) and shifted by an
    independent formula (counter-clockwise as displayed: y points down); their enclosing box."""
    a, s = math.radians(rec["angle"]), rec["scale"]
    out = []
    for x1, y1, x2, y2 in before.fields["boxes"].astype(np.float64):
        xs, ys = [], []
        for x, y in ((x1, y1), (x2, y1), (x1, y2), (x2, y2)):
            dx, dy = x - W / 2, y - H / 2
            xs.append(W / 2 + s * (math.cos(a) * dx + math.sin(a) * dy) + rec["tx"])
            ys.append(H / 2 + s * (-math.sin(a) * dx + math.cos(a) * dy) + rec["ty"])
        out.append([min(xs), min(ys), max(xs), max(ys)])
    return np.asarray(out).reshape(-1, 4)


def affine_kept(before: Sample, after: Sample, params: dict, msg: str) -> list[int]:
    """Affine: the boxes kept are those whose independently moved enclosing box, clipped, keeps a visible
    fraction above 0 and at least ``min_visibility``, and an area, width and height at least ``min_area``,
    ``min_width``, ``min_height``; an object with pixels on the grid keeps its box when no filter is set (its
    pixel centres lie inside its box)."""
    H, W = before.fields["image"].shape[:2]
    min_vis = params.get("min_visibility", 0.0)
    kept = []
    for i, r in enumerate(affine_reference(before, after.meta["augment"][-1], H, W)):
        width, height = max(min(r[2], W) - max(r[0], 0), 0), max(min(r[3], H) - max(r[1], 0), 0)
        vis = width * height / ((r[2] - r[0]) * (r[3] - r[1]))
        assume(abs(vis - min_vis) > 1e-5 and vis > 1e-5 or vis == 0)   # no float ties at the boundary
        for v, key in ((width * height, "min_area"), (width, "min_width"), (height, "min_height")):
            assume(key not in params or abs(v - params[key]) > 1e-5)
        if passes(params, vis, width * height, width, height):
            kept.append(i)
        elif not any(params.get(k) for k in FILTERS):
            assert pixel_box(after.fields["objects"], i + 1) is None, f"{msg}: object {i} on the grid, box dropped"
    return kept


def check_boxes(name: str, before: Sample, after: Sample, kept: list[int], msg: str) -> None:
    H, W = after.fields["image"].shape[:2]
    boxes = after.fields["boxes"].astype(np.float64)
    assert boxes.shape == (len(kept), 4), msg
    assert (boxes[:, [0, 2]] >= 0).all() and (boxes[:, [0, 2]] <= W).all(), msg
    assert (boxes[:, [1, 3]] >= 0).all() and (boxes[:, [1, 3]] <= H).all(), msg
    ref = affine_reference(before, after.meta["augment"][-1], *before.fields["image"].shape[:2]) \
        if name == "random_affine" else None
    for row, i in enumerate(kept):
        pix = pixel_box(after.fields["objects"], i + 1)
        b = boxes[row]
        if name == "random_affine":
            r = ref[i]
            clipped = np.array([np.clip(r[0], 0, W), np.clip(r[1], 0, H), np.clip(r[2], 0, W), np.clip(r[3], 0, H)])
            np.testing.assert_allclose(b, clipped, atol=1e-3, err_msg=msg)
            if pix is None:
                continue
            assert (pix[:2] >= b[:2] - 0.5 - 1e-3).all() and (pix[2:] <= b[2:] + 0.5 + 1e-3).all(), \
                f"{msg}: object {i} pixels {pix} outside its box {b}"
            if np.array_equal(r, clipped):   # not clipped: tight
                assert np.abs(pix - b).max() <= 1.5, f"{msg}: box {b} not tight around object {i} pixels {pix}"
            continue
        if pix is None:   # a sliver under one output pixel vanished in the resampling
            assert name not in EXACT and min(b[2] - b[0], b[3] - b[1]) < 1.0, f"{msg}: object {i} vanished"
            continue
        tol = 1e-4 if name in EXACT else 0.5 + 1e-4
        assert np.abs(pix - b).max() <= tol, f"{msg}: box {b} vs object {i} pixels {pix}"


def check_instances(name: str, before: Sample, after: Sample, kept: list[int], msg: str) -> None:
    """The tied instance mask after the step: ``instances == row + 1`` is the object of box ``row`` (the plain
    ``objects`` mask, moved alike, holds the objects' own ids), and for exact steps its painted colour; the ids
    of dropped boxes are gone; the crowd patch keeps the ignore id; no other value appears."""
    inst, obj = after.fields["instances"][..., 0], after.fields["objects"][..., 0]
    assert inst.dtype == np.uint16, msg
    assert set(np.unique(inst).tolist()) <= {0, IGNORE, *range(1, len(kept) + 1)}, f"{msg}: ids {np.unique(inst)}"
    np.testing.assert_array_equal(inst == IGNORE, after.fields["crowd"][..., 0] == 1, err_msg=f"{msg}: ignore")
    for row, i in enumerate(kept):
        np.testing.assert_array_equal(inst == row + 1, obj == i + 1, err_msg=f"{msg}: box {row} is object {i}")
        if name in EXACT and (obj == i + 1).any():
            colour = before.fields["image"][before.fields["objects"][..., 0] == i + 1][0]
            painted = (after.fields["image"] == colour).all(-1)
            np.testing.assert_array_equal(inst == row + 1, painted, err_msg=f"{msg}: box {row}: colour {colour}")
    for i in sorted(set(range(len(before.fields["boxes"]))) - set(kept)):
        assert not inst[obj == i + 1].any(), f"{msg}: the pixels of dropped object {i} keep an id"


def _mirrored(name: str, after: Sample) -> bool:
    if name != "random_flip":
        return False
    rec = after.meta["augment"][-1]
    return rec["horizontal"] != rec["vertical"]


def check_keypoints(name: str, params: dict, before: Sample, after: Sample, kept: list[int], msg: str) -> None:
    H, W = after.fields["image"].shape[:2]
    kp = after.fields["keypoints"]
    assert kp.shape == (len(kept), K, 3) and kp.dtype == np.float32, msg
    perm = list(range(K))
    if _mirrored(name, after):
        for a, b in params.get("flip_pairs", []):
            perm[a], perm[b] = b, a
    marks = after.fields["marks"][..., 0]
    for row, i in enumerate(kept):
        for j in range(K):
            x, y, v = (float(c) for c in kp[row, j])
            inside = 0 <= x < W and 0 <= y < H
            assert (v == 0) == (not inside), f"{msg}: keypoint {j} of object {i} at ({x}, {y}) visibility {v}"
            ys, xs = np.nonzero(marks == 3 * i + perm[j] + 1)
            if name in EXACT:
                assert (xs.size > 0) == inside, f"{msg}: keypoint {j} of object {i} in view {inside}, marker {xs}"
            if not inside or xs.size == 0:
                continue
            # distance from the point to the nearest marker pixel square [x, x+1) x [y, y+1)
            d = np.maximum(np.maximum(xs - x, x - (xs + 1)), np.maximum(ys - y, y - (ys + 1))).clip(0).min()
            assert d <= (1e-4 if name in EXACT or name == "resize" else 1.0), \
                f"{msg}: keypoint {j} of object {i} at ({x}, {y}) is {d} px from its marker {list(zip(xs, ys))}"


CASE_PARAMS = [pytest.param(n, p, id=f"{n}-{i}") for n, ps in sorted(CASES.items()) for i, p in enumerate(ps)]


def test_every_step_that_moves_annotations_has_cases():
    movers = sorted(n for n, c in STEPS.items() if c.__module__.startswith("precompile.") and c.applies & ANNOTATIONS)
    assert movers == sorted(CASES), movers


def test_scene_is_its_own_reference():
    s = scene(5, 40, 44)
    assert len(s.fields["boxes"]) >= 1 and s.links == {"instances": "boxes", "box_labels": "boxes", "keypoints": "boxes"}
    assert (s.fields["crowd"] == 1).sum() == 9
    for i, b in enumerate(s.fields["boxes"]):
        np.testing.assert_array_equal(pixel_box(s.fields["objects"], i + 1), b)
    check_instances("random_crop", s, s, list(range(len(s.fields["boxes"]))), "identity")
    check_keypoints("random_crop", {}, s, s, list(range(len(s.fields["boxes"]))), "identity")


@pytest.mark.parametrize("name, params", CASE_PARAMS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31), H=st.integers(30, 48), W=st.integers(30, 52))
def test_boxes_and_keypoints_follow_the_pixels(name, params, seed, H, W):
    step = _make(name, params)
    before = scene(seed, H, W)
    for copy in (1, 2):
        (after,) = step.run(before, rng_for(seed, before.key, copy))
        msg = f"{name} {params} seed={seed} {H}x{W} copy {copy} {after.meta.get('augment')}"
        kept = expected_kept(name, before, after, params)
        if kept is None:
            kept = affine_kept(before, after, params, msg)
        labels = before.fields["box_labels"][kept]
        np.testing.assert_array_equal(after.fields["box_labels"], labels, err_msg=msg)
        check_boxes(name, before, after, kept, msg)
        check_instances(name, before, after, kept, msg)
        check_keypoints(name, params, before, after, kept, msg)


def test_dropped_boxes_take_their_labels_and_keypoints():
    s = scene(11, 40, 44)
    step = _make("center_crop", {"size": [12, 12]})
    (out,) = step.run(s, rng_for(0, s.key, 0))
    n = len(out.fields["boxes"])
    assert n < len(s.fields["boxes"]) and len(out.fields["box_labels"]) == n and len(out.fields["keypoints"]) == n
    assert out.fields["boxes"].shape == (n, 4) and out.fields["boxes"].dtype == np.float32


def _rectangles(H: int = 60, W: int = 80, rects=((0, 0, 12, 12), (30, 20, 50, 40), (60, 40, 76, 56))):
    """Issue 32's example: an H x W image with rectangles (x1, y1, x2, y2) painted in their own colours, the
    instance mask of their ids (i + 1), their boxes and labels 5, 6, 7..."""
    colours = np.array([(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)][:len(rects)], np.uint8)
    image = np.zeros((H, W, 3), np.uint8)
    mask = np.zeros((H, W, 1), np.uint16)
    for i, (x1, y1, x2, y2) in enumerate(rects):
        image[y1:y2, x1:x2], mask[y1:y2, x1:x2] = colours[i], i + 1
    fields = {"image": image, "mask": mask, "boxes": np.array(rects, np.float32),
              "box_labels": np.arange(5, 5 + len(rects), dtype=np.int64)}
    return fields, colours


def test_instance_mask_ids_follow_the_boxes_a_step_drops():
    """Issue 32.1: center_crop 40x40 of a 60x80 image drops boxes 0 and 2; box 1 becomes box 0, so its
    pixels must carry id 1 (they kept id 2, and mask == 1 was empty)."""
    fields, colours = _rectangles()
    fields["mask"][55:60, 0:5] = IGNORE   # a crowd region (ignore id) outside the crop, one inside
    fields["mask"][28:31, 38:41] = IGNORE
    for kinds, links in (({"mask": Tied("mask", "boxes")}, {}), ({"mask": "mask"}, {"mask": "boxes"})):
        s = Sample("k", dict(fields), {"image": "image", "boxes": "boxes", "box_labels": "box_labels", **kinds},
                   links=links)
        assert s.links == {"mask": "boxes", "box_labels": "boxes"}
        (out,) = _make("center_crop", {"size": [40, 40]}).run(s, rng_for(0, "k", 0))
        np.testing.assert_array_equal(out.fields["boxes"], [[10, 10, 30, 30]])
        np.testing.assert_array_equal(out.fields["box_labels"], [6])
        m = out.fields["mask"][..., 0]
        assert m.dtype == np.uint16 and set(np.unique(m).tolist()) == {0, 1, IGNORE}
        painted = (out.fields["image"] == colours[1]).all(-1)
        np.testing.assert_array_equal(m == 1, painted & (m != IGNORE))
        np.testing.assert_array_equal(pixel_box(out.fields["mask"], 1), [10, 10, 30, 30])
        assert out.specs()["mask"].of == "boxes"
    # a plain mask (a label map of classes) is not an instance mask: its values are classes, never renumbered
    plain = Sample("k", dict(fields), {"image": "image", "mask": "mask", "boxes": "boxes", "box_labels": "box_labels"})
    assert plain.links == {"box_labels": "boxes"}
    (out,) = _make("center_crop", {"size": [40, 40]}).run(plain, rng_for(0, "k", 0))
    assert set(np.unique(out.fields["mask"]).tolist()) == {0, 2, IGNORE}


@pytest.mark.parametrize("name, params", [("center_crop", {"size": [40, 40]}),
                                          ("random_crop", {"size": [40, 40], "min_visibility": 0.9}),
                                          ("random_resized_crop", {"size": [40, 40], "scale": [0.2, 0.4]}),
                                          ("random_affine", {"degrees": 30, "translate": 0.4, "min_visibility": 0.7})])
def test_every_dropping_step_renumbers_a_tied_instance_mask(name, params):
    """Over many draws each of the four steps that drop boxes: mask == row + 1 is the object of box row (the
    plain mask of the objects' own ids, moved alike), and its painted colour where the step moves pixels
    exactly."""
    fields, _ = _rectangles(rects=((0, 0, 12, 12), (30, 20, 50, 40), (60, 40, 76, 56), (14, 44, 28, 58)))
    fields["objects"] = fields["mask"].astype(np.uint8)
    fields["instances"] = fields.pop("mask")
    fields["crowd"] = np.zeros_like(fields["objects"])
    s = Sample("k", fields, {"image": "image", "objects": "mask", "crowd": "mask", "instances": Tied("mask", "boxes"),
                             "boxes": "boxes", "box_labels": "box_labels"})
    step, dropped = _make(name, params), 0
    for copy in range(40):
        (out,) = step.run(s, rng_for(7, "k", copy))
        kept = [int(v) - 5 for v in out.fields["box_labels"]]
        dropped += 4 - len(kept)
        check_instances(name, s, out, kept, f"{name} copy {copy}")
        if name != "random_affine":
            check_boxes(name, s, out, kept, f"{name} copy {copy}")
    assert dropped > 0


def test_an_instance_id_with_no_box_is_an_error_naming_step_and_field():
    fields, _ = _rectangles()
    fields["mask"][15, 25] = 9   # inside the crop window
    s = Sample("k", fields, {"image": "image", "mask": Tied("mask", "boxes"), "boxes": "boxes",
                             "box_labels": "box_labels"})
    with pytest.raises(StepError, match=r"center_crop: field 'mask' tied to 'boxes': instance id 9 names no box "
                                        r"\(3 boxes: mask == i \+ 1 is box i\)") as e:
        _make("center_crop", {"size": [40, 40]}).run(s, rng_for(0, "k", 0))
    assert e.value.field == "mask"


@pytest.mark.parametrize("H, W", [(10, 14), (7, 9)])
def test_a_flip_of_a_flip_is_the_identity_for_keypoints_on_the_edges(H, W):
    """Issue 32: a keypoint at x = 0 mirrors to x = W, on the image's edge: it stays in view (the image
    spans [0, W] x [0, H]), and a second flip brings every in-image point back with its visibility."""
    xy = [(0, 0), (W, H), (0, H), (W, 0), (0.5, 3.25), (W - 0.5, H / 2), (W / 2, 0)]
    kp = np.array([[[x, y, 2] for x, y in xy], [[x, y, 1] for x, y in xy]], np.float32)
    out_of_view = np.array([[[-0.01, 1, 2], [W + 0.01, 1, 2], [1, -0.01, 2], [1, H + 0.01, 2], *[[1, 1, 0]] * 3]] * 2,
                           np.float32)
    for pts in (kp, out_of_view):
        s = Sample("k", {"image": np.zeros((H, W, 3), np.uint8), "boxes": np.zeros((2, 4), np.float32),
                         "keypoints": pts}, {"image": "image", "boxes": "boxes", "keypoints": "keypoints"})
        for h, v in ((True, False), (False, True), (True, True)):
            flip = _make("random_flip", {"horizontal": float(h), "vertical": float(v), "flip_pairs": []})
            (once,) = flip.run(s, rng_for(0, "k", 1))
            want = pts.copy()
            want[..., 0] = W - pts[..., 0] if h else pts[..., 0]
            want[..., 1] = H - pts[..., 1] if v else pts[..., 1]
            inside = (want[..., 0] >= 0) & (want[..., 0] <= W) & (want[..., 1] >= 0) & (want[..., 1] <= H)
            want[..., 2] = np.where(inside, pts[..., 2], 0)
            np.testing.assert_array_equal(once.fields["keypoints"], want)
            (twice,) = flip.run(once, rng_for(0, "k", 1))
            if pts is kp:   # in the image: back where they were, visibility unchanged
                np.testing.assert_array_equal(twice.fields["keypoints"], pts)
            else:           # out of view stays out of view
                np.testing.assert_allclose(twice.fields["keypoints"][..., :2], pts[..., :2], atol=1e-5)
                assert not twice.fields["keypoints"][..., 2].any()


def test_min_visibility_boundary_is_inclusive():
    """A box exactly half visible is kept at min_visibility 0.5 and dropped above it."""
    img = np.zeros((10, 20, 3), np.uint8)
    s = Sample("k", {"image": img, "boxes": np.array([[0, 0, 10, 10]], np.float32), "box_labels": np.array([4])},
               {"image": "image", "boxes": "boxes", "box_labels": "box_labels"})
    for mv, n in ((0.5, 1), (0.51, 0)):
        (out,) = _make("center_crop", {"size": [10, 10], "min_visibility": mv}).run(s, rng_for(0, "k", 0))
        assert len(out.fields["boxes"]) == n and len(out.fields["box_labels"]) == n
        if n:
            np.testing.assert_array_equal(out.fields["boxes"], [[0, 0, 5, 10]])


#: four rectangles on a 20x30 image; center_crop 10x10 keeps the window x 10..20, y 5..15, so each one's visible
#: part, worked out by hand: (width, height, area) in output pixels
FILTER_RECTS = ((8, 4, 14, 9), (15, 6, 20, 14), (19, 14, 25, 20), (10, 14, 19, 15))
FILTER_VISIBLE = ((4, 4, 16), (5, 8, 40), (1, 1, 1), (9, 1, 9))


@pytest.mark.parametrize("params, kept", [
    ({}, [0, 1, 2, 3]),
    ({"min_area": 16}, [0, 1]),             # inclusive: 16 pixels kept at 16
    ({"min_area": 16.5}, [1]),
    ({"min_width": 5}, [1, 3]),
    ({"min_height": 4}, [0, 1]),
    ({"min_area": 10, "min_width": 2, "min_height": 2}, [0, 1]),
    ({"min_area": 9, "min_width": 9}, [3]),
    ({"min_area": 9, "min_visibility": 0.55}, [1, 3]),   # box 0 shows 16 of its 30 pixels, box 3 all 9
])
def test_box_size_filters_drop_what_albumentations_drops(params, kept):
    """Issue 35: min_area, min_width, min_height (albumentations' BboxParams): a box whose visible area, width
    or height in output pixels after the step is under the threshold is dropped, with its label, keypoint row
    and instance id. Against sizes worked out by hand and against the painted pixels."""
    H, W = 20, 30
    image = np.zeros((H, W, 3), np.uint8)
    mask = np.zeros((H, W, 1), np.uint16)
    for i, (x1, y1, x2, y2) in enumerate(FILTER_RECTS):
        image[y1:y2, x1:x2], mask[y1:y2, x1:x2] = 40 * (i + 1), i + 1
    kp = np.array([[[x1 + 0.5, y1 + 0.5, 2]] for x1, y1, _, _ in FILTER_RECTS], np.float32)
    s = Sample("k", {"image": image, "mask": mask, "boxes": np.array(FILTER_RECTS, np.float32),
                     "box_labels": np.arange(7, 11, dtype=np.int64), "keypoints": kp},
               {"image": "image", "mask": Tied("mask", "boxes"), "boxes": "boxes", "box_labels": "box_labels",
                "keypoints": "keypoints"})
    (full,) = _make("center_crop", {"size": [10, 10]}).run(s, rng_for(0, "k", 0))
    for i, (w, h, a) in enumerate(FILTER_VISIBLE):   # the hand-worked sizes are the pixels' own
        seen = full.fields["mask"][..., 0] == i + 1
        assert (seen.any(0).sum(), seen.any(1).sum(), seen.sum()) == (w, h, a), i
    (out,) = _make("center_crop", {"size": [10, 10], **params}).run(s, rng_for(0, "k", 0))
    np.testing.assert_array_equal(out.fields["box_labels"], [7 + i for i in kept])
    np.testing.assert_array_equal(out.fields["boxes"], full.fields["boxes"][kept])
    np.testing.assert_array_equal(out.fields["keypoints"], full.fields["keypoints"][kept])
    for row, i in enumerate(kept):
        np.testing.assert_array_equal(out.fields["mask"][..., 0] == row + 1, full.fields["mask"][..., 0] == i + 1)
    assert set(np.unique(out.fields["mask"]).tolist()) <= set(range(len(kept) + 1))


@pytest.mark.parametrize("step", ["center_crop", "random_crop", "random_resized_crop", "random_affine"])
@pytest.mark.parametrize("option", ["min_area", "min_width", "min_height"])
def test_box_size_filters_are_non_negative_numbers(step, option):
    from pydantic import ValidationError

    cls = STEPS.get(step)
    size = {} if step == "random_affine" else {"size": 8}
    assert getattr(cls.Params.model_validate({**size, option: 2.5}), option) == 2.5
    with pytest.raises(ValidationError, match=f"{option} is a size in output pixels, at least 0"):
        cls.Params.model_validate({**size, option: -1})


def test_links_tie_labels_and_keypoints_to_their_boxes():
    B, L, P, F, V = Kind.BOXES, Kind.BOX_LABELS, Kind.KEYPOINTS, Kind.FLOW, Kind.FLOW_VALID
    assert link_fields({"gt": B, "gt_labels": L, "pose": P}) == {"gt_labels": "gt", "pose": "gt"}
    assert link_fields({"a": B, "b": B, "a_labels": L, "b_labels": L, "a_keypoints": P}) == \
        {"a_labels": "a", "b_labels": "b", "a_keypoints": "a"}
    assert link_fields({"face": P}) == {}     # keypoints alone: no boxes to follow
    assert link_fields({"flow": F, "flow_valid": V}) == {"flow_valid": "flow"}
    with pytest.raises(ValueError, match=r"box_labels field 'cls' belongs to no boxes field \(boxes fields: \['a', 'b'\]"):
        link_fields({"a": B, "b": B, "cls": L})
    with pytest.raises(ValueError, match="box_labels field 'cls' belongs to no boxes field"):
        link_fields({"cls": L})
    with pytest.raises(ValueError, match=r"'cls' -> 'img' ties no field to the kind it belongs to"):
        link_fields({"cls": L, "img": Kind.IMAGE}, {"cls": "img"})
    # an instance mask is tied only where declared: a mask beside boxes is a label map unless it says so
    M = Kind.MASK
    assert link_fields({"gt": B, "gt_mask": M, "mask": M}) == {}
    assert link_fields({"gt": B, "mask": M}, {"mask": "gt"}) == {"mask": "gt"}
    with pytest.raises(ValueError, match=r"'mask' -> 'img' ties no field .*mask -> boxes \(an instance mask, "
                                         r"declared\), boxes -> image \(the image they annotate, declared\)"):
        link_fields({"mask": M, "img": Kind.IMAGE}, {"mask": "img"})
    # boxes name the image they annotate only where declared (inputs.coco does): never inferred
    assert link_fields({"b": B, "img": Kind.IMAGE}) == {}
    assert link_fields({"b": B, "img": Kind.IMAGE, "b_labels": L}, {"b": "img"}) == {"b": "img", "b_labels": "b"}
    s = Sample("k", {"m": np.zeros((2, 2, 1), np.uint16), "b": np.zeros((0, 4), np.float32)},
               {"m": Tied(Kind.MASK, "b"), "b": "boxes"})
    assert s.kinds == {"m": Kind.MASK, "b": Kind.BOXES} and s.links == {"m": "b"}


def test_tied_rows_must_match_their_boxes():
    s = Sample("k", {"image": np.zeros((8, 8, 3), np.uint8), "boxes": np.array([[0, 0, 4, 4]], np.float32),
                     "box_labels": np.array([1, 2])}, {"image": "image", "boxes": "boxes", "box_labels": "box_labels"})
    with pytest.raises(StepError, match=r"field 'box_labels' has 2 rows for the 1 boxes of 'boxes'"):
        _make("random_flip", {"horizontal": 1.0}).run(s, rng_for(0, "k", 1))


@pytest.mark.parametrize("boxes, message", [
    (np.array([[0, 0, 4]], np.float32), r"boxes must be \(N, 4\) x1, y1, x2, y2, got shape \(1, 3\)"),
    (np.array([[5, 0, 4, 4]], np.float32), r"box 0 \[5.0, 0.0, 4.0, 4.0\] has x2 < x1 or y2 < y1"),
    (np.array([[0, 0, 4, 4], [0, np.nan, 1, 1]], np.float32), "box 1 holds a non-finite value"),
])
def test_bad_boxes_name_the_step_field_and_box(boxes, message):
    s = Sample("k", {"image": np.zeros((8, 8, 3), np.uint8), "boxes": boxes}, {"image": "image", "boxes": "boxes"})
    with pytest.raises(StepError, match="resize: " + message) as e:
        _make("resize", {"size": [4, 4]}).run(s, rng_for(0, "k", 0))
    assert e.value.field == "boxes"


def test_flip_of_keypoints_needs_flip_pairs_at_plan_time():
    specs = scene(1, 30, 30).specs()
    with pytest.raises(ValueError, match=r"keypoints field 'keypoints': a mirror swaps left and right; say which"):
        _make("random_flip", {"horizontal": 0.5}).plan(specs)
    with pytest.raises(ValueError, match=r"flip_pairs name keypoint 5, and field 'keypoints' has 3 keypoints"):
        _make("random_flip", {"horizontal": 0.5, "flip_pairs": [[5, 1]]}).plan(specs)
    _make("random_flip", {"horizontal": 0.0, "vertical": 0.0}).plan(specs)   # never mirrors: no pairs needed
    out = _make("random_flip", {"flip_pairs": [[0, 1]]}).plan(specs)
    assert out["boxes"].shape == (None, 4) and out["box_labels"].shape == (None,) and out["keypoints"].shape == (None, 3, 3)
    for bad, message in (([[0, 0]], "two different keypoint indices"), ([[0, 1], [1, 2]], "keypoint 1 is in two flip pairs")):
        with pytest.raises(Exception, match=message):
            _make("random_flip", {"flip_pairs": bad})


def test_annotations_without_a_grid_are_a_plan_error():
    s = Sample("k", {"boxes": np.zeros((0, 4), np.float32)}, {"boxes": "boxes"})
    with pytest.raises(ValueError, match=r"fields \['boxes'\] are coordinates on an image, and the sample has no image"):
        _make("resize", {"size": [4, 4]}).plan(s.specs())


def test_every_step_states_its_rule_for_annotations_in_the_docs():
    """docs/annotations.md's table is the rule of every built-in step for boxes, box_labels, keypoints."""
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "annotations.md")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| ([a-z]+) \|", text, flags=re.M))
    words = {"apply": "moves", "keep": "keeps", "refuse": "refuses"}
    wrong = [f"{n}: docs say {rows.get(n)}, code {words[c.rule(Kind.BOXES)]}" for n, c in STEPS.items()
             if c.__module__.startswith("precompile.") and rows.get(n) != words[c.rule(Kind.BOXES)]]
    assert not wrong, wrong
    for n, c in STEPS.items():   # the three kinds share one rule per step (labels follow their boxes)
        if c.__module__.startswith("precompile."):
            assert c.rule(Kind.KEYPOINTS) == c.rule(Kind.BOXES), n
            assert c.rule(Kind.BOX_LABELS) in ("keep", c.rule(Kind.BOXES)), n


# -- Loader side: device steps on padded batches -----------------------------------------------------
DEVICE_CASES = [("random_flip", {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}),
                ("random_crop", {"size": [24, 28]}),
                ("random_crop", {"size": [32, 32], "padding": 6, "min_visibility": 0.3}),
                ("random_crop", {"size": [60, 20], "pad": True, "min_visibility": 0.5}),
                ("random_crop", {"size": [28, 30], "padding": 3, "min_area": 30, "min_width": 5, "min_height": 4}),
                ("random_resized_crop", {"size": [40, 40], "scale": [0.3, 1.0]}),
                ("random_resized_crop", {"size": [48, 40], "scale": [0.2, 0.8], "min_visibility": 0.4,
                                         "interpolation": "nearest"}),
                ("random_affine", {"degrees": 40, "scale": [0.8, 1.3], "translate": 0.2}),
                ("random_affine", {"degrees": [85, 95], "min_visibility": 0.6, "interpolation": "nearest"})]


def test_every_device_step_has_annotation_cases():
    from precompile.reader import augment

    assert {n for n, _ in DEVICE_CASES} == {n for n, s in augment.STEP_NAMES.items() if s.moves_grid}


@pytest.mark.parametrize("name, params", [pytest.param(n, p, id=f"{n}-{i}") for i, (n, p) in enumerate(DEVICE_CASES)])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 31), H=st.integers(30, 44), W=st.integers(30, 48))
def test_device_steps_move_padded_annotations_like_the_pixels(name, params, seed, H, W):
    import torch

    from precompile.reader import augment, gpu
    from precompile.reader.ragged import count_name, pad_rows

    scenes = [scene(seed + i, H, W) for i in range(4)]
    grids = GRIDS
    notes = ("boxes", "box_labels", "keypoints")
    specs = {f: {"kind": scenes[0].kinds[f].value, **({"of": scenes[0].links[f]} if f in scenes[0].links else {})}
             for f in scenes[0].fields}
    shapes = {**{f: scenes[0].fields[f].shape for f in grids}, "boxes": (None, 4), "box_labels": (None,),
              "keypoints": (None, K, 3)}
    step = augment.parse_steps([{name: params}])[0]
    assert set(step.bind(specs, shapes)) == {*grids, "boxes", "keypoints"}
    batch = {f: torch.from_numpy(np.stack([s.fields[f] for s in scenes])) for f in grids}
    for f in notes:
        a, n = pad_rows([s.fields[f] for s in scenes], scenes[0].fields[f].shape[1:], scenes[0].fields[f].dtype)
        batch[f], batch[count_name(f)] = torch.from_numpy(a), torch.from_numpy(n)
    (p,) = gpu.step_params([step], seed, 0, 0, 0, len(scenes))
    out = gpu.run_steps(dict(batch), [step], [p])
    for i, s in enumerate(scenes):
        one = gpu.param_at(p, i)
        fields = {f: out[f][i].numpy() for f in grids}
        for f in notes:
            c = int(out[count_name(f)][i])
            rows = out[f][i].numpy()
            assert (np.isnan(rows[c:]).all() if rows.dtype.kind == "f" else (rows[c:] == -1).all()), f
            fields[f] = rows[:c]
        got = Sample(s.key, fields, dict(s.kinds), meta={"augment": [{"step": name, **one}]}, links=dict(s.links))
        msg = f"device {name} {params} seed={seed} {H}x{W} sample {i} {one}"
        kept = expected_kept(name, s, got, params)
        if kept is None:
            kept = affine_kept(s, got, params, msg)
        np.testing.assert_array_equal(got.fields["box_labels"], s.fields["box_labels"][kept], err_msg=msg)
        check_boxes(name, s, got, kept, msg)
        check_instances(name, s, got, kept, msg)
        check_keypoints(name, params, s, got, kept, msg)
        ref = step.step.replay(s, one)   # and exactly the build step's result (a resampled image: within a
        for f in (*grids, *notes):       # level, OpenCV's fixed-point linear weights against float32 ones)
            if f == "image" and step.resamples and params.get("interpolation") != "nearest":
                import cv2   # the build's warpAffine on OpenCV 4 (the floor) rounds coordinates to 1/32 px

                lv = 8 if name == "random_affine" and int(cv2.__version__.split(".")[0]) < 5 else 1
                d = np.abs(got.fields[f].astype(int) - ref.fields[f].astype(int))
                assert d.max() <= lv, f"{msg}: image differs from the build's by {d.max()}"
                continue
            np.testing.assert_array_equal(got.fields[f], ref.fields[f], err_msg=f"{msg}: {f} != build")


# -- Loader side: chains of device steps, each on the grid the one before it made (issue 32.2) ---------------
#: the k-th crop of a chain (each fits what the ones before it leave: 34x38 of a 40x44 or larger scene, then
#: 26x30 with padding, then a padded 30x20)
CHAIN_CROPS = [{"size": [34, 38], "min_visibility": 0.3}, {"size": [26, 30], "padding": 3, "min_area": 20, "min_height": 4},
               {"size": [30, 20], "pad": True, "min_visibility": 0.5}]
CHAIN_FLIP = {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}
CHAINS = [c for n in (1, 2, 3) for c in __import__("itertools").product(("random_flip", "random_crop"), repeat=n)]


def _chain(names: tuple[str, ...]) -> list[dict]:
    crops = iter(CHAIN_CROPS)
    return [{n: dict(CHAIN_FLIP) if n == "random_flip" else next(crops)} for n in names]


def _device_samples(batch: dict, scenes: list[Sample]) -> list[Sample]:
    """A device batch back as samples (rows cut to each sample's count)."""
    from precompile.reader.ragged import count_name

    out = []
    for i, s in enumerate(scenes):
        fields = {f: batch[f][i].numpy() for f in GRIDS}
        for f in ("boxes", "box_labels", "keypoints"):
            fields[f] = batch[f][i].numpy()[:int(batch[count_name(f)][i])]
        out.append(Sample(s.key, fields, dict(s.kinds), links=dict(s.links)))
    return out


def check_chain_step(name: str, params: dict, before: Sample, after: Sample, rec: dict, slots: np.ndarray,
                     msg: str) -> np.ndarray:
    """One device step of a chain against the pixels. Box labels are the objects' own ids (label L is
    object L): the boxes kept are those whose object keeps a visible fraction > 0 and >= min_visibility, and
    a visible area, width and height in pixels >= min_area, min_width, min_height (the objects mask before
    and after, both exact: crops and flips move pixels without resampling); each box is its object's pixel
    box; the instance mask's row ids are the objects'; a keypoint is invisible exactly when it was or lands
    off the image [0, w] x [0, h], else it sits on its marker. ``slots[L, j]`` is the marker of keypoint slot
    j of object L (flip pairs swap them); returns it after this step."""
    H, W = after.fields["image"].shape[:2]
    obj0, obj1 = before.fields["objects"][..., 0], after.fields["objects"][..., 0]
    labels0 = before.fields["box_labels"].tolist()
    kept = [L for L in labels0 if passes(params, (obj1 == L + 1).sum() / (obj0 == L + 1).sum(), (obj1 == L + 1).sum(),
                                         (obj1 == L + 1).any(0).sum(), (obj1 == L + 1).any(1).sum())]
    assert after.fields["box_labels"].tolist() == kept, f"{msg}: kept {after.fields['box_labels']} want {kept}"
    for row, L in enumerate(kept):
        np.testing.assert_array_equal(after.fields["boxes"][row], pixel_box(after.fields["objects"], L + 1),
                                      err_msg=f"{msg}: box {row} (object {L})")
    inst = after.fields["instances"][..., 0]
    assert set(np.unique(inst).tolist()) <= {0, IGNORE, *range(1, len(kept) + 1)}, msg
    np.testing.assert_array_equal(inst == IGNORE, after.fields["crowd"][..., 0] == 1, err_msg=f"{msg}: ignore")
    for row, L in enumerate(kept):
        np.testing.assert_array_equal(inst == row + 1, obj1 == L + 1, err_msg=f"{msg}: instance {row} (object {L})")
        colour = before.fields["image"][obj0 == L + 1][0]
        np.testing.assert_array_equal(inst == row + 1, (after.fields["image"] == colour).all(-1), err_msg=msg)
    slots = slots.copy()
    if name == "random_flip" and rec["horizontal"] != rec["vertical"]:
        for a, b in PAIRS:
            slots[:, [a, b]] = slots[:, [b, a]]
    marks = after.fields["marks"][..., 0]
    kp0 = {L: before.fields["keypoints"][r] for r, L in enumerate(labels0)}
    for row, L in enumerate(kept):
        for j in range(K):
            x, y, v = (float(c) for c in after.fields["keypoints"][row, j])
            inside = 0 <= x <= W and 0 <= y <= H
            assert (v == 0) == (not inside or _was_hidden(kp0[L], slots, L, j, name, rec)), \
                f"{msg}: keypoint {j} of object {L} at ({x}, {y}) visibility {v}"
            if v:
                ys, xs = np.nonzero(marks == 3 * L + slots[L, j] + 1)
                d = np.maximum(np.maximum(xs - x, x - (xs + 1)), np.maximum(ys - y, y - (ys + 1))).clip(0).min()
                assert d <= 1e-4, f"{msg}: keypoint {j} of object {L} at ({x}, {y}) is {d} px from its marker"
    return slots


def _was_hidden(kp_before: np.ndarray, slots: np.ndarray, L: int, j: int, name: str, rec: dict) -> bool:
    """Whether keypoint slot j of object L had visibility 0 before the step (a mirror swaps the pairs' slots)."""
    src = j
    if name == "random_flip" and rec["horizontal"] != rec["vertical"]:
        for a, b in PAIRS:
            src = b if j == a else a if j == b else src
    return float(kp_before[src][2]) == 0


@pytest.mark.parametrize("names", [pytest.param(c, id="+".join(n.split("_")[1] for n in c)) for c in CHAINS])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2 ** 31), H=st.integers(40, 48), W=st.integers(44, 52))
def test_device_step_chains_see_the_grid_before_them(names, seed, H, W):
    """Every chain of 1-3 device steps (flips and crops): each step moves boxes, keypoints and the instance
    mask on the grid the step before it made. The batch equals the build steps replayed sample by sample
    with the same parameters (the reference: same names, same rules), and each step agrees with the
    painted pixels."""
    import torch

    from precompile.reader import gpu
    from precompile.reader.ragged import count_name, pad_rows

    scenes = [scene(seed + i, H, W) for i in range(4)]
    for s in scenes:   # label L is object L: what survives each step is read off the labels
        s.fields["box_labels"] = np.arange(len(s.fields["boxes"]), dtype=np.int64)
    notes = ("boxes", "box_labels", "keypoints")
    s0 = scenes[0]
    specs = {f: {"kind": s0.kinds[f].value, **({"of": s0.links[f]} if f in s0.links else {})} for f in s0.fields}
    shapes = {**{f: s0.fields[f].shape for f in GRIDS}, "boxes": (None, 4), "box_labels": (None,),
              "keypoints": (None, K, 3)}
    chain = _chain(names)
    steps = gpu.parse_steps(chain)
    gpu.bind_steps(steps, specs, shapes)
    batch = {f: torch.from_numpy(np.stack([s.fields[f] for s in scenes])) for f in GRIDS}
    for f in notes:
        a, n = pad_rows([s.fields[f] for s in scenes], s0.fields[f].shape[1:], s0.fields[f].dtype)
        batch[f], batch[count_name(f)] = torch.from_numpy(a), torch.from_numpy(n)
    params = gpu.step_params(steps, seed, 0, 0, 0, len(scenes))
    stages = [_device_samples(batch, scenes)]
    for step, p in zip(steps, params):
        batch = gpu.run_steps(dict(batch), [step], [p])
        stages.append(_device_samples(batch, scenes))
    for i, s in enumerate(scenes):
        ref, slots = s, np.tile(np.arange(K), (len(s.fields["boxes"]), 1))
        for k, (step, p) in enumerate(zip(steps, params)):
            one = {key: (bool(v[i]) if v.dtype == bool else int(v[i])) for key, v in p.items()}
            msg = f"chain {chain} seed={seed} {H}x{W} sample {i} step {k} {one}"
            ref = step.step.replay(ref, one)
            got = stages[k + 1][i]
            for f in (*GRIDS, *notes):
                np.testing.assert_array_equal(got.fields[f], ref.fields[f], err_msg=f"{msg}: {f} != build")
            slots = check_chain_step(step.name, step.params.model_dump(), stages[k][i], got, one, slots, msg)
