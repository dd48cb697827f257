"""Where the serial part of ``precompile build`` goes (issue 33): a per-phase table of the parent process.

Each run is a fresh ``python`` process that runs the CLI's ``build`` command as a user does
(``precompile build RECIPE -o OUT -j J --force --no-progress``), with the build's phases timed by wrappers
around the driver's functions (nothing in precompile is changed; wall and the parent's own CPU seconds):

- ``interpreter``: from this script's spawn of the process to its first line (interpreter start, ``site``);
- ``imports``: ``precompile.cli`` and the build path it imports (``precompile.compiler``), to the CLI's call
  of ``build`` (the wrappers go on as each module is imported, by an import hook: the CLI imports as it does
  for a user);
- ``recipe parse``: YAML -> validated Recipe (``driver.as_recipe``);
- ``input listing``: ``read_inputs`` (walking the root, matching, the table of items);
- ``plan``: the rest of ``make_plan`` (shards, specs, checks);
- ``shard keys``: ``driver._keys`` (fingerprints of every input: a stat each, or hashing with --content-hash);
- ``setup``: the rest of ``build`` before its stages (output folder, lock, start_pool, ...);
- ``sort/check``: the stages before the shards run (temporaries, the no-op check, free space, ...);
- ``preload``: the imports done before forking the workers (``backends.preload``);
- ``worker start``: ``ForkPool.start`` (the fork itself);
- ``work``: the shards running (inline at -j1; at -jN the parent waits for its workers);
- ``index/commit``: ``driver._conclude`` (the index, the report, the rename into place);
- ``cli+exit``: the CLI's summary lines and the interpreter's exit (to the process's end; its CPU column stops
  at the exit: the ``CPU s`` row has the whole process's, from the parent's rusage of its children).

``serial s`` is the wall minus the summed per-sample work (decode + steps + write over all workers) / J.
Medians of ``--repeats`` runs; ``--repo A,B`` measures several checkouts taking turns (a before/after table
in one run; e.g. an exported main: ``git archive main | tar -x -C /tmp/base``), with the ratio B/A.
``--importtime`` adds the modules that cost most to import (``-X importtime`` self times, summed by top-level
package, medians).

    PYTHONPATH=. python benchmarks/bench_serial.py --recipe recipes/images.yaml --jobs 1,2 --repeats 7
    PYTHONPATH=. python benchmarks/bench_serial.py --photos 2000 --jobs 1,2 --repeats 5 --repo /tmp/base,.

Python's bytecode cache is on in the runs (``PYTHONDONTWRITEBYTECODE`` is removed from their environment), as
on a user's machine; a first, unmeasured run of each checkout writes it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys, time
T = {"start": time.perf_counter()}
C = {"start": time.process_time()}
recipe, out, j, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
import importlib.abc, importlib.machinery
acc = {}


def wrap(owner, name, phase):
    fn = getattr(owner, name)

    def timed(*a, **k):
        if phase == "build" and "imports" not in T:   # the CLI has imported the build path: its call starts
            T["imports"], C["imports"] = time.perf_counter(), time.process_time()
        t, c = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            w, p = acc.get(phase, (0.0, 0.0))
            acc[phase] = (w + time.perf_counter() - t, p + time.process_time() - c)
    setattr(owner, name, timed)


WRAPS = {   # wrapped as each module is first imported (by the CLI, as a user's build imports them)
    "precompile.compiler": [("build", "build")],   # what the CLI calls (``from .compiler import build``)
    "precompile.compiler.driver": [("as_recipe", "parse"), ("make_plan", "plan+listing"), ("_keys", "keys"),
                                   ("_stages", "stages"), ("_run_stage", "run"), ("_conclude", "finalize")],
    "precompile.compiler.plan": [("read_inputs", "listing")],
    "precompile.compiler.backends": [("preload", "preload")],
    "precompile.compiler.forkpool": [("ForkPool.start", "fork")],
}


class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WRAPS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, run=run):
            run(module)
            for attr, phase in WRAPS[name]:
                owner, _, leaf = attr.rpartition(".")
                wrap(getattr(module, owner) if owner else module, leaf, phase)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Hook())
import precompile.cli as cli
try:
    cli.main(["build", recipe, "-o", out, "-j", j, "--force", "--no-progress"] + extra, standalone_mode=False)
except SystemExit as e:
    if e.code:
        raise
T["main"], C["main"] = time.perf_counter(), time.process_time()
print("\n" + json.dumps({"T": T, "C": C, "acc": acc}), flush=True)
"""

PHASES = ["interpreter", "imports", "recipe parse", "input listing", "plan", "shard keys", "setup", "sort/check",
          "preload", "worker start", "work", "index/commit", "cli+exit"]


def run_once(recipe: str, out: str, j: int, repo: str, extra: list[str]) -> dict:
    """One fresh process of ``repo``'s CLI build: its phases (wall, parent CPU), wall, summed work."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    shutil.rmtree(out, ignore_errors=True)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()   # CLOCK_MONOTONIC: the same clock as the child's perf_counter on Linux
    p = subprocess.run([sys.executable, "-c", _CHILD, recipe, out, str(j), json.dumps(extra)],
                       capture_output=True, text=True, env=env, cwd=repo)
    t1 = time.perf_counter()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{recipe} -j{j} ({repo}) failed:\n{p.stderr[-3000:]}")
    d = json.loads(p.stdout.strip().splitlines()[-1])
    reports = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".report.json") and f.count(".") == 2]
    with open(max(reports, key=os.path.getmtime)) as f:
        rep = json.load(f)
    T, C, acc = d["T"], d["C"], d["acc"]
    z = (0.0, 0.0)

    def a(k: str, i: int) -> float:
        return acc.get(k, z)[i]

    ph: dict[str, tuple[float, float]] = {}
    for i in (0, 1):
        v = {
            "imports": (T["imports"] - T["start"]) if i == 0 else (C["imports"] - C["start"]),
            "recipe parse": a("parse", i),
            "input listing": a("listing", i),
            "plan": a("plan+listing", i) - a("listing", i),
            "shard keys": a("keys", i),
            "setup": a("build", i) - a("parse", i) - a("plan+listing", i) - a("keys", i) - a("stages", i),
            "sort/check": a("stages", i) - a("run", i) - a("finalize", i),
            "preload": a("preload", i),
            "worker start": a("fork", i),
            "work": a("run", i) - a("preload", i) - a("fork", i),
            "index/commit": a("finalize", i),
        }
        if i == 0:
            v["interpreter"] = T["start"] - t0
            v["cli+exit"] = (T["main"] - T["imports"] - a("build", 0)) + (t1 - T["main"])
        else:
            v["interpreter"] = float("nan")
            v["cli+exit"] = (C["main"] - C["imports"]) - a("build", 1)
        for k, x in v.items():
            ph.setdefault(k, [0.0, 0.0])[i] = x
    work = sum(rep["stage_seconds"].get(k, 0.0) for k in ("decode", "steps", "write"))
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime   # the process and its workers, exit included
    return {"phases": ph, "wall": t1 - t0, "work": work, "cpu": cpu, "inputs": rep["inputs"], "shards": rep["shards"]["total"]}


def importtime(repo: str, recipe: str, out: str, j: int) -> dict[str, float]:
    """Self import seconds by top-level package (``-X importtime``) of one CLI build."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "precompile.cli", "build", recipe, "-o", out,
                        "-j", str(j), "--force", "--no-progress"], capture_output=True, text=True, env=env, cwd=repo)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    by: dict[str, float] = collections.Counter()
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line.split(":", 1)[1].split("|")
        by[name.strip().split(".")[0]] += int(self_us) / 1e6
    return by


def make_photo_recipe(work: str, n: int) -> str:
    """``n`` 500x375 JPEGs (bench_scale's photos) -> 64x64, 256 per shard, as bench_scale's --jobs table."""
    sys.path.insert(0, REPO)
    from benchmarks.bench_scale import make_photos, write_photo_recipe

    root = os.path.join(work, f"photos-{n}")
    make_photos(root, n)
    return write_photo_recipe(os.path.join(work, f"photos-{n}-64.yaml"), root, 64)


def _label(repo: str) -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return os.path.basename(repo.rstrip("/")) + (f"@{head}" if head else "") + \
        ("+" if head and git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=None, help="a recipe file (e.g. recipes/images.yaml, under the repository)")
    ap.add_argument("--photos", type=int, default=0, help="instead: this many generated 500x375 JPEGs -> 64x64")
    ap.add_argument("--dir", default=None, help="work folder (generated photos are kept and reused)")
    ap.add_argument("--jobs", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--repo", default=None, help="checkouts to measure, comma-separated (default: this one)")
    ap.add_argument("--importtime", action="store_true", help="and the import self time by package")
    args = ap.parse_args(argv)
    repos = [os.path.abspath(r) for r in args.repo.split(",")] if args.repo else [REPO]
    jobs = [int(j) for j in args.jobs.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-serial-")
    os.makedirs(work, exist_ok=True)
    if args.photos:
        recipe, what = make_photo_recipe(work, args.photos), f"{args.photos} JPEGs 500x375 -> 64x64"
    else:
        recipe, what = os.path.abspath(args.recipe or os.path.join(REPO, "recipes/images.yaml")), args.recipe
    out = os.path.join(work, "out")
    print(f"{what}; {os.cpu_count()} cpus; load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"medians of {args.repeats} runs, the checkouts and job counts taking turns")
    for repo in repos:   # writes the bytecode caches
        run_once(recipe, out, jobs[0], repo, [])
    runs: dict[tuple[str, int], list[dict]] = {(r, j): [] for r in repos for j in jobs}
    for _ in range(args.repeats):
        for j in jobs:
            for repo in repos:
                runs[repo, j].append(run_once(recipe, out, j, repo, []))
    med = lambda xs: float(np.median(xs))   # noqa: E731
    cols = [(r, j) for j in jobs for r in repos]
    labels = {r: _label(r) for r in repos}
    print()
    print("wall ms (parent CPU ms) per phase")
    print()
    print("| phase | " + " | ".join(f"{labels[r]} -j{j}" for r, j in cols) +
          (" | " + " | ".join(f"-j{j} ratio" for j in jobs) if len(repos) > 1 else "") + " |")
    print("|---|" + "---:|" * (len(cols) + (len(jobs) if len(repos) > 1 else 0)))
    for k in PHASES:
        cells, w = [], {}
        for r, j in cols:
            wv = med([x["phases"][k][0] for x in runs[r, j]])
            cv = med([x["phases"][k][1] for x in runs[r, j]])
            w[r, j] = wv
            cells.append(f"{1e3 * wv:.0f}" + ("" if np.isnan(cv) else f" ({1e3 * cv:.0f})"))
        ratios = [f"{w[repos[-1], j] / w[repos[0], j]:.2f}" if w[repos[0], j] > 5e-4 else "-" for j in jobs] \
            if len(repos) > 1 else []
        print(f"| {k} | " + " | ".join(cells + ratios) + " |")
    rows = {"wall s": lambda x: x["wall"], "CPU s (process + workers, exit included)": lambda x: x["cpu"],
            "work s (summed)": lambda x: x["work"]}
    for name, f in rows.items():
        vals = {c: med([f(x) for x in runs[c]]) for c in cols}
        ratios = [f"{vals[repos[-1], j] / vals[repos[0], j]:.2f}" for j in jobs] if len(repos) > 1 else []
        print(f"| **{name}** | " + " | ".join(f"{vals[c]:.3f}" for c in cols) + (" | " + " | ".join(ratios)
                                                                                if ratios else "") + " |")
    ser = {c: med([x["wall"] - x["work"] / c[1] for x in runs[c]]) for c in cols}
    ratios = [f"{ser[repos[-1], j] / ser[repos[0], j]:.2f}" for j in jobs] if len(repos) > 1 else []
    print("| **serial s** (wall - work/j) | " + " | ".join(f"{ser[c]:.3f}" for c in cols)
          + (" | " + " | ".join(ratios) if ratios else "") + " |")
    for r in repos:
        base = med([x["wall"] for x in runs[r, jobs[0]]])
        print(f"{labels[r]}: " + ", ".join(f"-j{j} wall {med([x['wall'] for x in runs[r, j]]):.3f} s "
                                           f"({base / med([x['wall'] for x in runs[r, j]]):.2f}x -j{jobs[0]})"
                                           for j in jobs)
              + f"; {runs[r, jobs[0]][0]['inputs']} inputs, {runs[r, jobs[0]][0]['shards']} shards")
    if args.importtime:
        print()
        print("import self time by top-level package, ms (-X importtime, -j1, medians)")
        it = {r: [importtime(r, recipe, out, 1) for _ in range(args.repeats)] for r in repos}
        names = collections.Counter()
        for r in repos:
            for d in it[r]:
                names.update(d)
        top = [n for n, _ in names.most_common(16)]
        print("| package | " + " | ".join(labels[r] for r in repos) + " |")
        print("|---|" + "---:|" * len(repos))
        for n in top + ["(all)"]:
            print(f"| {n} | " + " | ".join(
                f"{1e3 * med([sum(d.values()) if n == '(all)' else d.get(n, 0.0) for d in it[r]]):.0f}"
                for r in repos) + " |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    else:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
