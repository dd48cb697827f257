"""Variable-shape fields: ragged HDF5 (flat data + offsets + shapes) readable with plain h5py,
samples in their own shapes, ``batch`` refusing or padding unequal shapes, fixed layout unchanged."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import yaml

import precompile
from conftest import shard_file
from precompile import build as run_build
from precompile.decoders.base import Decoder
from precompile.reader import ShapeMismatchError
from precompile.registry import DECODERS
from precompile.sample import FieldSpec

SIZES = ((20, 30), (24, 24), (18, 40), (32, 16), (20, 30))


class _Clip(Decoder):
    """Test decoder: an .npy file -> (C, N) float32 audio of any duration."""

    name = "_var_test_audio"
    kind = "audio"

    def output_specs(self, field):
        return {field: FieldSpec("audio", (1, None), "float32")}

    def decode(self, path, field):
        return {field: np.load(path, allow_pickle=False)}, {"sample_rate": 100}


if _Clip.name not in DECODERS:
    DECODERS.register()(_Clip)


def make_images(root, sizes=SIZES, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = {}
    for k, (h, w) in enumerate(sizes):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        key = f"{'ab'[k % 2]}/img{k}.png"
        os.makedirs(os.path.join(root, key[0]), exist_ok=True)
        Image.fromarray(a).save(os.path.join(root, key))
        out[key] = a
    return out


def recipe(tmp_path, fields, steps=(), match="{label}/{name}.png", per_shard=2, fmt="hdf5", name="var", **out):
    r = {"name": name, "inputs": {"root": str(tmp_path / "in"), "match": match, "fields": fields,
                                  "label": {"capture": "label"}},
         "steps": list(steps), "output": {"format": fmt, "samples_per_shard": per_shard, **out}}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(r))
    return str(p)


@pytest.fixture
def native(tmp_path):
    src = make_images(str(tmp_path / "in"))
    rep = run_build(recipe(tmp_path, {"image": {"decoder": "image"}}), out_dir=str(tmp_path / "out"))
    return src, rep, precompile.open(rep["output"])


def test_native_sizes_round_trip_and_plain_h5py(native, tmp_path):
    src, rep, ds = native
    assert ds.field_specs["image"]["shape"] == [None, None, 3] and ds.variable("image")
    assert not ds.variable("label")
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i]["image"], src[ds.key(i)])
    # the index file, with plain h5py: data is a virtual dataset over the shards, offsets are global
    with h5py.File(rep["output"], "r") as f:
        g = f["image"]
        assert g.attrs["layout"] == "ragged" and g["data"].is_virtual and g["data"].ndim == 1
        o, sh = g["offsets"][:], g["shapes"][:]
        assert o.shape == (6,) and sh.shape == (5, 3) and o[-1] == sum(h * w * 3 for h, w in SIZES)
        keys = [k.decode() for k in f["__key__"][:]]
        for i in range(5):
            a = g["data"][o[i]:o[i + 1]].reshape(sh[i])
            np.testing.assert_array_equal(a, src[keys[i]])
        assert f["label"].shape == (5,)   # a fixed field keeps its (N, *shape) dataset
    # each shard alone, with plain h5py: local offsets, chunked, no filters
    base = os.path.dirname(rep["output"])
    seen = 0
    for s in ds.shards:
        with h5py.File(os.path.join(base, s["file"]), "r") as f:
            d = f["image"]["data"]
            assert d.chunks is not None and d.compression is None and not d.id.get_create_plist().get_nfilters()
            o, sh = f["image"]["offsets"][:], f["image"]["shapes"][:]
            assert o[0] == 0 and len(o) == s["num_samples"] + 1
            for j in range(s["num_samples"]):
                np.testing.assert_array_equal(d[o[j]:o[j + 1]].reshape(sh[j]), ds[seen + j]["image"])
            assert isinstance(f["label"], h5py.Dataset) and f["label"].shape == (s["num_samples"],)
        seen += s["num_samples"]


def test_batch_refuses_unequal_shapes_naming_them(native):
    src, rep, ds = native
    shapes = [ds[i]["image"].shape for i in range(len(ds))]
    i, j = next((i, j) for i in range(5) for j in range(5) if shapes[i] != shapes[j])
    with pytest.raises(ShapeMismatchError) as e:
        ds.batch([i, j])
    msg = str(e.value)
    assert "field 'image'" in msg and str(shapes[i]) in msg and str(shapes[j]) in msg and "pad=True" in msg
    assert isinstance(e.value, ValueError)
    # equal shapes stack without padding (keys img0 and img4 are both 20 x 30)
    same = [k for k in range(5) if shapes[k] == (20, 30, 3)]
    b = ds.batch(same)
    assert b["image"].shape == (2, 20, 30, 3) and b.padded == {}
    np.testing.assert_array_equal(b.shapes["image"], [[20, 30, 3]] * 2)


@pytest.mark.parametrize("pad,value", [(True, 0), (7, 7)])
def test_batch_pads_when_asked_and_says_what(native, pad, value):
    src, rep, ds = native
    idx = [3, 0, 1]
    b = ds.batch(idx, pad=pad)
    own = [ds[i]["image"].shape for i in idx]
    to = tuple(max(s[k] for s in own) for k in range(3))
    assert b["image"].shape == (3, *to) and b["image"].dtype == np.uint8
    assert b.padded["image"]["to"] == to and b.padded["image"]["value"] == value
    assert b.padded["image"]["samples"] == [p for p, s in enumerate(own) if s != to]
    np.testing.assert_array_equal(b.shapes["image"], own)
    for p, i in enumerate(idx):
        h, w, _ = own[p]
        np.testing.assert_array_equal(b["image"][p, :h, :w], ds[i]["image"])
        assert (b["image"][p, h:] == value).all() and (b["image"][p, :, w:] == value).all()
    np.testing.assert_array_equal(b["label"], [ds[i]["label"] for i in idx])


def test_fixed_fields_keep_their_layout(tmp_path):
    make_images(str(tmp_path / "in"))
    rep = run_build(recipe(tmp_path, {"image": {"decoder": "image"}}, steps=[{"resize": {"size": [16, 16]}}]),
                    out_dir=str(tmp_path / "out"))
    base = os.path.dirname(rep["output"])
    ds = precompile.open(rep["output"])
    with h5py.File(os.path.join(base, ds.shards[0]["file"]), "r") as f:
        d = f["image"]
        assert isinstance(d, h5py.Dataset) and d.shape == (2, 16, 16, 3) and d.chunks[1:] == (16, 16, 3)
    b = ds.batch([4, 2, 0])
    assert b["image"].shape == (3, 16, 16, 3) and b.padded == {} and b.shapes == {}


def test_variable_length_audio_in_hdf5(tmp_path):
    rng = np.random.default_rng(2)
    clips = {}
    for k, n in enumerate((50, 120, 7)):
        a = rng.normal(size=(1, n)).astype(np.float32)
        os.makedirs(tmp_path / "in" / "a", exist_ok=True)
        np.save(tmp_path / "in" / "a" / f"c{k}.npy", a)
        clips[f"a/c{k}.npy"] = a
    rep = run_build(recipe(tmp_path, {"clip": {"decoder": "_var_test_audio"}}, match="{label}/{name}.npy",
                           chunk_bytes=4096), out_dir=str(tmp_path / "out"))
    ds = precompile.open(rep["output"])
    for i in range(3):
        np.testing.assert_array_equal(ds[i]["clip"], clips[ds.key(i)])
    with pytest.raises(ShapeMismatchError, match=r"field 'clip'.*\(1, 50\).*\(1, 120\)"):
        ds.batch([0, 1])
    b = ds.batch([0, 1, 2], pad=True)
    assert b["clip"].shape == (3, 1, 120) and b.padded["clip"]["samples"] == [0, 2]
    assert (b["clip"][2, 0, 7:] == 0).all()


def test_variable_extra_field_in_flat_npy(tmp_path):
    """A ragged non-image field in a PNG build: flat <field>.npy per shard, shapes in the index."""
    src = make_images(str(tmp_path / "in"), sizes=((4, 5), (6, 3), (2, 2)))
    rng = np.random.default_rng(9)
    clips = {}
    for k, key in enumerate(src):
        a = rng.normal(size=(1, 10 + 5 * k)).astype(np.float32)
        np.save(tmp_path / "in" / key.replace(".png", ".npy"), a)
        clips[key] = a
    fields = {"image": {"decoder": "image"}, "clip": {"decoder": "_var_test_audio", "path": "{label}/{name}.npy"}}
    rep = run_build(recipe(tmp_path, fields, fmt="png", per_shard=2), out_dir=str(tmp_path / "out"))
    ds = precompile.open(rep["output"])
    assert ds.storage["clip"] == {"store": "npy", "layout": "flat"}
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i]["clip"], clips[ds.key(i)])
        np.testing.assert_array_equal(ds[i]["image"], src[ds.key(i)])
    flat = np.load(shard_file(tmp_path / "out" / "var.json", 0) / "clip.npy", allow_pickle=False)
    assert flat.ndim == 1 and flat.size == sum(ds[i]["clip"].size for i in range(ds.shards[0]["num_samples"]))


def test_ragged_build_is_byte_identical(tmp_path):
    make_images(str(tmp_path / "in"))
    rec = recipe(tmp_path, {"image": {"decoder": "image"}})
    rep = run_build(rec, out_dir=str(tmp_path / "out"))
    ds = precompile.open(rep["output"])
    paths = [os.path.join(os.path.dirname(rep["output"]), s["file"]) for s in ds.shards]

    def read(p):
        with open(p, "rb") as f:
            return f.read()

    first = [read(p) for p in paths]
    run_build(rec, out_dir=str(tmp_path / "out"), force=True)
    assert [read(p) for p in paths] == first
