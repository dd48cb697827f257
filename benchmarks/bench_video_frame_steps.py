"""A whole video with a per-frame resize and no ``clips`` (issue 32.10): decoded whole, then resized (the
path before), against resized frame by frame as it is decoded (``temporal.FrameSteps``), same run.

Makes an MPEG-4 AVI shaped like OpenCV's vtest.avi (768x576, 10 fps; --frames of them, 795 in vtest.avi)
and builds it -j1 with ``resize: {size: [48, 64]}`` both ways, each in a fresh process, --repeats times in
turns; prints the median build wall time, the peak RSS growth of the building process (ru_maxrss), the
ratio of each, and whether the stored samples are byte-identical. The budget is raised for the old path
(``limits.input_bytes``: 8 GiB) so that it builds at all.

    PYTHONPATH=. python benchmarks/bench_video_frame_steps.py [--frames 300] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import precompile, precompile.transforms.temporal as temporal
recipe, out, old = sys.argv[1], sys.argv[2], sys.argv[3] == "old"
if old:
    temporal.frame_steps_plan = lambda decoders, steps: None
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
precompile.build(recipe, out_dir=out, n_jobs=1)
wall = time.perf_counter() - t0
print(json.dumps({"wall": wall, "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
"""


def make_video(path: Path, n: int, size=(768, 576)) -> None:
    import av

    rng = np.random.default_rng(0)
    w, h = size
    base = (np.add.outer(np.arange(h), np.arange(w)) % 256).astype(np.uint8)
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height = w, h
        s.pix_fmt = "yuv420p"
        for i in range(n):
            img = np.stack([np.roll(base, i * 3, axis=1), np.roll(base, i, axis=0), np.roll(base, -2 * i, axis=1)],
                           -1)
            img[rng.integers(0, h, 50), rng.integers(0, w, 50)] = 255
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import yaml

    import precompile

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        make_video(tmp / "in" / "vtest.avi", a.frames)
        r = {"name": "v", "inputs": {"root": str(tmp / "in"), "match": "{name}.avi",
                                     "fields": {"video": {"decoder": "video"}}},
             "steps": [{"resize": {"size": [48, 64]}}], "limits": {"input_bytes": 8 << 30},
             "output": {"format": "hdf5"}}
        (tmp / "r.yaml").write_text(yaml.safe_dump(r))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        res: dict[str, list[dict]] = {"old": [], "new": []}
        for i in range(a.repeats):
            for way in ("old", "new"):
                out = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "r.yaml"), str(tmp / f"{way}{i}"), way],
                                     capture_output=True, text=True, env=env, check=True)
                res[way].append(json.loads(out.stdout.strip().splitlines()[-1]))

        def dump(d: Path) -> list:
            ds = precompile.open(str(d / "v.h5"))
            return [(ds.key(i), ds.meta(i), {f: x.tobytes() for f, x in ds[i].items()}) for i in range(len(ds))]

        same = dump(tmp / "old0") == dump(tmp / "new0")
        src = a.frames * 768 * 576 * 3
        print(f"{a.frames} frames of 768x576 (source {src / 1e6:.0f} MB decoded; output "
              f"{a.frames * 48 * 64 * 3 / 1e6:.2f} MB); medians of {a.repeats} builds, -j1, fresh process each")
        print()
        print("| path | build s | peak RSS growth MB |")
        print("|---|---:|---:|")
        med = {w: (statistics.median(x["wall"] for x in v), statistics.median(x["peak_mb"] for x in v))
               for w, v in res.items()}
        print(f"| decode whole, then resize (before) | {med['old'][0]:.2f} | {med['old'][1]:.0f} |")
        print(f"| resize each frame as decoded (now) | {med['new'][0]:.2f} | {med['new'][1]:.0f} |")
        print(f"| before / now | {med['old'][0] / med['new'][0]:.2f} | {med['old'][1] / max(med['new'][1], 1):.1f} |")
        print()
        print(f"stored samples byte-identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
