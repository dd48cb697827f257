"""The test decoders of test_annotation_builds: an .npz (no pickles) -> an image and its boxes, labels and
keypoints. A module of its own, importing only what a build imports: a build's loky workers import the module
that defines a decoder to unpickle its tasks, and the build path never imports torch (the test module does, for
its Loader tests)."""
from __future__ import annotations

import numpy as np

from precompile.decoders.base import Decoder
from precompile.registry import DECODERS
from precompile.sample import FieldSpec

K = 3


class _Annotated(Decoder):
    """Test decoder: an .npz (no pickles) -> an image and its boxes, labels and keypoints."""

    name = "_annotations_test"
    kind = "image"

    def output_specs(self, field):
        return {field: FieldSpec("image", (None, None, 3), "uint8"),
                "boxes": FieldSpec("boxes", (None, 4), "float32"),
                "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

    def decode(self, path, field):
        with np.load(path, allow_pickle=False) as z:
            return {field: z["image"], "boxes": z["boxes"], "box_labels": z["box_labels"],
                    "keypoints": z["keypoints"]}, {}


if _Annotated.name not in DECODERS:
    DECODERS.register()(_Annotated)


class _Instances(Decoder):
    """Test decoder: an .npz -> an image, its boxes, labels and keypoints, and an instance mask tied to the
    boxes (``of``: ``instances == i + 1`` is box i, 65535 an ignored region)."""

    name = "_instances_test"
    kind = "image"

    def output_specs(self, field):
        return {field: FieldSpec("image", (None, None, 3), "uint8"),
                "instances": FieldSpec("mask", (None, None, 1), "uint16", of="boxes"),
                "boxes": FieldSpec("boxes", (None, 4), "float32"),
                "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

    def decode(self, path, field):
        with np.load(path, allow_pickle=False) as z:
            return {field: z["image"], **{f: z[f] for f in ("instances", "boxes", "box_labels", "keypoints")}}, {}


if _Instances.name not in DECODERS:
    DECODERS.register()(_Instances)
