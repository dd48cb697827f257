"""Incremental rebuilds: what a change to inputs, recipe, output name, job count or flags rebuilds."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import index_shards, shard_file
from precompile import build
from precompile.compiler.keys import recipe_key
from precompile.recipe import load_recipe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, PER = 20, 4   # 5 shards


def _img(path, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(path)


def _recipe(path, root, **changes) -> str:
    data = {"name": "inc", "seed": 1, "inputs": {"root": str(root), "match": "{name}.png",
                                                 "fields": {"image": {"decoder": "image"}}},
            "steps": [{"resize": {"size": [8, 8]}}], "output": {"samples_per_shard": PER}}
    for k, v in changes.items():
        if k == "output":
            data["output"].update(v)
        else:
            data[k] = v
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return str(path)


@pytest.fixture
def proj(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for i in range(N):
        _img(root / f"img_{i:03d}.png", i)
    recipe = _recipe(tmp_path / "r.yaml", root)
    rep = build(recipe, tmp_path / "out")
    assert rep["shards"] == {"total": 5, "built": 5, "skipped": 0, "reused": 0, "failed": 0}
    return tmp_path, root, recipe


def _shard_bytes(out, name="inc") -> dict[str, bytes]:
    """{'shard-00002': bytes} of the shards the output's index names."""
    return {n: p.read_bytes() for n, p in index_shards(os.path.join(out, f"{name}.h5")).items()}


def _counts(rep) -> tuple[int, int]:
    return rep["shards"]["built"], rep["shards"]["skipped"]


def test_unchanged_rebuilds_nothing_and_cli_says_so(proj):
    tmp, root, recipe = proj
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "precompile", "build", recipe, "-o", str(tmp / "out"), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "20 samples" in r.stdout and "0 shard(s) built, 5 up to date" in r.stdout


def test_changing_one_input_rebuilds_only_its_shard(proj):
    tmp, root, recipe = proj
    before = _shard_bytes(tmp / "out")
    _img(root / "img_009.png", 999)   # item 9 -> shard 2
    rep = build(recipe, tmp / "out")
    assert _counts(rep) == (1, 4)
    after = _shard_bytes(tmp / "out")
    assert [n for n in before if before[n] != after[n]] == ["shard-00002"]
    fresh = build(recipe, tmp / "fresh")   # the incremental result is what a clean build gives
    assert fresh["shards"]["built"] == 5 and _shard_bytes(tmp / "fresh") == after


def test_changing_a_step_rebuilds_all(proj):
    tmp, root, _ = proj
    recipe = _recipe(tmp / "r.yaml", root, steps=[{"resize": {"size": [6, 6]}}])
    assert _counts(build(recipe, tmp / "out")) == (5, 0)
    recipe = _recipe(tmp / "r.yaml", root, seed=2, steps=[{"resize": {"size": [6, 6]}}])
    assert _counts(build(recipe, tmp / "out")) == (5, 0)   # the seed decides bytes too


@pytest.mark.parametrize("change", [
    {"on_error": "skip"}, {"max_failures": 3}, {"timeout_s": 60.0}, {"name": "renamed", "output": {"name": "inc"}},
])
def test_policy_and_name_changes_rebuild_nothing(proj, change):
    tmp, root, _ = proj
    recipe = _recipe(tmp / "r2.yaml", root, **change)
    assert _counts(build(recipe, tmp / "out")) == (0, 5)


def test_job_count_and_moved_output_folder_rebuild_nothing(proj):
    tmp, root, recipe = proj
    assert _counts(build(recipe, tmp / "out", n_jobs=2)) == (0, 5)
    shutil.move(str(tmp / "out"), str(tmp / "moved"))
    rep = build(recipe, tmp / "moved")
    assert _counts(rep) == (0, 5) and rep["num_samples"] == 20


def test_new_output_name_reuses_sibling_shards(proj):
    tmp, root, _ = proj
    old = _shard_bytes(tmp / "out")
    recipe = _recipe(tmp / "r2.yaml", root, output={"name": "other"})
    rep = build(recipe, tmp / "out")
    assert rep["shards"]["built"] == 0 and rep["shards"]["reused"] == 5
    assert _shard_bytes(tmp / "out", "other") == old
    assert os.path.exists(tmp / "out" / "other.h5") and os.path.exists(tmp / "out" / "inc.h5")
    from precompile.tools.verify import verify

    assert verify(tmp / "out" / "other.h5").ok


def test_recipe_key_ignores_exactly_the_non_byte_keys(proj):
    tmp, root, recipe = proj
    base = recipe_key(load_recipe(recipe))
    same = [dict(on_error="skip"), dict(max_failures=0), dict(timeout_s=1.0), dict(name="x"), dict(output={"name": "y"})]
    diff = [dict(seed=7), dict(copies=0, keep_original=False), dict(output={"chunk_samples": 2}),
            dict(steps=[{"resize": {"size": [8, 9]}}])]
    for ch in same:
        assert recipe_key(load_recipe(_recipe(tmp / "k.yaml", root, **ch))) == base, ch
    for ch in diff:
        assert recipe_key(load_recipe(_recipe(tmp / "k.yaml", root, **ch))) != base, ch


def test_force_rebuilds_all_with_the_same_bytes(proj):
    tmp, root, recipe = proj
    before = _shard_bytes(tmp / "out")
    assert _counts(build(recipe, tmp / "out", force=True)) == (5, 0)
    assert _shard_bytes(tmp / "out") == before


def test_content_hash_ignores_a_touch(proj):
    tmp, root, recipe = proj
    assert _counts(build(recipe, tmp / "out", content_hash=True)) == (5, 0)   # new kind of key
    st = os.stat(root / "img_004.png")
    os.utime(root / "img_004.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _counts(build(recipe, tmp / "out", content_hash=True)) == (0, 5)
    # back to size+mtime keys: the first build's shards are still on disk (the snapshot the content-hash
    # build replaced is kept until the next build starts), so only the touched input's shard is new
    assert _counts(build(recipe, tmp / "out")) == (1, 4)
    os.utime(root / "img_004.png", ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert _counts(build(recipe, tmp / "out")) == (1, 4)       # size+mtime sees the touch


def test_adding_inputs(proj):
    """Items go to shards in key order: appending rebuilds the tail, inserting shifts later shards."""
    tmp, root, recipe = proj
    _img(root / "img_100.png", 100)   # sorts last: shard 5 is new, nothing else moves
    rep = build(recipe, tmp / "out")
    assert _counts(rep) == (1, 5) and rep["num_samples"] == 21
    _img(root / "img_004a.png", 101)  # sorts inside shard 1: shards 1.. shift by one item
    assert _counts(build(recipe, tmp / "out")) == (5, 1)


def test_deleted_shard_is_rebuilt_alone(proj):
    tmp, root, recipe = proj
    before = _shard_bytes(tmp / "out")
    os.remove(shard_file(tmp / "out" / "inc.h5", 3))
    assert _counts(build(recipe, tmp / "out")) == (1, 4)
    assert _shard_bytes(tmp / "out") == before


def _stamp(path) -> tuple[int, int, bytes]:
    st = os.stat(path)
    with open(path, "rb") as f:
        return st.st_mtime_ns, st.st_ino, f.read()


def test_no_change_rebuild_writes_nothing(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    index, report = out / "inc.h5", out / "inc.report.json"
    before = {p: _stamp(p) for p in (index, report)}
    shards = _shard_bytes(out)
    rep = build(recipe, out)
    assert rep["up_to_date"] is True and _counts(rep) == (0, 5) and rep["num_samples"] == 20
    assert {p: _stamp(p) for p in (index, report)} == before          # not rewritten, not even touched
    assert _shard_bytes(out) == shards


def test_no_change_check_sees_every_index_input(proj):
    tmp, root, recipe = proj
    out = tmp / "out"
    index = out / "inc.h5"
    # a policy key changes no shard, but the index records the resolved recipe: rewritten, shards kept
    changed = _recipe(tmp / "r2.yaml", root, on_error="skip")
    rep = build(changed, out)
    assert _counts(rep) == (0, 5) and not rep.get("up_to_date")
    stamp = _stamp(index)
    assert build(changed, out).get("up_to_date") and _stamp(index) == stamp
    # a shard file that lost bytes behind the build's back: rebuilt, index rewritten
    shard = shard_file(out / "inc.h5", 3)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1)
    rep = build(changed, out)
    assert _counts(rep) == (1, 4) and not rep.get("up_to_date")
    # an index that is not readable is rewritten
    index.write_bytes(b"not hdf5")
    rep = build(changed, out)
    assert _counts(rep) == (0, 5) and not rep.get("up_to_date")
    import precompile

    assert len(precompile.open(index)) == N


def test_no_change_rebuild_of_a_file_folder_build(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for i in range(6):
        _img(root / f"img_{i:03d}.png", i)
    recipe = _recipe(tmp_path / "r.yaml", root, output={"format": "png"})
    first = build(recipe, tmp_path / "out")
    index = tmp_path / "out" / "inc.json"
    stamp = _stamp(index)
    rep = build(recipe, tmp_path / "out")
    assert first["shards"]["built"] == 2 and rep.get("up_to_date") and _stamp(index) == stamp


_NOOP = """
import sys
from precompile import build
rep = build(sys.argv[1], sys.argv[2])
heavy = sorted(m for m in ("torch", "joblib", "cv2", "PIL", "tqdm", "precompile.compiler.shard", "h5py")
               if m in sys.modules)
print(rep.get("up_to_date"), ",".join(heavy))
"""


def test_no_change_rebuild_imports_only_what_it_needs(proj):
    tmp, root, recipe = proj
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _NOOP, recipe, str(tmp / "out")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    # h5py reads the index's attributes; nothing that decodes, schedules or trains is imported
    assert r.stdout.split() == ["True", "h5py"], r.stdout


@pytest.mark.parametrize("key", ["a/b.png", "ü/ñ 1.jpg", 'q"uo\\te/\t\x01\u2028.png', ""])
@pytest.mark.parametrize("label", [None, 0, 7])
def test_shard_key_item_text_is_the_canonical_json(key, label):
    # the direct formatting behind shard keys gives fmt.dumps's bytes, so keys do not change with it
    from precompile.formats import names as fmt
    from precompile.compiler.keys import item_text

    for fps in ([("image", [12, 1700000000123456789])],
                [("flow", [3, 4]), ("image", [5, 6])],
                [("image", ["missing"])],
                [("image", [10, "ab" * 32])],
                [("dir", [["x/y.dcm", [1, 2]]])]):
        assert item_text(key, label, fps) == fmt.dumps([key, label, dict(fps)])


def test_incremental_rate_counts_only_the_samples_built(tmp_path):
    """One shard of several rebuilt: the rate (and samples_built) is over that shard's samples only."""
    import json

    from click.testing import CliRunner
    from PIL import Image

    from conftest import image_recipe, make_image_tree, write_recipe
    from precompile.cli import main

    root = make_image_tree(tmp_path / "data")
    recipe = image_recipe(root)                       # 10 images, 4 per shard: 3 shards
    rep = build(recipe, out_dir=tmp_path / "out")
    assert rep["samples_built"] == rep["num_samples"] == 10
    assert rep["samples_per_second"] == round(10 / rep["wall_seconds"], 1)
    first = sorted(root.rglob("*.*"))[0]               # the first key: shard 0 (4 samples)
    Image.new("RGB", (40, 56), (0, 255, 0)).save(first, format="PNG" if first.suffix == ".png" else "JPEG")
    rep = build(recipe, out_dir=tmp_path / "out")
    assert rep["shards"]["built"] == 1 and rep["num_samples"] == 10 and rep["samples_built"] == 4
    assert rep["samples_per_second"] == round(4 / rep["wall_seconds"], 1)
    on_disk = json.loads((tmp_path / "out" / "imgs.report.json").read_text())
    assert on_disk["samples_built"] == 4 and on_disk["samples_per_second"] == rep["samples_per_second"]
    rep = build(recipe, out_dir=tmp_path / "out")
    assert rep["up_to_date"] and rep["samples_built"] == 0 and rep["samples_per_second"] == 0.0
    # the CLI names the samples the rate is over
    os.utime(first, ns=(1, 1))
    r = CliRunner().invoke(main, ["build", str(write_recipe(tmp_path / "r.yaml", recipe)), "-o",
                                  str(tmp_path / "out"), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "1 shard(s) built, 2 up to date" in r.output and "samples/s over the 4 samples built" in r.output
