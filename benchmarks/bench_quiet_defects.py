"""Issue 27's two fixes that cost or change something measurable, each against its baseline in the same run.

1. Reduced JPEG geometry. For JPEGs at sizes divisible and not divisible by k, the decoder
   output after a resize (64x64, or shorter side 96) with ``reduce: auto`` is compared with
   ``reduce: off``: PSNR (median and worst over the images) and the shift of a step edge in
   output pixels (an edge's area, so to a hundredth of a pixel), for the old geometry (the
   reduced image taken as covering the source) and the new one (resampled from the source's
   extent, ``image._cover_source``); and the decode + resize time of each (medians).
2. Video decode threading. Frames/s of ``read_video`` on a generated 1280x720 H.264 file
   with FFmpeg's frame threads (what a -j1 build's parent used before), slice threads (now)
   and one thread (a -j worker, before and now).

    PYTHONPATH=. python benchmarks/bench_quiet_defects.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = [(1001, 751), (1025, 769), (1337, 1003), (2049, 1537), (1024, 768), (2048, 1536)]   # width, height
TARGETS = [("64x64", {"size": [64, 64]}), ("shorter 96", {"shorter": 96})]
DARK, BRIGHT = 40.0, 210.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def edge_x(a: np.ndarray, rows: int) -> float:
    g = a[:rows, :, 0].astype(np.float64)
    return float(((BRIGHT - g) / (BRIGHT - DARK)).sum(1).mean())


def content(kind: str, rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    from bench_decode import photo

    if kind == "photo":
        return photo(rng, h, w)
    if kind == "noise":
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img = np.full((h, w, 3), 230, np.uint8)          # line art: 1-pixel lines every 7 pixels
    img[::7] = 20
    img[:, ::11] = 20
    return img


def decode_resize(path: str, need, target: dict, old: bool) -> tuple[np.ndarray, float]:
    import precompile.decoders.image as I
    from precompile.transforms.kernels import geometry as F

    keep = I._cover_source
    if old:
        I._cover_source = lambda img, extent: img   # the geometry before the fix
    try:
        t0 = time.perf_counter()
        a, _ = I.decode_image_scaled(path, "rgb8", True, need)
        h, w = need.target.target_size(*a.shape[:2]) if need is not None else (0, 0)
        out = F.resize_hwc(a, h, w, "area")
        return out, time.perf_counter() - t0
    finally:
        I._cover_source = keep


def need_for(target: dict):
    from precompile.recipe import parse_recipe

    rec = parse_recipe({"name": "b", "inputs": {"root": ".", "match": "{n}.jpg", "fields": {"image": {"decoder": "image"}}},
                        "steps": [{"resize": target}]}, base_dir=".")
    return rec.decoders["image"].need


def reduce_table(tmp: Path, repeats: int) -> None:
    from PIL import Image

    from precompile.decoders.image import decode_image_file
    from precompile.transforms.kernels import geometry as F

    print("\n## Reduced JPEG decoding against reduce: off (PSNR dB, edge shift in output px, ms per image)\n")
    print("| content | source | output | k | PSNR old (med/min) | PSNR new (med/min) | edge old | edge new "
          "| ms off | ms old | ms new | new / old |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    cases = [("photo", s) for s in SIZES] + [("noise", (1001, 751)), ("line art", (1001, 751))]
    for kind, (W, H) in cases:
        files = []
        for j in range(3):
            p = tmp / f"{kind}_{W}_{j}.jpg"
            Image.fromarray(content(kind, rng, H, W)).save(p, "JPEG", quality=90)
            files.append(str(p))
        step = np.full((H, W, 3), DARK, np.uint8)
        step[:, int(W * 0.37):] = BRIGHT
        Image.fromarray(step).save(tmp / "step.jpg", "JPEG", quality=95)
        for tname, target in TARGETS:
            need = need_for(target)
            k = need.scale_for(H, W)
            ps = {"old": [], "new": []}
            times = {"off": [], "old": [], "new": []}
            for p in files:
                full = decode_image_file(p)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    ref = F.resize_hwc(decode_image_file(p), *need.target.target_size(H, W), "area")
                    times["off"].append(time.perf_counter() - t0)
                    for v in ("old", "new"):
                        out, dt = decode_resize(p, need, target, v == "old")
                        times[v].append(dt)
                ref = F.resize_hwc(full, *need.target.target_size(H, W), "area")
                for v in ("old", "new"):
                    ps[v].append(psnr(decode_resize(p, need, target, v == "old")[0], ref))
            sref = F.resize_hwc(decode_image_file(str(tmp / "step.jpg")), *need.target.target_size(H, W), "area")
            rows = max(1, sref.shape[0] // 2)
            shift = {v: edge_x(decode_resize(str(tmp / "step.jpg"), need, target, v == "old")[0], rows) - edge_x(sref, rows)
                     for v in ("old", "new")}
            med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
            pm = {v: f"{statistics.median(x):.1f} / {min(x):.1f}" for v, x in ps.items()}
            print(f"| {kind} | {W}x{H} | {tname} | {k} | {pm['old']} | {pm['new']} | {shift['old']:+.3f} | "
                  f"{shift['new']:+.3f} | {med['off']:.1f} | {med['old']:.1f} | {med['new']:.1f} | "
                  f"{med['new'] / med['old']:.2f}x |")


def video_table(tmp: Path, repeats: int) -> None:
    import av

    from precompile.decoders import video as V

    path = str(tmp / "720p.mp4")
    c = av.open(path, "w")
    s = c.add_stream("libx264", rate=30)
    s.width, s.height, s.pix_fmt = 1280, 720, "yuv420p"
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, (720 // 8, 1280 // 8, 3), dtype=np.uint8)
    for i in range(150):
        img = np.roll(base, i, axis=1).repeat(8, 0).repeat(8, 1)
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    print("\n## Video decode (read_video, 150 frames 1280x720 H.264), frames/s, medians\n")
    print("| threading | frames/s | vs frame threads |")
    print("|---|---|---|")
    keep = V._decoding
    rates = {}

    def frame_threads(container):   # the decoder's settings before the fix (a -j1 build's parent)
        stream = container.streams.video[0]
        stream.thread_type, stream.thread_count = "AUTO", 0
        return stream

    for name, fn, n in (("frame threads, auto count (old -j1 parent)", frame_threads, 0),
                        ("slice threads, auto count (now, -j1 parent)", keep, 0),
                        ("one thread (-j workers, old and now)", keep, 1)):
        V._decoding = fn
        V.set_decode_threads(n)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            arr, _ = V.read_video(path)
            ts.append(time.perf_counter() - t0)
        rates[name] = len(arr) / statistics.median(ts)
    V._decoding = keep
    V.set_decode_threads(0)
    first = next(iter(rates.values()))
    for name, r in rates.items():
        print(f"| {name} | {r:.0f} | {r / first:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        reduce_table(Path(d), args.repeats)
        video_table(Path(d), args.repeats)


if __name__ == "__main__":
    main()
