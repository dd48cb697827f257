"""Step-contract cases for the deterministic planar (2D grid) steps: resize, center_crop, convert, and the
planar sample factories (image/mask/flow, 16-bit gray, RGBA, a clip) the random-step cases share.

``CASES = {step_name: [(params, sample_factory), ...]}``; each factory returns a fresh sample.
"""
from __future__ import annotations

import numpy as np

from precompile.sample import Sample


def _rng(tag: int) -> np.random.Generator:
    return np.random.default_rng(1000 + tag)  # fixed test content, not build randomness


def image_mask_flow(h: int = 24, w: int = 32) -> Sample:
    r = _rng(1)
    flow = r.normal(0, 3, (h, w, 2)).astype(np.float32)
    flow[2:4, 5:9] = np.nan  # invalid vectors
    return Sample("scene/a.png", {
        "image": r.integers(0, 256, (h, w, 3), dtype=np.uint8),
        "image2": r.integers(0, 256, (h, w, 3), dtype=np.uint8),
        "mask": r.integers(0, 4, (h, w, 1), dtype=np.uint8),
        "flow": flow,
        "label": np.asarray(2, dtype=np.int64),
    }, {"image": "image", "image2": "image", "mask": "mask", "flow": "flow", "label": "label"})


def gray16(h: int = 20, w: int = 18) -> Sample:
    r = _rng(2)
    return Sample("g/b.png", {"image": r.integers(0, 65536, (h, w, 1), dtype=np.uint16)}, {"image": "image"})


def rgba(h: int = 16, w: int = 16) -> Sample:
    r = _rng(3)
    return Sample("c/d.png", {"image": r.integers(0, 256, (h, w, 4), dtype=np.uint8)}, {"image": "image"})


def clip(t: int = 5, h: int = 16, w: int = 20) -> Sample:
    r = _rng(4)
    return Sample("v/e.mp4", {"video": r.integers(0, 256, (t, h, w, 3), dtype=np.uint8)}, {"video": "video"})


def annotated(h: int = 24, w: int = 32) -> Sample:
    """An image and its instance mask with 3 objects (one inside, one on an edge, one in a corner),
    their boxes, labels and 3 keypoints each (0 and 1 a left/right pair) at pixel centres."""
    r = _rng(5)
    image = r.integers(0, 256, (h, w, 3), dtype=np.uint8)
    mask = np.zeros((h, w, 1), np.uint8)
    boxes = np.array([[10, 8, 20, 16], [0, 5, 6, 15], [26, 18, 32, 24]], np.float32)
    for i, (x1, y1, x2, y2) in enumerate(boxes.astype(int)):
        mask[y1:y2, x1:x2] = i + 1
    kp = np.stack([[[x1 + 0.5, y1 + 0.5, 2], [x2 - 0.5, y1 + 0.5, 2], [x1 + 0.5, y2 - 0.5, 1]]
                   for x1, y1, x2, y2 in boxes]).astype(np.float32)
    return Sample("coco/000001.jpg", {"image": image, "mask": mask, "boxes": boxes,
                                      "box_labels": np.array([3, 1, 3], np.int64), "keypoints": kp},
                  {"image": "image", "mask": "mask", "boxes": "boxes", "box_labels": "box_labels",
                   "keypoints": "keypoints"})


CASES = {
    "resize": [
        ({"size": [12, 10]}, image_mask_flow),
        ({"shorter": 10}, image_mask_flow),
        ({"longer": 40, "interpolation": "cubic"}, gray16),
        ({"size": [16, 16], "keep_aspect": True, "pad_value": 7}, image_mask_flow),
        ({"size": [8, 9]}, clip),
        ({"size": [12, 20]}, annotated),
        ({"size": [20, 20], "keep_aspect": True}, annotated),
    ],
    "center_crop": [
        ({"size": [16, 20]}, image_mask_flow),
        ({"size": [30, 30], "pad": True}, image_mask_flow),
        ({"size": [10, 12]}, clip),
        ({"size": [16, 20], "min_visibility": 0.5}, annotated),
        ({"size": [30, 30], "pad": True}, annotated),
    ],
    "convert": [
        ({"mode": "gray8"}, image_mask_flow),
        ({"mode": "rgb8"}, gray16),
        ({"mode": "rgba8"}, image_mask_flow),
        ({"mode": "gray16"}, rgba),
        ({"mode": "gray8"}, clip),
    ],
}
