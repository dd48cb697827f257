"""Output formats png, bmp and wav: builds on generated inputs, read back with the ordinary tools
(PIL, OpenCV, soundfile, json, numpy) and through ``precompile.open``."""
from __future__ import annotations

import json
import os
import pickle

from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import precompile
from conftest import index_shards, shard_file
from precompile.decoders.base import Decoder
from precompile import build as run_build
from precompile.errors import BuildError, RecipeError
from precompile.reader import ShapeMismatchError
from precompile.registry import DECODERS
from precompile.sample import FieldSpec


class _Audio(Decoder):
    """Test decoder: a WAV file -> (C, N) float32 and its rate in the metadata."""

    name = "_fmt_test_audio"
    kind = "audio"

    def output_specs(self, field):
        return {field: FieldSpec("audio", (2, None), "float32")}

    def decode(self, path, field):
        import soundfile as sf

        data, rate = sf.read(path, dtype="float32", always_2d=True)
        return {field: np.ascontiguousarray(data.T)}, {"sample_rate": rate}


class _Flow(Decoder):
    """Test decoder: an .npy file -> a (H, W, 2) float32 flow field."""

    name = "_fmt_test_flow"
    kind = "flow"

    def output_specs(self, field):
        return {field: FieldSpec("flow", (None, None, 2), "float32")}

    def decode(self, path, field):
        return {field: np.load(path, allow_pickle=False)}, {}


for _cls in (_Audio, _Flow):
    if _cls.name not in DECODERS:
        DECODERS.register()(_cls)


def _save_png(path, arr):
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(arr).save(path)


def make_images(root, sizes=((20, 30), (24, 24), (18, 40), (32, 16)), classes=("a", "b"), seed=0):
    """RGB PNG inputs of the given sizes in class folders; returns {key: pixels}."""
    rng = np.random.default_rng(seed)
    out = {}
    for c in classes:
        for k, (h, w) in enumerate(sizes):
            a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            key = f"{c}/img{k}.png"
            _save_png(os.path.join(root, key), a)
            out[key] = a
    return out


def write_recipe(tmp_path, fields, output, steps=(), match="{label}/{name}.png", label=True, name="ds"):
    r = {"name": name, "inputs": {"root": str(tmp_path / "in"), "match": match, "fields": fields},
         "steps": list(steps), "output": output}
    if label:
        r["inputs"]["label"] = {"capture": "label"}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(r))
    return str(p)


def build(tmp_path, recipe):
    rep = run_build(recipe, out_dir=str(tmp_path / "out"))
    return rep, precompile.open(rep["output"])


# --- PNG ---------------------------------------------------------------------------------------

def test_png_round_trip_pil_cv2_and_json_index(tmp_path):
    import cv2
    from PIL import Image

    src = make_images(tmp_path / "in")
    rec = write_recipe(tmp_path, {"image": {"decoder": "image"}}, {"format": "png", "samples_per_shard": 3})
    rep, ds = build(tmp_path, rec)
    assert rep["output"].endswith("ds.json") and len(ds) == len(src) == 8
    assert len(ds.shards) == 3 and ds.label_names == ["a", "b"]
    with open(rep["output"], encoding="utf-8") as f:
        index = json.load(f)  # the index is JSON, nothing pickled
    assert index["storage"] == {"image": {"store": "file", "ext": ".png"}, "label": {"store": "index"}}
    for i in range(len(ds)):
        key = ds.key(i)
        entry = index["samples"][i]
        assert entry["key"] == key and entry["values"]["label"] == ["a", "b"].index(key[0])
        path = os.path.join(os.path.dirname(rep["output"]), entry["files"]["image"])
        assert path == ds.file(i, "image")
        assert os.path.basename(os.path.dirname(path)).startswith("shard-") and path.endswith(".png")
        sample = ds[i]
        np.testing.assert_array_equal(sample["image"], src[key])        # own native shape, lossless
        assert entry["shapes"]["image"] == list(src[key].shape)
        np.testing.assert_array_equal(np.asarray(Image.open(path)), src[key])
        np.testing.assert_array_equal(cv2.imread(path, cv2.IMREAD_UNCHANGED)[..., ::-1], src[key])
        assert int(sample["label"]) == entry["values"]["label"] and sample["label"].dtype == np.int64
        assert ds.meta(i) == {} and ds.copy(i) == 0
    # the shard folder keeps its own info for skipping and resuming
    info = json.loads((shard_file(tmp_path / "out" / "ds.json", 0) / "info.json").read_text())
    assert info["num_samples"] == 3 and info["key"] == ds.shards[0]["key"]
    # a second build skips every shard; the dataset pickles without handles
    rep2 = run_build(rec, out_dir=str(tmp_path / "out"))
    assert rep2["shards"]["skipped"] == 3 and rep2["shards"]["built"] == 0
    ds2 = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(ds2[5]["image"], ds[5]["image"])


def test_png_is_zlib_level_0(tmp_path):
    os.makedirs(tmp_path / "in" / "a")
    flat = np.full((100, 120, 3), 77, np.uint8)   # compresses to almost nothing at any real level
    _save_png(str(tmp_path / "in" / "a" / "flat.png"), flat)
    rec = write_recipe(tmp_path, {"image": {"decoder": "image"}}, {"format": "png"})
    rep, ds = build(tmp_path, rec)
    size = os.path.getsize(ds.file(0, "image"))
    raw = flat.nbytes + flat.shape[0]          # pixels + one filter byte per row
    stored_blocks = -(-raw // 65535)
    assert raw <= size <= raw + 5 * stored_blocks + 200, (size, raw)
    np.testing.assert_array_equal(ds[0]["image"], flat)


def test_png_keeps_16_bits(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(3)
    g16 = rng.integers(0, 65536, (21, 17), dtype=np.uint16)
    g16[0, 0] = 65535
    os.makedirs(tmp_path / "in" / "a")
    Image.fromarray(g16).save(tmp_path / "in" / "a" / "deep.png")
    rec = write_recipe(tmp_path, {"image": {"decoder": "image", "mode": "gray16"}}, {"format": "png"})
    rep, ds = build(tmp_path, rec)
    out = ds[0]["image"]
    assert out.dtype == np.uint16 and out.shape == (21, 17, 1)
    np.testing.assert_array_equal(out[..., 0], g16)
    with Image.open(ds.file(0, "image")) as im:
        assert im.mode.startswith("I;16")
        np.testing.assert_array_equal(np.asarray(im), g16)


def test_png_16_bit_rgb_written_and_read(tmp_path):
    import cv2

    from precompile.formats.image import read_image_file
    from precompile.formats.png import write_png

    a = np.random.default_rng(4).integers(0, 65536, (9, 11, 3), dtype=np.uint16)
    p = str(tmp_path / "rgb16.png")
    write_png(p, a)
    np.testing.assert_array_equal(cv2.imread(p, cv2.IMREAD_UNCHANGED)[..., ::-1], a)
    np.testing.assert_array_equal(read_image_file(p, "uint16", a.shape), a)
    assert os.path.getsize(p) >= a.nbytes  # stored, not compressed


# --- BMP ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,channels", [("rgb8", 3), ("gray8", 1)])
def test_bmp_round_trip(tmp_path, mode, channels):
    import cv2
    from PIL import Image

    src = make_images(tmp_path / "in", sizes=((13, 7), (8, 21)))
    rec = write_recipe(tmp_path, {"image": {"decoder": "image", "mode": mode}}, {"format": "bmp"})
    rep, ds = build(tmp_path, rec)
    assert len(ds) == 4
    for i in range(len(ds)):
        a = ds[i]["image"]
        p = ds.file(i, "image")
        assert p.endswith(".bmp") and a.shape == (*src[ds.key(i)].shape[:2], channels)
        with open(p, "rb") as f:
            assert f.read(2) == b"BM"
        pil = np.asarray(Image.open(p))
        cv = cv2.imread(p, cv2.IMREAD_UNCHANGED)
        if channels == 3:
            np.testing.assert_array_equal(a, src[ds.key(i)])
            np.testing.assert_array_equal(pil, a)
            np.testing.assert_array_equal(cv[..., ::-1], a)
        else:
            np.testing.assert_array_equal(pil, a[..., 0])
            np.testing.assert_array_equal(cv.reshape(a.shape[:2]), a[..., 0])


def test_bmp_refuses_uint16_at_plan_time(tmp_path):
    make_images(tmp_path / "in", sizes=((8, 8),))
    rec = write_recipe(tmp_path, {"scan": {"decoder": "image", "mode": "gray16"}}, {"format": "bmp"})
    with pytest.raises(RecipeError) as e:
        run_build(rec, out_dir=str(tmp_path / "out"))
    msg = str(e.value)
    assert "output.format" in msg and "'scan'" in msg and "uint16" in msg and "png" in msg
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_bmp_refuses_alpha(tmp_path):
    make_images(tmp_path / "in", sizes=((8, 8),))
    rec = write_recipe(tmp_path, {"image": {"decoder": "image", "mode": "rgba8"}}, {"format": "bmp"})
    with pytest.raises(RecipeError, match=r"'image'.*\(\?, \?, 4\) uint8"):
        run_build(rec, out_dir=str(tmp_path / "out"))


# --- fields the format cannot hold ---------------------------------------------------------------

def _image_and_flow_inputs(tmp_path, sizes):
    rng = np.random.default_rng(5)
    flows = {}
    for k, (h, w) in enumerate(sizes):
        _save_png(str(tmp_path / "in" / "a" / f"s{k}.png"), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        fl = rng.normal(size=(h, w, 2)).astype(np.float32)
        fl[0, 0] = np.nan
        np.save(tmp_path / "in" / "a" / f"s{k}.flow.npy", fl)
        flows[f"a/s{k}.png"] = fl
    return flows


def test_extra_fields_go_to_npy(tmp_path):
    flows = _image_and_flow_inputs(tmp_path, [(10, 12)] * 5)
    fields = {"image": {"decoder": "image"}, "flow": {"decoder": "_fmt_test_flow", "path": "{label}/{name}.flow.npy"}}
    rec = write_recipe(tmp_path, fields, {"format": "png", "samples_per_shard": 2},
                       steps=[{"center_crop": {"size": [8, 8]}}])
    rep, ds = build(tmp_path, rec)
    assert ds.storage["flow"] == {"store": "npy", "layout": "stacked"}
    shard0 = shard_file(tmp_path / "out" / "ds.json", 0)
    on_disk = np.load(shard0 / "flow.npy", allow_pickle=False)
    assert on_disk.shape == (2, 8, 8, 2) and on_disk.dtype == np.float32
    for i in range(len(ds)):
        s, j = ds.locate(i)
        f = np.load(shard_file(tmp_path / "out" / "ds.json", s) / "flow.npy", allow_pickle=False)
        np.testing.assert_array_equal(ds[i]["flow"], f[j])
        np.testing.assert_array_equal(ds[i]["flow"], flows[ds.key(i)][1:9, 2:10])  # NaN kept (equal_nan)
    b = ds.batch([4, 0])
    assert b["flow"].shape == (2, 8, 8, 2) and b["image"].shape == (2, 8, 8, 3)


def test_extra_fields_refused_when_asked(tmp_path):
    _image_and_flow_inputs(tmp_path, [(10, 12)])
    fields = {"image": {"decoder": "image"}, "flow": {"decoder": "_fmt_test_flow", "path": "{label}/{name}.flow.npy"}}
    rec = write_recipe(tmp_path, fields, {"format": "png", "options": {"extra_fields": "refuse"}})
    with pytest.raises(RecipeError, match=r"output.format: field 'flow' .*cannot be stored as PNG.*extra_fields: npy"):
        run_build(rec, out_dir=str(tmp_path / "out"))


def test_unknown_writer_option_is_a_recipe_error(tmp_path):
    make_images(tmp_path / "in", sizes=((8, 8),))
    rec = write_recipe(tmp_path, {"image": {"decoder": "image"}}, {"format": "png", "options": {"level": 9}})
    with pytest.raises(RecipeError, match=r"output.options.level: unknown key"):
        run_build(rec, out_dir=str(tmp_path / "out"))


def test_png_with_no_image_field_is_refused(tmp_path):
    _image_and_flow_inputs(tmp_path, [(10, 12)])
    rec = write_recipe(tmp_path, {"flow": {"decoder": "_fmt_test_flow"}}, {"format": "png"},
                       match="{label}/{name}.flow.npy")
    with pytest.raises(RecipeError, match=r"no field can be stored as PNG files"):
        run_build(rec, out_dir=str(tmp_path / "out"))


# --- WAV ---------------------------------------------------------------------------------------

def make_audio(root, rate=8000, lengths=(800, 1203, 517), seed=1):
    import soundfile as sf

    rng = np.random.default_rng(seed)
    out = {}
    for k, n in enumerate(lengths):
        a = (0.5 * rng.uniform(-1, 1, (n, 2))).astype(np.float32)
        a[0] = [1.0, -1.0]   # full scale
        p = os.path.join(root, "a", f"clip{k}.wav")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        sf.write(p, a, rate, subtype="FLOAT")
        out[f"a/clip{k}.wav"] = a.T.copy()
    return out


@pytest.mark.parametrize("subtype", ["FLOAT", "PCM_16"])
def test_wav_round_trip_soundfile(tmp_path, subtype):
    import soundfile as sf

    src = make_audio(str(tmp_path / "in"), rate=8000)
    rec = write_recipe(tmp_path, {"sound": {"decoder": "_fmt_test_audio"}},
                       {"format": "wav", "samples_per_shard": 2, "options": {"subtype": subtype}},
                       match="{label}/{name}.wav")
    rep, ds = build(tmp_path, rec)
    assert len(ds) == 3 and ds.field_specs["sound"]["shape"] == [2, None]
    for i in range(len(ds)):
        p = ds.file(i, "sound")
        assert p.endswith(".wav")
        info = sf.info(p)
        assert info.samplerate == 8000 and info.channels == 2 and info.subtype == subtype
        got = ds[i]["sound"]
        want = src[ds.key(i)]
        assert got.dtype == np.float32 and got.shape == want.shape
        data, rate = sf.read(p, dtype="float32", always_2d=True)
        np.testing.assert_array_equal(got, data.T)   # precompile.open == soundfile
        if subtype == "FLOAT":
            np.testing.assert_array_equal(got, want)
        else:
            assert np.abs(got - want).max() <= 1 / 32768
            ints, _ = sf.read(p, dtype="int16", always_2d=True)
            assert ints[0, 0] == 32767 and ints[0, 1] == -32768
    with pytest.raises(ShapeMismatchError, match=r"field 'sound'.*\(2, 800\).*\(2, 1203\)"):
        ds.batch([0, 1])


def test_wav_bytes_are_deterministic_and_rate_option_checked(tmp_path):
    make_audio(str(tmp_path / "in"), rate=8000, lengths=(300,))
    rec = write_recipe(tmp_path, {"sound": {"decoder": "_fmt_test_audio"}}, {"format": "wav"},
                       match="{label}/{name}.wav")
    _, ds = build(tmp_path, rec)
    with open(ds.file(0, "sound"), "rb") as f:
        first = f.read()
    run_build(rec, out_dir=str(tmp_path / "out"), force=True)
    with open(ds.file(0, "sound"), "rb") as f:
        assert f.read() == first
    rec2 = write_recipe(tmp_path, {"sound": {"decoder": "_fmt_test_audio"}},
                        {"format": "wav", "options": {"sample_rate": 16000}}, match="{label}/{name}.wav", name="r2")
    with pytest.raises(BuildError, match=r"8000\] Hz but output.options.sample_rate is 16000"):
        run_build(rec2, out_dir=str(tmp_path / "out"))


# --- inspect --------------------------------------------------------------------------------------

def test_inspect_describes_file_formats(tmp_path):
    from click.testing import CliRunner

    from precompile.cli import main

    _image_and_flow_inputs(tmp_path, [(10, 12), (14, 9), (10, 12)])
    fields = {"image": {"decoder": "image"}, "flow": {"decoder": "_fmt_test_flow", "path": "{label}/{name}.flow.npy"}}
    rec = write_recipe(tmp_path, fields, {"format": "png", "samples_per_shard": 2})
    rep, ds = build(tmp_path, rec)
    res = CliRunner().invoke(main, ["inspect", rep["output"]])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "format       png" in out and "samples      3 in 2 shard(s)" in out
    assert "3 sample file(s), 2 .npy companion(s), 2 info.json" in out
    assert "(?, ?, 3)" in out and "one .png file per sample, shapes (10..14, 9..12, 3)" in out
    assert "flow.npy per shard (flat), shapes (10..14, 9..12, 2)" in out
    assert "label        label   ()                 int64    in the JSON index" in out
    assert f"({rep['bytes']} bytes in shards)" in out


def test_several_image_fields_rebuild_and_stray_temporaries(tmp_path):
    src = make_images(tmp_path / "in", sizes=((12, 10), (9, 9), (12, 10)), classes=("a",))
    fields = {"left": {"decoder": "image"}, "right": {"decoder": "image", "mode": "gray8"}}
    rec = write_recipe(tmp_path, fields, {"format": "png", "samples_per_shard": 2})
    rep, ds = build(tmp_path, rec)
    names = sorted(os.listdir(shard_file(tmp_path / "out" / "ds.json", 0)))
    assert names == ["000000.left.png", "000000.right.png", "000001.left.png", "000001.right.png", "info.json"]
    np.testing.assert_array_equal(ds[1]["left"], src[ds.key(1)])
    assert ds[1]["right"].shape == (*src[ds.key(1)].shape[:2], 1)
    # a killed build's temporary shard folder is cleared; a changed recipe rebuilds folders in place
    stray = tmp_path / "out" / "ds.shards" / "shard-00000.tmp-99999"
    stray.mkdir()
    (stray / "000000.left.png").write_bytes(b"partial")
    rec2 = write_recipe(tmp_path, fields, {"format": "png", "samples_per_shard": 2},
                        steps=[{"center_crop": {"size": [8, 8]}}])
    rep2 = run_build(rec2, out_dir=str(tmp_path / "out"))
    assert not stray.exists() and rep2["shards"]["built"] == 2
    ds2 = precompile.open(rep2["output"])
    assert ds2.batch([0, 1, 2])["left"].shape == (3, 8, 8, 3)
    # no stray temporaries left: the new snapshot's shards, and the replaced one's kept for readers still open
    # on it (previous.json); ".lock" is the build lock, kept on purpose
    new = sorted(p.name for p in index_shards(tmp_path / "out" / "ds.json").values())
    old = json.loads((tmp_path / "out" / "ds.shards" / "previous.json").read_text())["files"]
    assert len(new) == 2 and len(old) == 2 and not set(new) & set(old)
    assert sorted(os.listdir(tmp_path / "out" / "ds.shards")) == sorted([".lock", "previous.json"] + new + old)


def test_png_build_with_two_workers_matches_one(tmp_path):
    make_images(tmp_path / "in", sizes=((12, 10), (9, 9)))
    rec = write_recipe(tmp_path, {"image": {"decoder": "image"}}, {"format": "png", "samples_per_shard": 1})
    rep1 = run_build(rec, out_dir=str(tmp_path / "one"))
    rep2 = run_build(rec, out_dir=str(tmp_path / "two"), n_jobs=2)
    a, b = precompile.open(rep1["output"]), precompile.open(rep2["output"])
    assert [s["checksums"] for s in a.shards] == [s["checksums"] for s in b.shards]
    for i in range(len(a)):
        with open(a.file(i, "image"), "rb") as f1, open(b.file(i, "image"), "rb") as f2:
            assert f1.read() == f2.read()


# --- a new format is one module plus one registration ----------------------------------------------

def test_a_new_format_is_one_module_plus_one_registration(tmp_path):
    """A toy folder format (raw pixel files) written here, registered, then built, opened, inspected and
    verified through the same lookups as the built-in ones: nothing else in precompile names it."""
    from click.testing import CliRunner

    from precompile.cli import main
    from precompile.formats.image import ImageFolderFormat
    from precompile.registry import WRITERS
    from precompile.tools.verify import verify

    class RawFormat(ImageFolderFormat):
        name = "_fmt_test_raw"
        label = "RAW"
        file_ext = ".raw"
        allowed = {"uint8": (1, 3)}

        def write_file(self, path, field, array, sample, options):
            np.ascontiguousarray(array).tofile(path)
            return array

        @classmethod
        def read_file(cls, path, dtype, shape):
            return np.fromfile(path, dtype=dtype).reshape(tuple(shape))

    WRITERS.register()(RawFormat)
    try:
        src = make_images(tmp_path / "in", sizes=((12, 10), (9, 14)))
        rec = write_recipe(tmp_path, {"image": {"decoder": "image"}}, {"format": "_fmt_test_raw",
                                                                       "samples_per_shard": 2})
        rep = run_build(rec, out_dir=str(tmp_path / "out"), n_jobs=1)
        ds = precompile.open(rep["output"])
        assert type(ds).__name__ == "FileDataset" and ds.output_format == "_fmt_test_raw" and len(ds) == 4
        for i in range(len(ds)):
            assert ds.file(i, "image").endswith(".raw")
            np.testing.assert_array_equal(ds[i]["image"], src[ds.key(i)])
        assert verify(rep["output"]).ok
        res = CliRunner().invoke(main, ["inspect", rep["output"]])
        assert res.exit_code == 0 and "one .raw file per sample" in res.output, res.output
        with open(ds.file(1, "image"), "r+b") as f:
            f.write(b"\xff\x00")
        bad = verify(rep["output"])
        assert not bad.ok and any(".raw: bytes changed" in p for p in bad.problems)
    finally:
        WRITERS._items.pop("_fmt_test_raw", None)


def test_inspect_columns_align_after_long_kind_names():
    """Column widths come from the content: volume_mask, flow_valid, box_labels, keypoints and a long
    field name push the later columns right, on every line alike."""
    from precompile.tools.inspect import field_table

    specs = {"ct": {"kind": "volume", "shape": [None, None, None], "dtype": "float32"},
             "lung": {"kind": "volume_mask", "shape": [None, None, None], "dtype": "uint8"},
             "flow_valid": {"kind": "flow_valid", "shape": [64, 64, 1], "dtype": "uint8"},
             "box_labels": {"kind": "box_labels", "shape": [None], "dtype": "int64"},
             "keypoints": {"kind": "keypoints", "shape": [None, 17, 3], "dtype": "float32"},
             "a_very_long_field_name": {"kind": "image", "shape": [1024, 1024, 3], "dtype": "uint8"}}
    lines = field_table(specs, {"ct": "ragged", "a_very_long_field_name": "chunked"})
    assert len(lines) == 6
    starts = []
    for line, (name, s) in zip(lines, specs.items()):
        cols = [line.index(f" {s['kind']} ", 4 + len(name) - 1) + 1]
        cols.append(line.index("(", cols[0]))
        cols.append(line.index(f" {s['dtype']}", cols[1]) + 1)
        starts.append(cols)
    assert all(c == starts[0] for c in starts), lines   # kind, shape and dtype start in the same column
    assert starts[0][0] == 4 + len("a_very_long_field_name") + 1
    assert starts[0][1] - starts[0][0] == len("volume_mask") + 1
    assert lines[0].endswith(" ragged") and lines[5].endswith(" chunked") and lines[1].endswith("uint8")


def _tiny_build(tmp_path, fmt_name: str) -> Path:
    import precompile

    root = tmp_path / "in"
    root.mkdir(exist_ok=True)
    for i in range(3):
        Image.fromarray(np.full((4, 4, 3), 40 * i, np.uint8)).save(root / f"{i}.png")
    out = tmp_path / "out"
    precompile.build({"name": "b", "inputs": {"root": str(root), "match": "{n}.png",
                                              "fields": {"image": {"decoder": "image"}}},
                      "output": {"format": fmt_name, "samples_per_shard": 2}}, str(out), progress=False)
    return out


@pytest.mark.parametrize("entry, why", [("../secret/s.png", r"has an empty, '\.' or '\.\.' part: it would leave"),
                                        ("/abs/s.png", r"is not a relative path inside the index's folder"),
                                        ("a\\..\\s.png", r"is not a relative path inside the index's folder")])
def test_a_folder_index_naming_files_outside_its_folder_is_refused(tmp_path, entry, why):
    """An index is data (a build handed over, or fetched): its sample file entries were joined to its folder
    as they were, so '../secret/s.png' or an absolute path read a file anywhere. Reading such an entry is a
    FormatError naming the index and the entry; the honest index still reads."""
    import json

    import precompile
    from precompile.errors import FormatError

    out = _tiny_build(tmp_path, "png")
    (tmp_path / "secret").mkdir()
    Image.fromarray(np.full((4, 4, 3), 222, np.uint8)).save(tmp_path / "secret" / "s.png")
    index = json.loads((out / "b.json").read_text())
    index["samples"][0]["files"]["image"] = entry.replace("/abs", str(tmp_path / "secret")) \
        if entry.startswith("/abs") else entry
    (out / "evil.json").write_text(json.dumps(index))
    ds = precompile.open(out / "evil.json")
    with pytest.raises(FormatError, match="evil.json: sample file entry .* " + why):
        ds[0]
    assert int(precompile.open(out / "b.json")[0]["image"][0, 0, 0]) == 0


@pytest.mark.parametrize("fmt_name", ["hdf5", "png"])
def test_an_index_naming_shards_outside_its_folder_is_refused(tmp_path, fmt_name):
    """A shard entry '../elsewhere/<shard>' was followed by both readers (HDF5 and the folder formats): the shard
    read was any file of that name anywhere. Opening such an index is a FormatError naming the entry."""
    import json
    import shutil

    import h5py

    import precompile
    from precompile.errors import FormatError
    from precompile.formats import names as fmt

    out = _tiny_build(tmp_path, fmt_name)
    index_path = out / ("b.h5" if fmt_name == "hdf5" else "b.json")
    (tmp_path / "elsewhere").mkdir()
    if fmt_name == "hdf5":
        with h5py.File(index_path, "r+") as f:
            shards = json.loads(f.attrs[fmt.A_SHARDS])
            src = out / shards[0]["file"]
            shutil.copy(src, tmp_path / "elsewhere" / src.name)
            shards[0]["file"] = f"../elsewhere/{src.name}"
            f.attrs[fmt.A_SHARDS] = json.dumps(shards)
            del f[fmt.SHARD_TABLE]                 # (an index written before the table: the entries are read)
            if fmt.A_INDEX_CRC in f.attrs:
                del f.attrs[fmt.A_INDEX_CRC]       # (and before the crc32s: nothing else tells a crafted one)
    else:
        index = json.loads(index_path.read_text())
        src = out / index["attrs"]["shards"][0]["file"]
        shutil.copytree(src, tmp_path / "elsewhere" / src.name)
        index["attrs"]["shards"][0]["file"] = f"../elsewhere/{src.name}"
        index_path.write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"shard entry '\.\./elsewhere/.*' has an empty, '\.' or '\.\.' part"):
        precompile.open(index_path)
