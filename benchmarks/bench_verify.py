"""What checking every stored byte costs: open vs open(verify=True), the no-op rebuild vs build --repair.

Builds an HDF5 output of about --mb MiB (default 1024: 1024x1024 RGB BMP inputs, 4 per shard), then
times, medians of --repeats (the page cache warm after the build, as on a machine that just built it):

  open                  precompile.open(path): the index and the shard list
  open + verify         precompile.open(path, verify=True): every shard file hashed (sha256)
  no-op rebuild         precompile.build again: the stored keys and file sizes, nothing hashed
  build --repair        the same, after verify (every byte hashed)

and prints each against its baseline (open; the no-op rebuild) of the same run, with the hash rate.

    python benchmarks/bench_verify.py [--mb 1024] [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_time  # noqa: E402


def _inputs(root: Path, n: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "a").mkdir(parents=True)
    base = rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    for i in range(n):
        Image.fromarray(np.roll(base, i, axis=1)).save(root / "a" / f"{i:05d}.bmp")




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import precompile

    n = max(1, a.mb // 3)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _inputs(root / "data", n)
        recipe = {"name": "v", "inputs": {"root": str(root / "data"), "match": "{c}/{name}.bmp",
                                          "fields": {"image": {"decoder": "image"}}},
                  "output": {"format": "hdf5", "samples_per_shard": 4}}
        out = root / "out"
        rep = precompile.build(recipe, out_dir=out)
        index = out / "v.h5"
        size = rep["bytes"]
        rows = [("open", median_time(lambda: precompile.open(index), a.repeats)),
                ("open + verify", median_time(lambda: precompile.open(index, verify=True), a.repeats)),
                ("no-op rebuild", median_time(lambda: precompile.build(recipe, out_dir=out), a.repeats)),
                ("build --repair", median_time(lambda: precompile.build(recipe, out_dir=out, repair=True), a.repeats))]
    print(f"HDF5 build: {n} samples of 1024x1024x3, {size / 2**20:.0f} MiB in {len(rep['shards']) and rep['shards']['total']} shards")
    print(f"| what | median s | vs baseline | hashed MiB/s |")
    print(f"|---|---|---|---|")
    for i, (name, t) in enumerate(rows):
        base = rows[0][1] if i < 2 else rows[2][1]
        rate = f"{size / 2**20 / t:.0f}" if "verify" in name or "repair" in name else "-"
        print(f"| {name} | {t:.4f} | {t / base:.1f}x | {rate} |")


if __name__ == "__main__":
    main()
