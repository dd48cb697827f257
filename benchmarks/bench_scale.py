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

Worker start and -j scaling (issue 33; each a fresh process per run, medians over ``--repeats``):

    python benchmarks/bench_scale.py --pool 1,2 [--repeats 7]           # N workers ready, after the imports
    python benchmarks/bench_scale.py --recipes 'recipes/*.yaml' [--repeats 5]   # the tour's -j1 against -j2
    python benchmarks/bench_scale.py --videos 8 [--frames 120] [--repeats 3]    # a few heavy inputs, -j1 against -j2
    python benchmarks/bench_scale.py --jobs 1,2 --photos 2000 [--repeats 3] [--joblib]  # wall, summed work, serial part
                                                   # (--joblib: and a hand-written joblib pool of the same work)

``--repo PATH`` measures another checkout of precompile (e.g. the main branch, for a before/after table in one
run); ``PRECOMPILE_WORKERS=loky`` selects loky's worker start instead of the fork.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the code measured, unless --repo

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
elif step == "pool":   # N workers ready (each answered a trivial task), timed after this process's imports
    import os
    n = int(sys.argv[4])
    from precompile.compiler import backends
    method = getattr(backends, "worker_start", lambda: "loky")()   # a checkout from before issue 33: loky
    if method == "fork":
        backends.preload()
        from precompile.compiler.forkpool import ForkPool
        t1 = time.perf_counter()
        pool = ForkPool(n, lambda tid, isolate, sink: os.getpid())
        pool.start()
        for tid in range(n):
            pool.send(pool.idle(), tid, False)
        pids = set()
        while len(pids) < n:
            pids.update(r for _, kind, r in pool.events() if kind == "ok")
        t2 = time.perf_counter()
        pool.close()
    else:   # loky: the warm-up a build starts while it plans (the workers import the build path)
        import joblib
        import precompile.compiler.shard  # noqa: F401  (what the parent has imported when its shards run)
        t1 = time.perf_counter()
        pids = set(joblib.Parallel(n_jobs=n, backend="loky")(joblib.delayed(backends.warm_worker)() for _ in range(n)))
        t2 = time.perf_counter()
    res["method"], res["start_s"], res["workers"] = method, t2 - t1, len(pids)
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


def run_step(step: str, recipe: str, out: str, *extra: str, repo: str | None = None) -> dict:
    repo = repo or REPO
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _STEP, step, recipe, out, *extra], capture_output=True, text=True,
                       env=env, cwd=repo)   # the folder first on sys.path: the checkout measured
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
    ap.add_argument("--joblib", action="store_true", help="with --jobs: also a hand-written joblib pool (PIL decode, "
                    "cv2 resize, one HDF5 file) at each -j, the baseline issue 33 asks -j16 to beat")
    ap.add_argument("--repeats", type=int, default=1, help="with --jobs, --recipes, --pool: runs per figure (medians)")
    ap.add_argument("--recipes", default=None, help="the -j1 against -j2 table of these recipes (a glob under the "
                    "repository, e.g. 'recipes/*.yaml'), each a fresh `precompile build --force` process")
    ap.add_argument("--pool", default=None, help="worker counts, e.g. 1,2: how long N workers take to start "
                    "(each answers a trivial task) after the parent's own imports")
    ap.add_argument("--videos", type=int, default=0, help="a few heavy inputs at -j1 against -j2 (with --jobs "
                    "1,2 by default): this many 320x240 MPEG-4 videos (see heavy_table)")
    ap.add_argument("--frames", type=int, default=120, help="with --videos: frames per video")
    ap.add_argument("--repo", default=None, help="the precompile checkout(s) to measure, comma-separated (default: "
                    "this one); with --recipes and --jobs their runs take turns (a before/after table in one run)")
    args = ap.parse_args(argv)
    args.repos = [os.path.abspath(r) for r in args.repo.split(",")] if args.repo else [REPO]
    print(f"measuring {', '.join(_label(r) for r in args.repos)}; {os.cpu_count()} cpus; "
          f"load average before: {_load()}")
    if args.pool:
        return pool_table(args)
    if args.recipes:
        return recipes_table(args)
    if args.videos:
        return heavy_table(args)
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


def _label(repo: str) -> str:
    """A checkout as ``folder@commit`` (``+`` when it has changes not committed)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")   # none for an exported tree (git archive)
    return os.path.basename(repo) + (f"@{head}" if head else "") + \
        ("+" if head and git("status", "--porcelain", "--untracked-files=no") else "")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _median(xs: list[float]) -> float:
    return float(np.median(xs))


def pool_table(args: argparse.Namespace) -> None:
    """Seconds until N workers have each answered a trivial task, from a process that has imported the build
    path (what a build's parent has done when its shards run): the worker start a parallel build pays."""
    print("| workers | checkout | start | start s (median) | runs (workers that answered) |")
    print("|---:|---|---|---:|---|")
    for n in (int(x) for x in args.pool.split(",")):
        for repo in args.repos:
            runs = [run_step("pool", "-", "-", str(n), repo=repo) for _ in range(args.repeats)]
            # loky: the warm-up a build starts (n tasks; a quick worker may take two); -j1 runs no worker at all
            print(f"| {n} | {_label(repo)} | {runs[0]['method']} | {_median([r['start_s'] for r in runs]):.3f} | "
                  + ", ".join(f"{r['start_s']:.3f} ({r['workers']})" for r in runs) + " |", flush=True)
    print(f"load average after: {_load()}")


def _cli_build(recipe: str, out: str, j: int, repo: str) -> dict:
    """``precompile build RECIPE -o OUT -j J --force --no-progress`` in a fresh process of ``repo``'s code: its wall
    seconds and its report's (stage seconds, summed over workers)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "precompile", "build", recipe, "-o", out, "-j", str(j), "--force",
                        "--no-progress"], capture_output=True, text=True, env=env, cwd=repo)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{recipe} -j{j} failed:\n{p.stderr}")
    reports = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".report.json") and f.count(".") == 2]
    with open(max(reports, key=os.path.getmtime)) as f:
        rep = json.load(f)
    work = sum(rep["stage_seconds"].get(k, 0.0) for k in ("decode", "steps", "write"))
    return {"wall_s": wall, "work_s": work, "inputs": rep["inputs"], "shards": rep["shards"]["total"],
            "one": "one process" if any(e.startswith("built in one process") for e in rep.get("events", [])) else
            "inline, then forked" if any(" in one process (a small build), then started workers" in e
                                         for e in rep.get("events", [])) else "forked"}


def _workers(j: int, runs: list[dict]) -> str:
    """Whether the runs had workers: ``-`` at -j1, ``one process`` when the small-build rule ran them in the
    build's own process, ``inline, then forked`` when it handed the rest to workers (its notes in the report),
    else ``forked``; the runs' kinds joined by ``/`` when they differ."""
    return "-" if j == 1 else " / ".join(sorted({r["one"] for r in runs}))


def make_videos(root: str, n: int, frames: int, size: tuple[int, int] = (240, 320)) -> None:
    """``n`` MPEG-4 videos (``frames`` frames of ``size``, a moving square on smooth noise), written once."""
    import cv2

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(3)
    h, w = size
    for i in range(n):
        path = os.path.join(root, f"clip_{i:03d}.mp4")
        if os.path.exists(path):
            continue
        bg = cv2.resize(rng.integers(0, 256, (6, 8, 3)).astype(np.uint8), (w, h), interpolation=cv2.INTER_CUBIC)
        wr = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 25, (w, h))
        for t in range(frames):
            fr = bg.copy()
            cx, cy = (20 + 3 * t + 7 * i) % w, (20 + 2 * t) % h
            cv2.rectangle(fr, (cx - 12, cy - 12), (cx + 12, cy + 12), (40, 200, 230), -1)
            wr.write(fr)
        wr.release()


def heavy_table(args: argparse.Namespace) -> None:
    """A few heavy inputs, -j1 against -j2 (``--videos N``): N MPEG-4 videos of ``--frames`` 320x240 frames,
    each cut into 8-frame clips resized to 112x112, 2 videos a shard: few samples, much work each, the build
    the small-build rule must leave to its workers. Each run a fresh CLI process; medians."""
    import yaml

    jobs = [int(j) for j in (args.jobs or "1,2").split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-heavy-")
    root = os.path.join(work, f"videos-{args.videos}-{args.frames}")
    make_videos(root, args.videos, args.frames)
    nbytes = sum(e.stat().st_size for e in os.scandir(root))
    recipe = os.path.join(work, "heavy.yaml")
    with open(recipe, "w") as f:
        yaml.safe_dump({"name": "heavy", "seed": 0,
                        "inputs": {"root": root, "match": "{name}.mp4", "fields": {"video": {"decoder": "video"}}},
                        "steps": [{"clips": {"length": 8, "stride": 8}}, {"resize": {"size": [112, 112]}}],
                        "output": {"samples_per_shard": 2}}, f)
    print(f"{args.videos} videos x {args.frames} frames 320x240 ({nbytes / 2**20:.2f} MiB) in {root}; "
          f"medians of {args.repeats} run(s)")
    print("| checkout | -j | wall s | x -j1 wall | work s (summed) | serial s | workers |")
    print("|---|---:|---:|---:|---:|---:|---|")
    runs: dict[tuple[str, int], list[dict]] = {(repo, j): [] for repo in args.repos for j in jobs}
    try:
        for _ in range(args.repeats):
            for repo in args.repos:
                for j in jobs:
                    runs[repo, j].append(_cli_build(recipe, os.path.join(work, f"out-j{j}"), j, repo))
        for repo in args.repos:
            base = _median([x["wall_s"] for x in runs[repo, jobs[0]]])
            for j in jobs:
                rs = runs[repo, j]
                wall, w = _median([x["wall_s"] for x in rs]), _median([x["work_s"] for x in rs])
                print(f"| {_label(repo)} | {j} | {wall:.2f} | {wall / base:.2f} | {w:.2f} | {wall - w / j:.2f} | "
                      f"{_workers(j, rs)} |", flush=True)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {_load()}")


def recipes_table(args: argparse.Namespace) -> None:
    """The README tour's ``precompile build RECIPE -j 1`` against ``-j 2`` for each recipe, as a user runs it
    (a fresh process, imports included; ``--force`` so every run builds every shard), the job counts (and the
    checkouts) taking turns: median wall seconds, the ratio to -j1's, and the serial part: wall - summed work / j
    (the imports, plan, worker start, the parent and finalize)."""
    import glob

    jobs = [int(j) for j in (args.jobs or "1,2").split(",")]
    recipes = sorted(glob.glob(os.path.join(args.repos[0], args.recipes)))
    work = tempfile.mkdtemp(prefix="precompile-bench-recipes-")
    print(f"{len(recipes)} recipe(s); medians of {args.repeats} run(s)")
    print("| recipe | inputs | shards | checkout | -j | wall s | x -j1 wall | work s (summed) | serial s | workers |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    totals = {(repo, j): 0.0 for repo in args.repos for j in jobs}
    try:
        for r in recipes:
            rel = os.path.relpath(r, args.repos[0])
            runs: dict[tuple[str, int], list[dict]] = {k: [] for k in totals}
            for _ in range(args.repeats):
                for repo in args.repos:
                    for j in jobs:
                        runs[repo, j].append(_cli_build(os.path.join(repo, rel), os.path.join(work, f"j{j}"), j, repo))
            for repo in args.repos:
                base = _median([x["wall_s"] for x in runs[repo, jobs[0]]])
                for j in jobs:
                    rs = runs[repo, j]
                    wall, w = _median([x["wall_s"] for x in rs]), _median([x["work_s"] for x in rs])
                    totals[repo, j] += wall
                    x = rs[0]
                    print(f"| {rel} | {x['inputs']} | {x['shards']} | {_label(repo)} | {j} | {wall:.2f} | "
                          f"{wall / base:.2f} | {w:.2f} | {wall - w / j:.2f} | {_workers(j, rs)} |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for repo in args.repos:
        print(f"| all | | | {_label(repo)} | " + " / ".join(str(j) for j in jobs) + " | "
              + " / ".join(f"{totals[repo, j]:.2f}" for j in jobs) + " | "
              + " / ".join(f"{totals[repo, j] / totals[repo, jobs[0]]:.2f}" for j in jobs) + " | | |")
    print(f"load average after: {_load()}")


def write_photo_recipe(path: str, root: str, target: int, fast: bool = False) -> str:
    """The photos' recipe at ``path``: each JPEG resized (``size`` at 64, else ``shorter``) and centre-cropped to
    ``target`` x ``target``, 256 samples a shard (the --jobs table's, and bench_serial's)."""
    import yaml

    resize: dict = {"size": [64, 64]} if target == 64 else {"shorter": target}
    if fast:
        resize["fast"] = True
    with open(path, "w") as f:
        yaml.safe_dump({"name": "tiny", "seed": 0,
                        "inputs": {"root": root, "match": "{label}/{name}.jpg",
                                   "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                   "label": {"capture": "label"}},
                        "steps": [{"resize": resize}, {"center_crop": {"size": [target, target]}}],
                        "output": {"format": "hdf5", "samples_per_shard": 256}}, f)
    return path


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

    def write(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            img = np.roll(base[i % 8], i * 7, axis=1)
            img = img if i % 3 else np.ascontiguousarray(img.transpose(1, 0, 2))
            cv2.imwrite(os.path.join(root, f"c{i % 10}", f"{i:07d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])

    from concurrent.futures import ThreadPoolExecutor   # cv2 releases the GIL while it encodes

    k = os.cpu_count() or 1
    with ThreadPoolExecutor(k) as ex:
        list(ex.map(lambda j: write(j * n // k, (j + 1) * n // k), range(k)))
    open(done, "w").close()


_JOBLIB = r"""
import json, os, sys, time
t0 = time.perf_counter()
root, out, j, t = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import cv2, h5py, numpy as np
from joblib import Parallel, delayed
from PIL import Image


def one(path):
    # what a user writes: full decode, the shorter side to t (area), the centre t x t (or t x t at 64)
    with Image.open(path) as im:
        a = np.asarray(im.convert("RGB"))
    h, w = a.shape[:2]
    if t == 64:
        return cv2.resize(a, (64, 64), interpolation=cv2.INTER_AREA)
    s = t / min(h, w)
    nh, nw = max(t, round(h * s)), max(t, round(w * s))
    a = cv2.resize(a, (nw, nh), interpolation=cv2.INTER_AREA)
    y, x = (nh - t) // 2, (nw - t) // 2
    return a[y:y + t, x:x + t]


files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".jpg"))
labels = sorted({os.path.basename(os.path.dirname(f)) for f in files})
t1 = time.perf_counter()
arrs = Parallel(n_jobs=j)(delayed(one)(f) for f in files)
os.makedirs(out, exist_ok=True)
with h5py.File(os.path.join(out, "pool.h5"), "w") as h:
    h.create_dataset("image", data=np.stack(arrs), chunks=(min(len(arrs), 64), t, t, 3))
    h.create_dataset("label", data=np.array([labels.index(os.path.basename(os.path.dirname(f))) for f in files]))
print(json.dumps({"build_s": time.perf_counter() - t1}))
"""


def run_joblib(root: str, out: str, j: int, t: int) -> dict:
    """The hand-written joblib pool in a fresh process (wall includes its imports, as a build's does)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _JOBLIB, root, out, str(j), str(t)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"joblib pool failed:\n{p.stderr}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def jobs_table(args: argparse.Namespace) -> None:
    """-j1..-jN scaling of a build of ``--photos`` JPEGs, each resize target: wall seconds (a fresh process,
    imports included), samples/s, speed-up over -j1 and its share of linear, and against the work itself:
    the stage seconds (decode + steps + write) summed over the workers, as a rate per core (``work/s/core``),
    ``ideal s`` = summed / j, ``serial s`` = wall - ideal (imports, plan, worker start, the parent, finalize,
    exit); ``build() s`` and its ``x -j1``: the same without the interpreter's start, imports and exit (the
    report's wall seconds, from the call of ``build`` to its return)."""
    jobs = [int(j) for j in args.jobs.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-jobs-")
    root = os.path.join(work, f"photos-{args.photos}")
    make_photos(root, args.photos)
    print(f"{args.photos} JPEGs 500x375 in {work}; {os.cpu_count()} cpus; fast={args.fast}; "
          f"medians of {args.repeats} run(s)")
    print("| target | checkout | -j | wall s | samples/s | x -j1 | of linear | work s (summed) | work/s/core "
          "| ideal s | serial s | build() s | x -j1 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in (int(x) for x in args.targets.split(",")):
        recipe = write_photo_recipe(os.path.join(work, f"photos-{t}.yaml"), root, t, args.fast)
        runs: dict[tuple[str, int], list[dict]] = {(repo, j): [] for repo in args.repos for j in jobs}
        pool: dict[int, list[dict]] = {j: [] for j in jobs}
        for _ in range(args.repeats):   # job counts and checkouts take turns: a busy spell of the machine hits each
            for repo in args.repos:
                for j in jobs:
                    out = os.path.join(work, f"out-{t}-{j}")
                    shutil.rmtree(out, ignore_errors=True)
                    r = run_step("build", recipe, out, str(j), repo=repo)
                    r["work_s"] = sum(r["stage_seconds"].get(k, 0.0) for k in ("decode", "steps", "write"))
                    runs[repo, j].append(r)
                    shutil.rmtree(out, ignore_errors=True)
            if args.joblib:
                for j in jobs:
                    out = os.path.join(work, f"pool-{t}-{j}")
                    shutil.rmtree(out, ignore_errors=True)
                    pool[j].append(run_joblib(root, out, j, t))
                    shutil.rmtree(out, ignore_errors=True)
        for repo in args.repos:
            base = inner_base = None
            for j in jobs:
                rs = runs[repo, j]
                wall, summed = _median([r["wall_s"] for r in rs]), _median([r["work_s"] for r in rs])
                inner = _median([r["build_s"] for r in rs])
                rate = args.photos / wall
                base, inner_base = base or rate, inner_base or inner
                ideal = summed / j
                print(f"| {t} | {_label(repo)} | {j} | {wall:.2f} | {rate:.0f} | {rate / base:.2f} | "
                      f"{rate / base / j:.2f} | {summed:.2f} | {args.photos / summed:.0f} | {ideal:.2f} | "
                      f"{wall - ideal:.2f} | {inner:.2f} | {inner_base / inner:.2f} |", flush=True)
        if args.joblib:
            base = None
            for j in jobs:
                wall = _median([r["wall_s"] for r in pool[j]])
                inner = _median([r["build_s"] for r in pool[j]])
                rate = args.photos / wall
                base = base or rate
                ours = args.photos / _median([r["wall_s"] for r in runs[args.repos[0], j]])
                print(f"| {t} | joblib pool (precompile {ours / rate:.2f}x) | {j} | {wall:.2f} | {rate:.0f} | "
                      f"{rate / base:.2f} | {rate / base / j:.2f} | | | | | {inner:.2f} | |", flush=True)
    print(f"load average after: {_load()}")
    if not args.keep and not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
