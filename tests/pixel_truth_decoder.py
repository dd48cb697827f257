"""The test decoder of test_device_steps_outside: an .npz (no pickles) -> an image whose pixels carry its own
annotations (each box a solid rectangle of its own colour), an instance mask tied to the boxes, a semantic
mask (not tied), a flow field, boxes, labels and keypoints. A module of its own, importing only what a build
imports (a build's workers import the module that defines a decoder; the build path never imports torch)."""
from __future__ import annotations

import numpy as np

from precompile.decoders.base import Decoder
from precompile.registry import DECODERS
from precompile.sample import FieldSpec

K = 3


class _PixelTruth(Decoder):
    name = "_pixel_truth_test"
    kind = "image"

    def output_specs(self, field):
        return {field: FieldSpec("image", (None, None, 3), "uint8"),
                "instances": FieldSpec("mask", (None, None, 1), "uint16", of="boxes"),
                "semantic": FieldSpec("mask", (None, None, 1), "uint8"),
                "flow": FieldSpec("flow", (None, None, 2), "float32"),
                "boxes": FieldSpec("boxes", (None, 4), "float32"),
                "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

    def decode(self, path, field):
        with np.load(path, allow_pickle=False) as z:
            return {field: z["image"], **{f: z[f] for f in ("instances", "semantic", "flow", "boxes",
                                                             "box_labels", "keypoints")}}, {}


if _PixelTruth.name not in DECODERS:
    DECODERS.register()(_PixelTruth)


class _PixelTruthDeep(Decoder):
    """Test decoder: the same .npz -> its image as a 3-frame clip (frame t: the image + 40 t where painted), the
    image as uint16 (x 257) and as float32 (/ 255), with the instance mask, boxes, labels and keypoints."""

    name = "_pixel_truth_deep_test"
    kind = "image"

    def output_specs(self, field):
        return {field: FieldSpec("image", (None, None, 3), "uint16"),
                "imagef": FieldSpec("image", (None, None, 3), "float32"),
                "clip": FieldSpec("video", (3, None, None, 3), "uint8"),
                "instances": FieldSpec("mask", (None, None, 1), "uint16", of="boxes"),
                "boxes": FieldSpec("boxes", (None, 4), "float32"),
                "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

    def decode(self, path, field):
        with np.load(path, allow_pickle=False) as z:
            img = z["image"]
            painted = (img != 0).any(-1, keepdims=True)
            clip = np.stack([np.where(painted, np.clip(img.astype(np.int64) - 40 * t, 1, 255), 0) for t in range(3)])
            return {field: img.astype(np.uint16) * 257, "imagef": img.astype(np.float32) / 255,
                    "clip": clip.astype(np.uint8),
                    **{f: z[f] for f in ("instances", "boxes", "box_labels", "keypoints")}}, {}


if _PixelTruthDeep.name not in DECODERS:
    DECODERS.register()(_PixelTruthDeep)


class _PixelTruthFixed(_PixelTruth):
    """Test decoder: the same .npz with 20x30 grids declared (a fixed shape: a build with no step stores the
    annotations as the file holds them, unchecked, for the Loader's tests of bad stored rows)."""

    name = "_pixel_truth_fixed_test"

    def output_specs(self, field):
        return {field: FieldSpec("image", (20, 30, 3), "uint8"),
                "instances": FieldSpec("mask", (20, 30, 1), "uint16", of="boxes"),
                "boxes": FieldSpec("boxes", (None, 4), "float32"),
                "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

    def decode(self, path, field):
        fields, meta = super().decode(path, field)
        return {f: fields[f] for f in (field, "instances", "boxes", "box_labels", "keypoints")}, meta


if _PixelTruthFixed.name not in DECODERS:
    DECODERS.register()(_PixelTruthFixed)
