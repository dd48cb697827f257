"""Build speed per sample against the peers (issue 33): N photo-like 500x375 JPEGs -> 64x64 on this machine's cores.

Contenders, each a fresh Python process per run (its wall time includes the interpreter's start and its imports,
as a user runs it), taking turns run by run (a busy spell of the shared machine hits each), medians of
``--repeats``:

- ``precompile -jJ`` for each checkout given (``--repos``: this one, and e.g. the base branch's for a before /
  after in one run): ``precompile.build`` of the peers' recipe (``resize: {size: [64, 64]}``, hdf5, shards of
  256, the image decoder's defaults: ``reduce: auto``);
- ``ideal -jJ``: the full-decode ideal, nothing but the work: ``simplejpeg`` full decode (libjpeg-turbo, the
  fastest full decode here) and OpenCV's area resize to 64x64 in J processes (a ``multiprocessing`` pool over
  J slices of the file list), the results gathered into one array and saved as one ``.npy``;
- ``litdata -jJ``: LitData's ``optimize`` (``num_workers=J``, chunks of 64 MB) with the same decode and resize
  per item (skipped with a note when ``litdata`` is not importable; ``--litdata-python`` runs it from another
  interpreter, e.g. a venv with it installed).

Printed: wall seconds and samples/s per contender, and each precompile row's ratio to the ideal's and LitData's
samples/s at the same -j, measured in this run; the load average before and after.

    PYTHONPATH=. python benchmarks/bench_peers.py [--photos 20000] [--jobs 2] [--repeats 3] \\
        [--repos .,/path/to/base-checkout] [--litdata-python /tmp/venv-lit/bin/python] [--dir DIR]
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
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

_PRECOMPILE = r"""
import json, sys, time
t0 = time.perf_counter()
import precompile
recipe, out, j = sys.argv[1], sys.argv[2], int(sys.argv[3])
t1 = time.perf_counter()
rep = precompile.build(recipe, out_dir=out, n_jobs=j)
t2 = time.perf_counter()
print(json.dumps({"inner_s": t2 - t1, "file": precompile.__file__, "n": rep.num_samples
                  if hasattr(rep, "num_samples") else None}))
"""

_KERNEL = r"""
import numpy as np, cv2, simplejpeg
cv2.setNumThreads(1)

def one(path):
    with open(path, "rb") as f:
        a = simplejpeg.decode_jpeg(f.read(), "RGB")
    return cv2.resize(a, (64, 64), interpolation=cv2.INTER_AREA)
"""

_IDEAL = _KERNEL + r"""
import json, sys, time
from multiprocessing import get_context

def part(paths):
    return np.stack([one(p) for p in paths])

if __name__ == "__main__":
    t1 = time.perf_counter()
    listing, out, j = sys.argv[1], sys.argv[2], int(sys.argv[3])
    paths = open(listing).read().split("\n")
    parts = [paths[i * len(paths) // j:(i + 1) * len(paths) // j] for i in range(j)]
    if j == 1:
        res = [part(parts[0])]
    else:
        with get_context("fork").Pool(j) as pool:
            res = pool.map(part, parts)
    np.save(out, np.concatenate(res))
    print(json.dumps({"inner_s": time.perf_counter() - t1}))
"""

_LITDATA = _KERNEL + r"""
import json, sys, time

def item(path):
    return {"image": one(path), "label": int(path.rsplit("/", 2)[-2][1:])}

if __name__ == "__main__":
    import litdata
    t1 = time.perf_counter()
    listing, out, j = sys.argv[1], sys.argv[2], int(sys.argv[3])
    paths = open(listing).read().split("\n")
    litdata.optimize(fn=item, inputs=paths, output_dir=out, chunk_bytes="64MB", num_workers=j, mode="overwrite")
    print(json.dumps({"inner_s": time.perf_counter() - t1}))
"""


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _run(argv: list[str], env: dict, cwd: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--photos", type=int, default=20000)
    ap.add_argument("--jobs", default="2", help="comma-separated process counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repos", default=REPO, help="comma-separated checkouts of precompile to measure")
    ap.add_argument("--litdata-python", default=sys.executable, help="the interpreter that runs LitData")
    ap.add_argument("--dir", default=None, help="keep the JPEGs here (reused by a later run)")
    args = ap.parse_args()
    from bench_scale import _label, make_photos

    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-peers-")
    root = os.path.join(work, f"photos-{args.photos}")
    make_photos(root, args.photos)
    paths = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".jpg"))
    listing = os.path.join(work, "paths.txt")
    with open(listing, "w") as f:
        f.write("\n".join(paths))
    recipe = os.path.join(work, "peers.yaml")
    import yaml

    with open(recipe, "w") as f:
        yaml.safe_dump({"name": "peers", "seed": 0,
                        "inputs": {"root": root, "match": "{label}/{name}.jpg",
                                   "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                   "label": {"capture": "label"}},
                        "steps": [{"resize": {"size": [64, 64]}}],
                        "output": {"format": "hdf5", "samples_per_shard": 256}}, f)
    scripts = {}
    for name, code in (("ideal", _IDEAL), ("litdata", _LITDATA)):
        scripts[name] = os.path.join(work, f"peer_{name}.py")   # (not litdata.py: it would import itself)
        with open(scripts[name], "w") as f:
            f.write(code)
    repos = [os.path.abspath(r) for r in args.repos.split(",")]
    jobs = [int(j) for j in args.jobs.split(",")]
    has_litdata = subprocess.run([args.litdata_python, "-c", "import litdata"], capture_output=True).returncode == 0
    if not has_litdata:
        print(f"(litdata is not importable by {args.litdata_python}: its rows are skipped; "
              f"pip install litdata, or --litdata-python PATH)")
    contenders: list[tuple[str, int, list[str], dict, str]] = []
    for j in jobs:
        for repo in repos:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
            out = os.path.join(work, "out-precompile")
            contenders.append((f"precompile {_label(repo)}", j,
                               [sys.executable, "-c", _PRECOMPILE, recipe, out, str(j)], env, repo))
        env = dict(os.environ, PYTHONPATH="")
        contenders.append(("ideal (simplejpeg full decode + cv2 area)", j,
                           [sys.executable, scripts["ideal"], listing, os.path.join(work, "ideal.npy"), str(j)],
                           env, work))
        if has_litdata:
            contenders.append(("litdata optimize (same decode + resize)", j,
                               [args.litdata_python, scripts["litdata"], listing, os.path.join(work, "out-litdata"),
                                str(j)], env, work))
    print(f"{args.photos} JPEGs 500x375 (a third turned to 375x500) -> 64x64; {os.cpu_count()} cpus; "
          f"medians of {args.repeats}; load average before: {_load()}", flush=True)
    runs: dict[int, list[dict]] = {i: [] for i in range(len(contenders))}
    for _ in range(args.repeats):
        for i, (name, j, argv, env, cwd) in enumerate(contenders):
            for d in ("out-precompile", "out-litdata"):
                shutil.rmtree(os.path.join(work, d), ignore_errors=True)
            runs[i].append(_run(argv, env, cwd))
    rate = {}
    for i, (name, j, *_rest) in enumerate(contenders):
        wall = float(np.median([r["wall_s"] for r in runs[i]]))
        inner = float(np.median([r["inner_s"] for r in runs[i]]))
        rate[i] = (name, j, wall, inner, args.photos / wall)
    print("\n| contender | -j | wall s | samples/s | x ideal | x litdata | work s (no start/imports) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, (name, j, wall, inner, r) in rate.items():
        ideal = next(x[4] for x in rate.values() if x[0].startswith("ideal") and x[1] == j)
        lit = next((x[4] for x in rate.values() if x[0].startswith("litdata") and x[1] == j), None)
        print(f"| {name} | {j} | {wall:.2f} | {r:.0f} | {r / ideal:.2f} | "
              f"{'' if lit is None else f'{r / lit:.2f}'} | {inner:.2f} |")
    print(f"load average after: {_load()}")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
