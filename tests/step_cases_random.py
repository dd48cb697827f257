"""Step-contract cases for the random (augmentation) steps of every domain (``transforms/geometry.py``, ``colour.py``, ``temporal.py``, ``audio.py``, ``volume.py``).

``CASES = {step_name: [(params, sample_factory), ...]}``; each factory returns a fresh sample.
"""
from __future__ import annotations

import numpy as np

from precompile.sample import Sample

from step_cases_planar import annotated, clip, gray16, image_mask_flow, rgba


def _rng(tag: int) -> np.random.Generator:
    return np.random.default_rng(2000 + tag)  # fixed test content, not build randomness


def volume_mask(shape: tuple = (8, 10, 12)) -> Sample:
    r = _rng(1)
    vol = r.integers(-1000, 2000, shape, dtype=np.int16)
    mask = np.zeros(shape, np.uint8)
    mask[2:6, 3:8, 4:10] = 1
    mask[3:5, 4:6, 5:7] = 2
    return Sample("ct/p1", {"volume": vol, "mask": mask}, {"volume": "volume", "mask": "volume_mask"})


def cube() -> Sample:
    r = _rng(2)
    return Sample("mr/p2", {"volume": r.normal(0, 1, (8, 8, 8)).astype(np.float32),
                            "mask": (r.random((8, 8, 8)) > 0.7).astype(np.uint8)},
                  {"volume": "volume", "mask": "volume_mask"})


def audio(c: int = 2, n: int = 400) -> Sample:
    r = _rng(3)
    return Sample("a/x.wav", {"audio": (r.normal(0, 0.2, (c, n))).astype(np.float32)}, {"audio": "audio"})


def audio_int16(c: int = 2, n: int = 400) -> Sample:
    """int16 PCM (the audio decoder's ``dtype: int16``), loud enough that a gain saturates some samples."""
    r = _rng(4)
    x = np.clip(np.rint(r.normal(0, 12000, (c, n))), -32768, 32767).astype(np.int16)
    return Sample("a/x16.wav", {"audio": x}, {"audio": "audio"})


def long_clip() -> Sample:
    return clip(t=12, h=8, w=10)


CASES = {
    "random_crop": [
        ({"size": [16, 20]}, image_mask_flow),
        ({"size": [30, 20], "pad": True, "pad_value": 3}, image_mask_flow),  # pads the height only
        ({"size": [10, 12]}, clip),
        ({"size": 8}, gray16),
        ({"size": [12, 16], "padding": 4, "min_visibility": 0.3}, annotated),
    ],
    "random_resized_crop": [
        ({"size": [12, 16]}, image_mask_flow),
        ({"size": [20, 20], "scale": [0.3, 1.0], "ratio": [0.5, 2.0], "interpolation": "linear"}, gray16),
        ({"size": [8, 8]}, clip),
        ({"size": [16, 16], "scale": [0.2, 0.6]}, annotated),
    ],
    "random_flip": [
        ({"horizontal": 0.5, "vertical": 0.5}, image_mask_flow),
        ({"horizontal": 0.5}, clip),
        ({"vertical": 0.5}, rgba),
        ({"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}, annotated),
    ],
    "random_affine": [
        ({"degrees": 30, "scale": [0.8, 1.2], "translate": 0.1}, image_mask_flow),
        ({"degrees": [-10, 10], "interpolation": "cubic", "fill": 9}, gray16),
        ({"degrees": 15}, clip),
        ({"degrees": 45, "scale": [0.7, 1.3], "translate": 0.2, "min_visibility": 0.25}, annotated),
    ],
    "color_jitter": [
        ({"brightness": 0.3, "contrast": 0.3, "saturation": 0.3}, image_mask_flow),
        ({"brightness": [0.5, 1.5]}, gray16),
        ({"contrast": 0.5, "saturation": 0.5}, rgba),
        ({"brightness": 0.2, "contrast": 0.2}, clip),
        ({"brightness": 0.3}, annotated),
    ],
    "gaussian_noise": [
        ({"std": [2.0, 10.0]}, image_mask_flow),
        ({"std": 0.05}, audio),
        ({"std": 20}, volume_mask),
        ({"std": 5}, clip),
    ],
    "temporal_jitter": [
        ({"length": 4, "strides": [1, 2], "jitter": 1}, long_clip),
        ({"length": 8, "jitter": 1}, clip),  # longer than the clip: the last frame repeats
    ],
    "random_gain": [
        ({"db": 6}, audio),
        ({"db": [-20, 3], "clip": True}, audio),
        ({"db": 12}, audio_int16),
    ],
    "time_shift": [
        ({"max_fraction": 0.25}, audio),
        ({"max_shift": 50, "mode": "zero"}, audio),
        ({"max_shift": 50, "mode": "zero"}, audio_int16),
    ],
    "random_flip3d": [
        ({"prob": 0.5}, volume_mask),
        ({"prob": 0.7, "axes": [0, 2]}, cube),
    ],
    "random_rot90": [
        ({"k": [0, 2], "planes": [[0, 1], [1, 2], [0, 2]]}, volume_mask),
        ({"planes": [[0, 1], [1, 2]]}, cube),
    ],
    "elastic": [
        ({"magnitude": 1.5}, volume_mask),
        ({"magnitude": [0.5, 2.0], "grid": 3}, cube),
    ],
}
