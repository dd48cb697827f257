"""Plans that scale (issue 19) and builds that start warm (issue 26): every case runs in a fresh Python
process and reports its wall time and peak RSS (``ru_maxrss`` of the child, imports included).

Cases (``--cases``, comma-separated):

- ``synthetic``: a synthetic listing of N inputs fed to the plan through its listing seam
  (``make_plan(recipe, listing=...)``) in a realistic tree shape, ``train/<class>/<sub>/<class>_<id>.JPEG``
  (1000 classes, 1000 names a folder) with a size and mtime per name; the plan, then every shard key.
- ``walk``: a real tree of ``--walk-files`` empty files: the plan (scandir walk + a stat per match +
  match), against ``os.walk`` alone and ``os.walk`` + ``os.stat`` of every file.
- ``table``: a CSV and a Parquet table of N rows (path, class, a float target), planned (the rows' files
  do not exist: the keys stat each path and find nothing, as they would find a missing file); medians of
  ``--repeats`` runs, alternating with ``--before``.
- ``noop``: a real tree of ``--noop-files`` empty files, built once (-j2, a decoder that reads nothing),
  then rebuilt with nothing changed: index read, listing, keys, compared, nothing written.
- ``jobs``: ``--photos`` JPEGs (500x375) resized to 64x64 (and with ``--jobs-tree N``, N empty files
  through a decoder that reads nothing: a plan that takes longer), -j1 and -j2, with the workers started
  warm (the default) and cold (``start_pool`` switched off): the wall time split into the plan, how long
  the run waited for the warm pool, the time from the run's start to its first shard result, the run,
  and the stage times summed over workers.

With ``--before DIR`` (a checkout of the code before the columnar plan, e.g. main), the ``synthetic``
(plan only: its old walk is replaced by the same list), ``walk``, ``table`` and ``noop`` cases run on it
too, in the same run, and the table gives after / before.

    PYTHONPATH=. python benchmarks/bench_plan.py [--sizes 1000000,10000000] [--before ../main] [--cases ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, os, resource, sys, time
args = json.loads(sys.argv[1])
case, res = args["case"], {}
t0 = time.perf_counter()


def synthetic(n):
    import numpy as np
    rng = np.random.default_rng(0)
    per, classes = 1000, max(1, min(1000, n // 1000))
    subs = max(1, n // (per * classes))
    for c in range(classes):
        cls = f"n{c:08d}"
        for s in range(subs):
            rels = [f"train/{cls}/{s:04d}/{cls}_{s * per + i:08d}.JPEG" for i in range(per)]
            yield rels, rng.integers(2000, 200000, per), 1_600_000_000 * 10**9 + rng.integers(0, 10**15, per)


def recipe(root, **over):
    from precompile.recipe import parse_recipe
    r = {"name": "syn", "inputs": {"root": root, "match": "train/{label}/{sub}/{name}.JPEG",
         "fields": {"image": {"decoder": "image", "mode": "rgb8"}}, "label": {"capture": "label"}},
         "steps": [{"resize": {"size": [64, 64]}}], "output": {"samples_per_shard": 256}}
    r["inputs"].update(over)
    return parse_recipe(r)


def keys_of(plan):
    from precompile.compiler.keys import recipe_key, shard_key
    t = time.perf_counter()
    rk = recipe_key(plan.recipe)
    for s in plan.shards:
        shard_key(plan, s, rk)
    return time.perf_counter() - t


if case == "synthetic":
    from precompile.compiler import plan as P
    try:   # the listing's home: precompile/inputs/ (issue 36), compiler/plan.py before it
        from precompile.inputs.listing import Listed
    except ImportError:
        Listed = getattr(P, "Listed", None)
    r = recipe(args["root"])   # a folder that exists (the code before the seam checks it), never walked
    t = time.perf_counter()
    if Listed is not None:
        p = P.make_plan(r, listing=(Listed(rels, size=s, mtime=m) for rels, s, m in synthetic(args["n"])))
    else:   # the code before the listing seam: its walk returns the same names, sorted
        P._walk = lambda root, dirs: sorted(rel for rels, _, _ in synthetic(args["n"]) for rel in rels)
        p = P.make_plan(r)
    res["plan_s"], res["n"] = time.perf_counter() - t, len(p.items)
    if Listed is not None:
        res["keys_s"] = keys_of(p)
elif case == "walk":
    from precompile.compiler.plan import make_plan
    root = args["root"]
    if args.get("what") == "os.walk":
        t = time.perf_counter()
        n = sum(len(f) for _, _, f in os.walk(root))
        res["plan_s"], res["n"] = time.perf_counter() - t, n
    elif args.get("what") == "os.walk+stat":
        t = time.perf_counter()
        n = 0
        for d, _, files in os.walk(root):
            for f in files:
                os.stat(os.path.join(d, f))
                n += 1
        res["plan_s"], res["n"] = time.perf_counter() - t, n
    else:
        t = time.perf_counter()
        p = make_plan(recipe(root))
        res["plan_s"], res["n"] = time.perf_counter() - t, len(p.items)
        res["keys_s"] = keys_of(p)
elif case == "table":
    from precompile.compiler.plan import make_plan
    from precompile.recipe import parse_recipe
    r = parse_recipe({"name": "tab", "inputs": {"root": args["root"], "table": args["table"], "path": "{path}",
                      "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                      "columns": {"label": {"column": "cls", "kind": "label"}, "y": {"column": "y", "kind": "target"}}},
                      "output": {"samples_per_shard": 256}})
    t = time.perf_counter()
    p = make_plan(r)
    res["plan_s"], res["n"] = time.perf_counter() - t, len(p.items)
    if args["keys"]:
        res["keys_s"] = keys_of(p)
elif case in ("build", "noop"):
    from precompile import build
    rep = build(args["recipe"], args["out"], n_jobs=args.get("jobs", 1))
    res["n"], res["up_to_date"], res["built"] = rep["inputs"], bool(rep.get("up_to_date")), rep["shards"]["built"]
elif case == "jobs":
    from precompile.compiler import backends, driver
    marks = {}
    if args["cold"]:
        driver.start_pool = lambda *a, **k: None
    real_plan, real_run = driver.make_plan, driver.run_shards

    def plan(*a, **k):
        out = real_plan(*a, **k)
        marks["plan"] = time.perf_counter()
        return out

    def run(*a, **k):
        marks["run"] = time.perf_counter()
        for r in real_run(*a, **k):
            marks.setdefault("first", time.perf_counter())
            yield r
        marks["done"] = time.perf_counter()
    real_settle = backends._settle_warm

    def settle():
        out = real_settle()
        marks["ready"] = time.perf_counter()
        return out
    driver.make_plan, driver.run_shards, backends._settle_warm = plan, run, settle
    from precompile import build
    t = time.perf_counter()
    rep = build(args["recipe"], args["out"], n_jobs=args["jobs"])
    res["wall_s"] = time.perf_counter() - t
    res["plan_s"], res["first_s"] = marks["plan"] - t, marks["first"] - marks["run"]
    res["run_s"], res["n"] = marks["done"] - marks["run"], rep["inputs"]
    res["wait_s"] = marks["ready"] - marks["run"] if "ready" in marks and not args["cold"] else 0.0
    res["summed_s"] = sum(rep["stage_seconds"].get(k, 0.0) for k in ("decode", "steps", "write"))
try:   # this process's own peak (ru_maxrss would count the benchmark's pages from before the exec)
    res["rss"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
except OSError:
    res["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
res["inner_s"] = time.perf_counter() - t0
print(json.dumps(res))
"""

_DECODER = '''"""A decoder that reads its (empty) file and gives one 1x1 grey pixel: bench_plan's no-change rebuild."""
import numpy as np

from precompile.decoders import Decoder, DecoderParams
from precompile.plugins import register_decoder
from precompile.sample import FieldSpec


@register_decoder()
class BenchEmpty(Decoder):
    name = "bench_empty"
    kind = "image"

    class Params(DecoderParams):
        pass

    def spec(self):
        return FieldSpec("image", (1, 1, 1), "uint8")

    def read(self, path):
        with open(path, "rb") as f:
            f.read()
        return np.zeros((1, 1, 1), np.uint8), {}
'''


def child(args: dict, code_dir: str = REPO) -> dict:
    """Run one case in a fresh process on the code in ``code_dir``: its result, wall time and peak RSS."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([code_dir, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True, env=env,
                       cwd=code_dir)   # `python -c` puts its folder first on sys.path
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{args['case']} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall"] = wall
    return res


def empty_tree(root: str, n: int, per: int = 1000) -> None:
    """``n`` empty files, ``per`` a folder, in the synthetic listing's shape (kept for a later run)."""
    done = os.path.join(root, f".done-{n}")
    if os.path.exists(done):
        return
    classes = max(1, min(1000, n // per))
    subs = max(1, n // (per * classes))
    for c in range(classes):
        cls = f"n{c:08d}"
        for s in range(subs):
            d = os.path.join(root, "train", cls, f"{s:04d}")
            os.makedirs(d, exist_ok=True)
            for i in range(per):
                open(os.path.join(d, f"{cls}_{s * per + i:08d}.JPEG"), "wb").close()
    open(done, "w").close()


def make_table(path: str, n: int) -> None:
    """A table of ``n`` rows naming the files :func:`empty_tree` makes for ``n``: path, class name, a float
    target (CSV or Parquet by extension; kept for a later run)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv
    import pyarrow.parquet

    if os.path.exists(path):
        return
    per, classes = 1000, max(1, min(1000, n // 1000))
    subs = max(1, n // (per * classes))
    j = np.arange(n)

    def digits(v: np.ndarray, w: int) -> pa.Array:
        return pc.utf8_lpad(pa.array(v).cast(pa.string()), width=w, padding="0")
    cls = pc.binary_join_element_wise("n", digits(j // (subs * per), 8), "")
    name = pc.binary_join_element_wise(cls, "_", digits(j % (subs * per), 8), "")
    paths = pc.binary_join_element_wise("train/", cls, "/", digits(j // per % subs, 4), "/", name, ".JPEG", "")
    t = pa.table({"path": paths, "cls": cls, "y": pa.array((j % 97) / 7.0)})
    tmp = path + ".tmp"
    (pyarrow.parquet.write_table if path.endswith(".parquet") else pyarrow.csv.write_csv)(t, tmp)
    os.replace(tmp, path)


def fmt_row(cells: list) -> str:
    return "| " + " | ".join(cells) + " |"


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def scale_table(args: argparse.Namespace, work: str) -> None:
    """The synthetic, walk, table and noop cases: one markdown table."""
    cases = args.cases.split(",")
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        if "synthetic" in cases:
            a = child({"case": "synthetic", "n": n, "root": work})
            b = child({"case": "synthetic", "n": n, "root": work}, args.before) if args.before and n <= args.before_max else None
            rows.append(("synthetic listing: plan", n, a["plan_s"], a["rss"], b and b["plan_s"], b and b["rss"]))
            rows.append(("synthetic listing: shard keys", n, a["keys_s"], None, None, None))
            print(f"synthetic {n}: plan {a['plan_s']:.2f} s, keys {a['keys_s']:.2f} s, {mib(a['rss'])} MiB", flush=True)
        if "table" in cases:
            keys = n <= args.noop_files   # the rows name files of the no-op tree: their keys stat real files
            root = os.path.join(work, f"noop-{args.noop_files}")
            if keys:
                empty_tree(root, args.noop_files)
            for ext in ("parquet", "csv"):
                path = os.path.join(work, f"table-{n}.{ext}")
                make_table(path, n)
                job = {"case": "table", "table": path, "root": root, "keys": keys}
                a, b = _table_runs(args, job, args.before if args.before and n <= args.before_max else None)
                rows.append((f"{ext} table: plan", n, a["plan_s"], a["rss"], b and b["plan_s"], b and b["rss"]))
                if keys:
                    rows.append((f"{ext} table: shard keys (a stat per row)", n, a["keys_s"], None, None, None))
                print(f"{ext} {n}: plan {a['plan_s']:.2f} s, {mib(a['rss'])} MiB", flush=True)
    if "walk" in cases:
        root = os.path.join(work, f"walk-{args.walk_files}")
        empty_tree(root, args.walk_files)
        n = args.walk_files
        for what in ("os.walk", "os.walk+stat", "plan"):
            a = child({"case": "walk", "root": root, "what": what})
            b = child({"case": "walk", "root": root, "what": what}, args.before) if args.before and what == "plan" \
                else None
            label = f"real tree: {what}" if what != "plan" else "real tree: plan (scandir walk + stat of each match)"
            rows.append((label, n, a["plan_s"], a["rss"], b and b["plan_s"], b and b["rss"]))
            print(f"walk {what}: {a['plan_s']:.2f} s ({1e6 * a['plan_s'] / n:.1f} us/file)", flush=True)
    if "noop" in cases:
        rows += noop_rows(args, work)
    print()
    print(f"{os.cpu_count()} cpus; load average before: {args.load}; each case a fresh process (table rows: medians "
          f"of {args.repeats})")
    print()
    print(fmt_row(["case", "N", "s", "us / input", "peak RSS MiB", "before s", "before RSS MiB", "s after / before"]))
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, n, s, rss, bs, brss in rows:
        print(fmt_row([label, f"{n:,}", f"{s:.2f}", f"{1e6 * s / n:.2f}", mib(rss) if rss else "-",
                       f"{bs:.2f}" if bs else "-", mib(brss) if brss else "-", f"{s / bs:.3f}" if bs else "-"]))


def _table_runs(args: argparse.Namespace, job: dict, before: str | None) -> tuple[dict, dict | None]:
    """The table case ``--repeats`` times on this code and on ``before`` (plan only), alternately: the
    median of each figure of each."""
    mine, old = [], []
    for _ in range(args.repeats):
        mine.append(child(job))
        if before:
            old.append(child(dict(job, keys=False), before))
    return _medians(mine), _medians(old) if old else None


def _medians(rs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}


def noop_rows(args: argparse.Namespace, work: str) -> list[tuple]:
    """Build ``--noop-files`` empty inputs once, then the no-change rebuild (after, and before)."""
    import yaml

    n = args.noop_files
    root = os.path.join(work, f"noop-{n}")
    empty_tree(root, n)
    with open(os.path.join(work, "bench_empty_decoder.py"), "w") as f:
        f.write(_DECODER)
    recipe = os.path.join(work, f"noop-{n}.yaml")
    with open(recipe, "w") as f:
        yaml.safe_dump({"name": "noop", "seed": 0, "imports": ["bench_empty_decoder"],
                        "inputs": {"root": root, "match": "train/{label}/{sub}/{name}.JPEG",
                                   "fields": {"image": {"decoder": "bench_empty"}}, "label": {"capture": "label"}},
                        "output": {"format": "hdf5", "samples_per_shard": 256}}, f)
    out = os.path.join(work, f"noop-out-{n}")
    first_file = os.path.join(work, f"noop-first-{n}.json")
    if not os.path.exists(first_file):   # the first build, once (a later run with --dir reuses it)
        first = child({"case": "build", "recipe": recipe, "out": out, "jobs": 2})
        with open(first_file, "w") as f:
            json.dump(first, f)
    with open(first_file) as f:
        first = json.load(f)
    print(f"noop {n}: first build -j2 {first['wall']:.1f} s", flush=True)
    a = child({"case": "noop", "recipe": recipe, "out": out})
    assert a["up_to_date"] and a["built"] == 0, a
    b = child({"case": "noop", "recipe": recipe, "out": out}, args.before) if args.before else None
    assert b is None or b["up_to_date"], b   # the same shard keys before and after: nothing to do for either
    print(f"noop {n}: {a['wall']:.2f} s", flush=True)
    return [("first build -j2 (a decoder that reads an empty file)", n, first["wall"], first["rss"], None, None),
            ("no-change rebuild (whole process)", n, a["wall"], a["rss"], b and b["wall"], b and b["rss"])]


def jobs_table(args: argparse.Namespace, work: str) -> None:
    """-j1/-j2 builds, workers warm and cold, where the wall time goes: photos to 64x64, and (with
    ``--jobs-tree N``) N empty files through a decoder that reads nothing, where the plan takes longer."""
    import yaml

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from bench_scale import make_photos

    root = os.path.join(work, f"photos-{args.photos}")
    make_photos(root, args.photos)
    scenarios = [(f"{args.photos} JPEGs 500x375 -> 64x64", args.photos, os.path.join(work, "photos.yaml"), {
        "name": "photos", "seed": 0, "inputs": {"root": root, "match": "{label}/{name}.jpg",
                                                "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                                "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [64, 64]}}], "output": {"format": "hdf5", "samples_per_shard": 64}})]
    if args.jobs_tree:
        n = args.jobs_tree
        empty_tree(os.path.join(work, f"noop-{n}"), n)
        with open(os.path.join(work, "bench_empty_decoder.py"), "w") as f:
            f.write(_DECODER)
        scenarios.append((f"{n:,} empty files, a decoder that reads nothing", n, os.path.join(work, "tree.yaml"), {
            "name": "tree", "seed": 0, "imports": ["bench_empty_decoder"],
            "inputs": {"root": os.path.join(work, f"noop-{n}"), "match": "train/{label}/{sub}/{name}.JPEG",
                       "fields": {"image": {"decoder": "bench_empty"}}, "label": {"capture": "label"}},
            "output": {"format": "hdf5", "samples_per_shard": 1000}}))
    print(f"\n{os.cpu_count()} cpus; load average before: {args.load}; medians of {args.repeats}")
    print(fmt_row(["inputs", "-j", "workers", "wall s", "plan s", "run waits for the warm pool s",
                   "run start -> first result s", "run s", "summed stage s", "inputs/s", "wall cold / warm"]))
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, n, recipe, data in scenarios:
        with open(recipe, "w") as f:
            yaml.safe_dump(data, f)
        for j in (int(x) for x in args.jobs.split(",")):
            got = {cold: _median_runs(args, work, recipe, j, cold) for cold in (True, False)}
            for cold in (True, False):
                g = got[cold]
                print(fmt_row([label, str(j), "cold" if cold else "warm", f"{g['wall']:.2f}", f"{g['plan_s']:.2f}",
                               f"{g['wait_s']:.2f}" if not cold and j > 1 else "-", f"{g['first_s']:.2f}",
                               f"{g['run_s']:.2f}", f"{g['summed_s']:.2f}", f"{n / g['wall']:.0f}",
                               f"{got[True]['wall'] / g['wall']:.2f}" if not cold else "-"]), flush=True)


def _median_runs(args: argparse.Namespace, work: str, recipe: str, j: int, cold: bool) -> dict:
    """The median of each figure over ``--repeats`` fresh builds."""
    rs = []
    for _ in range(args.repeats):
        out = os.path.join(work, f"jobs-out-{j}-{cold}")
        shutil.rmtree(out, ignore_errors=True)
        rs.append(child({"case": "jobs", "recipe": recipe, "out": out, "jobs": j, "cold": cold}))
        shutil.rmtree(out, ignore_errors=True)
    return {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0] if isinstance(rs[0][k], float)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000000,10000000", help="input counts of the synthetic and table cases")
    ap.add_argument("--cases", default="synthetic,table,walk,noop,jobs")
    ap.add_argument("--walk-files", type=int, default=100_000)
    ap.add_argument("--noop-files", type=int, default=1_000_000)
    ap.add_argument("--photos", type=int, default=2000)
    ap.add_argument("--jobs", default="1,2")
    ap.add_argument("--jobs-tree", type=int, default=0, help="jobs case: also N empty files (0: not)")
    ap.add_argument("--repeats", type=int, default=3, help="jobs and table cases: runs per cell (median)")
    ap.add_argument("--before", default=None, help="a checkout of the code to compare with (e.g. main)")
    ap.add_argument("--before-max", type=int, default=1_000_000, help="largest N run on --before")
    ap.add_argument("--dir", default=None, help="work folder (inputs kept for a later run)")
    args = ap.parse_args(argv)
    args.load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.before:
        args.before = os.path.abspath(args.before)
    work = args.dir or tempfile.mkdtemp(prefix="precompile-bench-plan-")
    os.makedirs(work, exist_ok=True)
    try:
        if set(args.cases.split(",")) - {"jobs"}:
            scale_table(args, work)
        if "jobs" in args.cases.split(","):
            jobs_table(args, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
