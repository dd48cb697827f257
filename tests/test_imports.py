"""User code in recipes (``imports:``): a custom decoder and step from ``tests/plugin_pkg`` build the
same bytes under -j1, loky -j2 and a local dask cluster; editing the step's source rebuilds; bad
imports and bad options are clear recipe errors; the Python API builds from a dict."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import precompile
from conftest import index_shards, write_recipe
from precompile.errors import RecipeError

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def make_r8_tree(root: Path, n: int = 6) -> Path:
    from plugin_pkg.steps import write_r8

    rng = np.random.default_rng(3)
    for i in range(n):
        (root / ("a" if i % 2 else "b")).mkdir(parents=True, exist_ok=True)
        write_r8(root / ("a" if i % 2 else "b") / f"{i:02d}.r8", rng.integers(0, 256, (5 + i, 7)))
    return root


def r8_recipe(root: Path, imports=("plugin_pkg.steps",), bits: int = 3) -> dict:
    return {"name": "r8", "imports": list(imports),
            "inputs": {"root": str(root), "match": "{label}/{name}.r8",
                       "fields": {"image": {"decoder": "r8_test", "invert": True}}, "label": {"capture": "label"}},
            "steps": [{"posterize_test": {"bits": bits}}, {"resize": {"size": [8, 8], "interpolation": "nearest"}}],
            "output": {"samples_per_shard": 2}}


def shard_bytes(out: Path, name: str = "r8") -> dict[str, bytes]:
    return {n: p.read_bytes() for n, p in index_shards(out / f"{name}.h5").items()}


def test_custom_decoder_and_step_decode_and_apply(tmp_path):
    root = make_r8_tree(tmp_path / "data")
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", r8_recipe(root)), out_dir=tmp_path / "out")
    assert rep["num_samples"] == 6 and rep["shards"]["built"] == 3
    ds = precompile.open(tmp_path / "out" / "r8.h5")
    raw = (root / "b" / "00.r8").read_bytes()
    src = np.frombuffer(raw, np.uint8, offset=6).reshape(5, 7, 1)
    i = [ds.key(j) for j in range(len(ds))].index("b/00.r8")
    from precompile.transforms.kernels.geometry import resize_hwc

    want = resize_hwc(((255 - src) >> 5) << 5, 8, 8, "nearest")
    np.testing.assert_array_equal(ds[i]["image"], want)
    assert ds.meta(i)["image"]["r8_size"] == [5, 7]
    with h5py.File(tmp_path / "out" / "r8.h5") as f:
        assert "plugin_pkg.steps" in f.attrs["recipe"]


def test_same_bytes_j1_j2_and_dask(tmp_path):
    root = make_r8_tree(tmp_path / "data")
    rf = write_recipe(tmp_path / "r.yaml", r8_recipe(root))
    precompile.build(rf, out_dir=tmp_path / "j1", n_jobs=1)
    precompile.build(rf, out_dir=tmp_path / "j2", n_jobs=2)
    a, b = shard_bytes(tmp_path / "j1"), shard_bytes(tmp_path / "j2")
    assert len(a) == 3 and a == b
    pytest.importorskip("dask.distributed", reason="dask.distributed is not installed (extra 'dask')")
    rep = precompile.build(rf, out_dir=tmp_path / "dask", n_jobs=2, scheduler="local")
    assert rep["shards"]["built"] == 3 and shard_bytes(tmp_path / "dask") == a


def test_build_from_dict_and_recipe_object_give_the_same_shards(tmp_path):
    root = make_r8_tree(tmp_path / "data")
    d = r8_recipe(root)
    rep = precompile.build(d, out_dir=tmp_path / "dict")
    assert rep["status"] == "ok" and rep["recipe"] is None and rep["num_samples"] == 6
    rep2 = precompile.build(precompile.load_recipe(d), out_dir=tmp_path / "obj")
    assert rep2["recipe_hash"] == rep["recipe_hash"]
    assert shard_bytes(tmp_path / "dict") == shard_bytes(tmp_path / "obj")
    with pytest.raises(RecipeError, match="expected a recipe file's path or a dict, got list"):
        precompile.load_recipe([d])
    with pytest.raises(RecipeError, match="expected a recipe file's path, a dict or a Recipe, got list"):
        precompile.build([d], out_dir=tmp_path / "x")


def test_user_code_is_in_the_shard_key_but_builtin_recipes_keep_their_hash(tmp_path, image_recipe_file):
    r = precompile.load_recipe(image_recipe_file)
    assert r.code == {} and "code" not in r.content_dict() and "imports" not in r.resolved()
    root = make_r8_tree(tmp_path / "data")
    u = precompile.load_recipe(r8_recipe(root))
    assert set(u.code) == {"decoder:r8_test", "step:posterize_test"}
    fp = u.code["step:posterize_test"]
    src = (HERE / "plugin_pkg" / "steps.py").read_bytes()
    import hashlib

    assert fp["class"] == "plugin_pkg.steps.PosterizeTest" and fp["version"] == "1.0"
    assert fp["source_sha256"] == hashlib.sha256(src).hexdigest()
    assert u.content_dict()["code"] == u.code


def test_editing_the_step_source_rebuilds_and_runs_the_new_code(tmp_path):
    """A copy of the plugin beside the recipe (found through the recipe's folder, also by loky workers)."""
    pkg = tmp_path / "edit_plugin_x1"
    shutil.copytree(HERE / "plugin_pkg", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    steps = pkg / "steps.py"
    text = steps.read_text()
    # a distinct registered name, so this copy does not clash with tests/plugin_pkg in this process
    steps.write_text(text.replace('"posterize_test"', '"posterize_edit"').replace('"r8_test"', '"r8_edit"'))
    root = make_r8_tree(tmp_path / "data")
    d = r8_recipe(root, imports=["edit_plugin_x1.steps"])
    d["inputs"]["fields"]["image"]["decoder"] = "r8_edit"
    d["steps"][0] = {"posterize_edit": {"bits": 3}}
    rf = write_recipe(tmp_path / "r.yaml", d)
    first = precompile.build(rf, out_dir=tmp_path / "out", n_jobs=2)
    assert first["shards"]["built"] == 3
    again = precompile.build(rf, out_dir=tmp_path / "out", n_jobs=2)
    assert again["shards"] == {"total": 3, "built": 0, "skipped": 3, "reused": 0, "failed": 0}
    before = shard_bytes(tmp_path / "out")
    # edit the step: keep one more bit than asked
    steps.write_text(steps.read_text().replace("keep = 8 - self.params.bits", "keep = 7 - self.params.bits"))
    for jobs in (2, 1):
        rep = precompile.build(rf, out_dir=tmp_path / f"edited{jobs}", n_jobs=jobs)
        assert rep["shards"]["built"] == 3
    rebuilt = precompile.build(rf, out_dir=tmp_path / "out", n_jobs=2)
    assert rebuilt["shards"]["built"] == 3 and rebuilt["shards"]["skipped"] == 0
    after = shard_bytes(tmp_path / "out")
    assert after != before and after == shard_bytes(tmp_path / "edited2") == shard_bytes(tmp_path / "edited1")
    ds = precompile.open(tmp_path / "out" / "r8.h5")
    assert all(np.all(ds[i]["image"] % 16 == 0) and np.any(ds[i]["image"] % 32 != 0) for i in range(len(ds)))
    # a version bump alone (the package's __version__) rebuilds too
    (pkg / "__init__.py").write_text('__version__ = "2.0"\n')
    r = precompile.load_recipe(rf)
    assert r.code["step:posterize_edit"]["version"] == "2.0"
    assert precompile.build(rf, out_dir=tmp_path / "out")["shards"]["built"] == 3


def test_bad_imports_and_bad_options_are_recipe_errors(tmp_path):
    root = make_r8_tree(tmp_path / "data")
    with pytest.raises(RecipeError, match=r"imports\[0\]: cannot import 'no_such_plugin_mod'"):
        precompile.load_recipe(r8_recipe(root, imports=["no_such_plugin_mod"]))
    with pytest.raises(RecipeError, match=r"imports\[0\]: '../x' is not a module name"):
        precompile.load_recipe(r8_recipe(root, imports=["../x"]))
    (tmp_path / "broken_plugin_y.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RecipeError, match=r"importing 'broken_plugin_y' failed: RuntimeError: boom at import"):
        precompile.load_recipe(r8_recipe(root, imports=["broken_plugin_y"]), base_dir=str(tmp_path))
    d = r8_recipe(root)
    d["steps"][0] = {"posterize_test": {"bits": 9}}
    with pytest.raises(RecipeError, match=r"steps\[0\]\.posterize_test\.bits: Input should be less than or equal to 8"):
        precompile.load_recipe(d)
    # plan-time checks apply to user steps: posterize_test refuses float images before any decoding
    d = r8_recipe(root)
    d["steps"] = [{"convert": {"mode": "gray16"}}, {"posterize_test": {"bits": 2}}]
    rf = write_recipe(tmp_path / "bad.yaml", d)
    out = subprocess.run([sys.executable, "-m", "precompile.cli", "plan", str(rf)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)])))
    assert out.returncode == 2, out.stderr
    assert "bad.yaml: steps[1].posterize_test: posterize_test needs uint8 images, got uint16" in out.stderr


def test_entry_point_plugins_are_loaded(tmp_path, monkeypatch):
    """An installed distribution's ``precompile.plugins`` entry point registers its classes."""
    site = tmp_path / "site"
    (site / "ep_plugin_z").mkdir(parents=True)
    (site / "ep_plugin_z" / "__init__.py").write_text(
        "from precompile.plugins import register_step\nfrom precompile.transforms import Step\n"
        "@register_step()\nclass Neg(Step):\n    name = 'negate_ep_z'\n    kinds = frozenset({'image'})\n"
        "    def apply(self, a, kind, **p):\n        return 255 - a\n")
    dist = site / "ep_plugin_z-0.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin-z\nVersion: 0.3\n")
    (dist / "entry_points.txt").write_text("[precompile.plugins]\nz = ep_plugin_z\n")
    monkeypatch.syspath_prepend(str(site))
    from precompile import plugins

    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    root = make_r8_tree(tmp_path / "data")
    d = r8_recipe(root)
    d["steps"] = [{"negate_ep_z": {}}]
    r = precompile.load_recipe(d)
    assert r.code["step:negate_ep_z"]["class"] == "ep_plugin_z.Neg"
    rep = precompile.build(r, out_dir=tmp_path / "out")
    assert rep["num_samples"] == 6


def test_public_api_is_functions_and_import_is_light():
    """``precompile.build`` is a real function (no callable module); ``import precompile`` loads neither
    the compiler nor torch; the four exports come through the one lazy ``__getattr__``."""
    import types

    assert isinstance(precompile.build, types.FunctionType) and precompile.build.__module__ == "precompile.compiler.driver"
    from precompile import build, load_recipe

    assert build is precompile.build and isinstance(load_recipe, types.FunctionType)
    code = ("import sys, precompile; print(sorted(m for m in ('torch', 'precompile.compiler', 'precompile.recipe', "
            "'precompile.reader') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_only_the_options_a_recipe_names_are_built():
    """The built-in decoders', steps' and writers' option models build their validators on first use
    (pydantic's defer_build): importing the build path builds none of them (some 60 schemas, ~70 ms of a
    build's start); parsing a recipe builds those it names, and a bad option of a model built then is the
    same one-line recipe error (and a plugin step's model, deferred too, still validates)."""
    code = r"""
import sys
from precompile.errors import RecipeError
from precompile.recipe import parse_recipe
from precompile.registry import DECODERS, STEPS, WRITERS, load_builtins

load_builtins()
def built():
    return [sorted(n for n, c in reg.items() if getattr(c, attr).__pydantic_complete__)
            for reg, attr in ((DECODERS, "Params"), (STEPS, "Params"), (WRITERS, "Options"))]
print(built())
r = {"name": "x", "seed": 0, "inputs": {"root": sys.argv[1], "match": "{label}/{name}.{ext}",
     "fields": {"image": {"decoder": "image", "mode": "rgb8"}}, "label": {"capture": "label"}},
     "steps": [{"resize": {"shorter": 72}}, {"center_crop": {"size": [64, 64]}}],
     "output": {"format": "hdf5", "samples_per_shard": 16}}
parse_recipe(r)
print(built())
r["steps"] = [{"random_flip": {"horizontal": float("nan")}}]
try:
    parse_recipe(r)
except RecipeError as e:
    print(e)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "sample_data" / "images")], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "[[], [], []]"
    assert lines[1] == "[['image'], ['center_crop', 'resize'], []]"
    assert lines[2] == "steps[0].random_flip.horizontal: Input should be a finite number, got nan", lines[2]


def test_every_random_draw_comes_from_seeding():
    """One source of randomness: outside precompile/seeding.py no module seeds or draws from a generator of its
    own, but the two kernels that take a seed already drawn from the sample's ``rng_for`` stream (``draw_seed``:
    elastic displacement, gaussian noise). The reader's streams (an epoch's order, a batch's device steps) go
    through ``seeding.stream``, which is ``default_rng`` of the same integer key (the draws are unchanged)."""
    import re
    from pathlib import Path

    import numpy as np

    from precompile import seeding

    root = Path(seeding.__file__).parent
    pattern = re.compile(r"np\.random\.(?!Generator\b)|numpy\.random|^\s*import random\b|^\s*from random\b|"
                         r"torch\.(?:rand|randn|randint|randperm|manual_seed|Generator)\b", re.M)
    found = {str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "seeding.py"
             and pattern.search(p.read_text(encoding="utf-8"))}
    assert found == {"transforms/kernels/volume.py", "transforms/kernels/colour.py"}, found
    key = (7, 3, 1, 12, 0, 3)
    assert np.array_equal(seeding.stream(*key).random(5), np.random.default_rng(list(key)).random(5))
