"""Run a case: write its inputs, build it in-process (``-j1``; some also ``-j2``), run the oracles; minimise a
failing recipe; the explore mode.

    python tests/fuzz_recipes/runner.py --explore 200            # fresh seeds, prints failing seeds + minimal recipes
    python tests/fuzz_recipes/runner.py --explore 200 --keep     # ... and appends each to regressions.json
    python tests/fuzz_recipes/runner.py --seed 123 --show        # one case: its recipe and findings
    PRECOMPILE_FUZZ_EXPLORE=200 python -m pytest tests/test_recipe_fuzzer.py -k explore
    PRECOMPILE_FUZZ_DEVICE=cuda python tests/fuzz_recipes/runner.py --loader-cases 100   # the Loader oracles on CUDA

A failure kept with ``--keep`` is a strict xfail ("new finding") in test_recipe_fuzzer.py until it is fixed; give
it a narrow entry in known.NEW too if drawn cases keep hitting it (the fixed seeds must pass on main).
"""
from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":   # run as a script: the tests folder and the repository on the path
    sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

from fuzz_recipes import draw, known  # noqa: E402
from fuzz_recipes.oracles import Finding, Report  # noqa: E402

REGRESSIONS = os.path.join(HERE, "regressions.json")


def family_module(fam: str):
    from fuzz_recipes import fam2d, famav, famtable, famvolume

    return {"coco": fam2d, "folder": fam2d, "flow": fam2d, "table": famtable, "video": famav, "audio": famav,
            "volume": famvolume, "dicom": famvolume}[fam]


def substitute(obj: Any, inp: str) -> Any:
    if isinstance(obj, str):
        return obj.replace("$IN", inp)
    if isinstance(obj, list):
        return [substitute(v, inp) for v in obj]
    if isinstance(obj, dict):
        return {k: substitute(v, inp) for k, v in obj.items()}
    return obj


@dataclass
class Result:
    case: dict
    findings: list[Finding] = field(default_factory=list)
    checks: int = 0
    per_oracle: dict = field(default_factory=dict)
    seconds: float = 0.0
    samples: int = 0

    @property
    def oracles(self) -> set[str]:
        return {f.oracle for f in self.findings}


def outputs(out: str, recipe: dict) -> dict[str, str]:
    """split (or '') -> index path (a split's from the build report beside the outputs)."""
    name = recipe.get("output", {}).get("name", recipe["name"])
    ext = ".h5" if recipe.get("output", {}).get("format", "hdf5") == "hdf5" else ".json"
    if "split" in recipe:
        with open(os.path.join(out, name + ".report.json"), encoding="utf-8") as f:
            splits = json.load(f).get("splits") or {}
        return {s: os.path.join(out, f"{name}.{s}{ext}") for s in splits}
    return {"": os.path.join(out, name + ext)}


def build(recipe: dict, out: str, n_jobs: int = 1):
    import precompile

    return precompile.build(recipe, out_dir=out, n_jobs=n_jobs)


def run_case(case: dict, work: Optional[str] = None, j2: Optional[bool] = None) -> Result:
    """Every oracle of ``case``; the findings are in the result (nothing raises for a finding)."""
    t0 = time.perf_counter()
    own = work is None
    work = work or tempfile.mkdtemp(prefix="fuzz-")
    res = Result(case)
    R = Report()
    try:
        _run(case, work, R, case.get("j2", False) if j2 is None else j2)
    except Exception as e:   # an oracle that cannot run is a finding too (named), never a silent pass
        R.check("crash", False, f"{type(e).__name__}: {str(e)[:600]}\n{traceback.format_exc(limit=-4)[-1500:]}")
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    res.findings, res.checks, res.per_oracle = R.findings, R.checks, R.per_oracle
    res.seconds = time.perf_counter() - t0
    res.samples = getattr(R, "samples", 0)
    return res


def _run(case: dict, work: str, R: Report, j2: bool) -> None:
    import precompile
    from precompile.errors import PrecompileError

    fam = family_module(case["family"])
    inp = os.path.join(work, "in")
    os.makedirs(inp, exist_ok=True)
    truth = fam.write(case, inp)
    recipe = substitute(case["recipe"], inp)
    out = os.path.join(work, "out")
    source: Any = recipe
    if case["seed"] % 7 == 3:   # some cases as a YAML file (the CLI's path), the rest as a dict
        import yaml

        source = os.path.join(work, "recipe.yaml")
        with open(source, "w", encoding="utf-8") as f:
            yaml.safe_dump(recipe, f, allow_unicode=True, sort_keys=False)
    try:
        rep = build(source, out)
    except PrecompileError as e:
        if hasattr(fam, "check_error"):
            fam.check_error(case, e, truth, R)
            return
        why = fam.expected_error(case, e, truth) if hasattr(fam, "expected_error") else None
        R.check("build_error", why is not None, f"{type(e).__name__}: {str(e)[:800]}")
        return
    if hasattr(fam, "check_error"):
        fam.check_error(case, None, truth, R)
    elif hasattr(fam, "expected_error"):
        want = fam.expected_error(case, None, truth)
        R.check("build_error", want is None, f"the build succeeded, but {want}")
    failures = [f.to_json() for f in rep.failures]
    for f in failures:
        ok = fam.expected_failure(case, f, truth) if hasattr(fam, "expected_failure") else False
        R.check("input_failure", ok, f"input failed: {f.get('key')}: {f.get('message', '')[:500]}", f.get("key"))
    failed = {f.get("key") for f in failures}
    keys_seen: set[str] = set()
    R.samples = 0
    for split, path in outputs(out, recipe).items():
        if not os.path.exists(path):
            R.check("outputs", "split" in recipe, f"no output {path}")
            continue
        ds = precompile.open(path)
        try:
            n = len(ds)
            R.samples += n
            for i in range(n):
                key, meta, s = ds.key(i), ds.meta(i), ds[i]
                keys_seen.add(key.split("#")[0])
                fam.check_sample(case, truth, key, s, meta, R, ds.copy(i))
            check_dataset(case, ds, R)
            if hasattr(fam, "check_dataset"):
                fam.check_dataset(case, truth, ds, R, split)
        finally:
            ds.close()
        if case.get("loader") and split == "" and recipe.get("output", {}).get("format", "hdf5") == "hdf5":
            from fuzz_recipes import loader_check

            loader_check.check(case, truth, path, R)
    expected = set(fam.input_keys(case, truth)) if hasattr(fam, "input_keys") else None
    if expected is not None:
        missing = expected - keys_seen - failed
        extra = keys_seen - expected
        dropped = fam.dropped_keys(case, truth) if hasattr(fam, "dropped_keys") else set()
        R.check("inputs_accounted", not (missing - dropped) and not extra,
                f"inputs neither stored nor failed: {sorted(missing - dropped)[:5]}; stored but no input: {sorted(extra)[:5]}")
    if "split" in recipe and hasattr(fam, "check_splits"):
        fam.check_splits(case, truth, out, recipe, R)
    if case["seed"] % 9 == 4 and not failures:   # docs/reference-build.md: a no-change rebuild writes nothing
        again = build(recipe, out)
        R.check("rebuild_noop", again["shards"]["built"] == 0 and again.get("up_to_date"),
                f"a rebuild with nothing changed built {again['shards']}")
    if j2:
        check_j2(recipe, out, os.path.join(work, "out2"), R)
    if case.get("whole"):
        check_whole(recipe, out, os.path.join(work, "out3"), R)


# -- generic oracles ---------------------------------------------------------------------------------------------------
def check_dataset(case: dict, ds: Any, R: Report) -> None:
    """``ds[i]``, ``ds.batch`` (padded where shapes differ) and the copies agree."""
    n = len(ds)
    if n == 0:
        return
    idx = list(range(n))[::-1]
    b = ds.batch(idx, pad=True)
    for f in ds.fields:
        spec = ds.field_specs[f]
        for pos, i in enumerate(idx):
            one = ds[i][f]
            if spec.get("kind") == "text":
                R.check("batch_vs_open", b[f][pos] == one, f"{f}: batch {b[f][pos]!r} vs open {one!r}", ds.key(i))
                continue
            got = np.asarray(b[f][pos])
            one = np.asarray(one)
            sl = tuple(slice(0, d) for d in one.shape)
            same = got[sl].shape == one.shape and np.array_equal(got[sl], one, equal_nan=one.dtype.kind == "f")
            R.check("batch_vs_open", same, f"{f}: ds.batch row {pos} differs from ds[{i}]", ds.key(i))
            if spec.get("kind") == "box_labels" and got.shape != one.shape:
                pad = got[len(one):]
                R.check("batch_pad_labels", (pad < 0).all(),
                        f"ds.batch(pad=True) pads box_labels with {np.unique(pad).tolist()}: a real class id "
                        f"(the Loader pads with -1)", ds.key(i))
    rec = case["recipe"]
    copies = rec.get("copies", 0)
    if copies:
        per: dict[str, list[int]] = {}
        for i in range(n):
            per.setdefault(ds.key(i), []).append(ds.copy(i))
        want = list(range(0 if rec.get("keep_original", True) else 1, copies + 1))
        # an expanding step after a random one cuts each copy by its own shape: a patch, window or clip of one copy
        # may have no twin in another (seed 212688: random_rot90 turned copy 2 into a shape patches3d with pad: false
        # could cut, copies 0 and 1 not; docs: "Volumes smaller than a patch are ... dropped")
        names = [next(iter(st)) for st in rec.get("steps", [])]
        from precompile.registry import STEPS, load_builtins

        load_builtins()
        loose = any(STEPS.get(b).expands and any(STEPS.get(a).random for a in names[:j])
                    for j, b in enumerate(names))
        for k, cs in per.items():
            ok = set(cs) <= set(want) if loose else sorted(set(cs)) == want
            R.check("copies", ok, f"copies {sorted(cs)}, expected {want}", k)


def _tree_digest(path: str) -> dict[str, str]:
    out = {}
    for p in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)):
        if os.path.isfile(p) and not p.endswith(".report.json") and "coco-plan" not in p:
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _index_content(path: str) -> Any:
    """An index's content without its build date (the one thing that may differ between two builds)."""
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        d.pop("build_date", None)
        if isinstance(d.get("attrs"), dict):
            d["attrs"].pop("build_date", None)
        return json.dumps(d, sort_keys=True)
    import h5py

    out = []
    with h5py.File(path, "r") as f:
        for k, v in sorted(f.attrs.items()):
            if k == "index_crc32":   # the index's own checksums cover build_date too: compare the rest
                v = json.loads(v)
                v.get("attrs", {}).pop("build_date", None)
                v = json.dumps(v, sort_keys=True)
            if k != "build_date":
                out.append((k, str(v)))
        def add(n: str, o: Any) -> None:
            if isinstance(o, h5py.Dataset):
                v = o[()]
                raw = repr(v.tolist()).encode() if getattr(v, "dtype", None) is not None and v.dtype.kind == "O" \
                    else np.ascontiguousarray(v).tobytes()
                out.append((n, hashlib.sha256(raw).hexdigest()))

        f.visititems(add)
    return out


def check_j2(recipe: dict, out1: str, out2: str, R: Report) -> None:
    """The same recipe at -j2 writes the same shard bytes and the same index (but its build date)."""
    build(recipe, out2, n_jobs=2)
    a, b = _tree_digest(out1), _tree_digest(out2)
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    idx = {os.path.relpath(p, out1) for p in outputs(out1, recipe).values()}
    for k in [d for d in diff if d in idx]:
        if os.path.exists(os.path.join(out2, k)) and \
                _index_content(os.path.join(out1, k)) == _index_content(os.path.join(out2, k)):
            diff.remove(k)
    R.check("j1_vs_j2", not diff, f"files differ between -j1 and -j2: {diff[:6]}")


def check_whole(recipe: dict, out1: str, out3: str, R: Report) -> None:
    """docs/reference-steps.md: a streamed video gives the bytes of decoding it whole (a build with timeout_s
    decodes each input whole in a helper process)."""
    import precompile

    precompile.build(recipe, out_dir=out3, n_jobs=1, timeout_s=60)
    a, b = _tree_digest(out1), _tree_digest(out3)
    idx = {os.path.relpath(p, out1) for p in outputs(out1, recipe).values()}
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in idx)
    R.check("stream_vs_whole", not diff, f"streamed and whole-video builds differ: {diff[:6]}")


# -- known defects, regressions, minimisation ------------------------------------------------------------------------
def classify(res: Result) -> tuple[list[Finding], list[str]]:
    """(findings no known defect excuses, the known defect ids that excused some)."""
    return known.excuse(res.case, res.findings)


def signature(f: Finding) -> str:
    """A finding's oracle and, when its message names one, the exception type: what a smaller case must keep."""
    import re

    m = re.search(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b", f.message)
    return f.oracle + (":" + m.group(1) if m else "")


def minimise(case: dict, target: set[str], budget_s: float = 60.0) -> dict:
    """A smaller case whose findings still include one of ``target``'s oracles (or oracle:ErrorType
    signatures): steps dropped one at a time, then inputs, then options (loader, copies, splits, -j2) left out."""
    t_end = time.perf_counter() + budget_s

    def fails(c: dict) -> bool:
        res = run_case(c)
        return bool(({signature(f) for f in res.findings} | res.oracles) & target)

    best = copy.deepcopy(case)
    for key in ("j2",):
        if best.get(key):
            c = copy.deepcopy(best)
            c[key] = False
            if fails(c):
                best = c
    if best.get("loader"):
        c = copy.deepcopy(best)
        c["loader"] = None
        if fails(c):
            best = c
        else:
            steps = best["loader"].get("gpu_steps", [])
            i = 0
            while i < len(steps) and time.perf_counter() < t_end:
                c = copy.deepcopy(best)
                del c["loader"]["gpu_steps"][i]
                if fails(c):
                    best, steps = c, c["loader"]["gpu_steps"]
                else:
                    i += 1
    for k in ("copies", "split", "keep_original", "on_error"):
        if k in best["recipe"] and time.perf_counter() < t_end:
            c = copy.deepcopy(best)
            del c["recipe"][k]
            if fails(c):
                best = c
    i = 0
    while i < len(best["recipe"].get("steps", [])) and time.perf_counter() < t_end:
        c = copy.deepcopy(best)
        del c["recipe"]["steps"][i]
        if fails(c):
            best = c
        else:
            i += 1
    items = best["inputs"].get("images") or best["inputs"].get("items")
    if isinstance(items, list):
        name = "images" if "images" in best["inputs"] else "items"
        i = 0
        while len(best["inputs"][name]) > 1 and i < len(best["inputs"][name]) and time.perf_counter() < t_end:
            c = copy.deepcopy(best)
            del c["inputs"][name][i]
            try:
                ok = fails(c)
            except Exception:
                ok = False
            if ok:
                best = c
            else:
                i += 1
    return best


def load_regressions() -> list[dict]:
    if not os.path.exists(REGRESSIONS):
        return []
    with open(REGRESSIONS, encoding="utf-8") as f:
        return json.load(f)


def explore(n: int, start: Optional[int] = None, minimise_s: float = 60.0, keep: bool = False) -> int:
    """Run ``n`` fresh seeds; print each failing seed with its unexcused findings and a minimal recipe."""
    start = start if start is not None else int.from_bytes(os.urandom(4), "little") % 10 ** 8 + 10 ** 6
    bad = 0
    t0 = time.perf_counter()
    for seed in range(start, start + n):
        try:
            case = draw.draw_case(seed)
        except Exception as e:   # the drawer itself failed: a fuzzer bug, named with its seed
            bad += 1
            print(f"FAIL seed {seed}: drawing the case raised {type(e).__name__}: {e}", flush=True)
            continue
        res = run_case(case)
        new, ids = classify(res)
        tag = f"seed {seed} ({case['family']}, {res.seconds:.2f} s)"
        if not new:
            print(f"ok   {tag}" + (f" known: {', '.join(ids)}" if ids else ""), flush=True)
            continue
        bad += 1
        print(f"FAIL {tag}", flush=True)
        for f in new:
            print(f"     {f}", flush=True)
        small = minimise(case, {f.oracle for f in new}, minimise_s)
        print("     minimal case: " + json.dumps(small, ensure_ascii=False), flush=True)
        if keep:
            regs = load_regressions()
            regs.append({"id": f"seed-{seed}", "kind": "new", "reason": "new finding: " + str(new[0])[:200],
                         "found": str(new[0])[:300], "case": small})
            with open(REGRESSIONS, "w", encoding="utf-8") as f:
                json.dump(regs, f, indent=1, ensure_ascii=False)
    print(f"{n} seeds from {start}: {bad} with new findings, {time.perf_counter() - t0:.1f} s")
    return bad


def loader_cases(n: int, start: int = 0) -> int:
    """The Loader oracles over the first ``n`` drawn cases with a Loader (the device from PRECOMPILE_FUZZ_DEVICE)."""
    out: dict[str, Any] = {"device": os.environ.get("PRECOMPILE_FUZZ_DEVICE", "cpu"), "cases": [], "new": 0}
    seed = start
    while len(out["cases"]) < n and seed < start + 20 * n:
        case = draw.draw_case(seed)
        seed += 1
        if not case.get("loader") or case["recipe"].get("output", {}).get("format", "hdf5") != "hdf5":
            continue
        case = dict(case, j2=False, whole=False)
        res = run_case(case)
        new, ids = classify(res)
        loader = {k: v for k, v in res.per_oracle.items() if k.startswith("loader")}
        out["cases"].append({"seed": case["seed"], "known": ids, "new": [str(f)[:400] for f in new], "loader_checks": loader})
        out["new"] += bool(new)
    print(json.dumps(out, indent=1))
    return int(out["new"] > 0)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--explore", type=int, help="run this many fresh seeds")
    ap.add_argument("--start", type=int, help="first seed (default: random)")
    ap.add_argument("--seed", type=int, help="run one seed")
    ap.add_argument("--show", action="store_true", help="print the case")
    ap.add_argument("--keep", action="store_true", help="append each new failure's minimal case to regressions.json")
    ap.add_argument("--minimise-s", type=float, default=60.0)
    ap.add_argument("--loader-cases", type=int, help="run the first N seeds whose case has a Loader (with "
                    "PRECOMPILE_FUZZ_DEVICE=cuda: on the GPU); print a JSON summary")
    a = ap.parse_args(argv)
    if a.loader_cases:
        return loader_cases(a.loader_cases, a.start or 0)
    if a.seed is not None:
        case = draw.draw_case(a.seed)
        if a.show:
            print(json.dumps(case, indent=1, ensure_ascii=False))
        res = run_case(case)
        new, ids = classify(res)
        print(f"{res.checks} checks, {res.samples} samples, {res.seconds:.2f} s; known: {ids}")
        for f in res.findings:
            print(("NEW   " if f in new else "known ") + str(f))
        return int(bool(new))
    return int(explore(a.explore or 50, a.start, a.minimise_s, a.keep) > 0)


if __name__ == "__main__":
    sys.exit(main())
