"""``to_hf``'s bytes against the build's (issue 35): a build of N images as a ``datasets.Dataset``, its image
column as ``Image`` (lossless PNG, what ``to_hf`` writes) and, as the baseline measured in the same run from
the same rows, as the ``Array3D`` feature ``to_hf`` wrote before (an int32 offset beside every pixel).

For gray8, rgb8 and gray16 builds of noise (what no compression shrinks: the worst case) and of smooth images
(photographs compress better still), prints:

  build files        the index plus the shard files on disk
  pixel bytes        the image field's stored bytes (N x H x W x C x itemsize)
  Image column       the Arrow column's bytes; and / pixel bytes
  Array3D column     the same for the old feature
  Arrow files        the Arrow cache files datasets wrote for to_hf; and / build files
  to_hf s, read s    medians of --repeats: to_hf into a fresh cache; reading every row with_format("numpy")
                     (Image: PNG decode; Array3D: the baseline)

    PYTHONPATH=. python benchmarks/bench_hf_bytes.py [--quick] [--repeats 3]

Needs ``datasets`` (the hf extra); exits 0 with a line saying so without it.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_time  # noqa: E402


def images(root: Path, n: int, size: tuple[int, int], smooth: bool) -> None:
    import cv2
    from PIL import Image

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        if smooth:
            small = rng.integers(0, 256, (size[0] // 16, size[1] // 16, 3)).astype(np.float32)
            a = np.clip(cv2.resize(small, (size[1], size[0]), interpolation=cv2.INTER_CUBIC), 0, 255).astype(np.uint8)
        else:
            a = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        Image.fromarray(a).save(root / f"{i:05d}.png")


def folder_bytes(index: str) -> int:
    shards = Path(index[:-3] + ".shards")
    return os.path.getsize(index) + sum(p.stat().st_size for p in shards.glob("*.h5"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if importlib.util.find_spec("datasets") is None:
        print("datasets is not installed (pip install 'precompile[hf]'): nothing to measure")
        return
    warnings.simplefilter("ignore")
    import datasets

    import precompile
    from precompile.hf import to_hf

    datasets.disable_progress_bars()
    n, size = (24, (64, 64)) if a.quick else (200, (128, 128))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        for content in ("noise", "smooth"):
            images(tmp_p / content / "x", n, size, content == "smooth")
            for mode in ("gray8", "rgb8", "gray16"):
                r = {"name": f"{content}-{mode}", "inputs": {"root": str(tmp_p / content), "match": "{label}/{name}.png",
                                                            "fields": {"image": {"decoder": "image", "mode": mode}}},
                     "steps": [{"resize": {"size": list(size)}}],   # the same size: a fixed shape (Array3D's)
                     "output": {"format": "hdf5", "samples_per_shard": 50}}
                index = precompile.build(r, out_dir=str(tmp_p / "out"))["output"]
                ds = precompile.open(index)
                pixels = sum(ds[i]["image"].nbytes for i in range(len(ds)))
                k = [0]

                def export() -> None:
                    k[0] += 1
                    export.hf = to_hf(index, cache_dir=str(tmp_p / f"cache-{content}-{mode}-{k[0]}"))

                t_hf = median_time(export, a.repeats)
                hf = export.hf
                spec = ds.field_specs["image"]
                old = datasets.Dataset.from_dict(
                    {"image": [ds[i]["image"] for i in range(len(ds))]},
                    features=datasets.Features({"image": datasets.Array3D(shape=tuple(spec["shape"]),
                                                                          dtype=spec["dtype"])}))
                arrow = sum(os.path.getsize(f["filename"]) for f in hf.cache_files)
                new_np, old_np = hf.with_format("numpy"), old.with_format("numpy")
                t_new = median_time(lambda: [new_np[i]["image"] for i in range(len(ds))], a.repeats)
                t_old = median_time(lambda: [old_np[i]["image"] for i in range(len(ds))], a.repeats)
                col, old_col = hf.data.column("image").nbytes, old.data.column("image").nbytes
                rows.append((f"{content} {mode}", folder_bytes(index), pixels, col, col / pixels, old_col,
                             old_col / pixels, arrow, arrow / folder_bytes(index), t_hf, t_new, t_old))
    print(f"{n} images of {size[0]}x{size[1]}; medians of {a.repeats}")
    print("| build | build files | pixel bytes | Image column | x pixels | Array3D column | x pixels | Arrow files "
          "| x build files | to_hf s | read s (Image) | read s (Array3D) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:,} | {r[2]:,} | {r[3]:,} | {r[4]:.2f} | {r[5]:,} | {r[6]:.2f} | {r[7]:,} | "
              f"{r[8]:.2f} | {r[9]:.3f} | {r[10]:.3f} | {r[11]:.3f} |")


if __name__ == "__main__":
    main()
