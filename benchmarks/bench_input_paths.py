"""What the input path rule costs per input (issue 34.4; inputs/paths.py ``InputRoot.check``): the check of
a path as written and with its symbolic links resolved, against what ``decode_item`` already does for every
local input (``os.path.exists``) and against decoding a small image, same run.

Makes a root five folders below the temporary folder, 2000 small PNGs under it two folders deep (and a
link inside the root to one of them), and times, per input, medians of --repeats passes over all of them:

  exists          os.path.exists(path): what decode_item did before the rule (and still does where the
                  rule's look-ups did not find the file: a link, or follow_links: outside)
  rule            InputRoot.check(path): the text, then one lstat per part below the root (folders
                  found plain remembered, so about one per input); it also tells that the file exists
  rule (outside)  InputRoot.check with inputs.follow_links: outside (the text only) + os.path.exists
  decode 64x64    ImageDecoder.decode of one 64x64 PNG (the smallest input worth building)

    python benchmarks/bench_input_paths.py [--repeats 7] [--files 2000]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--files", type=int, default=2000)
    a = ap.parse_args()
    from PIL import Image

    from precompile.inputs.paths import InputRoot
    from precompile.decoders.image import ImageDecoder
    from precompile.recipe import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "data", "sets", "vision", "coco", "train")
        paths = []
        img = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        for i in range(a.files):
            p = root / f"d{i % 20:02d}" / f"s{i % 7}" / f"{i:06d}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            if i == 0:
                Image.fromarray(img).save(p)
            else:
                os.link(paths[0], p)   # same bytes, its own name: the path walk is what is timed
            paths.append(str(p))
        os.symlink(paths[1], root / "alias.png")
        paths.append(str(root / "alias.png"))
        rec = {"name": "b", "inputs": {"root": str(root), "match": "{n}.png", "fields": {"image": {"decoder": "image"}}}}
        rule = InputRoot(load_recipe(rec))
        rec["inputs"]["follow_links"] = "outside"
        loose = InputRoot(load_recipe(rec))
        dec = ImageDecoder()
        n = len(paths)
        rows = [("exists", median_time(lambda: [os.path.exists(p) for p in paths], a.repeats) / n),
                ("rule", median_time(lambda: [rule.check(p) for p in paths], a.repeats) / n),
                ("rule (outside)", median_time(lambda: [loose.check(p) or os.path.exists(p) for p in paths],
                                               a.repeats) / n),
                ("decode 64x64", median_time(lambda: [dec.decode(p, "image") for p in paths[:200]], a.repeats) / 200)]
    base = rows[0][1]
    decode = rows[-1][1]
    print(f"per input, median of {a.repeats} passes over {n} paths (root {len(root.parts) - 1} folders deep, "
          f"inputs 2 below it)")
    print(f"{'':16s} {'us/input':>9s} {'x exists':>9s} {'% of decode 64x64':>18s}")
    for name, t in rows:
        print(f"{name:16s} {t * 1e6:9.2f} {t / base:9.2f} {100 * t / decode:17.1f}%")


if __name__ == "__main__":
    main()
