"""Damaged outputs (issue 24): every stored byte is covered by ``verify`` (keys, meta, every field, every
file of the folder formats), damage is named (shard, column/field, sample), a damaged index is told apart
from a damaged shard, ``open``/``Loader`` can verify on open, ``build --repair`` rebuilds exactly the
damaged shards (or the index), and a damaged report is written again whole."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import precompile
from precompile.errors import FormatError
from precompile.tools.verify import verify

from conftest import image_recipe, index_shards, make_image_tree, shard_file, write_recipe

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precompile.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def _flip(path: Path, needle: bytes, at: int = 0, to: bytes | None = None) -> None:
    """Change one byte of ``path``: the byte ``at`` inside the one occurrence of ``needle``."""
    d = bytearray(path.read_bytes())
    assert d.count(needle) == 1, f"{needle!r} occurs {d.count(needle)} times in {path}"
    i = d.find(needle) + at
    d[i] = (to[0] if to else d[i] ^ 0x20)
    path.write_bytes(bytes(d))


def _all(index: Path) -> dict[str, list]:
    ds = precompile.open(index)
    return {"keys": list(ds.keys), "meta": [json.dumps(ds.meta(i), sort_keys=True) if hasattr(ds, "meta") else ""
                                            for i in range(len(ds))],
            "image": [ds[i]["image"].tobytes() for i in range(len(ds))]}


@pytest.fixture
def built(tmp_path) -> tuple[Path, Path]:
    tree = make_image_tree(tmp_path / "data", size=(160, 224))   # JPEGs decoded at 1/2: meta {"reduce": 2, ...}
    r = write_recipe(tmp_path / "r.yaml", image_recipe(tree))
    precompile.build(r, out_dir=tmp_path / "out")
    return r, tmp_path / "out" / "imgs.h5"


def _repair(recipe: Path, index: Path) -> dict:
    rep = precompile.build(recipe, out_dir=index.parent, repair=True)
    assert verify(index).ok
    return rep


def test_flipped_key_byte_fails_verify_naming_column_and_sample(built):
    recipe, index = built
    before = _all(index)
    sh = shard_file(index, 0)
    name = f"imgs.shards/{sh.name}"
    _flip(sh, b"cat/001.png", 0)                       # 'c' -> 'C' inside the __key__ column
    res = verify(index)
    assert not res.ok and res.bad_shards == [name] and not res.index_damaged
    assert res.problems == [f"{name}: whole-file sha256 differs from the index's",
                            f"{name}: column '__key__' differs from the index's at sample 1 (key 'cat/001.png')"]
    r = _cli("verify", str(index))
    assert r.returncode == 5 and "column '__key__' differs from the index's at sample 1" in r.stderr
    with pytest.raises(FormatError, match=r"verify on open failed, 1 of 3 shard\(s\) damaged: .*__key__"):
        precompile.open(index, verify=True)
    rep = _repair(recipe, index)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 2
    assert _all(index) == before


def test_flipped_meta_byte_fails_verify(built):
    recipe, index = built
    before = _all(index)
    sh = shard_file(index, 0)
    name = f"imgs.shards/{sh.name}"
    d = sh.read_bytes()
    i = d.find(b'{"image":{"reduce":2,')                # (then its map back to the source)
    assert i >= 0
    sh.write_bytes(d[:i + 19] + b"4" + d[i + 20:])      # one JPEG sample's meta: reduce 2 -> 4
    with h5py.File(sh, "r") as f:                        # which sample HDF5's heap held first
        changed = [j for j, m in enumerate(f["__meta__"][:]) if m.startswith(b'{"image":{"reduce":4,')]
        key = f["__key__"][changed[0]].decode()
    assert len(changed) == 1 and key.endswith(".jpg")
    res = verify(index)
    assert res.bad_shards == [name] and not res.index_damaged
    assert res.problems == [f"{name}: whole-file sha256 differs from the index's",
                            f"{name}: column '__meta__' differs from the index's at sample {changed[0]} (key {key!r})"]
    assert precompile.build(recipe, out_dir=index.parent)["shards"]["built"] == 0   # the no-op check does not hash
    assert _repair(recipe, index)["shards"]["built"] == 1
    assert _all(index) == before


def test_flipped_field_byte_named_and_repaired(built):
    recipe, index = built
    before = _all(index)
    sh = shard_file(index, 1)
    name = f"imgs.shards/{sh.name}"
    with h5py.File(sh, "r") as f:
        d = f["image"]
        info = d.id.get_chunk_info_by_coord((0,) * d.ndim)
    data = bytearray(sh.read_bytes())
    data[info.byte_offset + 100] ^= 0xFF
    sh.write_bytes(bytes(data))
    res = verify(index)
    assert res.bad_shards == [name]
    assert res.problems[0] == f"{name}: whole-file sha256 differs from the index's"
    assert res.problems[1].startswith(f"{name}: field 'image': data checksum mismatch")
    ds = precompile.open(index)                          # without verify: opens (the default no-op check)
    assert len(ds) == 10
    with pytest.raises(FormatError, match="field 'image': data checksum mismatch"):
        precompile.open(index, verify=True)
    r = _cli("build", str(recipe), "-o", str(index.parent), "--repair", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "1 shard(s) built, 2 up to date" in r.stdout
    assert verify(index).ok and _all(index) == before


def test_damaged_index_is_told_apart_from_the_shards(built):
    recipe, index = built
    before = _all(index)
    names = [f"imgs.shards/{p.name}" for p in index_shards(index).values()]
    with h5py.File(index, "r+") as f:
        shards = json.loads(f.attrs["shards"])
        good = shards[1]["checksums"]["image"]
        shards[1]["checksums"]["image"] = "0" * 64
        f.attrs["shards"] = json.dumps(shards)
        f["__key__"][5] = "dog/999.jpg"
    res = verify(index)
    assert res.bad_shards == [] and res.index_damaged
    assert res.index_problems == [
        f"entry of {names[1]}: field 'image': checksum 0000000000000000... in the index differs from the "
        f"shard's own {good[:16]}...",
        f"entry of {names[1]}: column '__key__' differs from the index's at sample 1 (key 'dog/999.jpg')",
        "its two copies of the keys differ at sample 5: 'dog/000.jpg' in __key_utf8__, 'dog/999.jpg' in __key__",
        "the crc32 of its key column (__key__) is not the one the build recorded"]
    assert all(p.startswith("index: ") for p in res.problems)
    r = _cli("verify", str(index))
    assert r.returncode == 5 and "error: the index is damaged (every shard is intact)" in r.stderr
    assert "shard(s) failed verification" not in r.stderr
    with pytest.raises(FormatError, match="verify on open failed, its index is damaged"):
        precompile.open(index, verify=True)
    rep = _repair(recipe, index)
    assert rep["shards"]["built"] == 0                  # no shard rebuilt: the index is written again
    assert _all(index) == before


def test_unusable_index_is_an_index_error_and_repair_rewrites_it(built):
    recipe, index = built
    before = _all(index)
    with h5py.File(index, "r+") as f:
        f.attrs["shards"] = "{not json"
    with pytest.raises(FormatError, match="the index file's metadata is damaged"):
        verify(index)
    rep = _repair(recipe, index)
    assert rep["shards"]["built"] == 0 and _all(index) == before


def test_truncated_report_is_written_again_whole(built):
    recipe, index = built
    report = index.parent / "imgs.report.json"
    full = json.loads(report.read_text())
    stamp = report.stat().st_mtime_ns
    precompile.build(recipe, out_dir=index.parent)
    assert report.stat().st_mtime_ns == stamp            # an intact report: a no-op build writes nothing
    report.write_text(report.read_text()[:50])
    again = precompile.build(recipe, out_dir=index.parent)
    assert again["up_to_date"]
    now = json.loads(report.read_text())
    assert now["recipe_hash"] == full["recipe_hash"] and now["num_samples"] == full["num_samples"] == 10


def test_png_folder_damage_named_and_repaired(tmp_path):
    tree = make_image_tree(tmp_path / "data")
    r = image_recipe(tree)
    r["output"] = {"format": "png", "samples_per_shard": 4}
    recipe = write_recipe(tmp_path / "r.yaml", r)
    precompile.build(recipe, out_dir=tmp_path / "out")
    index = tmp_path / "out" / "imgs.json"
    before = [precompile.open(index)[i]["image"].tobytes() for i in range(10)]
    folder = shard_file(index, 2)
    png = sorted(folder.glob("*.png"))[0]
    d = bytearray(png.read_bytes())
    d[-20] ^= 0xFF                                       # inside the last IDAT chunk's data or CRC
    png.write_bytes(bytes(d))
    rel = f"imgs.shards/{folder.name}/{png.name}"
    res = verify(index)
    assert res.bad_shards == [f"imgs.shards/{folder.name}"]
    assert any(p.startswith(f"imgs.shards/{folder.name}: {rel}: bytes changed") for p in res.problems)
    with pytest.raises(FormatError, match="bytes changed"):
        precompile.open(index, verify=True)
    assert precompile.build(recipe, out_dir=tmp_path / "out", repair=True)["shards"]["built"] == 1
    assert verify(index).ok and [precompile.open(index)[i]["image"].tobytes() for i in range(10)] == before
    info = shard_file(index, 0) / "info.json"
    info.write_text(info.read_text() + " ")             # a byte no sample file holds
    res = verify(index)
    assert res.problems == [f"imgs.shards/{shard_file(index, 0).name}: whole-shard sha256 (every file of the "
                            f"folder: info.json, .npy headers, extra files) differs from the index's"]


def test_loader_verifies_on_open(built):
    pytest.importorskip("torch")
    recipe, index = built
    from precompile import Loader

    assert len(list(Loader(index, batch_size=5, device="cpu", verify=True))) == 2
    _flip(shard_file(index, 2), b"dog/004.jpg", 0)
    with pytest.raises(FormatError, match="column '__key__' differs"):
        Loader(index, batch_size=5, device="cpu", verify=True)
    with pytest.raises(FormatError, match="column '__key__' differs"):
        Loader(precompile.open(index), batch_size=5, device="cpu", verify=True)
