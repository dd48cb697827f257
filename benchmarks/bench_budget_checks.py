"""What the decoders' pre-decode checks cost (issue 24): the budget checks, against the decode they guard,
same run. (The JPEG scan-length check this also timed is gone: libjpeg-turbo's strict mode, issue 32.9,
refuses a scan that ends early while it decodes, at no extra cost.)

Makes a smooth 4000x3000 JPEG (quality 92) and a 1000x800 PNG, and times, medians of --repeats:

  JPEG open + budget Pillow's header read + check_image_size (no pixels decoded)
  JPEG decode       decode_image_scaled at full size (includes the checks)
  PNG open + budget Pillow's header read + check_image_size (no pixels decoded)
  PNG decode        decode_image_scaled at full size

    python benchmarks/bench_budget_checks.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_time  # noqa: E402




def _image(h: int, w: int) -> np.ndarray:
    import cv2

    small = np.random.default_rng(0).integers(0, 255, (h // 10, w // 10, 3)).astype(np.float32)
    return np.clip(cv2.resize(small, (w, h)), 0, 255).astype(np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    from PIL import Image

    from precompile.decoders.image import check_image_size, decode_image_scaled

    with tempfile.TemporaryDirectory() as tmp:
        jpg, png = Path(tmp) / "a.jpg", Path(tmp) / "a.png"
        Image.fromarray(_image(3000, 4000)).save(jpg, quality=92)
        Image.fromarray(_image(800, 1000)).save(png)

        def check(p: Path) -> None:
            with Image.open(p) as im:
                check_image_size(im, "rgb8", str(p), 1 << 30)

        rows = [("JPEG open + budget check", median_time(lambda: check(jpg), a.repeats)),
                ("JPEG decode (4000x3000)", median_time(lambda: decode_image_scaled(str(jpg)), a.repeats)),
                ("PNG open + budget check", median_time(lambda: check(png), a.repeats)),
                ("PNG decode (1000x800)", median_time(lambda: decode_image_scaled(str(png)), a.repeats))]
    print("| what | median ms | share of its decode |")
    print("|---|---|---|")
    for i, (name, t) in enumerate(rows):
        share = f"{100 * t / rows[i + 1][1]:.1f}%" if i % 2 == 0 else "-"
        print(f"| {name} | {t * 1e3:.2f} | {share} |")


if __name__ == "__main__":
    main()
