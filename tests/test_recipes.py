"""Every example recipe in ``recipes/`` builds, opens and verifies, and makes what the README says it makes.

A generic loop builds each ``recipes/*.yaml`` (``-j1``, into its own folder under a temporary
directory), opens every index it wrote, reads every sample and runs ``verify``. Recipes with an
entry in ``FACTS`` also get their facts checked against an independent reference where one exists
(PyAV + OpenCV for the clips, soundfile + soxr for the audio windows, Pillow for native sizes,
numpy for the flow validity): the README's table of example recipes and ``docs/`` state these
numbers, so a recipe or a step that changes them fails here. A recipe added later without an entry
is still built, opened and verified.
"""
from __future__ import annotations

import glob
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml

import precompile
from precompile.errors import MissingDependencyError
from precompile.tools.verify import verify

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def input_root(recipe: Path) -> Path:
    """The recipe's ``inputs.root``, resolved as the build resolves it (relative to the recipe file)."""
    doc = yaml.safe_load(recipe.read_text())
    return (recipe.parent / doc["inputs"]["root"]).resolve()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[str], list[str]]:
    """``built(name)`` builds ``recipes/<name>.yaml`` once per module and returns the index files it wrote."""
    cache: dict[str, list[str]] = {}

    def get(name: str) -> list[str]:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            try:
                report = precompile.build(REPO / "recipes" / f"{name}.yaml", out_dir=out, n_jobs=1)
            except MissingDependencyError as e:   # an optional extra (e.g. pycocotools) is not installed
                pytest.skip(f"recipes/{name}.yaml needs an optional dependency: {e}")
            assert report["status"] == "ok", report["failures"]
            # only a recipe that says on_error: skip may lose inputs, and each must be a missing file it expects
            expected = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text()).get("on_error") == "skip"
            assert not report["failures"] or (expected and all("input file is missing" in f["detail"]
                                                                for f in report["failures"])), report["failures"]
            cache[name] = sorted(p for p in glob.glob(str(out / "*"))
                                 if p.endswith((".h5", ".json")) and not p.endswith(".report.json"))
        return cache[name]

    return get


def only(paths: list[str]) -> Any:
    assert len(paths) == 1, paths
    return precompile.open(paths[0])


def per_key(ds: Any) -> Counter:
    return Counter(ds.key(i).split("#")[0] for i in range(len(ds)))


# -- the facts the README and docs/ state, per recipe -----------------------------------------------

def images_facts(ds: Any, root: Path) -> None:
    """36 scenes in 3 class folders -> (64, 64, 3) uint8 + an int64 label from the folder name."""
    assert len(ds) == 36 and ds.label_names == ["beach", "forest", "night"]
    for i in range(len(ds)):
        s = ds[i]
        assert s["image"].shape == (64, 64, 3) and s["image"].dtype == np.uint8
        assert s["label"].dtype == np.int64 and ds.label_names[int(s["label"])] == ds.key(i).split("/")[0]
    assert Counter(ds.label_names[int(ds[i]["label"])] for i in range(len(ds))) == {
        "beach": 12, "forest": 12, "night": 12}


def check_images(built, root):
    images_facts(only(built("images")), root)


def check_file_formats(built, root):
    """images_png / images_bmp: images.yaml as one lossless file per sample: the same pixels and labels."""
    ref = only(built("images"))
    for name, ext in (("images_png", "png"), ("images_bmp", "bmp")):
        (index,) = built(name)
        assert index.endswith(f"{name}.json")
        ds = precompile.open(index)
        images_facts(ds, root)
        files = glob.glob(os.path.join(os.path.dirname(index), f"{name}.shards", "*", f"*.{ext}"))
        assert len(files) == 36
        for i in range(len(ds)):
            assert ds.key(i) == ref.key(i)
            np.testing.assert_array_equal(ds[i]["image"], ref[i]["image"])
            assert ds[i]["label"] == ref[i]["label"]


def check_images_augmented(built, root):
    """4 seeded copies per image plus the original (copy 0): 180 samples, each copy's draws in its meta."""
    ds = only(built("images_augmented"))
    assert len(ds) == 36 * 5
    copies: dict[str, set] = {}
    for i in range(len(ds)):
        copies.setdefault(ds.key(i), set()).add(ds.copy(i))
        assert ds[i]["image"].shape == (64, 64, 3)
        steps = [a["step"] for a in ds.meta(i)["augment"]]
        assert steps == ["random_resized_crop", "random_flip", "random_affine", "color_jitter"]
    assert len(copies) == 36 and all(c == {0, 1, 2, 3, 4} for c in copies.values())


def check_images_native(built, root):
    """No resize: every image at its file's own size (Pillow, EXIF applied), stored variable-shape."""
    from PIL import Image, ImageOps

    ds = only(built("images_native"))
    assert tuple(ds.field_specs["image"]["shape"]) == (None, None, 3)
    for i in range(len(ds)):
        with Image.open(root / ds.key(i)) as im:
            ref = ImageOps.exif_transpose(im)
            img = ds[i]["image"]
            assert img.shape == (ref.height, ref.width, 3), ds.key(i)
            if ref.mode == "RGB":                     # 8-bit RGB files: the very pixels
                np.testing.assert_array_equal(img, np.asarray(ref))
    assert len(ds) > 0 and len({ds.key(i) for i in range(len(ds))}) == len(ds)   # each file once, no copies
    assert len({ds[i]["image"].shape for i in range(len(ds))}) > 1                 # truly variable shapes


def check_video(built, root):
    """Clips of 8 frames, every 2nd frame, a clip every 8 frames, 32x32 RGB; short videos padded with the
    last frame; the frames field lists the source frames. Against PyAV frames resized by OpenCV (area)."""
    import av
    import cv2

    ds = only(built("video"))
    assert len(ds) == 7 and len(per_key(ds)) == 3
    for name, n_clips in per_key(ds).items():
        with av.open(str(root / name)) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        F = len(frames)
        span = (8 - 1) * 2 + 1
        expect = 1 if F < span else (F - span) // 8 + 1
        assert n_clips == expect, (name, F)
        for k in range(n_clips):
            i = next(j for j in range(len(ds)) if ds.key(j) == f"{name}#clip{k}")
            s = ds[i]
            want = [min(8 * k + 2 * j, F - 1) for j in range(8)]
            assert s["frames"].dtype == np.int32 and s["frames"].tolist() == want
            assert s["video"].shape == (8, 32, 32, 3) and s["video"].dtype == np.uint8
            ref = np.stack([cv2.resize(frames[j], (32, 32), interpolation=cv2.INTER_AREA) for j in want])
            np.testing.assert_array_equal(s["video"], ref)


def check_audio(built, root):
    """Mono 16 kHz float32, 0.5 s windows (8,000 samples) every 0.25 s (4,000); a recording shorter than
    one window and the tail after the last full window are zero-padded. Against soundfile + soxr."""
    import soundfile as sf
    import soxr

    ds = only(built("audio"))
    assert len(ds) == 13 and len(per_key(ds)) == 4
    for name, count in per_key(ds).items():
        x, sr = sf.read(str(root / name), dtype="float32", always_2d=True)
        mono = x.mean(axis=1)
        y = mono if sr == 16000 else soxr.resample(mono, sr, 16000, quality="HQ")
        n = len(y)
        starts = list(range(0, max(n - 8000, 0) + 1, 4000)) if n >= 8000 else [0]
        if n > 8000 and starts[-1] + 8000 < n:
            starts.append(starts[-1] + 4000)            # tail: pad
        assert count == len(starts), name
        for w, start in enumerate(starts):
            i = next(j for j in range(len(ds)) if ds.key(j) == f"{name}#w{w}")
            assert ds.meta(i)["window"] == {"index": w, "length": 8000, "start": start}
            assert ds.meta(i)["audio"]["sample_rate"] == 16000
            a = ds[i]["audio"]
            assert a.shape == (1, 8000) and a.dtype == np.float32
            ref = np.zeros(8000, np.float32)
            seg = y[start:start + 8000]
            ref[:len(seg)] = seg
            np.testing.assert_allclose(a[0], ref, atol=1e-6)


def check_flow(built, root):
    """Frame pair + .flo flow with its validity, resized to 40x54 and cropped to 32x48 together."""
    ds = only(built("flow"))
    assert len(ds) == len(list(root.glob("*_img1.png")))
    for i in range(len(ds)):
        s = ds[i]
        assert s["img1"].shape == s["img2"].shape == (32, 48, 3)
        assert s["flow"].shape == (32, 48, 2) and s["flow"].dtype == np.float32
        assert s["flow_valid"].shape == (32, 48, 1) and s["flow_valid"].dtype == np.uint8
        np.testing.assert_array_equal(s["flow_valid"][..., 0], np.isfinite(s["flow"]).all(-1).astype(np.uint8))
    assert ds.field_specs["flow_valid"]["kind"] == "flow_valid"


def check_ct_lung(built, root):
    """Two series -> ~7.5 mm spacing -> lung mask -> masked (-1000 HU outside) -> lung window [0, 1] ->
    16x32x32 patches with their corners: 8 patches per series."""
    ds = only(built("ct_lung"))
    assert per_key(ds) == {"chest_a": 8, "chest_b": 8}
    outside = (-1000 - (-600 - 1500 / 2)) / 1500          # -1000 HU in the window L -600, W 1500
    for i in range(len(ds)):
        s, m = ds[i], ds.meta(i)
        assert s["ct"].shape == s["lung"].shape == (16, 32, 32)
        assert s["ct"].dtype == np.float32 and s["lung"].dtype == np.uint8
        assert 0 <= s["ct"].min() and s["ct"].max() <= 1
        assert set(np.unique(s["lung"])) <= {0, 1} and s["lung"].mean() >= 0.05
        np.testing.assert_allclose(s["ct"][s["lung"] == 0], outside, rtol=1e-6)
        assert s["corner"].dtype == np.int32 and s["corner"].tolist() == m["patch"]["corner"]
        assert m["patch"]["size"] == [16, 32, 32]
        np.testing.assert_allclose(m["lung"]["spacing"], 7.5, rtol=0.01)
        assert ds.field_specs["lung"]["kind"] == "volume_mask"


def check_coco(built, root):
    """resize to 96x128 from 64x48 images: every box is its JSON bbox [x, y, w, h] as x1 y1 x2 y2, times 2
    (the resize moves boxes with the pixels); labels name the JSON's categories; crowd boxes dropped."""
    import json

    doc = json.loads((root.parent / "annotations" / "instances.json").read_text())
    cats = {c["id"]: c["name"] for c in doc["categories"]}
    by_image: dict[int, list] = {}
    for a in doc["annotations"]:
        if not a.get("iscrowd"):
            by_image.setdefault(a["image_id"], []).append(a)
    ds = only(built("coco"))
    assert len(ds) == len(doc["images"]) and list(ds.label_names) == [cats[k] for k in sorted(cats)]
    for i in range(len(ds)):
        img = next(im for im in doc["images"] if im["file_name"] == ds.key(i))
        sx, sy = 128 / img["width"], 96 / img["height"]
        anns = by_image.get(img["id"], [])
        want = np.array([[x * sx, y * sy, (x + w) * sx, (y + h) * sy] for x, y, w, h in (a["bbox"] for a in anns)],
                        np.float32).reshape(-1, 4)
        s = ds[i]
        assert s["image"].shape == (96, 128, 3)
        np.testing.assert_allclose(s["boxes"], want, atol=1e-4)
        assert [ds.label_names[k] for k in s["box_labels"]] == [cats[a["category_id"]] for a in anns]


FACTS: dict[str, Callable[..., None]] = {
    "coco": check_coco,
    "images": check_images,
    "images_png": check_file_formats,
    "images_bmp": check_file_formats,
    "images_augmented": check_images_augmented,
    "images_native": check_images_native,
    "video": check_video,
    "audio": check_audio,
    "flow": check_flow,
    "ct_lung": check_ct_lung,
}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_builds_opens_and_verifies(recipe, built):
    """Any recipe, known or added later: it builds, every index it wrote opens, every sample reads in the
    dtypes its fields declare, and verify finds nothing wrong."""
    indexes = built(recipe.stem)
    assert indexes, f"{recipe.name} wrote no index"
    for index in indexes:
        ds = precompile.open(index)
        assert len(ds) > 0
        for i in range(len(ds)):
            for f, a in ds[i].items():
                spec = ds.field_specs[f]
                if isinstance(a, np.ndarray):
                    assert a.dtype == np.dtype(spec["dtype"]), (f, a.dtype, spec)
                    assert a.ndim == len(spec["shape"]), (f, a.shape, spec)
        res = verify(index)
        assert res.ok, res.problems


@pytest.mark.parametrize("name", sorted(FACTS))
def test_recipe_facts(name, built):
    """The numbers the README's table of example recipes (and docs/) state about each recipe."""
    if not (REPO / "recipes" / f"{name}.yaml").exists():
        pytest.skip(f"recipes/{name}.yaml is not in this checkout")
    FACTS[name](built, input_root(REPO / "recipes" / f"{name}.yaml"))
