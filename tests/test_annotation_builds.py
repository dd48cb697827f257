"""Boxes, box_labels and keypoints through a real build: ragged storage round trips in HDF5 and the
folder formats (0 rows included), the stored rows equal the steps replayed from their records, and
a build is byte-identical for any worker count."""
from __future__ import annotations

import os

import numpy as np
import pytest
import yaml

import precompile
from precompile import build as run_build
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.transforms.base import replay

from annotated_decoder import K   # registers the test decoder; a build's workers import that module, not this one

load_builtins()

STEP_LIST = [{"resize": {"size": [40, 48]}},
             {"random_crop": {"size": [32, 32], "padding": 4, "min_visibility": 0.3}},
             {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}}]


def make_inputs(root: str, n: int = 7) -> dict[str, dict[str, np.ndarray]]:
    """n samples of random sizes; sample 0 has no boxes at all."""
    rng = np.random.default_rng(4)
    out = {}
    os.makedirs(os.path.join(root, "a"), exist_ok=True)
    for k in range(n):
        h, w = int(rng.integers(30, 50)), int(rng.integers(30, 60))
        m = 0 if k == 0 else int(rng.integers(1, 6))
        x1, y1 = rng.uniform(0, w - 4, m), rng.uniform(0, h - 4, m)
        x2, y2 = x1 + rng.uniform(1, w - x1), y1 + rng.uniform(1, h - y1)
        boxes = np.stack([x1, y1, x2, y2], 1).astype(np.float32).reshape(-1, 4)
        kp = np.concatenate([rng.uniform(0, 1, (m, K, 2)) * [w, h], rng.integers(0, 3, (m, K, 1))], -1)
        arrays = {"image": rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "boxes": boxes,
                  "box_labels": rng.integers(0, 4, m).astype(np.int64), "keypoints": kp.astype(np.float32)}
        key = f"a/s{k}.npz"
        np.savez(os.path.join(root, key), **arrays)
        out[key] = arrays
    return out


def recipe(tmp_path, fmt: str = "hdf5") -> str:
    r = {"name": "det", "seed": 3, "inputs": {"root": str(tmp_path / "in"), "match": "{label}/{name}.npz",
                                              "fields": {"image": {"decoder": "_annotations_test"}}},
         "steps": STEP_LIST, "output": {"format": fmt, "samples_per_shard": 3}}
    p = tmp_path / f"det-{fmt}.yaml"
    p.write_text(yaml.safe_dump(r))
    return str(p)


def _steps():
    return [STEPS.get(n)(STEPS.get(n).Params.model_validate(p)) for d in STEP_LIST for n, p in d.items()]


@pytest.mark.parametrize("fmt", ["hdf5", "png", "bmp"])
def test_annotations_round_trip_and_equal_the_replayed_steps(tmp_path, fmt):
    src = make_inputs(str(tmp_path / "in"))
    rep = run_build(recipe(tmp_path, fmt), out_dir=str(tmp_path / "out"))
    ds = precompile.open(rep["output"])
    assert len(ds) == len(src)
    for name, shape in (("boxes", [None, 4]), ("box_labels", [None]), ("keypoints", [None, K, 3])):
        assert list(ds.field_specs[name]["shape"]) == shape, (name, ds.field_specs[name])
    assert ds.field_specs["box_labels"].get("of") == "boxes" and ds.field_specs["keypoints"].get("of") == "boxes"
    dropped = 0
    for i in range(len(ds)):
        got, key = ds[i], ds.key(i)
        a = src[key]
        fresh = Sample(key, dict(a), {"image": "image", "boxes": "boxes", "box_labels": "box_labels",
                                      "keypoints": "keypoints"})
        (want,) = replay(_steps(), fresh, ds.meta(i)["augment"])
        for f in ("boxes", "box_labels", "keypoints"):
            assert got[f].dtype == want.fields[f].dtype, f
            np.testing.assert_array_equal(got[f], want.fields[f], err_msg=f"{fmt} {key} {f}")
        np.testing.assert_array_equal(got["image"], want.fields["image"])
        assert len(got["boxes"]) == len(got["box_labels"]) == len(got["keypoints"])
        dropped += len(a["boxes"]) - len(got["boxes"])
    assert ds[[ds.key(i) for i in range(len(ds))].index("a/s0.npz")]["boxes"].shape == (0, 4)
    assert dropped > 0   # the crops dropped some boxes: the tie was exercised


def test_annotation_build_is_byte_identical_for_any_worker_count(tmp_path):
    make_inputs(str(tmp_path / "in"))
    outs = []
    for workers in (1, 2):
        rep = run_build(recipe(tmp_path, "hdf5"), out_dir=str(tmp_path / f"out{workers}"), n_jobs=workers)
        ds = precompile.open(rep["output"])
        outs.append([(ds.key(i), {f: a.tobytes() for f, a in ds[i].items()}) for i in range(len(ds))])
    assert outs[0] == outs[1]


# -- the Loader: padded tensors + counts; device steps move annotations like the build -------------
import torch  # noqa: E402  (the reader side only)

from precompile import Loader  # noqa: E402
from precompile.reader import feed, gpu  # noqa: E402
from precompile.reader.ragged import count_name  # noqa: E402

from test_loader_device import FakeRing  # noqa: E402

NOTES = ("boxes", "box_labels", "keypoints")


@pytest.fixture(scope="module")
def det_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("det")
    make_inputs(str(tmp / "in"), n=23)
    return run_build(recipe(tmp, "hdf5"), out_dir=str(tmp / "out"))["output"]


def _padded_rows(batch, name):
    a, n = batch[name].numpy(), batch[count_name(name)].numpy()
    pad = np.isnan(a[~_row_mask(n, a.shape)]).all() if a.dtype.kind == "f" else (a[~_row_mask(n, a.shape)] == -1).all()
    assert pad, f"{name}: padding is not NaN / -1"
    assert a.shape[1] == max(1, int(n.max())), f"{name}: padded to {a.shape[1]}, largest count {n.max()}"
    return [a[i, :int(n[i])] for i in range(len(n))]


def _row_mask(n, shape):
    m = np.zeros(shape[:2], bool)
    for i, c in enumerate(n):
        m[i, :int(c)] = True
    return m


def test_loader_gives_padded_annotations_and_counts(det_build):
    ds = precompile.open(det_build)
    loader = Loader(det_build, batch_size=5, shuffle=True, seed=2, device="cpu", num_threads=0)
    seen = 0
    for b, batch in enumerate(loader):
        rows = loader.batch_indices(0)[b]
        assert batch["boxes"].dtype == torch.float32 and batch["box_labels"].dtype == torch.int64
        assert batch[count_name("boxes")].dtype == torch.int64 and batch[count_name("boxes")].shape == (len(rows),)
        for name in NOTES:
            for i, r in zip(rows, _padded_rows(batch, name)):
                np.testing.assert_array_equal(r, ds[int(i)][name], err_msg=f"{name} row {i}")
        np.testing.assert_array_equal(batch["image"].numpy(), np.stack([ds[int(i)]["image"] for i in rows]))
        seen += len(rows)
    assert seen == len(ds)


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_batch_pad_true_pads_annotations_like_the_loader(tmp_path, fmt):
    """Issue 32: ds.batch(pad=True) padded box_labels with 0, a real class. Annotation fields pad by the
    Loader's one rule (precompile.kinds.pad_value): -1 for box_labels, NaN for boxes and keypoints; other
    fields still pad with 0, and a number given pads every field with it."""
    make_inputs(str(tmp_path / "in"), n=7)
    out = run_build(recipe(tmp_path, fmt), out_dir=str(tmp_path / "out"))["output"]
    ds = precompile.open(out)
    idx = list(range(len(ds)))
    counts = [len(ds[i]["boxes"]) for i in idx]
    assert min(counts) == 0 < max(counts)
    b = ds.batch(idx, pad=True)
    for name, value in (("boxes", np.nan), ("box_labels", -1), ("keypoints", np.nan)):
        a, v = b[name], b.padded[name]["value"]
        assert a.shape[:2] == (len(idx), max(counts)), name
        assert np.isnan(v) if value is np.nan else v == value, (name, v)
        for p, i in enumerate(idx):
            np.testing.assert_array_equal(a[p, :counts[p]], ds[i][name])
            tail = a[p, counts[p]:]
            assert (np.isnan(tail).all() if value is np.nan else (tail == -1).all()), (name, p, tail)
    if fmt == "hdf5":   # the Loader pads the same rows with the same values
        from precompile.reader.ragged import RaggedFields

        lb = RaggedFields(ds, list(NOTES)).batch(np.asarray(idx))
        for name in NOTES:
            np.testing.assert_array_equal(lb[name].numpy(), b[name], err_msg=name)
    seven = ds.batch(idx, pad=7)
    assert (seven["box_labels"][np.asarray(counts) == 0] == 7).all() and seven.padded["boxes"]["value"] == 7


def _build_replay(ds, rows, steps, params):
    """The build steps' own rules, sample by sample, with the device steps' drawn parameters."""
    out = []
    for j, i in enumerate(rows):
        s = ds[int(i)]
        sample = Sample(ds.key(int(i)), {f: s[f] for f in ("image", *NOTES)},
                        {"image": "image", **{f: f for f in NOTES}})
        for step, p in zip(steps, params):
            one = {k: (bool(v[j]) if v.dtype == bool else int(v[j])) for k, v in p.items()}
            sample = step.step.replay(sample, one)
        out.append(sample)
    return out


FLIP_CROP = [{"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}},
             {"random_crop": {"size": [20, 24], "padding": 2, "min_visibility": 0.4}}]
#: issue 32.2: a step after a crop works on the crop's grid (the flip mirrored about the stored 32x32 grid, the
#: second crop drew windows of the first one's input and raised IndexError)
CROP_FLIP = [{"random_crop": {"size": [20, 26], "min_visibility": 0.4}},
             {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}}]
CROP_CROP = [{"random_crop": {"size": [26, 28]}}, {"random_crop": {"size": [16, 20], "padding": 2}}]


@pytest.mark.parametrize("gpu_steps", [FLIP_CROP, CROP_FLIP, CROP_CROP], ids=["flip-crop", "crop-flip", "crop-crop"])
@pytest.mark.parametrize("threads", [0, 2])
def test_device_steps_move_annotations_like_the_build_on_cpu_and_ring(det_build, threads, gpu_steps, monkeypatch):
    ds = precompile.open(det_build)
    kw = dict(batch_size=4, shuffle=True, seed=5, device="cpu", gpu_steps=gpu_steps, num_threads=threads)
    loader = Loader(det_build, **kw)
    got = list(loader)
    monkeypatch.setattr(feed, "GROUP_BYTES", 3 * 4 * (32 * 32 * 3 + 8))   # tasks of 3 batches, split + trimmed
    ringed = Loader(det_build, **kw)
    ringed.feeder = ringed.make_feeder(make_ring=FakeRing)
    dropped = 0
    for b, (batch, other) in enumerate(zip(got, list(ringed))):
        rows = loader.batch_indices(0)[b]
        params = gpu.step_params(loader.steps, loader.seed, 0, 0, b, len(rows))
        want = _build_replay(ds, rows, loader.steps, params)
        for name in NOTES:
            assert torch.equal(batch[count_name(name)], other[count_name(name)])
            assert torch.equal(batch[name].nan_to_num(-7), other[name].nan_to_num(-7)), f"ring != cpu: {name}"
            for j, r in enumerate(_padded_rows(batch, name)):
                np.testing.assert_array_equal(r, want[j].fields[name], err_msg=f"batch {b} sample {j} {name}")
        np.testing.assert_array_equal(batch["image"].numpy(), np.stack([w.fields["image"] for w in want]))
        dropped += sum(len(ds[int(i)]["boxes"]) for i in rows) - int(batch[count_name("boxes")].sum())
    assert dropped > 0


def test_device_steps_refuse_annotations_without_a_grid(det_build):
    with pytest.raises(ValueError, match="random_flip: boxes and keypoints move on the grid of the image fields"):
        Loader(det_build, batch_size=4, device="cpu",
               gpu_steps=[{"random_flip": {"fields": ["boxes"], "flip_pairs": []}}])
    with pytest.raises(ValueError, match="random_flip: keypoints field 'keypoints': a mirror swaps left and right"):
        Loader(det_build, batch_size=4, device="cpu", gpu_steps=[{"random_flip": {}}])


# -- preview and stats ------------------------------------------------------------------------------
def test_stats_count_boxes_per_class(det_build):
    from precompile.tools.stats import box_counts, compute_stats, describe

    ds = precompile.open(det_build)
    res = compute_stats(det_build, fields=["box_labels", "boxes"])
    every = np.concatenate([ds[i]["box_labels"] for i in range(len(ds))])
    want = {str(v): int(c) for v, c in zip(*np.unique(every, return_counts=True))}
    assert box_counts(res) == {"box_labels": want}
    b = res["fields"]["boxes"]   # x1, y1, x2, y2 as 4 channels
    allb = np.concatenate([ds[i]["boxes"] for i in range(len(ds))])
    assert b["channels"] == 4 and b["count"] == [len(allb)] * 4
    np.testing.assert_allclose(b["mean"], allb.astype(np.float64).mean(0), rtol=1e-9)
    assert "classes " in describe(res)


def test_draw_annotations_outlines_boxes_in_their_class_colour_and_dots_keypoints():
    from precompile.tools.preview import PALETTE, draw_annotations

    rgb = np.zeros((16, 16, 3), np.uint8)
    boxes = np.array([[2, 3, 10, 12]], np.float32)
    kp = np.array([[[5.5, 8.5, 2], [12.5, 2.5, 0]]], np.float32)
    pic = draw_annotations(rgb, boxes, np.array([4]), ["a", "b", "c", "d", "cat"], kp, min_side=160)
    s = 10   # 16 px -> 160
    colour = PALETTE[1 + 4 % (len(PALETTE) - 1)]
    assert tuple(pic[3 * s + 20, 2 * s]) == colour and tuple(pic[12 * s - 1, 5 * s]) == colour   # left, bottom edge
    assert tuple(pic[3 * s, 6 * s]) == colour and tuple(pic[7 * s, 10 * s - 1]) == colour        # top, right edge
    assert tuple(pic[int(8.5 * s), int(5.5 * s)]) == colour                                       # a visible keypoint
    assert not pic[int(2.5 * s) - 4:int(2.5 * s) + 4, int(12.5 * s) - 4:int(12.5 * s) + 4].any()   # visibility 0: none
    assert not pic[:, 11 * s:].any() or not pic[13 * s:, :].any()                                 # nothing outside
    plain = draw_annotations(rgb, boxes, None, [], None, min_side=160)
    inside = (slice(3 * s + 2, 3 * s + 16), slice(2 * s + 2, 2 * s + 40))
    assert pic[inside].any() and not plain[inside].any()    # the class name is written inside the box's corner


def test_preview_draws_the_boxes_panel(det_build):
    from precompile.tools.preview import render

    p = render(det_build, n=3)
    fields = [b["field"] for b in p.panels]
    assert "boxes" in fields and "box_labels" not in fields and "keypoints" not in fields
    again = render(det_build, n=3, fields=["boxes"])
    assert {b["field"] for b in again.panels} == {"boxes"}
    assert np.array_equal(render(det_build, n=3).sheet, p.sheet)   # deterministic


# -- instance masks and chained device steps (issue 32) ----------------------------------------------------
from annotated_decoder import _Instances  # noqa: E402,F401  (registers the decoder with the tied instance mask)

PAIRS = [[0, 1]]
COLOURS = np.array([((60 + 41 * i) % 256, (250 - 23 * i) % 256, (90 + 13 * i) % 256) for i in range(12)], np.uint8)
assert len({tuple(c) for c in COLOURS}) == 12 and COLOURS.min() > 0


def make_instance_inputs(root: str, n: int = 9, H: int = 64, W: int = 96) -> None:
    """n 64x96 images, up to 12 rectangles each in a 3x4 grid of cells, object i painted in COLOURS[i] with
    id i + 1 in the instance mask and label i (so a label names its object's colour); keypoints at the
    centres of its top-left, top-right and middle pixels; a 3x3 crowd patch (the ignore id) in an empty cell."""
    rng = np.random.default_rng(11)
    os.makedirs(os.path.join(root, "a"), exist_ok=True)
    ch, cw = H // 3, W // 4
    for k in range(n):
        image = np.zeros((H, W, 3), np.uint8)
        inst = np.zeros((H, W, 1), np.uint16)
        boxes, kps, empty = [], [], []
        for cy in range(3):
            for cx in range(4):
                if rng.random() < 0.3:
                    empty.append((cy * ch + 2, cx * cw + 2))
                    continue
                h, w = int(rng.integers(4, ch - 2)), int(rng.integers(4, cw - 2))
                y1, x1 = cy * ch + int(rng.integers(0, ch - h + 1)), cx * cw + int(rng.integers(0, cw - w + 1))
                i = len(boxes)
                image[y1:y1 + h, x1:x1 + w], inst[y1:y1 + h, x1:x1 + w] = COLOURS[i], i + 1
                boxes.append([x1, y1, x1 + w, y1 + h])
                kps.append([[x1 + 0.5, y1 + 0.5, 2], [x1 + w - 0.5, y1 + 0.5, 2], [x1 + w // 2 + 0.5, y1 + h // 2 + 0.5, 1]])
        for y, x in empty[:1]:
            inst[y:y + 3, x:x + 3] = 65535
        np.savez(os.path.join(root, "a", f"s{k}.npz"), image=image, instances=inst,
                 boxes=np.asarray(boxes, np.float32).reshape(-1, 4), box_labels=np.arange(len(boxes), dtype=np.int64),
                 keypoints=np.asarray(kps, np.float32).reshape(-1, 3, 3))


@pytest.fixture(scope="module")
def inst_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inst")
    make_instance_inputs(str(tmp / "in"))
    r = {"name": "inst", "seed": 1, "inputs": {"root": str(tmp / "in"), "match": "{label}/{name}.npz",
                                               "fields": {"image": {"decoder": "_instances_test"}}},
         "steps": [{"resize": {"size": [64, 96]}}],   # the same size: a fixed shape for the Loader
         "output": {"format": "hdf5", "samples_per_shard": 4}}
    return run_build(r, out_dir=str(tmp / "out"))["output"]


INST = ("image", "instances", "boxes", "box_labels", "keypoints")


def _replay_with_instances(ds, rows, steps, params):
    """The build steps replayed sample by sample with the device steps' drawn parameters (the reference)."""
    out = []
    for j, i in enumerate(rows):
        s = ds[int(i)]
        sample = Sample(ds.key(int(i)), {f: s[f] for f in INST},
                        {"image": "image", "instances": "mask", "boxes": "boxes", "box_labels": "box_labels",
                         "keypoints": "keypoints"}, links={"instances": "boxes"})
        for step, p in zip(steps, params):
            sample = step.step.replay(sample, {k: (bool(v[j]) if v.dtype == bool else int(v[j])) for k, v in p.items()})
        out.append(sample)
    return out


def _check_painted(image, inst, boxes, labels, kps, msg):
    """The painted truth: mask == r + 1 is the pixels of box r's object's colour, box r their extent, and a
    keypoint in view sits on a pixel of that colour."""
    H, W = image.shape[:2]
    assert set(np.unique(inst[inst != 65535]).tolist()) <= set(range(len(boxes) + 1)), msg
    for r, L in enumerate(labels):
        painted = (image == COLOURS[L]).all(-1)
        np.testing.assert_array_equal(inst[..., 0] == r + 1, painted, err_msg=f"{msg}: box {r} object {L}")
        ys, xs = np.nonzero(painted)
        np.testing.assert_array_equal(boxes[r], [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], err_msg=msg)
        for x, y, v in kps[r]:
            assert (v == 0) == (not (0 <= x <= W and 0 <= y <= H)), f"{msg}: keypoint ({x}, {y}) v {v}"
            if v:
                assert painted[int(y), int(x)], f"{msg}: keypoint ({x}, {y}) off object {L}"


CHAINS = {"crop-flip": [{"random_crop": {"size": [40, 56]}},
                        {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}}],
          "crop-crop": [{"random_crop": {"size": [48, 80], "min_visibility": 0.5}},
                        {"random_crop": {"size": [40, 56], "padding": 2}}],
          "flip-crop-flip": [{"random_flip": {"horizontal": 0.5, "flip_pairs": PAIRS}}, {"random_crop": {"size": [30, 70]}},
                             {"random_flip": {"vertical": 0.5, "horizontal": 0.5, "flip_pairs": PAIRS}}]}


@pytest.mark.parametrize("gpu_steps", list(CHAINS.values()), ids=list(CHAINS))
def test_loader_device_chains_move_annotations_on_the_grid_before_them(inst_build, gpu_steps):
    """Issue 32.2 as a user meets it: a Loader over 64x96 images with a crop then a flip mirrors boxes and
    keypoints about the 40x56 crop (not 96x64); two crops run (no IndexError); the instance mask tied in the
    build's index follows the boxes the crops drop. Against the build steps replayed and the painted pixels."""
    ds = precompile.open(inst_build)
    assert ds.field_specs["instances"]["of"] == "boxes"
    loader = Loader(inst_build, batch_size=4, shuffle=True, seed=3, device="cpu", gpu_steps=gpu_steps, num_threads=0)
    dropped = 0
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for b, batch in enumerate(loader):
            rows = loader.batch_indices(epoch)[b]
            params = gpu.step_params(loader.steps, loader.seed, epoch, 0, b, len(rows))
            want = _replay_with_instances(ds, rows, loader.steps, params)
            for j, w in enumerate(want):
                msg = f"epoch {epoch} batch {b} sample {j}"
                got = {f: batch[f][j].numpy() for f in ("image", "instances")}
                for f in ("boxes", "box_labels", "keypoints"):
                    got[f] = batch[f][j].numpy()[:int(batch[count_name(f)][j])]
                for f in INST:
                    np.testing.assert_array_equal(got[f], w.fields[f], err_msg=f"{msg}: {f} != build")
                _check_painted(got["image"], got["instances"], got["boxes"], got["box_labels"], got["keypoints"], msg)
            dropped += sum(len(ds[int(i)]["boxes"]) for i in rows) - int(batch[count_name("boxes")].sum())
    assert dropped > 0


def _coco_example(root) -> str:
    """Issue 32.1's example as a COCO file: a 60x80 PNG with rectangles (0,0,12,12), (30,20,50,40),
    (60,40,76,56) (x1, y1, x2, y2) painted in their own colours; polygons that cover exactly those pixels."""
    from PIL import Image

    fields, colours = _rectangles_example()
    (root / "img").mkdir()
    Image.fromarray(fields["image"]).save(root / "img" / "a.png")
    anns = [{"id": i + 1, "image_id": 7, "category_id": 1, "iscrowd": 0, "area": (x2 - x1) * (y2 - y1),
             "bbox": [x1, y1, x2 - x1, y2 - y1], "segmentation": [[x1, y1, x2, y1, x2, y2, x1, y2]]}
            for i, (x1, y1, x2, y2) in enumerate(RECTS)]
    (root / "a.json").write_text(__import__("json").dumps({
        "images": [{"id": 7, "file_name": "a.png", "height": 60, "width": 80}], "annotations": anns,
        "categories": [{"id": 1, "name": "thing"}]}))
    return colours


RECTS = ((0, 0, 12, 12), (30, 20, 50, 40), (60, 40, 76, 56))


def _rectangles_example():
    colours = np.array([(200, 30, 30), (30, 200, 30), (30, 30, 200)], np.uint8)
    image = np.zeros((60, 80, 3), np.uint8)
    for c, (x1, y1, x2, y2) in zip(colours, RECTS):
        image[y1:y2, x1:x2] = c
    return {"image": image}, colours


@pytest.mark.parametrize("isolate", [False, True], ids=["inline", "isolated-decode"])
def test_coco_instance_mask_follows_the_boxes_center_crop_drops(tmp_path, isolate):
    """Issue 32.1 through a real COCO build: center_crop 40x40 keeps only the middle box, which becomes box 0:
    its pixels (its painted colour) carry id 1. The tie is in the index (``of``), so the Loader's device crop
    renumbers the stored mask the same way the build step does."""
    pytest.importorskip("pycocotools", reason="pycocotools (the coco extra) is not installed")
    colours = _coco_example(tmp_path)
    r = {"name": "c", "seed": 2, "inputs": {"root": str(tmp_path / "img"),
                                            "coco": {"file": str(tmp_path / "a.json"), "mask": "instance"}},
         "steps": [{"center_crop": {"size": [40, 40]}}], "output": {"format": "hdf5"}}
    if isolate:
        r["timeout_s"] = 60   # decoded in a helper process: the tie must survive that path too
    ds = precompile.open(run_build(r, out_dir=str(tmp_path / "out"))["output"])
    s = ds[0]
    np.testing.assert_array_equal(s["boxes"], [[10, 10, 30, 30]])
    m = s["mask"][..., 0]
    np.testing.assert_array_equal(m == 1, (s["image"] == colours[1]).all(-1))
    assert set(np.unique(m).tolist()) == {0, 1}
    assert ds.field_specs["mask"]["of"] == "boxes"
    if isolate:
        return
    # the Loader: random_crops that drop boxes of the uncropped build, against the build step's replay
    r2 = {**r, "name": "u", "steps": [{"resize": {"size": [60, 80]}}]}   # the same size: a fixed shape
    plain = run_build(r2, out_dir=str(tmp_path / "out2"))["output"]
    steps = [{"random_crop": {"size": [30, 36], "padding": 8}}]
    loader = Loader(plain, batch_size=1, seed=4, device="cpu", gpu_steps=steps, fields=["image", "mask", "boxes",
                                                                                          "box_labels"])
    ds2, seen = precompile.open(plain), set()
    for epoch in range(12):
        loader.set_epoch(epoch)
        (batch,) = list(loader)
        (p,) = gpu.step_params(loader.steps, loader.seed, epoch, 0, 0, 1)
        one = {k: int(v[0]) for k, v in p.items()}
        t = ds2[0]
        want = loader.steps[0].step.replay(
            Sample("k", {f: t[f] for f in ("image", "mask", "boxes", "box_labels")},
                   {"image": "image", "mask": "mask", "boxes": "boxes", "box_labels": "box_labels"},
                   links={"mask": "boxes"}), one)
        n = int(batch[count_name("boxes")][0])
        boxes, mask, image = batch["boxes"][0, :n].numpy(), batch["mask"][0, ..., 0].numpy(), batch["image"][0].numpy()
        np.testing.assert_array_equal(boxes, want.fields["boxes"])
        np.testing.assert_array_equal(batch["mask"][0].numpy(), want.fields["mask"], err_msg=f"epoch {epoch}")
        assert set(np.unique(mask).tolist()) <= set(range(n + 1)), f"epoch {epoch}: ids {np.unique(mask)}"
        for row in range(n):   # mask == row + 1 is one painted object's pixels, and box row is their extent
            painted = [(image == c).all(-1) for c in colours]
            (k,) = [k for k, pm in enumerate(painted) if np.array_equal(pm, mask == row + 1)]
            ys, xs = np.nonzero(painted[k])
            np.testing.assert_array_equal(boxes[row], [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
        seen.add(n)
    assert len(seen) > 1   # some draws dropped boxes


def test_loader_ties_the_mask_of_a_coco_instance_build_made_before_the_tie(tmp_path):
    """An inputs.coco build with mask: instance from before its mask declared ``of: boxes`` in the index: the
    Loader knows the mask is the boxes' instance mask from the build's coco attributes, and renumbers it."""
    pytest.importorskip("pycocotools", reason="pycocotools (the coco extra) is not installed")
    import h5py

    from precompile.formats import names as fmt

    _coco_example(tmp_path)
    r = {"name": "old", "seed": 2, "inputs": {"root": str(tmp_path / "img"),
                                              "coco": {"file": str(tmp_path / "a.json"), "mask": "instance"}},
         "steps": [{"resize": {"size": [60, 80]}}], "output": {"format": "hdf5"}}
    index = run_build(r, out_dir=str(tmp_path / "out"))["output"]
    with h5py.File(index, "r+") as f:   # as written before issue 32
        specs = fmt.loads(f.attrs[fmt.A_FIELDS])
        del specs["mask"]["of"]
        f.attrs[fmt.A_FIELDS] = fmt.dumps(specs)
        del f.attrs[fmt.A_INDEX_CRC]   # and without the index's own checksums, which came later
    assert "of" not in precompile.open(index).field_specs["mask"]
    steps = [{"random_crop": {"size": [40, 40]}}]
    loader = Loader(index, batch_size=1, seed=0, device="cpu", gpu_steps=steps)
    renumbered = 0
    for epoch in range(10):
        loader.set_epoch(epoch)
        (batch,) = list(loader)
        n = int(batch[count_name("boxes")][0])
        ids = set(np.unique(batch["mask"].numpy()).tolist()) - {0}
        assert ids <= set(range(1, n + 1)), (epoch, n, ids)
        renumbered += n < 3 and bool(ids)
    assert renumbered


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
@pytest.mark.parametrize("name", list(CHAINS))
def test_cuda_batches_equal_the_cpu_batches_for_chains_and_instance_masks(inst_build, name):
    """On CUDA (the ring, and the fields resident on the device) the chained device steps, the moved
    annotations and the renumbered uint16 instance masks are the CPU Loader's, byte for byte."""
    kw = dict(batch_size=4, shuffle=True, seed=3, gpu_steps=CHAINS[name])
    cpu = list(Loader(inst_build, device="cpu", num_threads=0, **kw))
    for extra in ({}, {"in_memory": "gpu"}):
        got = list(Loader(inst_build, device="cuda", **kw, **extra))
        assert len(got) == len(cpu)
        for b, (x, y) in enumerate(zip(cpu, got)):
            assert set(x) == set(y)
            for f in x:
                assert y[f].device.type == "cuda", f
                a, c = x[f], y[f].cpu()
                assert a.dtype == c.dtype and torch.equal(a.nan_to_num(-7) if a.is_floating_point() else a,
                                                          c.nan_to_num(-7) if c.is_floating_point() else c), \
                    f"{name} {extra} batch {b} field {f}"
    first = next(iter(Loader(inst_build, device="cuda", batch_size=4, shuffle=False, channels_first=True)))
    ref = next(iter(Loader(inst_build, device="cpu", batch_size=4, shuffle=False)))
    assert first["image"].dtype == torch.uint8 and torch.equal(first["image"].cpu(), ref["image"].permute(0, 3, 1, 2))


@needs_cuda
def test_renumber_masks_on_cuda_equals_cpu():
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.uint16, np.int32):
        m = rng.integers(0, 6, (5, 7, 9, 1)).astype(dtype)
        top = np.iinfo(dtype).max
        m[0, 0, 0] = m[1, 0, 0] = top   # the ignore id stays, in a renumbered sample too
        rows = np.array([1, 3])
        ids = np.array([[0, 1, 0, 2, 3, 0], [0, 0, 0, 1, 4, 5]], np.int64)
        a = gpu.renumber_masks(torch.from_numpy(m), rows, ids)
        b = gpu.renumber_masks(torch.from_numpy(m).cuda(), rows, ids)
        assert b.dtype == a.dtype and torch.equal(a, b.cpu()), dtype
        for j in range(5):
            want = np.where(m[j] == top, top, ids[list(rows).index(j)][np.minimum(m[j], 5)]) if j in rows else m[j]
            np.testing.assert_array_equal(a[j].numpy(), want)


def test_declared_instance_tie_survives_isolated_decoding(tmp_path):
    """A decoder's declared tie (instances -> boxes) reaches the steps when the input is decoded in a helper
    process (``timeout_s``): a center crop that drops boxes renumbers the mask there as inline. Before, the
    helper's reply carried kinds only and the mask kept its old ids."""
    make_instance_inputs(str(tmp_path / "in"), n=4)
    r = {"name": "iso", "seed": 1, "timeout_s": 60,
         "inputs": {"root": str(tmp_path / "in"), "match": "{label}/{name}.npz",
                    "fields": {"image": {"decoder": "_instances_test"}}},
         "steps": [{"center_crop": {"size": [40, 40]}}], "output": {"format": "hdf5"}}
    ds = precompile.open(run_build(r, out_dir=str(tmp_path / "out"))["output"])
    assert ds.field_specs["instances"]["of"] == "boxes"
    dropped = 0
    for i in range(len(ds)):
        s = ds[i]
        dropped += 3 - len(s["boxes"])
        _check_painted(s["image"], s["instances"], s["boxes"], s["box_labels"], s["keypoints"], f"sample {i}")
    assert dropped > 0   # the crop did drop boxes, so ids had to move


def test_spilled_samples_keep_their_ties(tmp_path):
    """A sample spilled to disk (streamed clips) comes back with its links, so later steps still renumber a
    tied mask."""
    from precompile.spill import SampleSpill

    s = Sample("k", {"image": np.zeros((4, 4, 3), np.uint8), "inst": np.zeros((4, 4, 1), np.uint16),
                     "boxes": np.zeros((0, 4), np.float32)},
               {"image": "image", "inst": "mask", "boxes": "boxes"}, links={"inst": "boxes"})
    spill = SampleSpill(str(tmp_path), limit=0)
    spill.add(s)
    (back,) = list(spill)
    spill.close()
    assert back.links == {"inst": "boxes"}


def test_loader_refuses_a_damaged_ragged_table_of_the_index(inst_build, tmp_path):
    """The Loader's padded annotation rows come from the index's ``<field>/offsets`` and ``/shapes``: one
    flipped bit there is the index's FormatError (its recorded crc32), never rows of another sample."""
    import shutil

    import h5py

    from precompile.errors import FormatError

    out = tmp_path / "copy"
    shutil.copytree(os.path.dirname(inst_build), out)
    index = str(out / os.path.basename(inst_build))
    with h5py.File(index, "r+") as f:
        a = f["boxes/offsets"][()]
        a.reshape(-1).view(np.uint8)[8] ^= 1
        f["boxes/offsets"][...] = a
    with pytest.raises(FormatError, match=r"the index is damaged: .*boxes/offsets"):
        Loader(index, batch_size=2, device="cpu", fields=["image", "boxes"])
