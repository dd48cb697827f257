"""Step cases for the deterministic temporal, audio and volume steps (clips, windows, fix_length,
the CT steps), collected by the shared step-contract test: ``CASES = {step name: [(params, sample factory), ...]}``."""
from __future__ import annotations

import numpy as np

from precompile.sample import Sample


def video(n: int = 10, every: int = 1) -> Sample:
    a = np.random.default_rng(0).integers(0, 255, (n, 8, 10, 3), dtype=np.uint8)
    return Sample("clip.avi", {"video": a}, {"video": "video"}, {"video": {"fps": 25.0, "every": every}})


def audio(n: int = 1000, ch: int = 1, dtype: str = "float32") -> Sample:
    x = np.random.default_rng(1).uniform(-0.5, 0.5, (ch, n)).astype(np.float32)
    if dtype == "int16":
        x = (x * 32767).astype(np.int16)
    return Sample("a.wav", {"audio": x}, {"audio": "audio"}, {"audio": {"sample_rate": 8000}})


def ct(shape=(12, 24, 20), mask: bool = False) -> Sample:
    rng = np.random.default_rng(2)
    d, h, w = shape
    z, y, x = np.mgrid[0:d, 0:h, 0:w]
    v = np.full(shape, -1000.0, np.float32)
    body = ((y - h / 2) / (h * 0.45)) ** 2 + ((x - w / 2) / (w * 0.45)) ** 2 <= 1
    v[body] = 40
    for cx in (w * 0.3, w * 0.7):
        v[((y - h / 2) / (h * 0.3)) ** 2 + ((x - cx) / (w * 0.15)) ** 2 <= 1] = -800
    v += rng.normal(0, 5, shape).astype(np.float32)
    fields = {"ct": v}
    kinds = {"ct": "volume"}
    if mask:
        fields["lung"] = (v < -500).astype(np.uint8) & body.astype(np.uint8)
        kinds["lung"] = "volume_mask"
    return Sample("series1", fields, kinds, {"ct": {"spacing": [2.5, 1.0, 1.2]}})


CASES = {
    "clips": [
        ({"length": 4, "every": 2, "stride": 3, "index_field": "frames"}, video),
        ({"length": 16, "short": "pad", "pad": "zero"}, video),
        ({"length": 3}, lambda: video(12, every=2)),
    ],
    "windows": [
        ({"length": 300, "hop": 200}, audio),
        ({"length": 400, "hop": 400, "tail": "pad"}, lambda: audio(1000, 2)),
        ({"length": 2000, "hop": 100, "short": "pad"}, lambda: audio(500, 1, "int16")),
    ],
    "fix_length": [
        ({"length": 256, "align": "center"}, audio),
        ({"length": 1500, "pad_value": 0.1}, lambda: audio(1000, 2)),
    ],
    "resample_volume": [
        ({"spacing": [5.0, 2.0, 2.0]}, ct),
        ({"shape": [6, 12, 10]}, lambda: ct(mask=True)),
        ({"spacing": 2.0, "order": 3}, ct),
    ],
    "hu_window": [
        ({"level": -600, "width": 1500}, ct),
        ({"window": [-1000, 400], "dtype": "uint8"}, ct),
    ],
    "standardise": [
        ({"mean": -500, "std": 400}, ct),
        ({"per_sample": True, "mask": "lung"}, lambda: ct(mask=True)),
    ],
    "lung_mask": [
        ({"out": "lungs", "threshold": -400}, ct),
        ({"components": 1, "closing": 0, "fill_holes": False}, ct),
    ],
    "apply_mask": [
        ({"mask": "lung", "fill": -1000}, lambda: ct(mask=True)),
    ],
    "crop_pad_volume": [
        ({"shape": [16, 16, 16], "pad_value": -1000}, lambda: ct(mask=True)),
    ],
    "patches3d": [
        ({"size": [6, 12, 10], "stride": [3, 6, 5], "corner_field": "corner"}, lambda: ct(mask=True)),
        ({"size": [16, 8, 8], "pad_value": -1000}, ct),
        ({"size": [6, 12, 10], "mask": "lung", "min_fraction": 0.1, "max_patches": 4}, lambda: ct(mask=True)),
    ],
}
