"""The pixel-truth recipe fuzzer (issue 32; tests/fuzz_recipes/): random recipes over inputs that carry their
own truth, checked by oracles the code under test did not compute.

- ``test_fixed_seed``: the fixed seeds (``N_FIXED``), each a drawn case built in-process and checked by every
  oracle of its family. A finding that a known defect excuses (``fuzz_recipes/known.py``: a narrow predicate on
  the case and the oracles its failures show in) is an xfail naming the defect id; any other finding fails,
  printing the seed and the case to replay (``python tests/fuzz_recipes/runner.py --seed N --show``).
- ``test_regression``: failures kept as fixed cases (``fuzz_recipes/regressions.json``); a new finding is a
  strict xfail until it is fixed.
- coverage: every step, kind, decoder option, output format and Loader device step in the registries and the
  docs is in the fuzzer's table (``draw.COVERAGE``) and drawn by the fixed seeds.
- explore: ``PRECOMPILE_FUZZ_EXPLORE=N python -m pytest tests/test_recipe_fuzzer.py -k explore`` runs N fresh
  seeds, printing each failing seed and its minimal case (or ``python tests/fuzz_recipes/runner.py --explore N``).
"""
from __future__ import annotations

import json
import os
import re

import pytest

from fuzz_recipes import draw, known, runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_FIXED = 500
RESULTS: dict[str, list[str]] = {}      # case id -> the known defect ids that excused its findings


def _fail_text(case: dict, res: runner.Result, new: list) -> str:
    lines = [f"seed {case['seed']} ({case['family']}): {len(new)} new finding(s) in {res.checks} checks"]
    lines += [f"  {f}" for f in new[:12]]
    lines.append("case: " + json.dumps(case, ensure_ascii=False)[:6000])
    return "\n".join(lines)


@pytest.mark.parametrize("seed", range(N_FIXED))
def test_fixed_seed(seed):
    case = draw.draw_case(seed)
    res = runner.run_case(case)
    new, ids = known.excuse(case, res.findings)
    RESULTS[f"seed-{seed}"] = ids
    assert not new, _fail_text(case, res, new)
    assert res.checks > 0
    if ids:
        pytest.xfail("known: " + ", ".join(f"{i} ({(known.KNOWN[i].title)[:80]})" for i in ids))


REGRESSIONS = runner.load_regressions()


def _reg_params():
    out = []
    for r in REGRESSIONS:
        marks = [pytest.mark.xfail(strict=True, reason=r["reason"])] if r.get("kind") == "new" else []
        out.append(pytest.param(r, id=r["id"], marks=marks))
    return out


@pytest.mark.parametrize("reg", _reg_params())
def test_regression(reg):
    """A kept case: a new finding must still fail (strict xfail) until fixed; a case of a known defect is an
    xfail while its KNOWN entry stands, and must pass once it is removed."""
    case = reg["case"]
    res = runner.run_case(case)
    new, ids = known.excuse(case, res.findings, with_new=False)
    RESULTS[reg["id"]] = known.excuse(case, res.findings)[1]
    assert not new, _fail_text(case, res, new)
    if ids and reg.get("kind") != "new":
        pytest.xfail("known: " + ", ".join(ids))


def test_zz_every_known_defect_is_caught():
    """Over the fixed seeds and the regression cases, every KNOWN entry excuses some finding: an entry whose defect
    no longer shows (its fix merged) must be removed."""
    if len(RESULTS) < N_FIXED + len(REGRESSIONS):
        pytest.skip("runs after the whole fuzzer module (not every case ran in this session)")
    hit = {i for ids in RESULTS.values() for i in ids}
    dead = sorted(k for k, v in known.KNOWN.items() if k not in hit and not v.flaky)
    assert not dead, f"known defects no case shows any more (remove their entries): {dead}"


# -- coverage ------------------------------------------------------------------------------------------------------
def _docs(name: str) -> str:
    with open(os.path.join(REPO, "docs", name), encoding="utf-8") as f:
        return f.read()


def _listed() -> dict[str, set]:
    """What the registries and the docs list."""
    from precompile.kinds import Kind
    from precompile.reader import gpu
    from precompile.registry import DECODERS, STEPS, WRITERS, load_builtins

    load_builtins()
    builtin = lambda c: c.__module__.startswith("precompile.")   # noqa: E731  (user plugins of other tests)
    steps = {n for n, c in STEPS.items() if builtin(c)} | set(re.findall(r"^### `([a-z0-9_]+)`", _docs("reference-steps.md"), re.M))
    decs = {n for n, c in DECODERS.items() if builtin(c)} | set(re.findall(r"^## `([a-z0-9_]+)`", _docs("reference-decoders.md"), re.M))
    opts = {f"{n}.{o}" for n, c in DECODERS.items() if builtin(c) for o in c.Params.model_fields}
    text = _docs("reference-decoders.md")
    for sec in re.split(r"^## ", text, flags=re.M)[1:]:
        m = re.match(r"`([a-z0-9_]+)`", sec)
        if m:
            opts |= {f"{m.group(1)}.{o}" for o in re.findall(r"^\| `([a-z0-9_]+)` \|", sec, re.M)}
    kinds = {k.value for k in Kind} | set(re.findall(r"^\| `([a-z_]+)` \|", _docs("reference-kinds.md"), re.M))
    formats = {n for n, c in WRITERS.items() if builtin(c)} | set(
        re.findall(r"^#{2,3} `([a-z0-9]+)`", _docs("reference-formats.md"), re.M))
    row = next(ln for ln in _docs("reference-reader.md").splitlines() if ln.startswith("| `gpu_steps`"))
    device = set(gpu.STEP_NAMES) | set(re.findall(r"`(random_[a-z]+)` \(", row))
    return {"steps": steps, "decoders": decs, "decoder_options": opts, "kinds": kinds, "formats": formats,
            "device_steps": device}


def test_coverage_table_names_everything_listed():
    """draw.COVERAGE names every step, kind, decoder option, output format and Loader device step that the
    registries or the docs list (a new one fails here until the fuzzer draws it)."""
    listed = _listed()
    cov = draw.COVERAGE
    table_opts = {f"{d}.{o}" for d, opts in cov["decoders"].items() for o in opts}
    missing = {
        "steps": sorted(listed["steps"] - set(cov["steps"])),
        "decoders": sorted(listed["decoders"] - set(cov["decoders"])),
        "decoder options": sorted(listed["decoder_options"] - table_opts),
        "kinds": sorted(listed["kinds"] - set(cov["kinds"])),
        "formats": sorted(listed["formats"] - set(cov["formats"])),
        "device steps": sorted(listed["device_steps"] - set(cov["device_steps"])),
    }
    assert not any(missing.values()), f"not covered by the fuzzer's table draw.COVERAGE: {missing}"


def test_fixed_seeds_draw_everything_in_the_table():
    """The fixed seeds draw every entry of draw.COVERAGE (drawing only: no build)."""
    got: dict[str, set] = {"steps": set(), "kinds": set(), "decoders": set(), "formats": set(), "device_steps": set()}
    for seed in range(N_FIXED):
        for k, v in draw.used(draw.draw_case(seed)).items():
            got[k] |= v
    cov = draw.COVERAGE
    want_opts = {f"{d}.{o}" for d, opts in cov["decoders"].items() for o in opts}
    missing = {
        "steps": sorted(set(cov["steps"]) - got["steps"]),
        "kinds": sorted(set(cov["kinds"]) - got["kinds"]),
        "decoder options": sorted(want_opts - got["decoders"]),
        "formats": sorted(set(cov["formats"]) - got["formats"]),
        "device steps": sorted(set(cov["device_steps"]) - got["device_steps"]),
    }
    assert not any(missing.values()), f"the {N_FIXED} fixed seeds never draw: {missing}"


def test_fixed_seeds_draw_the_box_size_filters_on_coco_cases():
    """Issue 35: albumentations' min_area, min_width, min_height beside min_visibility: the fixed seeds draw each on
    every build step that takes them and on the Loader's device random_crop, over COCO cases (boxes to drop)."""
    want = {(n, k) for n in ("center_crop", "random_crop", "random_resized_crop", "random_affine", "device random_crop")
            for k in ("min_area", "min_width", "min_height")}
    got = set()
    for seed in range(N_FIXED):
        case = draw.draw_case(seed)
        if case["family"] != "coco":
            continue
        steps = [(n, p) for s in case["recipe"].get("steps", []) for n, p in s.items()]
        steps += [("device " + n, p) for s in (case.get("loader") or {}).get("gpu_steps", []) for n, p in s.items()]
        got |= {(n, k) for n, p in steps for k in (p or {}) if (n, k) in want}
    assert got == want, sorted(want - got)


def test_known_and_new_entries_are_narrow():
    """No KNOWN / NEW predicate excuses every case of its family: each is narrower than "anything goes"."""
    cases = [draw.draw_case(s) for s in range(N_FIXED)]
    for k, v in known.KNOWN.items():
        fams = {c["family"] for c in cases if known._safe(v, c)}
        for fam in fams:
            of_fam = [c for c in cases if c["family"] == fam]
            hits = sum(known._safe(v, c) for c in of_fam)
            assert hits < len(of_fam) or k == "32.7-pad", f"{k} excuses every {fam} case ({hits})"


# -- explore ---------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.environ.get("PRECOMPILE_FUZZ_EXPLORE"), reason="set PRECOMPILE_FUZZ_EXPLORE=N to explore")
def test_explore():
    n = int(os.environ["PRECOMPILE_FUZZ_EXPLORE"])
    start = int(os.environ["PRECOMPILE_FUZZ_START"]) if os.environ.get("PRECOMPILE_FUZZ_START") else None
    assert runner.explore(n, start, float(os.environ.get("PRECOMPILE_FUZZ_MINIMISE_S", "60"))) == 0


# -- the references themselves ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_map_agrees_with_pillow(orientation):
    """reference.exif_map (stored -> displayed coordinates) moves a pixel's box where Pillow's exif_transpose moves
    the pixel, and truth.exif_transpose gives the displayed size."""
    import numpy as np

    from fuzz_recipes import reference, truth

    H, W = 7, 11
    a = np.zeros((H, W), np.uint16)
    a[1, 8] = 5
    shown = truth.exif_transpose(a, orientation)
    M, hw = reference.exif_map(orientation, H, W)
    assert shown.shape == hw
    ys, xs = np.nonzero(shown == 5)
    box = reference.move_box(np.array([8.0, 1.0, 9.0, 2.0]), reference.Move("exif", M, hw, "none", 0.0)).box
    np.testing.assert_allclose(box, [xs[0], ys[0], xs[0] + 1, ys[0] + 1])


def test_scene_truth_is_consistent():
    """A drawn scene is its own reference: each COCO bbox is its colour's pixel extent, its ids pixels and its
    pycocotools raster; each keypoint sits on its marker."""
    import numpy as np

    from fuzz_recipes import oracles, truth

    for seed in range(20):
        sc = truth.make_scene(seed, 40 + seed, 52 - seed, 5, True, seed % 3 == 0, ["poly", "rle", "rle_list"])
        for o in sc.objects:
            ext = oracles.extent(sc.ids == o.index)
            np.testing.assert_array_equal(ext, o.box)
            np.testing.assert_array_equal(oracles.extent(oracles.colour_mask(sc.image, o.colour)), o.box)
            for j, m in enumerate(o.markers):
                if m is not None:
                    assert sc.marks[m[1], m[0]] == 3 * (o.index - 1) + j + 1
                    x, y = o.keypoints[j, :2]
                    assert m[0] <= x <= m[0] + 1 and m[1] <= y <= m[1] + 1
