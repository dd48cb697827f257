"""Existing builds do not rebuild: the shard keys of the sample recipes (and of variants that exercise
splits, ``where``, path templates, ``item_options``, Parquet rows with decoder options, folder inputs and
names that sort around ``/``) equal the keys computed before the plan became columnar.

The expected keys in ``golden/plan_shard_keys.json`` were produced on main at 231d9a9 (before
the columnar plan) with this very module::

    PYTHONPATH=<a checkout of main> python tests/test_plan_golden.py --write tests/golden/plan_shard_keys.json

It copies ``recipes/`` and ``sample_data/`` into a temporary folder, adds the variants, sets every file's
mtime to one fixed instant (so (size, mtime) fingerprints are the same on every machine), pins the package
version the keys hash, and computes every shard's key with (size, mtime) fingerprints and with content
hashes. A change to what a shard key hashes (a new decoder ``output_version``, a format version) changes
these keys on purpose: regenerate the file then, and say why in the commit. Regenerated for issue 32: the
2D steps resize, center_crop, random_crop, random_resized_crop, random_flip and random_affine went to
``output_version`` 2 (the 13 recipes using them got new keys; the 10 others kept theirs). Regenerated for
issue 35: the image decoder went to ``output_version`` 4 (its meta records the source's size when reduced, and
every image sample its map back to the source, ``to_source``): the 15 recipes with an image field got new keys;
the 8 others kept theirs. Regenerated when ``clips`` went to ``output_version`` 4 (time clips read frame
timestamps as exact rationals): the 3 recipes with clips (kinetics.yaml, v_kinetics_parquet.yaml, video.yaml) got
new keys; the 20 others kept theirs. Regenerated when the ``video`` decoder went to ``output_version`` 3 (frames
turned as the container's display matrix says): the same 3 video recipes got new keys; the 20 others kept theirs.
Regenerated when the ``video`` decoder went to ``output_version`` 4 (``start_s``/``end_s`` compare frame times
exactly, no 1e-6 s tolerance), and again when ``clips`` went to ``output_version`` 5 (frame times in a time base
finer than 1e-9 s are not snapped to a simpler fraction): the same 3 video recipes got new keys; the 20 others
kept theirs.

One known exception, not among these recipes: a float target column holding both -0.0 and 0.0. The
row-by-row code converted each distinct cell once, in a dict where -0.0 and 0.0 are one key, so every
such cell became whichever sign came first; the columnar code keeps each cell's own sign (the stored
target is the table's value), so the shards holding such rows get new keys, once
(tests/test_plan_columns.py::test_minus_zero_and_zero_stay_apart_in_row_options_and_targets).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "plan_shard_keys.json"
MTIME_NS = 1_600_000_000_123_456_789
VERSION = "golden"   # the package version the keys hash, pinned: a release does not change these keys

#: names that sort around '/': a walk in folder order would list them in another order than sorted paths
TRICKY = ["a/1.png", "a-b/1.png", "a.b/2.png", "a b/3.png", "ab/4.png", "a/.hidden.png", ".hid/5.png",
          "a/sub/6.png", "Z/7.png", "\u00e9t\u00e9/8.png", "a/1.png.bak", "a/sub-x.png", "a0/9.png", "a/sub.png",
          "a/sub/deeper/10.png", "a!/11.png", "a~/12.png", "q\"uote/13.png", "back\\slash/14.png"]


NIFTI_VARIANT = "v_nifti_all"


def _variants(tmp: Path) -> dict[str, dict]:
    """Recipes (as dicts) beside the sample ones: each exercises a part of planning the samples do not."""
    def load(name: str) -> dict:
        return yaml.safe_load((tmp / "recipes" / name).read_text())

    out = {}
    r = load("images.yaml")
    out["v_images_split_hash"] = dict(r, name="v1", split={"by": "hash", "fractions": {"train": 0.7, "val": 0.3}})
    out["v_images_split_group"] = dict(r, name="v2", split={"by": "hash", "group": "label", "seed": 3,
                                                            "fractions": {"a": 0.5, "b": 0.3, "c": 0.2}})
    out["v_images_where"] = dict(r, name="v3", inputs=dict(r["inputs"], where={"ext": "jpg", "label": "b.*|n.*"}))
    tricky = "../sample_data/tricky"
    one = {"image": {"decoder": "image", "mode": "rgb8"}}
    out["v_tricky_nested"] = {"name": "v4", "inputs": {"root": tricky, "match": "{rel}.png", "where": {"rel": ".+"},
                                                       "fields": one}, "output": {"samples_per_shard": 3}}
    out["v_tricky_label"] = {"name": "v5", "inputs": {"root": tricky, "match": "{label}/{name}.png", "fields": one,
                                                      "label": {"capture": "label"}},
                             "output": {"samples_per_shard": 2}}
    out["v_tricky_dirs"] = {"name": "v6", "inputs": {"root": tricky, "match": "{d}", "where": {"d": ".+"}, "kind": "dir",
                                                     "fields": {"ct": {"decoder": "dicom_series"}}},
                            "output": {"samples_per_shard": 4}}
    out[NIFTI_VARIANT] = {"name": "v7", "seed": 1,
                          "inputs": {"root": "../sample_data/nifti", "match": "{name}.nii",
                                     "fields": {"ct": {"decoder": "nifti", "index": "all"}}},
                          "split": {"fractions": {"train": 0.5, "val": 0.5}}, "output": {"samples_per_shard": 2}}
    k = load("kinetics.yaml")
    out["v_kinetics_parquet"] = dict(k, name="v8", inputs=dict(k["inputs"], table="../sample_data/kinetics/train.parquet"))
    c = load("chexpert.yaml")
    out["v_chexpert_nosplit"] = {kk: v for kk, v in c.items() if kk != "split"} | {"name": "v9"}
    return out


def _prepare(tmp: Path) -> list[Path]:
    """The sample recipes and the variants under ``tmp`` (inputs copied, every mtime fixed); their paths.
    Without nibabel (a test dependency) the NIfTI variant is left out: its inputs cannot be written."""
    shutil.copytree(REPO / "recipes", tmp / "recipes")
    shutil.copytree(REPO / "sample_data", tmp / "sample_data", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    png = (tmp / "sample_data" / "images" / "night" / "night_01_rgba.png").read_bytes()
    for rel in TRICKY:
        p = tmp / "sample_data" / "tricky" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(png[:100 + len(rel)])
    with_nifti = _nifti(tmp / "sample_data" / "nifti")
    import pyarrow.csv
    import pyarrow.parquet

    kin = tmp / "sample_data" / "kinetics"
    pyarrow.parquet.write_table(pyarrow.csv.read_csv(str(kin / "train.csv")), str(kin / "train.parquet"))
    for name, data in _variants(tmp).items():
        if name == NIFTI_VARIANT and not with_nifti:
            continue
        (tmp / "recipes" / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    for dirpath, _, files in os.walk(tmp):
        for f in files:
            os.utime(os.path.join(dirpath, f), ns=(MTIME_NS, MTIME_NS))
    return sorted((tmp / "recipes").glob("*.yaml"))


def _nifti(root: Path) -> bool:
    """Three 4D files (2, 3 and 1 volumes) and a 3D one: index: all makes 2 + 3 + 1 + 1 items. False, writing
    nothing, where nibabel is absent."""
    try:
        import nibabel as nib
    except ImportError:
        return False
    import numpy as np

    root.mkdir(parents=True)
    vol = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6)
    for name, n in (("s0", 2), ("s1", 3), ("s2", 1)):
        nib.save(nib.Nifti1Image(np.stack([vol + i for i in range(n)], -1), np.eye(4)), str(root / f"{name}.nii"))
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(root / "t3.nii"))
    return True


def shard_keys(recipes: list[Path]) -> dict[str, Any]:
    """{recipe file name: {"inputs": n, "shards": [[size/mtime key, content key], ...]}}."""
    from precompile.compiler import keys as keys_mod
    from precompile.compiler.plan import make_plan
    from precompile.recipe import load_recipe

    keys_mod.__version__ = VERSION
    out = {}
    for path in recipes:
        r = load_recipe(str(path))
        plan = make_plan(r)
        rk = keys_mod.recipe_key(r)
        out[path.name] = {"inputs": len(plan.items),
                          "shards": [[keys_mod.shard_key(plan, s, rk), keys_mod.shard_key(plan, s, rk, content=True)]
                                     for s in plan.shards]}
    return out


def compute() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="precompile-golden-") as tmp:
        return shard_keys(_prepare(Path(tmp)))


def test_shard_keys_equal_those_before_the_columnar_plan(monkeypatch, tmp_path):
    import precompile.compiler.keys as keys_mod

    monkeypatch.setattr(keys_mod, "__version__", keys_mod.__version__)   # restored after the test
    expected = json.loads(GOLDEN.read_text())
    got = shard_keys(_prepare(tmp_path))
    if f"{NIFTI_VARIANT}.yaml" not in got:   # no nibabel here: every other recipe is still checked
        del expected["recipes"][f"{NIFTI_VARIANT}.yaml"]
    assert sorted(got) == sorted(expected["recipes"])
    for name, want in expected["recipes"].items():
        assert got[name] == want, name


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        import subprocess

        import nibabel  # noqa: F401  (the golden file holds every variant: write it only where all can be made)

        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__import__("precompile").__file__)).stdout.strip()
        data = {"produced": f"on main at {rev} by: python tests/test_plan_golden.py --write (see the docstring)",
                "recipes": compute()}
        Path(sys.argv[2]).parent.mkdir(parents=True, exist_ok=True)
        Path(sys.argv[2]).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    else:
        sys.exit("usage: python tests/test_plan_golden.py --write PATH")
