"""Make the small sample inputs in this folder (run from anywhere; output is committed).

images/<class>/<name>.{jpg,png}: 36 small photo-like scenes in three classes
(beach, forest, night), made of smooth gradients, low-frequency texture and
soft shapes, JPEG-encoded. Awkward cases the decoders must handle are included:
a grayscale JPEG, a palette PNG with transparency, a JPEG with EXIF
orientation 6 (pixels stored rotated), a 16-bit grayscale PNG and an RGBA PNG.

Other kinds (video, DICOM, flow, audio) are added by their own make_* functions.
"""
from __future__ import annotations

import io
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    import cv2

    small = rng.random((cells, cells)).astype(np.float32)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def scene(rng: np.random.Generator, cls: str, h: int = 96, w: int = 128) -> np.ndarray:
    import cv2

    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    palettes = {
        "beach": ([0.35, 0.6, 0.95], [0.95, 0.85, 0.6], [0.1, 0.35, 0.6]),
        "forest": ([0.6, 0.75, 0.85], [0.1, 0.35, 0.12], [0.25, 0.5, 0.2]),
        "night": ([0.02, 0.03, 0.12], [0.05, 0.05, 0.08], [0.2, 0.2, 0.35]),
    }
    sky, ground, accent = (np.array(c, np.float32) for c in palettes[cls])
    jitter = rng.normal(0, 0.05, 3).astype(np.float32)
    horizon = 0.35 + 0.3 * rng.random()
    ridge = horizon + 0.12 * (smooth_noise(rng, 1, w, 6)[0] - 0.5)
    yy = np.broadcast_to(y[:, :, 0], (h, w))
    land = (yy > ridge[None, :]).astype(np.float32)
    land = cv2.GaussianBlur(land, (0, 0), 1.2)[..., None]
    tex = smooth_noise(rng, h, w, 12)[..., None]
    img = (1 - land) * (sky + jitter + 0.25 * (1 - y)) + land * (ground + jitter + 0.25 * (tex - 0.5))
    for _ in range(rng.integers(2, 5)):  # soft blobs: sun, trees, rocks, stars
        cy, cx = rng.random() * h, rng.random() * w
        r = (0.04 + 0.12 * rng.random()) * w
        yy2, xx2 = np.mgrid[0:h, 0:w]
        blob = np.exp(-(((yy2 - cy) ** 2 + (xx2 - cx) ** 2) / (2 * r * r)))[..., None].astype(np.float32)
        img = img * (1 - 0.8 * blob) + 0.8 * blob * (accent + 0.3 * rng.random(3).astype(np.float32))
    img += rng.normal(0, 0.015, img.shape).astype(np.float32)  # sensor noise
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def save_jpeg(arr: np.ndarray, path: str, exif=None, quality: int = 88) -> None:
    from PIL import Image

    img = Image.fromarray(arr)
    kw = {"quality": quality}
    if exif is not None:
        kw["exif"] = exif
    img.save(path, "JPEG", **kw)


def make_images(root: str) -> None:
    from PIL import Image

    rng = np.random.default_rng(20261121)
    for cls in ("beach", "forest", "night"):
        d = os.path.join(root, "images", cls)
        os.makedirs(d, exist_ok=True)
        for i in range(12):
            arr = scene(rng, cls)
            name = f"{cls}_{i:02d}"
            if cls == "beach" and i == 0:
                # EXIF orientation 6: the camera stored the pixels rotated; viewers turn it 90 deg clockwise
                stored = np.ascontiguousarray(np.rot90(arr, 1))
                exif = Image.Exif()
                exif[0x0112] = 6
                save_jpeg(stored, os.path.join(d, name + "_exif6.jpg"), exif=exif)
            elif cls == "forest" and i == 0:
                Image.fromarray(arr).convert("L").save(os.path.join(d, name + "_gray.jpg"), quality=88)
            elif cls == "forest" and i == 1:
                p = Image.fromarray(arr).quantize(colors=32, method=Image.Quantize.MEDIANCUT)
                p.info["transparency"] = 0
                p.save(os.path.join(d, name + "_palette.png"), transparency=0)
            elif cls == "night" and i == 0:
                g16 = (arr.astype(np.uint16).mean(axis=-1) * 257).astype(np.uint16)
                Image.fromarray(g16).save(os.path.join(d, name + "_gray16.png"))
            elif cls == "night" and i == 1:
                rgba = np.concatenate([arr, np.full(arr.shape[:2] + (1,), 200, np.uint8)], axis=-1)
                Image.fromarray(rgba).save(os.path.join(d, name + "_rgba.png"))
            else:
                save_jpeg(arr, os.path.join(d, name + ".jpg"))


MAKERS = {"images": make_images}


def main(argv: list[str]) -> None:
    kinds = argv or list(MAKERS)
    for k in kinds:
        MAKERS[k](HERE)
        print(f"made sample_data/{k}")


if __name__ == "__main__":
    main(sys.argv[1:])
