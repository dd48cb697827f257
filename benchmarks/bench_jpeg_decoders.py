"""JPEG decoding: Pillow (the image decoder's path before issue 32.9) against libjpeg-turbo's TurboJPEG API
through simplejpeg in strict mode (its path now), in the same run, full size and at 1/2, 1/4 and 1/8.

Generates photo-like JPEGs (quality 90, 4:2:0; bench_decode.photo) at sizes divisible by 8 and not, plus the
real 3072x2304 rommel.jpg when ../shared/realdata is present, and times, medians of --repeats calls taken in
turns (so load from other jobs hits both alike):

  pillow    the old decoder path: Image.open, draft, load, the reduced-geometry resample, EXIF transpose, array
            (image._decode_pillow, which still decodes every non-JPEG format)
  strict    the decoder now: decode_image_scaled (Image.open for the header, the file read whole, simplejpeg
            decode_jpeg(strict=True), the same resample, transpose and array)
  raw PIL   Image.open + draft + load + np.asarray: Pillow's libjpeg-turbo alone
  raw TJ    the file read + simplejpeg.decode_jpeg: TurboJPEG alone
  cover     the reduced-geometry resample alone (image._cover_source), on the strict decode's output; 0 when
            the size is divisible by k (nothing to do)

and says whether the two decoders' arrays are byte-identical (they must be).

    PYTHONPATH=. python benchmarks/bench_jpeg_decoders.py [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import photo  # noqa: E402

SIZES = [(500, 375), (1024, 768), (1001, 751), (2048, 1536)]   # width, height
REAL = Path(__file__).resolve().parents[2] / "shared" / "realdata" / "images" / "rommel.jpg"


def turns(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable, called in turns ``repeats`` times."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    import simplejpeg
    from PIL import Image

    from precompile.decoders import image as I

    def pillow(p: str, k: int) -> np.ndarray:
        with Image.open(p) as img:
            return I._decode_pillow(img, p, "rgb8", True, k, 1 << 30)[0]

    def strict(p: str, k: int) -> np.ndarray:
        return I.decode_image_scaled(p, "rgb8", True, k if k > 1 else None)[0]

    def raw_pil(p: str, k: int) -> np.ndarray:
        with Image.open(p) as img:
            if k > 1:
                img.draft(None, (img.size[0] // k, img.size[1] // k))
            img.load()
            return np.asarray(img)

    def raw_tj(p: str, k: int, h: int, w: int) -> np.ndarray:
        with open(p, "rb") as f:
            d = f.read()
        size = {"min_height": -(-h // k), "min_width": -(-w // k)} if k > 1 else {}
        return simplejpeg.decode_jpeg(d, "RGB", strict=True, **size)

    with tempfile.TemporaryDirectory() as tmp:
        files = []
        rng = np.random.default_rng(0)
        for w, h in SIZES:
            p = Path(tmp) / f"{w}x{h}.jpg"
            Image.fromarray(photo(rng, h, w)).save(p, "JPEG", quality=90)
            files.append((f"{w}x{h}", str(p), w, h))
        if REAL.exists():
            files.append(("3072x2304 rommel.jpg (real)", str(REAL), 3072, 2304))
        print(f"simplejpeg {simplejpeg.__version__}; Pillow {Image.__version__}; medians of {a.repeats}, ms")
        print()
        print("| source | k | pillow | strict | pillow / strict | raw PIL | raw TJ | raw PIL / raw TJ "
              "| cover | cover share of strict | same bytes |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, p, w, h in files:
            for k in (1, 2, 4, 8):
                same = pillow(p, k).tobytes() == strict(p, k).tobytes()
                cover_in = None
                if k > 1 and (w % k or h % k):
                    out = raw_tj(p, k, h, w)
                    cover_in = Image.frombuffer("RGB", (out.shape[1], out.shape[0]), out, "raw", "RGB", 0, 1)
                fns = {"pillow": lambda: pillow(p, k), "strict": lambda: strict(p, k),
                       "raw_pil": lambda: raw_pil(p, k), "raw_tj": lambda: raw_tj(p, k, h, w)}
                if cover_in is not None:
                    fns["cover"] = lambda: I._cover_source(cover_in, (w / k, h / k))
                t = turns(fns, a.repeats)
                c = t.get("cover", 0.0)
                print(f"| {name} | {k} | {t['pillow'] * 1e3:.2f} | {t['strict'] * 1e3:.2f} "
                      f"| {t['pillow'] / t['strict']:.2f} | {t['raw_pil'] * 1e3:.2f} | {t['raw_tj'] * 1e3:.2f} "
                      f"| {t['raw_pil'] / t['raw_tj']:.2f} | {c * 1e3:.2f} | {100 * c / t['strict']:.0f}% "
                      f"| {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
