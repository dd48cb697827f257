"""`resample_volume` at every spline order: what the prefilter of orders 2 and 3 costs, in the same run.

Orders 2 and 3 interpolate since they prefilter the volume into B-spline coefficients
(``scipy.ndimage.zoom(..., prefilter=True)``); before, they smoothed (``prefilter=False``).
Times ``zoom_volume`` (the step's kernel, float32 and int16 CT-like volumes) at orders 0-3,
and the old order 3 without the prefilter as the baseline of the fix, in rounds that
alternate all contenders so that load from other jobs hits each alike. Prints medians and
ratios against order 1 (the default), and what each keeps of an impulse and of the
standard deviation of smooth noise (the issue's figures of the smoothing).

    PYTHONPATH=. python benchmarks/bench_resample.py [--repeats 5] [--size 64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def old_cubic(v: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """The kernel before the fix: order 3 without its prefilter (the data taken as spline coefficients)."""
    from scipy import ndimage

    return ndimage.zoom(v.astype(np.float32), [s / d for s, d in zip(shape, v.shape)], order=3, mode="nearest",
                        grid_mode=True, prefilter=False)


def main() -> None:
    from scipy import ndimage

    from precompile.transforms.kernels.volume import zoom_volume

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=64, help="the volume is size/2 x size x size, resampled x1.5")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    d, n = a.size // 2, a.size
    ct = ndimage.gaussian_filter(rng.normal(0, 300, (d, n, n)), 1.5).astype(np.float32) - 600
    vols = {"float32": ct, "int16": np.clip(np.rint(ct), -1024, 3000).astype(np.int16)}
    shape = (d * 3 // 2, n * 3 // 2, n * 3 // 2)
    contenders = {f"order {o}": (lambda v, o=o: zoom_volume(v, shape, o)) for o in range(4)}
    contenders["order 3, no prefilter (old)"] = lambda v: old_cubic(v, shape)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.repeats):
        for dt, v in vols.items():
            for name, fn in contenders.items():
                t0 = time.perf_counter()
                fn(v)
                times.setdefault((dt, name), []).append(time.perf_counter() - t0)
    print(f"zoom_volume {d}x{n}x{n} -> {'x'.join(map(str, shape))}, median of {a.repeats} (seconds); "
          f"ratio against order 1 of the same dtype")
    print(f"| {'contender':<28} | {'dtype':<7} | {'median s':>8} | {'vs order 1':>10} |")
    print(f"|{'-' * 30}|{'-' * 9}|{'-' * 10}|{'-' * 12}|")
    for dt in vols:
        base = statistics.median(times[(dt, "order 1")])
        for name in contenders:
            m = statistics.median(times[(dt, name)])
            print(f"| {name:<28} | {dt:<7} | {m:8.4f} | {m / base:9.2f}x |")
    impulse = np.zeros((5, 5, 5), np.float32)
    impulse[2, 2, 2] = 1000
    noise = ndimage.gaussian_filter(rng.normal(0, 60, (16, 16, 16)), 1.0).astype(np.float32)
    print(f"\nwhat each keeps (x3 upsampling): impulse of 1000 -> peak; smooth noise std {noise.std():.2f} -> std")
    print(f"| {'contender':<28} | {'peak':>7} | {'std':>6} |")
    print(f"|{'-' * 30}|{'-' * 9}|{'-' * 8}|")
    for name, fn in [(f"order {o}", lambda v, s, o=o: zoom_volume(v, s, o)) for o in range(4)] + \
            [("order 3, no prefilter (old)", old_cubic)]:
        peak = float(fn(impulse, (15, 15, 15)).max())
        std = float(fn(noise, (48, 48, 48)).std())
        print(f"| {name:<28} | {peak:7.1f} | {std:6.2f} |")


if __name__ == "__main__":
    main()
