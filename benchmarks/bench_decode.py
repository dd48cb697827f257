"""Reduced-scale JPEG decoding: `reduce: off` against `reduce: auto`, in the same run.

Generates photo-like JPEGs (quality 90) at 500x375, 1024x768 and 2048x1536 and builds
each set to 64x64 (resize shorter 72 + center crop 64) and to 224x224 (resize shorter
256 + center crop 224) with the image decoder's `reduce: off` and `reduce: auto`,
alternating the two in every repeat so that load from other jobs hits both. Prints,
with medians of --repeats builds:

  samples/s of each, the speed-up of auto over off, the JPEG scale auto chose, the
  PSNR of the auto output against the off output (mean and worst sample), and both
  against the "ideal": the sum over samples of one process's full decode + resize +
  crop CPU time, divided by the cores (what a perfectly parallel build that decodes
  at full size could reach; it leaves out writing, scheduling and worker start-up),
  and the same loop's wall time / cores ("wall ideal"): on a shared machine CPU time
  leaves out the waits for a core that the builds pay.

A second table times decoding alone at each scale, Pillow's draft (what the decoder
used before issue 32.9; libjpeg-turbo through simplejpeg now, the same pixels: bench_jpeg_decoders.py) against OpenCV's IMREAD_REDUCED_COLOR_k, and says whether their pixels agree.

    PYTHONPATH=. python benchmarks/bench_decode.py [--repeats 5] [--scale 1.0] [--jobs N]
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [(500, 375, 256), (1024, 768, 96), (2048, 1536, 32)]   # width, height, images (x --scale)
TARGETS = [(64, 72), (224, 256)]                               # crop, shorter side


def photo(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth shading, soft shapes and texture down to a few pixels, plus sensor noise."""
    import cv2

    img = np.zeros((h, w, 3), np.float32)
    for cells, amp in ((4, 90.0), (16, 40.0), (max(2, w // 16), 25.0), (max(2, w // 4), 12.0)):
        small = rng.random((max(2, cells * h // w), cells, 3)).astype(np.float32) - 0.5
        img += amp * cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    for _ in range(int(rng.integers(3, 7))):
        cy, cx, r = rng.random() * h, rng.random() * w, (0.03 + 0.1 * rng.random()) * w
        yy, xx = np.ogrid[0:h, 0:w]
        blob = (((yy - cy) ** 2 + (xx - cx) ** 2) < r * r).astype(np.float32)
        blob = cv2.GaussianBlur(blob, (0, 0), 1.0)[..., None]
        img = img * (1 - blob) + blob * (rng.random(3).astype(np.float32) * 255 - 128)
    img += rng.normal(0, 2.0, img.shape).astype(np.float32)
    return np.clip(img + 128, 0, 255).astype(np.uint8)


def make_inputs(root: Path, w: int, h: int, n: int, seed: int) -> list[Path]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = root / f"{i:05d}.jpg"
        Image.fromarray(photo(rng, h, w)).save(p, "JPEG", quality=90)
        out.append(p)
    return out


def recipe(root: Path, crop: int, shorter: int, reduce: str, per_shard: int) -> dict:
    return {"name": "bench", "seed": 0,
            "inputs": {"root": str(root), "match": "{name}.jpg",
                       "fields": {"image": {"decoder": "image", "mode": "rgb8", "reduce": reduce}}},
            "steps": [{"resize": {"shorter": shorter}}, {"center_crop": {"size": crop}}],
            "output": {"format": "hdf5", "samples_per_shard": per_shard}}


def ideal_seconds(files: list[Path], crop: int, shorter: int, cores: int) -> tuple[float, float]:
    """Sum of per-sample full decode + resize + crop time, divided by the cores: (CPU time, wall time).
    On a shared machine the wall figure also pays for other jobs' use of the cores, as the builds do."""
    from precompile.decoders.image import decode_image_file
    from precompile.transforms.kernels import geometry as F

    total = 0.0
    w0 = time.perf_counter()
    for p in files:
        t0 = time.process_time()
        a = decode_image_file(str(p), "rgb8")
        h, w = F.shorter_side_size(a.shape[0], a.shape[1], shorter)
        a = F.resize_hwc(a, h, w)
        t, l = (h - crop) // 2, (w - crop) // 2
        a = np.ascontiguousarray(a[t:t + crop, l:l + crop])
        total += time.process_time() - t0
    return total / cores, (time.perf_counter() - w0) / cores


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def compare(index_off: Path, index_auto: Path) -> tuple[float, float, list[int]]:
    import precompile

    off, auto = precompile.open(index_off), precompile.open(index_auto)
    vals, scales = [], []
    for i in range(len(off)):
        assert off.key(i) == auto.key(i)
        vals.append(psnr(off[i]["image"], auto[i]["image"]))
        scales.append(auto.meta(i).get("image", {}).get("reduce", 1))
    finite = [v for v in vals if math.isfinite(v)]
    mean = statistics.mean(finite) if finite else math.inf
    return mean, min(vals), sorted(set(scales))


def decode_table(files_by_size: dict[str, list[Path]], repeats: int) -> None:
    import cv2
    from PIL import Image, ImageOps

    cv2.setNumThreads(1)
    flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
             8: cv2.IMREAD_REDUCED_COLOR_8}

    def pil(p: Path, k: int) -> np.ndarray:
        with Image.open(p) as im:
            if k > 1:
                im.draft(None, (im.size[0] // k, im.size[1] // k))
            return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))

    def ocv(p: Path, k: int) -> np.ndarray:
        return cv2.cvtColor(cv2.imread(str(p), flags[k]), cv2.COLOR_BGR2RGB)

    print("\ndecode only (one process, ms per image, medians of "
          f"{repeats}; speed-up against Pillow full decode of the same file)\n")
    print("| image | scale | Pillow draft ms | x | OpenCV REDUCED ms | x | same pixels |")
    print("|---|---|---|---|---|---|---|")
    for name, files in files_by_size.items():
        sample = files[:8]
        res: dict[tuple[str, int], list[float]] = {}
        for _ in range(repeats):
            for k in (1, 2, 4, 8):
                for lib, fn in (("pil", pil), ("cv2", ocv)):
                    t0 = time.perf_counter()
                    for p in sample:
                        fn(p, k)
                    res.setdefault((lib, k), []).append((time.perf_counter() - t0) / len(sample) * 1e3)
        base = statistics.median(res[("pil", 1)])
        for k in (1, 2, 4, 8):
            a, b = statistics.median(res[("pil", k)]), statistics.median(res[("cv2", k)])
            same = all(np.array_equal(pil(p, k), ocv(p, k)) for p in sample[:2])
            print(f"| {name} | 1/{k} | {a:.2f} | {base / a:.1f}x | {b:.2f} | {base / b:.1f}x | {'yes' if same else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of images per size")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-decode-table", action="store_true")
    args = ap.parse_args()

    import precompile

    tmp = Path(tempfile.mkdtemp(prefix="bench_decode_"))
    try:
        files_by_size: dict[str, list[Path]] = {}
        t0 = time.perf_counter()
        for i, (w, h, n) in enumerate(SIZES):
            n = max(4, int(n * args.scale))
            files_by_size[f"{w}x{h}"] = make_inputs(tmp / f"in{w}", w, h, n, seed=i)
        print(f"generated {sum(len(v) for v in files_by_size.values())} JPEGs in {time.perf_counter() - t0:.1f} s",
              flush=True)
        configs = [(name, crop, shorter) for name in files_by_size for crop, shorter in TARGETS]
        # at least 4 shards per worker, so that the workers stay busy to the end
        per_shard = {name: max(1, len(files) // (4 * args.jobs)) for name, files in files_by_size.items()}
        warm = tmp / "warm.yaml"   # start the worker pool once before any timed build
        name0 = next(iter(files_by_size))
        warm.write_text(yaml.safe_dump(recipe(files_by_size[name0][0].parent, 64, 72, "off", per_shard[name0])))
        precompile.build(warm, out_dir=tmp / "warm", n_jobs=args.jobs, force=True)
        times: dict[tuple, list[float]] = {}
        ideal: dict[tuple, list[tuple[float, float]]] = {}
        for r in range(args.repeats):
            for name, crop, shorter in configs:
                root = files_by_size[name][0].parent
                for red in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                    rp = tmp / f"{name}-{crop}-{red}.yaml"
                    rp.write_text(yaml.safe_dump(recipe(root, crop, shorter, red, per_shard[name])))
                    rep = precompile.build(rp, out_dir=tmp / f"out-{name}-{crop}-{red}", n_jobs=args.jobs, force=True)
                    assert rep["status"] == "ok", rep
                    times.setdefault((name, crop, red), []).append(rep["wall_seconds"])
                ideal.setdefault((name, crop), []).append(
                    ideal_seconds(files_by_size[name], crop, shorter, args.jobs))
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)

        print(f"\nbuild -j{args.jobs}, medians of {args.repeats} (off and auto alternate), {os.cpu_count()} cores; "
              "ideal = sum of per-sample full decode + resize + crop CPU time / cores, same run; "
              "x ideal = samples/s over the ideal's\n")
        print("| input | output | n | off samples/s | auto samples/s | auto / off | scale | PSNR mean dB | PSNR min dB "
              "| ideal samples/s | off x ideal | auto x ideal | auto x wall ideal |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, crop, shorter in configs:
            n = len(files_by_size[name])
            off = statistics.median(times[(name, crop, "off")])
            auto = statistics.median(times[(name, crop, "auto")])
            ide = statistics.median(c for c, _ in ideal[(name, crop)])
            ide_wall = statistics.median(w for _, w in ideal[(name, crop)])
            mean, worst, scales = compare(tmp / f"out-{name}-{crop}-off" / "bench.h5",
                                          tmp / f"out-{name}-{crop}-auto" / "bench.h5")
            sc = ",".join(f"1/{s}" for s in scales)
            fmt = lambda v: "identical" if math.isinf(v) else f"{v:.1f}"  # noqa: E731
            print(f"| {name} | {crop}x{crop} (shorter {shorter}) | {n} | {n / off:.0f} | {n / auto:.0f} | "
                  f"{off / auto:.2f}x | {sc} | {fmt(mean)} | {fmt(worst)} | {n / ide:.0f} | {ide / off:.2f}x | "
                  f"{ide / auto:.2f}x | {ide_wall / auto:.2f}x |")
        print(f"\nload average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} cores (the ideal counts CPU time, the builds wall time)")
        if not args.no_decode_table:
            decode_table(files_by_size, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
