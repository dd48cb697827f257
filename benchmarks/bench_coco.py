"""inputs.coco at plan time: parsing a COCO annotation file, per 100k annotations, against json.load alone
and pycocotools' own index (COCO(file)), in the same run; and the parse kept in the output folder
(inputs/coco/cache.py): reading it back, writing it, and a whole no-change rebuild with and without it.

Writes a synthetic instances file shaped like COCO's (80 categories with ids 1..90 and gaps, ~7.3
annotations per image, polygons of 2 x 12-30 points, 1% crowd RLE), then times, with medians of
--repeats runs:
  json.load            reading the file (the floor: every reader pays it)
  pycocotools COCO()   json.load + its index (imgToAnns, catToImgs)
  plan, boxes          precompile.inputs.coco.load_coco: checks, grouping, per-image arrays, digests
  plan, + mask         the same, with segmentations checked and carried (mask: semantic)
  orjson.loads         a faster JSON reader (optional contender, when installed): the floor it would give
  kept parse, ...      load_coco reading the kept parse instead (coco_cache.load + the items' paths)
  cache write, ...     what the first build pays to keep the parse (coco_cache.save)
and prints seconds, seconds per 100k annotations and the ratio against json.load. Then whole builds of the
same file over tiny images (--images-px; the boxes recipe): the no-change rebuild with the parse kept
(the default) against the same rebuild parsing the JSON (the kept parse deleted and not written again:
the code path before the cache), medians of --repeats. Also the worker side: rasterising one image's
semantic mask (640x480, its ~7 objects) with pycocotools.

    python benchmarks/bench_coco.py [--annotations 100000] [--repeats 3] [--no-builds]
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


def make_file(path: Path, n_ann: int, size: tuple[int, int] = (480, 640)) -> None:
    rng = np.random.default_rng(0)
    cat_ids = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
    n_img = max(1, int(n_ann / 7.3))
    images = [{"id": i, "file_name": f"{i:012d}.png", "height": size[0], "width": size[1]}
              for i in range(1, n_img + 1)]
    anns = []
    for a in range(1, n_ann + 1):
        iid = int(rng.integers(1, n_img + 1))
        x, y = rng.uniform(0, 500), rng.uniform(0, 380)
        w, h = rng.uniform(4, 140), rng.uniform(4, 100)
        crowd = int(rng.random() < 0.01)
        if crowd:   # three columns of a box's height, from its left edge (in the image's own size)
            rows, cols = size
            run = max(1, min(rows, int(h * rows / 480)))
            seg = {"counts": [min(int(x * cols / 640), cols - 3) * rows, run, rows - run] * 3 + [0], "size": list(size)}
            seg["counts"][-1] = rows * cols - sum(seg["counts"][:-1])
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


def plan_rows(ann: Path, tmp: str, repeats: int) -> tuple[dict[str, float], object]:
    """Seconds of each plan-time stage (see the module docstring), and the masked parse (for the raster)."""
    from pycocotools.coco import COCO

    from precompile.inputs.coco import cache as coco_cache, load_coco
    from precompile.inputs.coco.parse import parse_coco
    from precompile.recipe import load_recipe

    def recipe(mask: str):
        return load_recipe({"name": "b", "inputs": {"root": "images", "coco": {"file": str(ann), "mask": mask}}},
                           base_dir=tmp)

    def quiet_coco():
        with contextlib.redirect_stdout(io.StringIO()):
            COCO(str(ann))

    r_boxes, r_mask = recipe("none"), recipe("semantic")
    rows = [("json.load", lambda: json.loads(ann.read_bytes())), ("pycocotools COCO()", quiet_coco),
            ("plan, boxes", lambda: load_coco(r_boxes)), ("plan, + mask", lambda: load_coco(r_mask))]
    try:
        import orjson
        rows.insert(1, ("orjson.loads (contender)", lambda: orjson.loads(ann.read_bytes())))
    except ImportError:
        pass
    times = {name: median_time(fn, repeats) for name, fn in rows}
    for what, r in (("boxes", r_boxes), ("+ mask", r_mask)):
        kept = os.path.join(tmp, f"kept-{r.model.inputs.coco.mask}.h5")
        key, parsed = coco_cache.cache_key(r, str(ann), False), parse_coco(r)
        times[f"cache write, {what}"] = median_time(lambda: coco_cache.save(kept, key, parsed), repeats)
        times[f"plan from the kept parse, {what}"] = median_time(lambda: load_coco(r, kept), repeats)
        assert load_coco(r, kept).pending is None
    return times, parsed


def build_rows(ann: Path, tmp: str, repeats: int, px: int) -> dict[str, float]:
    """Whole builds over tiny images: the first one, and no-change rebuilds with and without the kept parse."""
    from PIL import Image

    import precompile
    from precompile.inputs.coco import cache as coco_cache

    images = Path(tmp) / "images"
    blank = Image.new("RGB", (px, px))
    for im in json.loads(ann.read_bytes())["images"]:
        blank.save(images / im["file_name"])
    r = {"name": "b", "inputs": {"root": str(images), "coco": {"file": str(ann)}},
         "output": {"samples_per_shard": 1024}}
    out = Path(tmp) / "out"
    kept = out / "b.shards" / "coco-plan.h5"
    times = {"first build (parse + cache write + shards)": median_time(lambda: precompile.build(r, out), 1)}
    times["no-change rebuild, parse kept (default)"] = median_time(lambda: precompile.build(r, out), repeats)

    def parsing():
        kept.unlink(missing_ok=True)
        precompile.build(r, out)
    real, coco_cache.Pending.write = coco_cache.Pending.write, lambda self: False   # the code path before
    try:
        times["no-change rebuild, JSON parsed (before)"] = median_time(parsing, repeats)
    finally:
        coco_cache.Pending.write = real
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--annotations", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images-px", type=int, default=8, help="side of the tiny images of the build rows")
    ap.add_argument("--no-builds", action="store_true", help="the plan-time rows only")
    args = ap.parse_args()
    px = args.images_px
    with tempfile.TemporaryDirectory() as tmp:
        ann = Path(tmp) / "instances.json"
        make_file(ann, args.annotations)
        (Path(tmp) / "images").mkdir()
        times, src = plan_rows(ann, tmp, args.repeats)
        mib = ann.stat().st_size / 2**20
        per = [a for a in src.annotations.values() if len(a.segments) >= 5][:50]
        raster = median_time(lambda: [a.rasterise("semantic", np.dtype(np.uint8)) for a in per], args.repeats)
        if not args.no_builds:   # the same annotations over images of px x px (the JSON says so)
            make_file(ann, args.annotations, (px, px))
        builds = {} if args.no_builds else build_rows(ann, tmp, args.repeats, px)
    scale = 100_000 / args.annotations
    print(f"{args.annotations} annotations, {len(src.images)} images, {mib:.0f} MiB of JSON, medians of "
          f"{args.repeats}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| stage | s | s per 100k annotations | x json.load |")
    print("|---|---:|---:|---:|")
    base = times["json.load"]
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {t * scale:.2f} | {t / base:.2f}x |")
    if builds:
        print(f"\n| whole build ({px}x{px} images, boxes) | s | x no-change rebuild before |")
        print("|---|---:|---:|")
        before = builds["no-change rebuild, JSON parsed (before)"]
        for name, t in builds.items():
            print(f"| {name} | {t:.2f} | {t / before:.2f}x |")
    print(f"\nworker: semantic mask of a 480x640 image with >= 5 objects: {raster / len(per) * 1000:.2f} ms "
          f"(median over {len(per)} images)")


if __name__ == "__main__":
    main()
