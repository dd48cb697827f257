"""How the build and the readers scale with the number of inputs: N = 1k, 10k, 100k tiny images.

For each N, a tree of N tiny PNG files (8x8 RGB, 10 class folders) and a recipe
(resize to 8x8, 256 samples per shard). Each step runs in a fresh Python
process, as a user runs it, so its wall time includes the imports it needs,
and the process reports its own peak RSS (the build also its workers', sampled
from /proc every 0.1 s: a forked worker's ru_maxrss counts the parent's pages):

- ``plan``: load the recipe, match the inputs, plan shards, estimate the size;
- ``build -j2``: the first build (loky workers);
- ``rebuild``: the same build again with nothing changed (writes nothing);
- ``open``: ``precompile.open(index)`` and ``len``;
- ``Loader``: construction (shard chunk tables, maps) and the first batch of 256.

The table gives each figure per N and its growth factor per 10x in N
(``x10``): 10 is linear, less is better than linear. Index size is the
index file's bytes (keys, metadata, the virtual datasets).

    PYTHONPATH=. python benchmarks/bench_scale.py [--sizes 1000,10000,100000] [--dir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STEP = r"""
import json, resource, sys, time
t0 = time.perf_counter()
step, recipe, out = sys.argv[1], sys.argv[2], sys.argv[3]
res = {}
if step == "plan":
    from precompile.compiler.plan import make_plan
    from precompile.recipe import load_recipe
    p = make_plan(load_recipe(recipe))
    res["estimate"] = p.estimated_bytes()
elif step in ("build", "rebuild"):
    import os, threading
    peak = {"workers": 0}
    stop = threading.Event()

    def children(pid):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            return []
        return kids + [g for k in kids for g in children(k)]

    def sample():  # the workers' own resident memory (ru_maxrss of a forked child counts its parent's pages)
        while not stop.wait(0.1):
            for k in children(os.getpid()):
                try:
                    with open(f"/proc/{k}/status") as f:
                        rss = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
                    peak["workers"] = max(peak["workers"], rss)
                except (OSError, StopIteration, ValueError):
                    pass
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    from precompile import build
    rep = build(recipe, out, n_jobs=int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    stop.set()
    th.join()
    res["worker_rss"] = peak["workers"]
    res["built"], res["up_to_date"], res["bytes"] = rep["shards"]["built"], bool(rep.get("up_to_date")), rep["bytes"]
    res["stage_seconds"], res["build_s"] = dict(rep["stage_seconds"]), rep["wall_seconds"]
elif step == "open":
    import precompile
    ds = precompile.open(out + "/tiny.h5")
    res["n"] = len(ds)
elif step == "loader":
    from precompile.reader.loader import Loader
    t1 = time.perf_counter()
    loader = Loader(out + "/tiny.h5", batch_size=256, shuffle=True, device="cpu", fields=["image"])
    t2 = time.perf_counter()
    b = next(iter(loader))
    t3 = time.perf_counter()
    res["construct_s"], res["first_batch_s"], res["n"] = t2 - t1, t3 - t2, int(b["image"].shape[0])
ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rc = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes on macOS, KiB on Linux
res["rss"], res["child_rss"], res["inner_s"] = ru * scale, rc * scale, time.perf_counter() - t0
print(json.dumps(res))
"""


def make_inputs(root: str, n: int) -> None:
    """``n`` 8x8 RGB PNG files in 10 class folders (written once, reused by a later run with --dir)."""
    import cv2

    done = os.path.join(root, f".done-{n}")
    if os.path.exists(done):
        return
    rng = np.random.default_rng(n)
    for c in range(10):
        os.makedirs(os.path.join(root, f"c{c}"), exist_ok=True)
    for i in range(n):
        img = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        cv2.imwrite(os.path.join(root, f"c{i % 10}", f"{i:07d}.png"), img)
    open(done, "w").close()


def write_recipe(path: str, root: str) -> None:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump({"name": "tiny", "seed": 0,
                        "inputs": {"root": root, "match": "{label}/{name}.png",
                                   "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                   "label": {"capture": "label"}},
                        "steps": [{"resize": {"size": [8, 8]}}],
                        "output": {"format": "hdf5", "samples_per_shard": 256}}, f)


def run_step(step: str, recipe: str, out: str, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _STEP, step, recipe, out, *extra], capture_output=True, text=True,
                       env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{step} failed:\n{p.stderr}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="input counts, comma-separated")
    ap.add_argument("--dir", default=None, help="work folder (inputs are kept and reused between runs)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--jobs", default=None, help="-j scaling instead: worker counts, e.g. 1,2 (see jobs_table)")
    ap.add_argument("--photos", type=int, default=2000, help="with --jobs: how many 500x375 JPEG inputs")
    ap.add_argument("--targets", default="256,64", help="with --jobs: resize targets (shorter side; 64 = 64x64)")
    ap.add_argument("--fast", action="store_true", help="with --jobs: resize with fast: true")
    args = ap.parse_args(argv)
    if args.jobs:
        return jobs_table(args)
    sizes = [int(x) for x in args.sizes.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-scale-")
    os.makedirs(work, exist_ok=True)
    print(f"work folder {work}; {os.cpu_count()} cpus; each step a fresh process (imports included)")
    table: dict[int, dict[str, float]] = {}
    for n in sizes:
        root = os.path.join(work, f"in-{n}")
        t0 = time.perf_counter()
        make_inputs(root, n)
        recipe = os.path.join(work, f"tiny-{n}.yaml")
        write_recipe(recipe, root)
        out = os.path.join(work, f"out-{n}")
        shutil.rmtree(out, ignore_errors=True)
        print(f"N={n}: inputs ready in {time.perf_counter() - t0:.1f} s", flush=True)
        plan = run_step("plan", recipe, out)
        first = run_step("build", recipe, out)
        again = run_step("rebuild", recipe, out)
        assert again["up_to_date"] and again["built"] == 0, again
        opened = run_step("open", recipe, out)
        assert opened["n"] == n
        ld = run_step("loader", recipe, out)
        written = sum(e.stat().st_size for e in os.scandir(os.path.join(out, "tiny.shards")) if e.name.endswith(".h5"))
        table[n] = {
            "plan s": plan["wall_s"], "plan RSS MiB": plan["rss"] / 2**20,
            "estimate / written": plan["estimate"] / written,
            "build -j2 s": first["wall_s"], "build RSS MiB": first["rss"] / 2**20,
            "build worker RSS MiB": first["worker_rss"] / 2**20,
            "rebuild s": again["wall_s"], "rebuild / build": again["wall_s"] / first["wall_s"],
            "rebuild RSS MiB": again["rss"] / 2**20,
            "open s": opened["wall_s"], "open RSS MiB": opened["rss"] / 2**20,
            "Loader() s": ld["construct_s"], "first batch ms": 1e3 * ld["first_batch_s"],
            "Loader RSS MiB": ld["rss"] / 2**20,
            "index KiB": os.path.getsize(os.path.join(out, "tiny.h5")) / 1024,
            "shards KiB": written / 1024,
        }
        print(f"N={n}: build {first['wall_s']:.1f} s, rebuild {again['wall_s']:.2f} s", flush=True)
    print()
    head = "| figure | " + " | ".join(f"N={n:,}" for n in sizes) + " | " + \
        " | ".join(f"x10 ({sizes[i]:,}->{sizes[i + 1]:,})" for i in range(len(sizes) - 1)) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(sizes) - 1))
    for key in table[sizes[0]]:
        vals = [table[n][key] for n in sizes]
        growth = []
        for i in range(len(sizes) - 1):
            per10 = (vals[i + 1] / vals[i]) ** (1 / np.log10(sizes[i + 1] / sizes[i])) if vals[i] > 0 else float("nan")
            growth.append(f"{per10:.2f}")
        if "/" in key:
            growth = ["-"] * len(growth)   # a ratio: read it, not its growth
        print(f"| {key} | " + " | ".join(f"{v:,.3g}" if v < 100 else f"{v:,.0f}" for v in vals) + " | "
              + " | ".join(growth) + " |")
    if not args.keep and not args.dir:
        shutil.rmtree(work, ignore_errors=True)


def make_photos(root: str, n: int) -> None:
    """``n`` photo-like 500x375 (or 375x500) JPEG files in 10 class folders (kept for a later run with --dir)."""
    import cv2

    from tests.test_resize_fast import scene

    done = os.path.join(root, f".done-{n}")
    if os.path.exists(done):
        return
    base = [scene(375, 500, s) for s in range(8)]
    for c in range(10):
        os.makedirs(os.path.join(root, f"c{c}"), exist_ok=True)
    for i in range(n):
        img = np.roll(base[i % 8], i * 7, axis=1)
        img = img if i % 3 else np.ascontiguousarray(img.transpose(1, 0, 2))
        cv2.imwrite(os.path.join(root, f"c{i % 10}", f"{i:07d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    open(done, "w").close()


def jobs_table(args: argparse.Namespace) -> None:
    """-j1..-jN scaling of a build of ``--photos`` JPEGs, each resize target: wall seconds (a fresh process,
    imports included), samples/s, speed-up over -j1 and its share of linear, and against the work itself:
    the stage seconds (decode + steps + write) summed over the workers, as a rate per core (``work/s/core``),
    ``ideal s`` = summed / j, ``serial s`` = wall - ideal (plan, worker start, the parent, finalize)."""
    import yaml

    jobs = [int(j) for j in args.jobs.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-jobs-")
    root = os.path.join(work, f"photos-{args.photos}")
    make_photos(root, args.photos)
    print(f"{args.photos} JPEGs 500x375 in {work}; {os.cpu_count()} cpus; fast={args.fast}")
    print("| target | -j | wall s | samples/s | x -j1 | of linear | work s (summed) | work/s/core | ideal s "
          "| serial s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in (int(x) for x in args.targets.split(",")):
        resize = {"size": [64, 64]} if t == 64 else {"shorter": t}
        if args.fast:
            resize["fast"] = True
        recipe = os.path.join(work, f"photos-{t}.yaml")
        with open(recipe, "w") as f:
            yaml.safe_dump({"name": "tiny", "seed": 0,
                            "inputs": {"root": root, "match": "{label}/{name}.jpg",
                                       "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                       "label": {"capture": "label"}},
                            "steps": [{"resize": resize}, {"center_crop": {"size": [t, t]}}],
                            "output": {"format": "hdf5", "samples_per_shard": 256}}, f)
        base = None
        for j in jobs:
            out = os.path.join(work, f"out-{t}-{j}")
            shutil.rmtree(out, ignore_errors=True)
            r = run_step("build", recipe, out, str(j))
            summed = sum(r["stage_seconds"].get(k, 0.0) for k in ("decode", "steps", "write"))
            rate = args.photos / r["wall_s"]
            base = base or rate
            ideal = summed / j
            print(f"| {t} | {j} | {r['wall_s']:.2f} | {rate:.0f} | {rate / base:.2f} | {rate / base / j:.2f} | "
                  f"{summed:.2f} | {args.photos / summed:.0f} | {ideal:.2f} | {r['wall_s'] - ideal:.2f} |", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep and not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
