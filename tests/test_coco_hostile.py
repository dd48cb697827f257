"""Hostile COCO annotation files (issue 34): every annotation is checked before it reaches pycocotools or a
stored array, and a bad one fails only its own image (``on_error: skip`` drops that input and names the file,
the image and the annotation; ``fail`` stops the plan with the same words). RLE counts must sum to the image's
height x width, polygons must lie within a margin of the image, boxes and keypoints must be finite as stored
(float32), the JSON's nesting is bounded, and masks are drawn one at a time under the per-input budget
(``limits.input_bytes``). Truths: pycocotools' own ``COCO.annToMask`` and ``mask.encode``, the json module."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.errors import BuildError, RecipeError

pytest.importorskip("pycocotools", reason="pycocotools (the coco extra) is not installed")
from pycocotools import mask as cocomask  # noqa: E402
from pycocotools.coco import COCO  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H, W = 24, 32


def make_set(tmp: Path, bad_ann: dict, good_seg=None, size=(H, W), n_good: int = 2) -> tuple[Path, Path]:
    """Images a.png (the bad annotation's) and b.png, c.png, ... (a good square each), all ``size``."""
    from PIL import Image

    h, w = size
    root = tmp / "img"
    root.mkdir(exist_ok=True)
    names = ["a.png"] + [f"{chr(ord('b') + i)}.png" for i in range(n_good)]
    for n in names:
        Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(root / n)
    images = [{"id": i + 1, "file_name": n, "height": h, "width": w} for i, n in enumerate(names)]
    anns = [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "iscrowd": 0,
             "segmentation": [[1, 1, 5, 1, 5, 5, 1, 5]], **bad_ann}]
    for i in range(n_good):
        anns.append({"id": 20 + i, "image_id": i + 2, "category_id": 1, "bbox": [2, 2, 6, 6], "iscrowd": 0,
                     "segmentation": good_seg or [[2, 2, 8, 2, 8, 8, 2, 8]]})
    ann = tmp / "ann.json"
    ann.write_text(json.dumps({"images": images, "annotations": anns,
                               "categories": [{"id": 1, "name": "thing", "keypoints": ["p", "q"]}]}))
    return root, ann


def recipe(root: Path, ann: Path, on_error: str = "skip", **coco) -> dict:
    return {"name": "c", "inputs": {"root": str(root), "coco": {"file": str(ann), "mask": "semantic", **coco}},
            "on_error": on_error, "output": {"samples_per_shard": 8}}


def skipped_one(tmp: Path, r: dict) -> tuple:
    """Build ``r`` (on_error: skip): only a.png fails; its failure, and the build's samples by key."""
    rep = precompile.build(r, tmp / "out", n_jobs=1)
    ds = precompile.open(str(tmp / "out" / "c.h5"))
    keys = [ds.key(i) for i in range(len(ds))]
    assert "a.png" not in keys and len(keys) >= 1, keys
    (f,) = rep.failures
    assert f.key == "a.png" and f.path == str(tmp / "img" / "a.png") and f.stage == "annotations"
    return f, {ds.key(i): ds[i] for i in range(len(ds))}


def names_everything(message: str, ann: Path, aid: int = 7) -> None:
    assert str(ann) in message and f"annotation id {aid}" in message
    assert "image id 1" in message and "'a.png'" in message


# -- 34.1: RLE counts -------------------------------------------------------------------------------------

def _string_of(counts: list[int]) -> str:
    """COCO's compressed RLE text of ``counts``, written by pycocotools itself (its frPyObjects encodes)."""
    return cocomask.frPyObjects({"counts": counts, "size": [H, W]}, H, W)["counts"].decode("ascii")


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
@pytest.mark.parametrize("counts, why", [
    ([3], "RLE counts sum to 3, not its image's 24 x 32 = 768 pixels"),
    ([700, 100], "RLE counts sum to 800, not its image's 24 x 32 = 768 pixels"),
    ([2 ** 32, 5], "RLE counts must be whole numbers from 0 to 4294967295"),
    ([-1, 769], "RLE counts must be whole numbers from 0 to 4294967295"),
    ("!!!!", "RLE counts text is not COCO's compressed RLE (a character outside '0'..'o' at 0)"),
    ("0[", "RLE counts text is not COCO's compressed RLE (it ends inside a number)"),
    (None, "RLE counts sum to 100, not its image's 24 x 32 = 768 pixels"),   # a valid text of another size
])
def test_bad_rle_fails_only_its_image_naming_it(tmp_path, counts, why):
    if counts is None:
        counts = cocomask.frPyObjects({"counts": [50, 50], "size": [10, 10]}, 10, 10)["counts"].decode()
    root, ann = make_set(tmp_path, {"segmentation": {"size": [H, W], "counts": counts}, "iscrowd": 1},
                         good_seg={"size": [H, W], "counts": _string_of([100, 50, 618])})
    f, samples = skipped_one(tmp_path, recipe(root, ann, crowd="keep"))
    names_everything(f.message, ann)
    assert why in f.message and "annotations[0]" in f.message
    # the good images: the compressed RLE decoded as pycocotools' COCO API decodes it
    coco = COCO(str(ann))
    want = coco.annToMask(coco.anns[20])
    assert np.array_equal(samples["b.png"]["mask"][..., 0], want) and want.sum() == 50
    # on_error: fail stops the plan before anything is built, with the same words
    with pytest.raises(RecipeError) as e:
        precompile.build(recipe(root, ann, on_error="fail", crowd="keep"), tmp_path / "fail", n_jobs=1)
    assert e.value.source == str(ann) and e.value.loc == "annotations[0]" and why in e.value.detail
    assert not (tmp_path / "fail" / "c.h5").exists()


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
@pytest.mark.parametrize("seed", range(4))
def test_valid_rles_equal_pycocotools_in_both_forms(tmp_path, seed):
    """Random masks (empty, full, noise, blobs) encoded by pycocotools: compressed text and the plain counts
    made of it both decode to the mask itself and to COCO.annToMask, and builds give the same bytes at -j2."""
    rng = np.random.default_rng(seed)
    masks = [np.zeros((H, W), np.uint8), np.ones((H, W), np.uint8),
             (rng.random((H, W)) < 0.5).astype(np.uint8), np.zeros((H, W), np.uint8)]
    masks[3][rng.integers(0, H):, rng.integers(0, W):] = 1
    anns = []
    for i, m in enumerate(masks):
        rle = cocomask.encode(np.asfortranarray(m))
        text = rle["counts"].decode("ascii")
        flat = m.T.reshape(-1)                      # column-major, as COCO counts
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])
        plain = ([0] if flat[0] == 1 else []) + [int(v) for v in np.diff(bounds)]
        assert sum(plain) == H * W
        for j, seg in enumerate(({"size": [H, W], "counts": text}, {"size": [H, W], "counts": plain})):
            anns.append({"id": 10 * i + j + 1, "image_id": 2 * i + j + 1, "category_id": 1, "bbox": [0, 0, 1, 1],
                         "iscrowd": 1, "segmentation": seg})
    from PIL import Image

    (tmp_path / "img").mkdir()
    images = [{"id": k + 1, "file_name": f"{k:02d}.png", "height": H, "width": W} for k in range(2 * len(masks))]
    for im in images:
        Image.fromarray(np.zeros((H, W, 3), np.uint8)).save(tmp_path / "img" / im["file_name"])
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": images, "annotations": anns, "categories": [{"id": 1, "name": "t"}]}))
    r = recipe(tmp_path / "img", ann, on_error="fail", crowd="keep")
    precompile.build(r, tmp_path / "j1", n_jobs=1)
    precompile.build(r, tmp_path / "j2", n_jobs=2)
    ds = precompile.open(str(tmp_path / "j1" / "c.h5"))
    coco = COCO(str(ann))
    for k in range(len(ds)):
        i = k // 2
        assert np.array_equal(ds[k]["mask"][..., 0], masks[i]), k
        assert np.array_equal(ds[k]["mask"][..., 0], coco.annToMask(coco.imgToAnns[k + 1][0])), k
    other = precompile.open(str(tmp_path / "j2" / "c.h5"))
    assert [s["checksums"] for s in ds.shards] == [s["checksums"] for s in other.shards]


# -- 34.2: polygons far outside the image; many masks; the budget ----------------------------------------

def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precompile.cli", *args], capture_output=True, text=True,
                          timeout=240, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, **kw)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_polygon_far_outside_the_image_fails_its_image_not_the_build(tmp_path, jobs):
    """[[0, 0, 1e8, 0, 1e8, 1e8]] crashed the rasteriser (SIGSEGV at -j1); now it is refused at plan time as
    its image's error (the build runs in a subprocess so that a crash fails this test, not pytest)."""
    import yaml

    root, ann = make_set(tmp_path, {"segmentation": [[0, 0, 1e8, 0, 1e8, 1e8]]})
    rf = tmp_path / "r.yaml"
    rf.write_text(yaml.safe_dump(recipe(root, ann)))
    res = _cli("build", str(rf), "-o", str(tmp_path / "out"), "-j", jobs, "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "c.report.json").read_text())
    (f,) = report["failures"]
    assert f["key"] == "a.png" and f["stage"] == "annotations"
    names_everything(f["message"], ann)
    assert ("a polygon coordinate (1e+08, 0) is outside the image's margin: x must lie in [-32, 64] "
            "and y in [-24, 48]") in f["message"]
    assert report["num_samples"] == 2


def test_many_full_image_masks_are_drawn_one_at_a_time(tmp_path):
    """300 full-image polygons on one 1000x1000 image held 300 decoded masks at once (300 MB); now the
    peak stays near one image's worth (RSS growth of a fresh process)."""
    from PIL import Image

    n, side = 300, 1000
    (tmp_path / "img").mkdir()
    Image.fromarray(np.zeros((side, side), np.uint8)).save(tmp_path / "img" / "a.png")
    full = [0, 0, side, 0, side, side, 0, side]
    anns = [{"id": i + 1, "image_id": 1, "category_id": 1 + i % 3, "bbox": [0, 0, side, side], "iscrowd": 0,
             "segmentation": [full]} for i in range(n)]
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png", "height": side, "width": side}],
                               "annotations": anns, "categories": [{"id": c, "name": f"c{c}"} for c in (1, 2, 3)]}))
    r = recipe(tmp_path / "img", ann, on_error="fail")
    r["inputs"]["fields"] = {"image": {"decoder": "image", "mode": "gray8"}}
    script = ("import resource, json, sys, precompile, numpy\n"
              "from precompile.inputs import coco\nfrom precompile.compiler import shard\n"
              "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              f"rep = precompile.build(json.loads({json.dumps(json.dumps(r))}), {str(tmp_path / 'out')!r}, n_jobs=1)\n"
              "print('PEAK', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    peak = float(out.stdout.split("PEAK")[-1])
    print("peak RSS growth (MB):", peak)
    assert peak < 120, peak   # one image, one mask, the output (~ 5 MB) and the libraries' own; before: > 300
    ds = precompile.open(str(tmp_path / "out" / "c.h5"))
    # equal pixel counts: the later annotation is on top, so the last one (label 2 + 1) covers everything
    assert np.array_equal(ds[0]["mask"], np.full((side, side, 1), (n - 1) % 3 + 1, np.uint8))


def test_rasterising_is_held_to_the_input_budget(tmp_path):
    """A 2000x2000 JPEG decoded at 1/8 takes 0.9 MB, but its mask is drawn at full size (7.9 MiB at the peak):
    with limits.input_bytes at 4 MiB the image fails, naming the need, the budget and the image."""
    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.fromarray(np.zeros((2000, 2000, 3), np.uint8)).save(tmp_path / "img" / "a.jpg", quality=50)
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(tmp_path / "img" / "b.jpg", quality=50)
    poly = [[10, 10, 500, 10, 500, 500]]
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "a.jpg", "height": 2000, "width": 2000},
                   {"id": 2, "file_name": "b.jpg", "height": 20, "width": 20}],
        "annotations": [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [10, 10, 490, 490], "iscrowd": 0,
                         "segmentation": poly},
                        {"id": 8, "image_id": 2, "category_id": 1, "bbox": [1, 1, 4, 4], "iscrowd": 0,
                         "segmentation": [[1, 1, 5, 1, 5, 5]]}],
        "categories": [{"id": 1, "name": "t"}]}))
    r = recipe(tmp_path / "img", ann)
    r["inputs"]["fields"] = {"image": {"decoder": "image", "reduce": 8}}
    r["limits"] = {"input_bytes": 4 << 20}
    rep = precompile.build(r, tmp_path / "out", n_jobs=1)
    (f,) = rep.failures
    assert f.key == "a.jpg" and f.stage == "annotations"
    assert "image id 1 ('a.jpg'): drawing its mask of 2000x2000 pixels (1 object) needs" in f.message
    assert "over the per-input budget of 4194304 bytes (4.0 MiB) (limits.input_bytes)" in f.message
    assert rep.num_samples == 1


# -- 34.3: non-finite values as stored --------------------------------------------------------------------

@pytest.mark.parametrize("bad, why", [
    ({"bbox": [3e38, 0, 3e38, 5]}, "bbox [3e+38, 0, 3e+38, 5] is not finite as float32 (x1 y1 x2 y2 = "
                                   "3e+38 0 inf 5)"),
    ({"bbox": [1e39, 0, 1, 1]}, "bbox [1e+39, 0, 1, 1] is not finite as float32"),
    ({"keypoints": [float("nan"), 1, 2, float("inf"), 3, 2]}, "keypoints are not finite as float32 "
                                                                "(keypoint 0: nan 1 2)"),
    ({"keypoints": [1e39, 1, 2, 1, 1, 2]}, "keypoints are not finite as float32 (keypoint 0: inf 1 2)"),
    ({"segmentation": [[0, 0, 10 ** 400, 0, 5, 5]]}, "a polygon segmentation is a list of [x1, y1, x2, y2, ...] "
                                                     "lists of finite numbers"),
])
def test_values_that_are_not_finite_as_stored_are_refused(tmp_path, bad, why):
    root, ann = make_set(tmp_path, bad)
    f, samples = skipped_one(tmp_path, recipe(root, ann, keypoints=True))
    names_everything(f.message, ann)
    assert why in f.message
    for s in samples.values():
        assert np.isfinite(s["boxes"]).all() and np.isfinite(s["keypoints"]).all()


# -- 34.6: nesting -----------------------------------------------------------------------------------------

def test_json_nested_200000_deep_is_a_clear_error(tmp_path):
    root, ann = make_set(tmp_path, {})
    data = ann.read_text()
    ann.write_text(data[:-1] + ', "info": ' + "[" * 200000 + "]" * 200000 + "}")
    with pytest.raises(RecipeError) as e:
        precompile.build(recipe(root, ann), tmp_path / "out", n_jobs=1)
    assert e.value.source == str(ann)
    assert e.value.detail.startswith("not valid JSON: nested more deeply than the JSON reader allows")


# -- 34.5: every other malformed annotation fails its image only -------------------------------------------

@pytest.mark.parametrize("bad, why", [
    ({"bbox": [1, 2, -3, 4]}, "bbox [1, 2, -3, 4] has a negative width or height"),
    ({"bbox": "x" * 5000}, "needs an integer id, image_id, category_id and bbox [x, y, w, h] of 4 numbers"),
    ({"category_id": 99}, "category_id 99 is not in categories"),
    ({"iscrowd": 2}, "iscrowd must be 0 or 1, got 2"),
    ({"keypoints": [1, 2]}, "keypoints must be 6 numbers"),
    ({"segmentation": {"size": [10, 10], "counts": [100]}}, "RLE size [10, 10] is not its image's [height, width] "
                                                            "[24, 32]"),
    ({"segmentation": [["a", 1, 2, 3, 4, 5]]}, "a polygon segmentation is a list of"),
    ({"segmentation": 5}, "segmentation must be polygons or an RLE {counts, size}"),
])
def test_a_malformed_annotation_fails_only_its_image(tmp_path, bad, why):
    root, ann = make_set(tmp_path, bad)
    f, samples = skipped_one(tmp_path, recipe(root, ann, keypoints=True))
    names_everything(f.message, ann)
    assert why in f.message and len(f.message) < 1000   # echoed input is cut
    assert sorted(samples) == ["b.png", "c.png"] and samples["b.png"]["boxes"].tolist() == [[2, 2, 8, 8]]
    with pytest.raises(RecipeError) as e:
        precompile.build(recipe(root, ann, on_error="fail", keypoints=True), tmp_path / "fail", n_jobs=1)
    assert why in e.value.detail and e.value.loc == "annotations[0]"


def test_skipped_image_is_reported_again_by_a_no_change_rebuild_and_rebuilt_when_fixed(tmp_path):
    root, ann = make_set(tmp_path, {"bbox": [1, 2, -3, 4]})
    r = recipe(root, ann)
    rep = precompile.build(r, tmp_path / "out", n_jobs=1)
    assert len(rep.failures) == 1
    again = precompile.build(r, tmp_path / "out", n_jobs=1)
    assert again["shards"]["built"] == 0 and [f.key for f in again.failures] == ["a.png"]
    data = json.loads(ann.read_text())
    data["annotations"][0]["bbox"] = [1, 2, 3, 4]
    ann.write_text(json.dumps(data))
    fixed = precompile.build(r, tmp_path / "out", n_jobs=1)
    assert not fixed.failures and fixed.num_samples == 3


def test_isolated_decoding_reports_the_same_failure(tmp_path):
    root, ann = make_set(tmp_path, {"segmentation": {"size": [H, W], "counts": [3]}})
    r = recipe(root, ann)
    r["timeout_s"] = 60
    f, _ = skipped_one(tmp_path, r)
    assert "RLE counts sum to 3" in f.message


def test_a_build_with_every_image_bad_names_them(tmp_path):
    root, ann = make_set(tmp_path, {"bbox": [1, 2, -3, 4]}, n_good=0)
    with pytest.raises(BuildError, match="every input failed"):
        precompile.build(recipe(root, ann), tmp_path / "out", n_jobs=1)


# -- a generated corpus of malformed files -----------------------------------------------------------------

_ODD_VALUES = [None, True, -1, 0, 2 ** 40, 10 ** 400, -1e300, 3e38, 1e39, float("nan"), float("inf"), "", "x" * 300,
               "../x", "/etc/passwd", [], [1], [[1, 2]], {}, {"counts": "0[", "size": [H, W]},
               {"counts": [H * W], "size": [H, W]}, [[0, 0, 1e9, 0, 1e9, 1e9]], [0.5] * 7, [[1, 2, 3]]]


def _mutations(seed: int, n: int) -> list[tuple[str, int, str, object]]:
    """``n`` random (section, index, key, value) edits of the set make_set writes."""
    rng = np.random.default_rng(seed)
    keys = {"images": ["id", "file_name", "height", "width"],
            "annotations": ["id", "image_id", "category_id", "bbox", "iscrowd", "segmentation", "keypoints"],
            "categories": ["id", "name", "keypoints"]}
    out = []
    for _ in range(n):
        section = str(rng.choice(list(keys)))
        out.append((section, int(rng.integers(0, 3)), str(rng.choice(keys[section])),
                    _ODD_VALUES[int(rng.integers(0, len(_ODD_VALUES)))]))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_generated_malformed_files_never_crash(tmp_path, seed):
    """Random fields of a small valid file replaced by hostile values (huge and non-finite numbers, wrong
    types, bad RLEs, far polygons, paths out of the root), one edit per build, both error policies: every
    build either stores finite annotations or stops with a RecipeError naming the file, or (skip) fails
    single images at stage annotations; never another exception, never a crash."""
    root, ann = make_set(tmp_path, {})
    good = json.loads(ann.read_text())
    for k, (section, index, key, value) in enumerate(_mutations(seed, 8)):
        data = json.loads(json.dumps(good))
        entries = data[section]
        if index < len(entries):
            entries[index][key] = value
        ann.write_text(json.dumps(data))
        for policy in ("skip", "fail"):
            out = tmp_path / f"o{k}{policy}"
            try:
                rep = precompile.build(recipe(root, ann, on_error=policy, keypoints=True, crowd="keep"), out,
                                       n_jobs=1)
            except RecipeError as e:
                assert e.source == str(ann) or e.loc.startswith("inputs"), (section, key, value, e)
                continue
            except BuildError as e:   # skip: every input failed; fail: an image failed while being read
                assert "stage annotations" in str(e) or "stage decode" in str(e), (section, key, value, e)
                continue
            assert all(f.stage in ("annotations", "decode") for f in rep.failures), (section, key, value)
            ds = precompile.open(str(out / "c.h5"))
            for i in range(len(ds)):
                s = ds[i]
                assert np.isfinite(s["boxes"]).all() and np.isfinite(s["keypoints"]).all()
                assert s["mask"].shape == s["image"].shape[:2] + (1,)
