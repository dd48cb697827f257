"""inputs.coco at plan time: parsing a COCO annotation file, per 100k annotations, against json.load alone
and pycocotools' own index (COCO(file)), in the same run.

Writes a synthetic instances file shaped like COCO's (80 categories with ids 1..90 and gaps, ~7.3
annotations per image, polygons of 2 x 12-30 points, 1% crowd RLE), then times, with medians of
--repeats runs:
  json.load            reading the file (the floor: every reader pays it)
  pycocotools COCO()   json.load + its index (imgToAnns, catToImgs)
  plan, boxes          precompile.compiler.coco.load_coco: checks, grouping, per-image arrays, digests
  plan, + mask         the same, with segmentations checked and carried (mask: semantic)
and prints seconds, seconds per 100k annotations and the ratio against json.load. Also the worker side:
rasterising one image's semantic mask (640x480, its ~7 objects) with pycocotools.

    python benchmarks/bench_coco.py [--annotations 100000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_time  # noqa: E402


def make_file(path: Path, n_ann: int) -> None:
    rng = np.random.default_rng(0)
    cat_ids = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
    n_img = max(1, int(n_ann / 7.3))
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": 480, "width": 640} for i in range(1, n_img + 1)]
    anns = []
    for a in range(1, n_ann + 1):
        iid = int(rng.integers(1, n_img + 1))
        x, y = rng.uniform(0, 500), rng.uniform(0, 380)
        w, h = rng.uniform(4, 140), rng.uniform(4, 100)
        crowd = int(rng.random() < 0.01)
        if crowd:
            seg = {"counts": [int(x * 480), int(h), 480 - int(h)] * 3 + [0], "size": [480, 640]}
            seg["counts"][-1] = 480 * 640 - sum(seg["counts"][:-1])
        else:
            seg = []
            for _ in range(2):
                k = int(rng.integers(12, 31))
                t = np.sort(rng.uniform(0, 2 * np.pi, k))
                pts = np.stack([x + w / 2 + w / 2 * np.cos(t), y + h / 2 + h / 2 * np.sin(t)], 1)
                seg.append([round(float(v), 2) for v in pts.reshape(-1)])
        anns.append({"id": a, "image_id": iid, "category_id": int(rng.choice(cat_ids)), "iscrowd": crowd,
                     "bbox": [round(x, 2), round(y, 2), round(w, 2), round(h, 2)], "area": round(w * h, 2),
                     "segmentation": seg})
    cats = [{"id": i, "name": f"class{i}", "supercategory": "thing"} for i in cat_ids]
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--annotations", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from pycocotools.coco import COCO

    from precompile.compiler.coco import load_coco
    from precompile.recipe import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        ann = Path(tmp) / "instances.json"
        make_file(ann, args.annotations)
        (Path(tmp) / "images").mkdir()

        def recipe(mask: str):
            return load_recipe({"name": "b", "inputs": {"root": "images", "coco": {"file": str(ann), "mask": mask}}},
                               base_dir=tmp)

        def quiet_coco():
            with contextlib.redirect_stdout(io.StringIO()):
                COCO(str(ann))

        r_boxes, r_mask = recipe("none"), recipe("semantic")
        rows = [("json.load", lambda: json.loads(ann.read_bytes())), ("pycocotools COCO()", quiet_coco),
                ("plan, boxes", lambda: load_coco(r_boxes)), ("plan, + mask", lambda: load_coco(r_mask))]
        times = {name: median_time(fn, args.repeats) for name, fn in rows}
        mib = ann.stat().st_size / 2**20
        src = load_coco(r_mask)
        per = [it.annotations for it in src.items if len(it.annotations.segments) >= 5][:50]
        raster = median_time(lambda: [a.rasterise("semantic", np.dtype(np.uint8)) for a in per], args.repeats)
    scale = 100_000 / args.annotations
    print(f"{args.annotations} annotations, {len(src.items)} images, {mib:.0f} MiB of JSON, medians of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| stage | s | s per 100k annotations | x json.load |")
    print("|---|---:|---:|---:|")
    base = times["json.load"]
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {t * scale:.2f} | {t / base:.2f}x |")
    print(f"\nworker: semantic mask of a 480x640 image with >= 5 objects: {raster / len(per) * 1000:.2f} ms "
          f"(median over {len(per)} images)")


if __name__ == "__main__":
    main()
