"""The segmentation and native-size sample recipes build what their comments say.

- ``recipes/segmentation.yaml``: 8 scenes x (the original + 2 augmented copies) = 24 samples of a
  64x64 image and its 64x64 label map; the map holds only the declared ids {0, 1, 2, 7, 9}, stats
  lists exactly those five, and in every copy the map still sits on the image (each class keeps its
  colour: the crop and the flip moved both alike).
- ``recipes/images_native.yaml``: nine scenes at nine sizes, stored ragged, each sample back at its
  file's own size.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from precompile import build, open as open_output
from precompile.tools import stats as st

RECIPES = REPO / "recipes"
SEG_IDS = [0, 1, 2, 7, 9]


@pytest.fixture(scope="module")
def seg(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seg")
    build(str(RECIPES / "segmentation.yaml"), out_dir=str(out))
    return out / "segmentation.h5"


def test_segmentation_recipe_shapes_and_ids(seg):
    ds = open_output(str(seg))
    assert len(ds) == 24 and sorted(set(ds.keys)) == [f"scene_{i:02d}.jpg" for i in range(8)]
    assert sorted(int(ds.copy(i)) for i in range(len(ds))) == sorted([0, 1, 2] * 8)
    b = ds.batch(range(len(ds)))
    assert b["image"].shape == (24, 64, 64, 3) and b["mask"].shape == (24, 64, 64, 1)
    assert set(np.unique(b["mask"]).tolist()) <= set(SEG_IDS)
    assert ds.field_specs["mask"]["classes"] == 5 and ds.field_specs["mask"]["class_ids"] == SEG_IDS
    res = st.compute_stats(seg, fields=["mask"])
    assert [c["id"] for c in res["fields"]["mask"]["classes"]] == SEG_IDS
    assert sum(c["count"] for c in res["fields"]["mask"]["classes"]) == 24 * 64 * 64


def test_segmentation_masks_stay_on_their_images(seg):
    """Per class, the pixels the map gives it have that class's colour in every copy: sky and water
    blue over red, land green, the sun bright yellow (a map moved apart from its image fails this)."""
    ds = open_output(str(seg))
    for i in range(len(ds)):
        s = ds[i]
        img, lab = s["image"].astype(np.float64), s["mask"][..., 0]
        inner = np.zeros_like(lab, bool)   # away from class borders (JPEG and resize blur them)
        inner[1:-1, 1:-1] = True
        for d in ((0, 1), (1, 0)):
            inner &= lab == np.roll(lab, d, (0, 1))
            inner &= lab == np.roll(lab, (-d[0], -d[1]), (0, 1))
        mean = {c: img[(lab == c) & inner].mean(axis=0) for c in SEG_IDS if ((lab == c) & inner).sum() >= 4}
        assert 0 in mean or 1 in mean, i
        if 0 in mean:
            assert mean[0][2] > mean[0][0] + 40, (i, mean)                     # sky: blue
        if 1 in mean:
            assert mean[1][1] > mean[1][0] + 20 and mean[1][1] > mean[1][2], (i, mean)   # land: green
        if 2 in mean:
            assert mean[2][2] > mean[2][0] + 40 and mean[2][2] > mean[2][1], (i, mean)   # water: deep blue
        if 7 in mean:
            assert mean[7][0] > 180 and mean[7][1] > 160 and mean[7][2] < mean[7][0] - 60, (i, mean)   # sun


def test_segmentation_copies_differ_and_the_original_is_the_whole_scene(seg):
    ds = open_output(str(seg))
    src = REPO / "sample_data" / "segmentation"
    by_key: dict[str, dict[int, dict]] = {}
    for i in range(len(ds)):
        by_key.setdefault(ds.key(i), {})[int(ds.copy(i))] = ds[i]
    for key, copies in by_key.items():
        assert not np.array_equal(copies[1]["image"], copies[2]["image"]), key
        lab = np.asarray(Image.open(src / key.replace(".jpg", "_mask.png")))
        # copy 0 is the neutral crop: the largest centred window, resized by nearest for the map
        assert set(np.unique(copies[0]["mask"]).tolist()) <= set(np.unique(lab).tolist()), key


def test_images_native_is_variable_shape(tmp_path):
    build(str(RECIPES / "images_native.yaml"), out_dir=str(tmp_path))
    ds = open_output(str(tmp_path / "images_native.h5"))
    assert len(ds) == 9 and ds.variable("image")
    shapes = set()
    for i in range(len(ds)):
        a = ds[i]["image"]
        h, w = (int(x) for x in os.path.splitext(ds.key(i))[0].rsplit("_", 1)[1].split("x"))
        assert a.shape == (h, w, 3), ds.key(i)
        with Image.open(REPO / "sample_data" / "native" / ds.key(i)) as im:
            assert im.size == (w, h)
        shapes.add(a.shape)
    assert len(shapes) == 9
    assert ds.label_names == ["beach", "forest", "night"]
