"""Build -> read round trips on real bytes, determinism across job counts, plain-h5py access."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import precompile
from precompile.decoders.image import decode_image_file
from precompile.transforms.kernels import geometry as F

from conftest import REPO, image_recipe, make_image_tree, write_recipe


def _expected(path: Path) -> np.ndarray:
    """What the recipe should produce for one input: decode, shorter side 36, center crop 32."""
    a = decode_image_file(str(path), "rgb8")
    h, w = F.shorter_side_size(a.shape[0], a.shape[1], 36)
    a = F.resize_hwc(a, h, w)
    t, l = (h - 32) // 2, (w - 32) // 2
    return a[t:t + 32, l:l + 32]


def _hash_build(index: Path) -> dict[str, str]:
    out = {}
    with h5py.File(index, "r") as f:
        for name in f:
            d = f[name][()]
            out[name] = hashlib.sha256(np.asarray(d).tobytes() if d.dtype != object else
                                       "\n".join(x.decode() for x in d).encode()).hexdigest()
    return out


def test_round_trip_matches_direct_processing(tmp_path, image_recipe_file, image_tree):
    rep = precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    assert rep["status"] == "ok" and rep["num_samples"] == 10 and rep["shards"]["built"] == 3
    assert set(rep["stage_seconds"]) >= {"decode", "steps", "write", "finalize"}
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    assert len(ds) == 10 and ds.label_names == ["cat", "dog"]
    for i in range(len(ds)):
        key = ds.key(i)
        s = ds[i]
        np.testing.assert_array_equal(s["image"], _expected(image_tree / key))
        assert int(s["label"]) == (0 if key.startswith("cat/") else 1)
    b = ds.batch([9, 0, 4, 4, 7])
    assert b["image"].shape == (5, 32, 32, 3)
    for row, i in enumerate([9, 0, 4, 4, 7]):
        np.testing.assert_array_equal(b["image"][row], ds[i]["image"])
    with pytest.raises(IndexError):
        ds[10]


def test_report_json_written(tmp_path, image_recipe_file):
    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "imgs.report.json").read_text())
    assert rep["num_samples"] == 10 and rep["failures"] == [] and rep["status"] == "ok"


def test_same_bytes_for_any_job_count(tmp_path, image_recipe_file):
    precompile.build(image_recipe_file, out_dir=tmp_path / "a", n_jobs=1)
    precompile.build(image_recipe_file, out_dir=tmp_path / "b", n_jobs=2)
    ha, hb = _hash_build(tmp_path / "a" / "imgs.h5"), _hash_build(tmp_path / "b" / "imgs.h5")
    assert ha == hb and {"image", "label", "__key__"} <= set(ha)
    # the shard files themselves are byte-identical (no timestamps in them)
    for name in sorted(os.listdir(tmp_path / "a" / "imgs.shards")):
        a = (tmp_path / "a" / "imgs.shards" / name).read_bytes()
        b = (tmp_path / "b" / "imgs.shards" / name).read_bytes()
        assert a == b, name


def test_plain_h5py_reads_without_precompile(tmp_path, image_recipe_file):
    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    want = ds.batch(range(len(ds)))["image"]
    code = f"""
import sys, json
sys.modules['precompile'] = None  # prove precompile is not needed
import h5py, numpy as np
with h5py.File({str(tmp_path / 'out' / 'imgs.h5')!r}, 'r') as f:
    img = f['image'][:]
    labels = json.loads(f.attrs['label_names'])
    fields = json.loads(f.attrs['fields'])
    keys = [k.decode() for k in f['__key__'][:]]
np.save({str(tmp_path / 'plain.npy')!r}, img, allow_pickle=False)
print(json.dumps([labels, fields['image']['shape'], keys[0], img.shape[0]]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    labels, shape, key0, n = json.loads(out.stdout)
    assert labels == ["cat", "dog"] and shape == [32, 32, 3] and key0 == "cat/000.jpg" and n == 10
    np.testing.assert_array_equal(np.load(tmp_path / "plain.npy"), want)


def test_output_moves_with_its_folder(tmp_path, image_recipe_file):
    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    os.rename(tmp_path / "out", tmp_path / "moved")
    ds = precompile.open(tmp_path / "moved" / "imgs.h5")
    with h5py.File(tmp_path / "moved" / "imgs.h5", "r") as f:
        np.testing.assert_array_equal(f["image"][3], ds[3]["image"])


def test_rebuild_skips_up_to_date_shards(tmp_path, image_recipe_file, image_tree):
    first = precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    again = precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    assert {k: again["shards"][k] for k in ("total", "built", "skipped", "failed")} == \
        {"total": 3, "built": 0, "skipped": 3, "failed": 0}
    assert _hash_build(tmp_path / "out" / "imgs.h5")["image"] == _hash_build(tmp_path / "out" / "imgs.h5")["image"]
    # touching one input rebuilds only its shard
    victim = image_tree / "dog" / "004.jpg"
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    assert third["shards"]["built"] == 1 and third["shards"]["skipped"] == 2
    assert first["num_samples"] == third["num_samples"] == 10


def test_corrupt_image_names_file_and_stage(tmp_path, image_tree):
    bad = image_tree / "dog" / "002.jpg"
    bad.write_bytes(bad.read_bytes()[:200])
    r = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree))
    with pytest.raises(precompile.errors.BuildError) as ei:
        precompile.build(r, out_dir=tmp_path / "out")
    msg = str(ei.value)
    assert str(bad) in msg and "stage decode" in msg and "field 'image'" in msg
    assert not (tmp_path / "out" / "imgs.h5").exists()
    # the shards that did not contain the bad file were finished and are kept
    assert len(list((tmp_path / "out" / "imgs.shards").glob("shard-*.h5"))) >= 1


def test_skip_policy_drops_only_the_bad_input(tmp_path, image_tree):
    bad = image_tree / "cat" / "001.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 50)
    r = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree, on_error="skip"))
    rep = precompile.build(r, out_dir=tmp_path / "out")
    assert rep["num_samples"] == 9 and len(rep["failures"]) == 1
    assert rep["failures"][0]["path"] == str(bad) and rep["failures"][0]["stage"] == "decode"
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    assert "cat/001.png" not in ds.keys and len(ds) == 9


def test_build_path_never_imports_torch(tmp_path, image_recipe_file):
    code = ("import sys, precompile; precompile.build(sys.argv[1], out_dir=sys.argv[2], n_jobs=1); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(image_recipe_file), str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_dataset_inside_torch_dataloader_with_workers(tmp_path, image_recipe_file):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    ds[0]  # open a handle in the parent: the workers must not inherit it
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, shuffle=False,
                                     multiprocessing_context="fork")
    got = torch.cat([b["image"] for b in dl]).numpy()
    np.testing.assert_array_equal(got, ds.batch(range(len(ds)))["image"])
    labels = torch.cat([b["label"] for b in dl]).numpy()
    assert labels.tolist() == [0] * 5 + [1] * 5


def test_make_image_tree_is_deterministic(tmp_path):
    a = make_image_tree(tmp_path / "a", per_class=2)
    b = make_image_tree(tmp_path / "b", per_class=2)
    assert (a / "cat" / "000.jpg").read_bytes() == (b / "cat" / "000.jpg").read_bytes()


def test_whole_output_is_byte_identical_with_source_date_epoch(tmp_path, image_recipe_file, monkeypatch):
    """With SOURCE_DATE_EPOCH fixing the recorded build date, the index file is reproducible too
    (its virtual datasets carry no timestamps); the builds are more than a second apart."""
    import time

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    precompile.build(image_recipe_file, out_dir=tmp_path / "a")
    time.sleep(1.1)
    precompile.build(image_recipe_file, out_dir=tmp_path / "b", n_jobs=2)
    assert (tmp_path / "a" / "imgs.h5").read_bytes() == (tmp_path / "b" / "imgs.h5").read_bytes()
    with h5py.File(tmp_path / "a" / "imgs.h5", "r") as f:
        assert f["image"].is_virtual and f.attrs["build_date"] == "2023-11-14T22:13:20+00:00"


def test_a_second_concurrent_build_of_the_same_output_is_refused(tmp_path, image_recipe_file):
    import fcntl

    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    lock = tmp_path / "out" / "imgs.shards" / ".lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # as a running build holds it
        with pytest.raises(precompile.errors.BuildError, match="another build of 'imgs'.*is running"):
            precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    finally:
        os.close(fd)
    assert precompile.build(image_recipe_file, out_dir=tmp_path / "out")["status"] == "ok"


def test_the_local_lock_never_reads_its_file_and_a_lock_that_is_no_file_is_named(tmp_path, image_recipe_file):
    """The local lock is an flock on ``<name>.shards/.lock``: its content is never read, so garbage in it
    changes nothing (unlike a URL lock object, whose body is read). A ``.lock`` that cannot be opened as a
    file (a folder in its place) is an OutputError naming it, not an I/O error of the output folder."""
    out = tmp_path / "out"
    precompile.build(image_recipe_file, out_dir=out)
    lock = out / "imgs.shards" / ".lock"
    lock.write_bytes(bytes(range(256)) * 64)
    assert precompile.build(image_recipe_file, out_dir=out, force=True)["status"] == "ok"
    lock.unlink()
    lock.mkdir()
    with pytest.raises(precompile.errors.OutputError) as e:
        precompile.build(image_recipe_file, out_dir=out, force=True)
    assert str(e.value) == (f"cannot open the build lock {lock}: Is a directory; it must be a file (its content is "
                            f"never read): remove what is there")
    assert e.value.exit_code == 6
    lock.rmdir()
    assert precompile.build(image_recipe_file, out_dir=out)["status"] == "ok"


def test_every_input_failing_is_an_error_not_an_empty_dataset(tmp_path, image_tree):
    for p in image_tree.rglob("*.*"):
        p.write_bytes(b"broken")
    r = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree, on_error="skip"))
    with pytest.raises(precompile.errors.BuildError, match=r"every input failed \(10 skipped\)"):
        precompile.build(r, out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "imgs.h5").exists()
    assert json.loads((tmp_path / "out" / "imgs.report.json").read_text())["status"] == "failed"


def test_build_arguments_are_what_the_cli_gives(tmp_path):
    """build() from Python took bool() of its flags and n_jobs as given: force="no" forced a rebuild, stats="no"
    computed stats, n_jobs=2.5 and True reached the pool, n_jobs=0 built, and n_jobs="2" failed comparing a string
    with an int. Now n_jobs is None, a whole number >= 1 or -1 (every core, as -j -1) and each flag True or False
    (stats None too); anything else is a ValueError naming the argument, before anything is read or written."""
    import precompile

    r = os.path.join(REPO, "recipes", "images.yaml")
    for kw, msg in [({"n_jobs": 2.5}, "n_jobs must be a whole number of jobs >= 1, or -1 for every core, got '2.5'"),
                    ({"n_jobs": True}, "n_jobs must be a whole number"), ({"n_jobs": 0}, "n_jobs must be a whole number of jobs >= 1, or -1 for every core, got '0'"),
                    ({"n_jobs": "2"}, "n_jobs must be a whole number of jobs >= 1, or -1 for every core, got '2'"), ({"force": "no"}, "force must be True or False, got 'no'"),
                    ({"stats": "no"}, "stats must be True or False"), ({"content_hash": 1}, "content_hash must be")]:
        with pytest.raises(ValueError, match="^build\\(\\): " + msg.replace("(", r"\(").replace(")", r"\)")):
            precompile.build(r, tmp_path / "out", **kw)
        assert not (tmp_path / "out").exists()
    rep = precompile.build(r, tmp_path / "out", n_jobs=-1, stats=None)
    assert rep["jobs"] == (os.cpu_count() or 1) and rep["num_samples"] == 36
