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


CASES = {
    "resize": [
        ({"size": [12, 10]}, image_mask_flow),
        ({"shorter": 10}, image_mask_flow),
        ({"longer": 40, "interpolation": "cubic"}, gray16),
        ({"size": [16, 16], "keep_aspect": True, "pad_value": 7}, image_mask_flow),
        ({"size": [8, 9]}, clip),
    ],
    "center_crop": [
        ({"size": [16, 20]}, image_mask_flow),
        ({"size": [30, 30], "pad": True}, image_mask_flow),
        ({"size": [10, 12]}, clip),
    ],
    "convert": [
        ({"mode": "gray8"}, image_mask_flow),
        ({"mode": "rgb8"}, gray16),
        ({"mode": "rgba8"}, image_mask_flow),
        ({"mode": "gray16"}, rgba),
        ({"mode": "gray8"}, clip),
    ],
}
