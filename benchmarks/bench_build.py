"""Build throughput: `precompile build` against a plain serial loop, in the same run.

Generates N photo-like JPEGs (default 3000, 128x96), then times, with medians of
--repeats runs:
  serial loop   PIL decode + EXIF + resize (shorter 72) + center crop 64 into one
                in-memory array, then one h5py write (what a hand-written script does)
  build -j1     precompile, one process
  build -jN     precompile, N loky workers (N = cores)
and prints samples/s, the ratio against the loop, and where build time goes.

    python benchmarks/bench_build.py [--n 3000] [--repeats 3]
"""
from __future__ import annotations

import argparse
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sample_data"))


def make_inputs(root: Path, n: int) -> None:
    from make_sample_data import save_jpeg, scene

    rng = np.random.default_rng(0)
    classes = ("beach", "forest", "night")
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        c = classes[i % 3]
        save_jpeg(scene(rng, c), str(root / c / f"{i:06d}.jpg"))


def serial_loop(root: Path, out: Path) -> float:
    import h5py
    from PIL import Image, ImageOps

    from precompile.transforms import functional as F

    t0 = time.perf_counter()
    files = sorted(p for p in root.rglob("*.jpg"))
    classes = sorted({p.parent.name for p in files})
    imgs = np.empty((len(files), 64, 64, 3), np.uint8)
    labels = np.empty(len(files), np.int64)
    for i, p in enumerate(files):
        with Image.open(p) as im:
            a = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
        h, w = F.shorter_side_size(a.shape[0], a.shape[1], 72)
        a = F.resize_hwc(a, h, w)
        t, l = (h - 64) // 2, (w - 64) // 2
        imgs[i] = a[t:t + 64, l:l + 64]
        labels[i] = classes.index(p.parent.name)
    with h5py.File(out, "w") as f:
        f["image"] = imgs
        f["label"] = labels
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    import precompile

    tmp = Path(tempfile.mkdtemp(prefix="bench_build_"))
    try:
        root = tmp / "inputs"
        t0 = time.perf_counter()
        make_inputs(root, args.n)
        print(f"generated {args.n} JPEGs in {time.perf_counter() - t0:.1f} s", flush=True)
        recipe = {
            "name": "bench", "seed": 0,
            "inputs": {"root": str(root), "match": "{label}/{name}.jpg",
                       "fields": {"image": {"decoder": "image", "mode": "rgb8"}}, "label": {"capture": "label"}},
            "steps": [{"resize": {"shorter": 72}}, {"center_crop": {"size": 64}}],
            "output": {"format": "hdf5", "samples_per_shard": 256},
        }
        rp = tmp / "bench.yaml"
        rp.write_text(yaml.safe_dump(recipe))
        rows = {}
        loop = [serial_loop(root, tmp / f"loop{r}.h5") for r in range(args.repeats)]
        rows["serial loop (baseline)"] = (statistics.median(loop), None)
        for j in sorted({1, args.jobs}):
            times, stages = [], []
            for r in range(args.repeats):
                rep = precompile.build(rp, out_dir=tmp / f"out{j}", n_jobs=j, force=True)
                times.append(rep["wall_seconds"])
                stages.append(rep["stage_seconds"])
            rows[f"precompile build -j{j}"] = (statistics.median(times), stages[len(stages) // 2])
        base = rows["serial loop (baseline)"][0]
        print(f"\n{args.n} images 128x96 JPEG -> 64x64 RGB, medians of {args.repeats}, {os.cpu_count()} cores\n")
        print(f"| {'contender':<26} | {'seconds':>8} | {'samples/s':>10} | {'vs loop':>7} | {'decode s':>8} | {'steps s':>7} | {'write s':>7} |")
        print(f"|{'-' * 28}|{'-' * 10}|{'-' * 12}|{'-' * 9}|{'-' * 10}|{'-' * 9}|{'-' * 9}|")
        for name, (sec, st) in rows.items():
            extra = (f"{st['decode']:>8.2f} | {st['steps']:>7.2f} | {st['write']:>7.2f}" if st else
                     f"{'':>8} | {'':>7} | {'':>7}")
            print(f"| {name:<26} | {sec:>8.2f} | {args.n / sec:>10.0f} | {base / sec:>6.2f}x | {extra} |")
        print("\nstage seconds are summed over workers (CPU time per stage), not wall time")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
