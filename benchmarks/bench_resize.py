"""resize's ``fast: true`` (approximate area downscale) against the exact area resize (OpenCV INTER_AREA).

For each (source -> target) pair, on photo-like content (the real photo ../shared/realdata/images/rommel.jpg
brought to the source size, and a generated scene), one OpenCV thread as in a build worker: the median ms per
image of both kernels over ``--repeats`` calls, the ratio exact / fast, and the PSNR of fast against exact.

    PYTHONPATH=. python benchmarks/bench_resize.py [--quick] [--repeats R]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from timing import median_time  # noqa: E402

from precompile.transforms.kernels.geometry import resize_area_fast, resize_hwc  # noqa: E402
from tests.test_resize_fast import PAIRS, psnr, scene  # noqa: E402

PHOTO = os.path.join(ROOT, "..", "shared", "realdata", "images", "rommel.jpg")




def sources(H: int, W: int) -> dict[str, np.ndarray]:
    from PIL import Image

    out = {"scene": scene(H, W, 0)}
    if os.path.exists(PHOTO):
        im = Image.open(PHOTO).convert("RGB")
        big = im.size[0] * im.size[1] >= H * W
        out["photo"] = np.asarray(im.resize((W, H), Image.BOX if big else Image.BICUBIC))
    return out


def main(argv: list[str] | None = None) -> None:
    import cv2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small pairs only, few repeats")
    ap.add_argument("--repeats", type=int, default=None, help="calls per kernel (default 21, quick 5)")
    args = ap.parse_args(argv)
    reps = args.repeats or (5 if args.quick else 21)
    cv2.setNumThreads(1)
    pairs = PAIRS[:3] if args.quick else PAIRS
    print("| source | target | content | exact ms | fast ms | exact / fast | PSNR dB |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (H, W), (h, w) in pairs:
        for name, a in sources(H, W).items():
            exact = 1e3 * median_time(lambda: resize_hwc(a, h, w, "area"), reps)
            fast = 1e3 * median_time(lambda: resize_area_fast(a, h, w), reps)
            q = psnr(resize_area_fast(a, h, w), resize_hwc(a, h, w, "area"))
            print(f"| {H}x{W} | {h}x{w} | {name} | {exact:.3f} | {fast:.3f} | {exact / fast:.2f} | {q:.1f} |")


if __name__ == "__main__":
    main()
