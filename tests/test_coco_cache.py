"""The parsed COCO annotation file kept in the output folder (inputs/coco/cache.py): a no-change rebuild
reads it instead of parsing the JSON (parses counted), a changed file (another mtime at the same size; other
bytes with --content-hash), a damaged or foreign cache, or other options mean a parse; the kept parse equals a
fresh one field by field, and builds from it write the same bytes."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.inputs.coco import cache as coco_cache, parse as coco
from precompile.inputs.coco.parse import parse_coco
from precompile.compiler.driver import collect_garbage
from precompile.recipe import load_recipe

pytest.importorskip("pycocotools", reason="COCO masks need pycocotools (the coco extra)")

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "coco"


@pytest.fixture
def parses(monkeypatch) -> list:
    """Every parse of an annotation file (one entry per read_json call)."""
    calls: list = []
    real = coco.read_json

    def counted(path, recipe):
        calls.append(path)
        return real(path, recipe)
    monkeypatch.setattr(coco, "read_json", counted)
    return calls


@pytest.fixture
def ann(tmp_path: Path) -> Path:
    dst = tmp_path / "instances.json"
    shutil.copy(SAMPLE / "annotations" / "instances.json", dst)
    return dst


def _recipe(ann: Path, **coco_opts) -> dict:
    opts = {"mask": "instance", "crowd": "ignore", **coco_opts}
    return {"name": "c", "inputs": {"root": str(SAMPLE / "images"), "coco": {"file": str(ann), **opts}},
            "output": {"samples_per_shard": 2}}


def _cache(out: Path) -> Path:
    return out / "c.shards" / "coco-plan.h5"


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "c.shards").glob("shard-*.h5"))}


def _same_parse(a: coco.CocoParse, b: coco.CocoParse) -> None:
    """Every field of two parses equal, arrays with their dtypes and shapes."""
    assert a.images == b.images and list(a.images) == list(b.images)
    assert (a.label_names, a.attrs, a.num_keypoints, a.mask_dtype) == (b.label_names, b.attrs, b.num_keypoints,
                                                                        b.mask_dtype)
    assert list(a.annotations) == list(b.annotations)
    for iid, x in a.annotations.items():
        y = b.annotations[iid]
        assert (x.image_id, x.height, x.width, x.mask_dtype, x.digest, x.error) == (
            y.image_id, y.height, y.width, y.mask_dtype, y.digest, y.error)
        for f in ("boxes", "labels", "keypoints"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None)
            if u is not None:
                assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)
        assert _plain(x.segments) == _plain(y.segments) and _plain(x.ignore) == _plain(y.ignore)
        assert y.seal().digest == x.digest   # the digest made again from what was read back


def _plain(segs: list) -> list:
    """Segmentations as plain values with their dtypes (polygons float64, RLE counts uint32 or text)."""
    def one(s):
        if isinstance(s, dict):
            c = s["counts"]
            return {"size": list(s["size"]), "counts": c if isinstance(c, str) else (c.dtype.str, c.tolist())}
        return None if s is None else [(p.dtype.str, p.tolist()) for p in s]
    return [one(s) for s in segs]


def test_no_change_rebuild_reads_the_kept_parse_and_writes_the_same_bytes(tmp_path, ann, parses):
    out = tmp_path / "out"
    first = precompile.build(_recipe(ann), out)
    assert first["shards"]["built"] == 4 and len(parses) == 1 and _cache(out).is_file()
    built = _shards(out)
    again = precompile.build(_recipe(ann), out)
    assert again["up_to_date"] and len(parses) == 1            # the JSON was not parsed again
    forced = precompile.build(_recipe(ann), out, force=True)   # every shard built again, from the kept parse
    assert forced["shards"]["built"] == 4 and len(parses) == 1
    assert _shards(out) == built
    fresh = precompile.build(_recipe(ann), tmp_path / "fresh")   # another output: parsed, the same bytes
    assert len(parses) == 2 and _shards(tmp_path / "fresh") == built
    # the output folder holds it, gc keeps it, and nothing else was written beside the outputs
    (out / "c.shards" / "stray.h5").write_bytes(b"x")   # what gc removes: no index names it
    collect_garbage(str(out / "c.h5"), keep_previous=False)
    assert not (out / "c.shards" / "stray.h5").exists() and _cache(out).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "instances.json", "out"]
    assert not list((out / "c.shards").glob("*.tmp-*"))


@pytest.mark.parametrize("opts", [{"mask": "instance", "crowd": "ignore"}, {"mask": "semantic", "crowd": "keep"},
                                  {"mask": "none", "keypoints": True}, {"mask": "instance", "crowd": "drop",
                                                                        "keypoints": True}])
def test_the_kept_parse_equals_a_fresh_one(tmp_path, ann, opts):
    data = json.loads(ann.read_text())
    a = data["annotations"]
    a[0]["segmentation"] = {"counts": [100, 20, 300, 7, 48 * 64 - 427], "size": [data["images"][0]["height"],
                                                                                data["images"][0]["width"]]}
    a[0]["image_id"] = data["images"][0]["id"]   # an uncompressed RLE (counts a list)
    a[1]["segmentation"] = [[1, 1, 4, 1, 4, 4, 1, 4], [9, 9, 12, 9, 12, 12]]   # two polygons
    a[2]["segmentation"] = []                                                  # none
    a[5]["bbox"] = [1, 2, -3, 4]                                               # its image fails (kept: its error)
    ann.write_text(json.dumps(data))
    r = load_recipe(_recipe(ann, **opts))
    parsed = parse_coco(r)
    assert [i for i, x in parsed.annotations.items() if x.error] == [a[5]["image_id"]]
    assert parsed.annotations[a[0]["image_id"]].error == ()
    key = coco_cache.cache_key(r, str(ann), False)
    path = str(tmp_path / "kept.h5")
    assert coco_cache.save(path, key, parsed)
    _same_parse(parsed, coco_cache.load(path, key))
    assert coco_cache.load(path, {**key, "mask": "other"}) is None


def test_string_image_ids_round_trip(tmp_path, ann):
    data = json.loads(ann.read_text())
    ids = {im["id"]: f"img-{im['id']}" for im in data["images"]}
    for im in data["images"]:
        im["id"] = ids[im["id"]]
    for a in data["annotations"]:
        a["image_id"] = ids[a["image_id"]]
    data["images"][0]["id"] = 7   # ids of both kinds in one file
    data["images"][1]["id"] = 2 ** 70   # and an integer past int64
    for a in data["annotations"]:
        if a["image_id"] == f"img-{list(ids)[0]}":
            a["image_id"] = 7
        if a["image_id"] == f"img-{list(ids)[1]}":
            a["image_id"] = 2 ** 70
    ann.write_text(json.dumps(data))
    r = load_recipe(_recipe(ann))
    parsed = parse_coco(r)
    key = coco_cache.cache_key(r, str(ann), False)
    assert coco_cache.save(str(tmp_path / "kept.h5"), key, parsed)
    back = coco_cache.load(str(tmp_path / "kept.h5"), key)
    _same_parse(parsed, back)
    assert 7 in back.images and 2 ** 70 in back.images and "img-108" in back.images


def test_a_changed_file_is_parsed_again(tmp_path, ann, parses):
    out = tmp_path / "out"
    ann.write_text(json.dumps(json.loads(ann.read_text())))   # one line: a bbox's text is found below
    precompile.build(_recipe(ann), out)
    st = os.stat(ann)
    os.utime(ann, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # the same bytes, another mtime
    rep = precompile.build(_recipe(ann), out)
    assert len(parses) == 2 and rep["up_to_date"]
    assert precompile.build(_recipe(ann), out)["up_to_date"] and len(parses) == 2   # kept again, with the new mtime

    hashed = tmp_path / "hashed"   # content fingerprints (of the images too): an output of their own
    precompile.build(_recipe(ann), hashed, content_hash=True)
    assert len(parses) == 3

    # other bytes of the same size under the same mtime: only the content fingerprint sees them
    text = ann.read_text()
    old = json.loads(text)["annotations"][0]["bbox"]
    new = [round(v + 1, 2) if len(str(round(v + 1, 2))) == len(str(v)) else v for v in old]
    changed = text.replace(json.dumps(old), json.dumps(new), 1)
    assert new != old and len(changed) == len(text) and changed != text
    st = os.stat(ann)
    ann.write_text(changed)
    os.utime(ann, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert precompile.build(_recipe(ann), out)["up_to_date"] and len(parses) == 3   # size and mtime: unchanged
    rep = precompile.build(_recipe(ann), hashed, content_hash=True)
    assert len(parses) == 4 and rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 3
    again = precompile.build(_recipe(ann), hashed, content_hash=True)
    assert again["up_to_date"] and len(parses) == 4


def test_a_damaged_or_foreign_cache_means_a_parse(tmp_path, ann, parses, monkeypatch):
    out = tmp_path / "out"
    precompile.build(_recipe(ann), out)
    built = _shards(out)
    kept = _cache(out)
    good = kept.read_bytes()
    damaged = [good[:len(good) // 2],                                            # cut short
               good[:len(good) // 2] + bytes([good[len(good) // 2] ^ 0xFF]) + good[len(good) // 2 + 1:],
               b"not hdf5 at all"]
    for n, bad in enumerate(damaged, start=2):
        kept.write_bytes(bad)
        rep = precompile.build(_recipe(ann), out)
        assert rep["up_to_date"] and len(parses) == n and _shards(out) == built
        assert kept.read_bytes() != bad   # written again from the parse
    kept.unlink()
    assert precompile.build(_recipe(ann), out)["up_to_date"] and len(parses) == 5 and kept.is_file()
    monkeypatch.setattr(coco_cache, "VERSION", coco_cache.VERSION + 1)   # a file this version did not write
    precompile.build(_recipe(ann), out)
    assert len(parses) == 6
    rep = precompile.build(_recipe(ann, mask="semantic"), out)   # other options shape another parse
    assert len(parses) == 7 and rep["shards"]["built"] == 4


def test_a_flipped_bit_in_any_stored_column_is_caught(tmp_path, ann):
    import h5py

    r = load_recipe(_recipe(ann, keypoints=True))
    parsed = parse_coco(r)
    key = coco_cache.cache_key(r, str(ann), False)
    path = tmp_path / "kept.h5"
    assert coco_cache.save(str(path), key, parsed)
    good = path.read_bytes()
    with h5py.File(path, "r") as f:
        spots = {name: f[name].id.get_chunk_info(0).byte_offset for name in f if f[name].size}
    assert {"meta", "boxes", "labels", "keypoints", "digest", "segments_coords", "ignore_rle_text"} <= set(spots)
    for name, at in spots.items():
        bad = bytearray(good)
        bad[at] ^= 0x01
        path.write_bytes(bytes(bad))
        assert coco_cache.load(str(path), key) is None, name


def test_a_cache_the_folder_refuses_leaves_the_build_going(tmp_path, ann, parses):
    out = tmp_path / "out"
    precompile.build(_recipe(ann), out)
    kept = _cache(out)
    kept.unlink()
    kept.mkdir()   # a folder where the file goes: the rename fails
    rep = precompile.build(_recipe(ann), out)
    assert rep["up_to_date"] and len(parses) == 2 and kept.is_dir()
    assert not list((out / "c.shards").glob("coco-plan.h5.tmp-*"))
