"""Fixes that change stored bytes for the same recipe make the shards built before them stale
(issue 27): reduced JPEG geometry (the reduce rule's version), damaged video decoding
(``video``'s ``output_version``), and the meta/fields that ``temporal_jitter``, ``random_rot90``,
``random_flip3d``, ``crop_pad_volume`` and ``patches3d`` now carry along (theirs); and (issue 32) the 2D
steps that move keypoints (a point on the image's right or bottom edge stays in view) and the four that drop
boxes (a tied instance mask is renumbered).

Each test builds with the code's previous version number patched in (what an old build's
keys hold), then with the current one: every shard rebuilds; a third build rebuilds nothing.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import precompile
from precompile.decoders import jpeg_reduce as JR
from precompile.decoders.video import VideoDecoder
from precompile.recipe import load_recipe, output_versions
from precompile.registry import STEPS, load_builtins

from conftest import write_recipe

load_builtins()
REPO = Path(__file__).resolve().parent.parent


def three_builds(recipe, out, patch) -> list[int]:
    """Shards built by: a build with the old version patched in, one with the current, one more."""
    built = []
    with patch():
        built.append(precompile.build(recipe, out_dir=str(out))["shards"]["built"])
    built.append(precompile.build(recipe, out_dir=str(out))["shards"]["built"])
    built.append(precompile.build(recipe, out_dir=str(out))["shards"]["built"])
    return built


def test_reduce_geometry_fix_rebuilds_reduced_builds(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    for j in range(3):
        Image.fromarray(np.full((751, 1001, 3), 40 * j, np.uint8)).save(root / f"{j}.jpg")
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "r", "inputs": {"root": str(root), "match": "{n}.jpg", "fields": {"image": {"decoder": "image"}}},
        "steps": [{"resize": {"size": [64, 64]}}], "output": {"format": "hdf5", "samples_per_shard": 2}})
    assert three_builds(recipe, tmp_path / "o", lambda: _patched(monkeypatch, JR, "RULE_VERSION", 1)) == [2, 2, 0]


def test_video_decode_fix_rebuilds_video_builds(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    shutil.copy(REPO / "sample_data" / "video" / "tiny.avi", root / "t.avi")
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "v", "inputs": {"root": str(root), "match": "{n}.avi", "fields": {"video": {"decoder": "video"}}},
        "steps": [], "output": {"format": "hdf5"}})
    assert three_builds(recipe, tmp_path / "o", lambda: _patched(monkeypatch, VideoDecoder, "output_version", 1)) \
        == [1, 1, 0]


@pytest.mark.parametrize("name", ["temporal_jitter", "random_rot90", "random_flip3d", "crop_pad_volume", "patches3d",
                                  "resample_volume", "resize", "center_crop", "random_crop", "random_resized_crop",
                                  "random_flip", "random_affine"])
def test_fixed_steps_name_their_output_version_in_the_recipe_key(name):
    """The recipe key holds each changed step's version (so its shards rebuild, as above), and
    only theirs: a recipe without them keeps its key."""
    cls = STEPS.get(name)
    assert cls.output_version >= 2
    assert output_versions({}, [cls.__new__(cls)]) == {"steps[0]": cls.output_version}
    assert output_versions({"image": object()}, [STEPS.get("color_jitter").__new__(STEPS.get("color_jitter"))]) == {}


def test_recipe_hash_moves_with_a_step_version(tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "v", "inputs": {"root": ".", "match": "{n}.avi", "fields": {"video": {"decoder": "video"}}},
        "steps": [{"temporal_jitter": {"length": 2}}]})
    now = load_recipe(recipe).content_hash()
    monkeypatch.setattr(STEPS.get("temporal_jitter"), "output_version", 1)
    assert load_recipe(recipe).content_hash() != now


class _patched:
    """A context that sets ``obj.attr = value`` and restores it."""

    def __init__(self, monkeypatch, obj, attr, value):
        self.mp, self.obj, self.attr, self.value = monkeypatch, obj, attr, value

    def __enter__(self):
        self.mp.setattr(self.obj, self.attr, self.value)

    def __exit__(self, *exc):
        self.mp.undo()
