"""Reduced-scale JPEG decoding (``reduce: auto | off | 2 | 4 | 8``): the scale rule, its
quality against full decoding on generated and real photos, EXIF/CMYK/gray/16-bit/PNG
inputs, errors, the recipe key, determinism, and one decode per input for all copies."""
from __future__ import annotations

import math
from pathlib import Path

import cv2
import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import precompile
from precompile.compiler.keys import recipe_key
from precompile.decoders import jpeg_reduce as JR
from precompile.decoders.image import ImageDecoder, decode_image_file, decode_image_scaled
from precompile.errors import DecodeError, RecipeError
from precompile.recipe import load_recipe, parse_recipe
from precompile.transforms.kernels import geometry as F
from precompile.transforms.geometry import RandomResizedCrop

from conftest import realdata, write_recipe


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    peak = 65535.0 if a.dtype == np.uint16 else 255.0
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image: smooth shading plus texture at several scales down to a few pixels."""
    rng = np.random.default_rng(seed)
    img = np.zeros((h, w, 3), np.float32)
    for cells, amp in ((4, 90.0), (16, 40.0), (max(2, w // 16), 25.0), (max(2, w // 4), 12.0)):
        small = rng.random((max(2, cells * h // w), cells, 3)).astype(np.float32) - 0.5
        img += amp * cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    return np.clip(img + 128, 0, 255).astype(np.uint8)


def save_jpeg(path: Path, arr: np.ndarray, orientation: int | None = None, quality: int = 90) -> Path:
    kw = {"quality": quality}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    Image.fromarray(arr).save(path, "JPEG", **kw)
    return path


def recipe_dict(root: Path, steps: list, image: dict | None = None, **over) -> dict:
    r = {"name": "jr", "seed": 3, "inputs": {"root": str(root), "match": "{name}.{ext}",
                                             "fields": {"image": {"decoder": "image", **(image or {})}}},
         "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 2}}
    r.update(over)
    return r


def need_of(steps: list, image: dict | None = None, root: str = ".", fields: dict | None = None):
    d = recipe_dict(Path(root), steps, image)
    if fields is not None:
        d["inputs"]["fields"] = fields
    rec = parse_recipe(d, base_dir=".")
    return rec.decoders["image"].need, rec.decoders["image"].need_reason


def read_all(index: Path) -> dict[str, np.ndarray]:
    ds = precompile.open(index)
    return {ds.key(i): (ds[i]["image"], ds.meta(i)) for i in range(len(ds))}


# -- the rule ------------------------------------------------------------------------------------
def test_scale_follows_the_first_resize_with_the_safety_factor():
    need, why = need_of([{"resize": {"shorter": 72}}, {"center_crop": {"size": 64}}])
    assert need is not None and need.step == "resize" and why == "steps[0] resize"
    # 1024x768 -> 96x72: 1/4 leaves 256x192 >= 2 x (96, 72); 1/8 (128x96) would not
    assert need.scale_for(768, 1024) == 4
    assert need.scale_for(375, 500) == 2      # 188x250 >= 144x192; 1/4 (94x125) is too small
    assert need.scale_for(96, 128) == 1       # the sample data: nothing to gain, decoded as before
    assert need.scale_for(1536, 2048) == 8
    big, _ = need_of([{"resize": {"shorter": 256}}, {"center_crop": {"size": 224}}])
    assert big.scale_for(768, 1024) == 1 and big.scale_for(1536, 2048) == 2


@settings(max_examples=300, deadline=None)
@given(H=st.integers(8, 5000), W=st.integers(8, 5000), n=st.integers(1, 400),
       how=st.sampled_from(["shorter", "longer", "size", "keep_aspect"]))
def test_chosen_scale_is_safe_and_the_largest_safe_one(H, W, n, how):
    step = {"shorter": {"shorter": n}, "longer": {"longer": n}, "size": {"size": [n, max(1, n * 3 // 4)]},
            "keep_aspect": {"size": [n, n], "keep_aspect": True}}[how]
    need, _ = need_of([{"resize": step}])
    rz = need.target
    try:
        th, tw = rz.target_size(H, W)
    except ValueError as e:   # an output side past 32768 pixels: the input fails, reduced or not, with that message
        assert "a side is at most 32768" in str(e)
        with pytest.raises(ValueError, match="a side is at most 32768"):
            need.scale_for(H, W)
        return
    k = need.scale_for(H, W)

    def ok(k: int) -> bool:
        h, w = JR.reduced_size(H, W, k)
        try:
            same = tuple(rz.target_size(h, w)) == (th, tw)
        except ValueError:   # (the reduced image's output past the largest side: not safe)
            return False
        return h >= JR.SAFETY * th and w >= JR.SAFETY * tw and same

    assert k == 1 or ok(k)                                   # safe, and the resize's output size unchanged
    assert all(not ok(j) for j in JR.SCALES if j > k)        # no larger reduction would have been safe


@pytest.mark.parametrize("steps, reason", [
    ([{"center_crop": {"size": 64}}, {"resize": {"shorter": 32}}], "center_crop works on source pixels"),
    ([{"random_crop": {"size": 64}}, {"resize": {"size": 32}}], "random_crop works on source pixels"),
    ([{"color_jitter": {"brightness": 0.2}}, {"resize": {"size": 32}}], "color_jitter works on source pixels"),
    ([{"resize": {"shorter": 32, "interpolation": "nearest"}}], "interpolation 'nearest'"),
    ([{"resize": {"shorter": 32, "interpolation": "linear"}}], "interpolation 'linear'"),
    ([], "no step resizes the field"),
])
def test_no_reduction_where_the_steps_need_source_pixels(steps, reason):
    need, why = need_of(steps)
    assert need is None and reason in why


def test_steps_that_commute_with_scaling_may_come_first():
    need, why = need_of([{"convert": {"mode": "gray8"}}, {"random_flip": {}}, {"resize": {"size": 32}}])
    assert need is not None and need.index == 2, why


def test_off_and_fixed_scales_configure_no_rule_and_yaml_off_is_off(tmp_path):
    assert need_of([{"resize": {"size": 32}}], {"reduce": "off"})[0] is None
    assert need_of([{"resize": {"size": 32}}], {"reduce": 4})[0] is None
    # YAML 1.1 reads a bare `off` as false, `on` as true, and a quoted "4" is a string
    for text, want in (("off", "off"), ("false", "off"), ("on", "auto"), ("auto", "auto"), ("'4'", 4), ("8", 8)):
        p = tmp_path / "r.yaml"
        p.write_text(f"name: r\ninputs:\n  root: .\n  match: '{{n}}.jpg'\n  fields:\n"
                     f"    image: {{decoder: image, reduce: {text}}}\n")
        assert load_recipe(p).decoders["image"].params.reduce == want, text
    p.write_text("name: r\ninputs:\n  root: .\n  match: '{n}.jpg'\n  fields:\n    image: {decoder: image, reduce: 3}\n")
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    assert "inputs.fields.image.reduce" in str(ei.value)


# -- random_resized_crop: the smallest window that can be drawn ----------------------------------
def test_random_resized_crop_respects_its_smallest_crop():
    need, _ = need_of([{"random_resized_crop": {"size": 64, "scale": [0.5, 1.0]}}])
    assert need is not None and need.step == "random_resized_crop"
    # smallest window of 1024x768: area 0.5*1024*768 at ratio 4/3 -> 543 rows, at 3/4 -> 543 columns
    assert need.scale_for(768, 1024) == 4
    wide, _ = need_of([{"random_resized_crop": {"size": 64}}])   # default scale 0.08: windows of ~200 px
    assert wide.scale_for(768, 1024) == 1
    two, why = need_of([{"random_resized_crop": {"size": 64}}],
                       fields={"image": {"decoder": "image"}, "other": {"decoder": "image", "path": "{name}.png"}})
    assert two is None and "several fields" in why


@settings(max_examples=60, deadline=None)
@given(H=st.integers(64, 3000), W=st.integers(64, 3000), lo=st.floats(0.05, 1.0), out=st.integers(8, 160),
       seed=st.integers(0, 2 ** 31))
def test_every_drawn_window_on_the_reduced_image_keeps_the_safety_factor(H, W, lo, out, seed):
    need, _ = need_of([{"random_resized_crop": {"size": out, "scale": [lo, 1.0]}}])
    k = need.scale_for(H, W)
    if k == 1:
        return
    h, w = JR.reduced_size(H, W, k)
    step: RandomResizedCrop = need.target
    from precompile.sample import Sample

    s = Sample("x", {"image": np.zeros((h, w, 1), np.uint8)}, {"image": "image"}, {})
    rng = np.random.default_rng(seed)
    for _ in range(50):
        p = step.sample_params(rng, s, ["image"])
        # windows are rounded to whole pixels: allow one pixel
        assert p["height"] >= JR.SAFETY * out - 1 and p["width"] >= JR.SAFETY * out - 1, (p, h, w, k)


# -- the decoder on real bytes -------------------------------------------------------------------
def test_auto_matches_full_decoding_within_tolerance_and_records_the_scale(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    for i, (h, w) in enumerate([(768, 1024), (375, 500), (1536, 2048), (96, 128)]):
        save_jpeg(root / f"p{i}.jpg", photo(h, w, seed=i))
    steps = [{"resize": {"shorter": 72}}, {"center_crop": {"size": 64}}]
    outs = {}
    for red in ("auto", "off"):
        rp = write_recipe(tmp_path / f"{red}.yaml", recipe_dict(root, steps, {"reduce": red}))
        precompile.build(rp, out_dir=tmp_path / red)
        outs[red] = read_all(tmp_path / red / "jr.h5")
    want_k = {"p0.jpg": 4, "p1.jpg": 2, "p2.jpg": 8, "p3.jpg": 1}
    for key, (a, meta) in outs["auto"].items():
        b, meta_off = outs["off"][key]
        assert a.shape == b.shape == (64, 64, 3)
        assert meta.get("image", {}).get("reduce", 1) == want_k[key] and "reduce" not in meta_off.get("image", {})
        if want_k[key] == 1:
            assert a.tobytes() == b.tobytes()           # nothing to reduce: the very same bytes
        else:
            assert psnr(a, b) >= 40, key                 # stated tolerance on photo-like content
    # off is exactly the old path: full decode, resize, crop
    full = decode_image_file(str(root / "p0.jpg"))
    h, w = F.shorter_side_size(*full.shape[:2], 72)
    r = F.resize_hwc(full, h, w)
    np.testing.assert_array_equal(outs["off"]["p0.jpg"][0], r[(h - 64) // 2:(h - 64) // 2 + 64,
                                                               (w - 64) // 2:(w - 64) // 2 + 64])


def test_exif_quarter_turn_swaps_the_axes_the_rule_sees(tmp_path):
    upright = photo(1024, 512, seed=5)                       # shown 512 wide, 1024 tall
    save_jpeg(tmp_path / "up.jpg", upright)
    save_jpeg(tmp_path / "rot.jpg", np.ascontiguousarray(np.rot90(upright, 1)), orientation=6)  # stored 1024 wide
    need, _ = need_of([{"resize": {"size": [32, 128]}}])
    # shown 1024x512 -> 32x128: columns allow only 1/2 (512/2 = 256 >= 2 x 128); the stored axes would allow 1/4
    assert need.scale_for(1024, 512) == 2 and need.scale_for(512, 1024) == 4
    a, ka = decode_image_scaled(str(tmp_path / "up.jpg"), "rgb8", True, need)
    b, kb = decode_image_scaled(str(tmp_path / "rot.jpg"), "rgb8", True, need)
    assert ka == kb == 2 and a.shape == b.shape == (512, 256, 3)
    ra, rb = F.resize_hwc(a, 32, 128), F.resize_hwc(b, 32, 128)
    assert psnr(ra, rb) >= 40   # the same picture, whichever way it was stored
    c, kc = decode_image_scaled(str(tmp_path / "rot.jpg"), "rgb8", False, need)   # exif_transpose off
    assert kc == 4 and c.shape == (128, 256, 3)


def test_real_camera_photo_with_orientation_6():
    p = str(realdata("images", "rommel.jpg"))              # stored 3072x2304, shown 2304 wide x 3072 tall
    need, _ = need_of([{"resize": {"shorter": 224}}, {"center_crop": {"size": 224}}])
    a, k = decode_image_scaled(p, "rgb8", True, need)
    assert k == 4 and a.shape == (768, 576, 3)             # 576 >= 2 x 224 columns; 1/8 (288) is not
    full = decode_image_file(p, "rgb8")
    h, w = F.shorter_side_size(*full.shape[:2], 224)
    assert (h, w) == F.shorter_side_size(*a.shape[:2], 224)
    assert psnr(F.resize_hwc(a, h, w), F.resize_hwc(full, h, w)) >= 40


@pytest.mark.parametrize("name, mode", [("hopper_gray.jpg", "gray8"), ("hopper_gray.jpg", "rgb8"),
                                        ("hopper_orientation_6.jpg", "rgb8")])
def test_gray_and_exif_jpegs_at_a_fixed_scale_match_an_area_resize_of_the_full_decode(name, mode):
    p = str(realdata("images", name))
    full = decode_image_file(p, mode)
    for k in (2, 4):
        a, got = decode_image_scaled(p, mode, True, k)
        h, w = JR.reduced_size(*full.shape[:2], k)
        assert got == k and a.shape == (h, w, full.shape[2]) and a.dtype == full.dtype
        assert psnr(a, F.resize_hwc(full, h, w, "area")) >= 38   # the scaled IDCT is close to a box average
    if mode == "rgb8" and name == "hopper_gray.jpg":
        assert (a[..., 0] == a[..., 1]).all() and (a[..., 1] == a[..., 2]).all()


def test_cmyk_jpeg_is_reduced_in_cmyk_space_and_left_whole_by_auto():
    p = str(realdata("images", "pil_sample_cmyk.jpg"))    # 100x100, mode CMYK
    with Image.open(p) as im:
        assert im.mode == "CMYK"
        cmyk = np.asarray(im)
    for k in (2, 4):  # a fixed scale: libjpeg averages C, M, Y, K, then the same conversion to RGB
        a, got = decode_image_scaled(p, "rgb8", True, k)
        want = np.asarray(Image.fromarray(F.resize_hwc(cmyk, *JR.reduced_size(100, 100, k), "area"), "CMYK")
                          .convert("RGB"))
        assert got == k and psnr(a, want) >= 45
    # auto would differ from full decoding (CMYK -> RGB is not linear): CMYK is decoded whole
    need, _ = need_of([{"resize": {"size": [10, 10]}}])
    assert need.scale_for(100, 100) == 4
    a, got = decode_image_scaled(p, "rgb8", True, need)
    assert got == 1 and a.tobytes() == decode_image_file(p, "rgb8").tobytes()


def test_non_jpeg_inputs_are_untouched_by_auto_and_area_resized_by_a_fixed_scale(tmp_path):
    need, _ = need_of([{"resize": {"shorter": 16}}])
    png = tmp_path / "a.png"
    Image.fromarray(photo(300, 400, seed=2)).save(png)
    a, k = decode_image_scaled(str(png), "rgb8", True, need)
    assert k == 1 and a.tobytes() == decode_image_file(str(png)).tobytes()
    b, k = decode_image_scaled(str(png), "rgb8", True, 4)
    assert k == 4 and b.tobytes() == F.resize_hwc(decode_image_file(str(png)), 75, 100, "area").tobytes()
    depth = str(realdata("images", "TUM_depth.png"))     # 16-bit stays 16-bit
    full = decode_image_file(depth, "gray16")
    d, k = decode_image_scaled(depth, "gray16", True, 2)
    assert k == 2 and d.dtype == np.uint16
    np.testing.assert_array_equal(d, F.resize_hwc(full, *JR.reduced_size(*full.shape[:2], 2), "area"))


def test_truncated_jpeg_is_still_an_error_at_reduced_scale():
    p = str(realdata("images", "truncated_jpeg.jpg"))
    for reduce in (2, 8):
        with pytest.raises(DecodeError) as ei:
            decode_image_scaled(p, "rgb8", True, reduce)
        assert p in str(ei.value) and "truncated" in str(ei.value)


# -- builds: key, determinism, one decode per input ----------------------------------------------
@pytest.fixture
def big_tree(tmp_path: Path) -> Path:
    root = tmp_path / "in"
    root.mkdir()
    for i in range(4):
        save_jpeg(root / f"{i}.jpg", photo(384, 512, seed=10 + i), orientation=6 if i == 1 else None)
    return root


def test_recipe_key_follows_the_scale_rule(tmp_path, big_tree, monkeypatch):
    steps = [{"resize": {"shorter": 48}}, {"center_crop": {"size": 48}}]
    key = lambda **img: recipe_key(parse_recipe(recipe_dict(big_tree, steps, img), base_dir="."))  # noqa: E731
    auto, off = key(), key(reduce="off")
    assert auto != off and key(reduce=2) not in (auto, off)
    monkeypatch.setattr(JR, "SAFETY", 3.0)                  # a different rule picks other scales
    assert key() != auto and key(reduce="off") == off
    monkeypatch.undo()
    # switching off -> auto rebuilds every shard (none reused under a stale key)
    rp = tmp_path / "r.yaml"
    write_recipe(rp, recipe_dict(big_tree, steps, {"reduce": "off"}))
    assert precompile.build(rp, out_dir=tmp_path / "o")["shards"]["built"] == 2
    write_recipe(rp, recipe_dict(big_tree, steps, {"reduce": "auto"}))
    rep = precompile.build(rp, out_dir=tmp_path / "o")
    assert rep["shards"]["built"] == 2 and rep["shards"]["skipped"] == 0
    assert read_all(tmp_path / "o" / "jr.h5")["0.jpg"][1]["image"]["reduce"] == 4


def test_auto_is_byte_identical_for_any_job_count(tmp_path, big_tree):
    rp = write_recipe(tmp_path / "r.yaml", recipe_dict(big_tree, [{"resize": {"shorter": 48}},
                                                                   {"random_resized_crop": {"size": 40, "scale": [0.6, 1]}}],
                                                       copies=2))
    precompile.build(rp, out_dir=tmp_path / "a", n_jobs=1)
    precompile.build(rp, out_dir=tmp_path / "b", n_jobs=2)
    for name in sorted((tmp_path / "a" / "jr.shards").iterdir()):
        assert name.read_bytes() == (tmp_path / "b" / "jr.shards" / name.name).read_bytes(), name.name
    with h5py.File(tmp_path / "a" / "jr.h5") as f:
        assert f["image"].shape[0] == 4 * 3


def test_each_input_is_decoded_once_for_all_its_copies(tmp_path, big_tree, monkeypatch):
    calls: list[str] = []
    orig = ImageDecoder.read

    def counting(self, path):
        calls.append(Path(path).name)
        return orig(self, path)

    monkeypatch.setattr(ImageDecoder, "read", counting)
    rp = write_recipe(tmp_path / "r.yaml", recipe_dict(
        big_tree, [{"random_resized_crop": {"size": 40, "scale": [0.8, 1.0]}}, {"random_flip": {}}], copies=3))
    rep = precompile.build(rp, out_dir=tmp_path / "o", n_jobs=1)
    assert rep["num_samples"] == 4 * 4                       # original + 3 copies per input
    assert sorted(calls) == ["0.jpg", "1.jpg", "2.jpg", "3.jpg"]
    ds = precompile.open(tmp_path / "o" / "jr.h5")
    metas = [ds.meta(i) for i in range(len(ds))]
    assert all(m["image"]["reduce"] == 4 for m in metas)    # one shared decode at the smallest crop's scale


def test_plan_says_how_each_image_field_is_decoded(tmp_path, big_tree):
    from click.testing import CliRunner

    from precompile.cli import main

    for img, steps, want in (({}, [{"resize": {"shorter": 48}}], "where steps[0] resize keeps >= 2x"),
                             ({}, [{"center_crop": {"size": 48}}], "full size: steps[0] center_crop works on source"),
                             ({"reduce": "off"}, [{"resize": {"shorter": 48}}], "full size (reduce: off)"),
                             ({"reduce": 4}, [], "1/4 scale for every input")):
        rp = write_recipe(tmp_path / "r.yaml", recipe_dict(big_tree, steps, img))
        r = CliRunner().invoke(main, ["plan", str(rp)])
        assert r.exit_code == 0 and "decode    image: " in r.output and want in r.output, r.output


def test_isolated_decoding_helper_picks_the_same_scales(tmp_path, big_tree):
    steps = [{"resize": {"shorter": 48}}, {"center_crop": {"size": 48}}]
    a = write_recipe(tmp_path / "a.yaml", recipe_dict(big_tree, steps))
    b = write_recipe(tmp_path / "b.yaml", recipe_dict(big_tree, steps, timeout_s=120))  # decodes in a helper
    precompile.build(a, out_dir=tmp_path / "a")
    precompile.build(b, out_dir=tmp_path / "b")
    got_a, got_b = read_all(tmp_path / "a" / "jr.h5"), read_all(tmp_path / "b" / "jr.h5")
    assert got_a.keys() == got_b.keys()
    for key in got_a:
        assert got_a[key][0].tobytes() == got_b[key][0].tobytes() and got_a[key][1] == got_b[key][1]
        assert got_b[key][1]["image"]["reduce"] == 4


def test_sample_recipe_auto_writes_the_same_bytes_as_off(tmp_path):
    """The sample images (128x96 -> shorter 72) cannot be reduced: auto leaves their bytes alone."""
    import yaml

    from conftest import REPO

    doc = yaml.safe_load((REPO / "recipes" / "images.yaml").read_text())
    doc["inputs"]["root"] = str(REPO / "sample_data" / "images")
    hashes = {}
    for red in ("auto", "off"):
        doc["inputs"]["fields"]["image"]["reduce"] = red
        rp = write_recipe(tmp_path / f"{red}.yaml", doc)
        precompile.build(rp, out_dir=tmp_path / red)
        with h5py.File(tmp_path / red / "images.h5") as f:
            hashes[red] = {n: f[n][()].tobytes() for n in ("image", "label")}
    assert hashes["auto"] == hashes["off"]


def test_fixed_scale_gives_every_format_the_same_reduced_size(tmp_path):
    from conftest import make_image_tree

    root = make_image_tree(tmp_path / "in", per_class=2, size=(41, 57))      # JPEG and PNG
    d = recipe_dict(root, [], {"reduce": 2})
    d["inputs"]["match"] = "{label}/{name}.{ext}"
    rp = write_recipe(tmp_path / "r.yaml", d)
    precompile.build(rp, out_dir=tmp_path / "o")
    got = read_all(tmp_path / "o" / "jr.h5")
    assert {k.rsplit(".", 1)[1] for k in got} == {"jpg", "png"}
    for key, (a, meta) in got.items():
        assert a.shape == (21, 29, 3) and meta["image"]["reduce"] == 2, key
        if key.endswith(".png"):
            np.testing.assert_array_equal(a, F.resize_hwc(decode_image_file(str(root / key)), 21, 29, "area"))


def test_progressive_jpeg_is_reduced_too(tmp_path):
    p = tmp_path / "prog.jpg"
    Image.fromarray(photo(768, 1024, seed=9)).save(p, "JPEG", quality=90, progressive=True)
    need, _ = need_of([{"resize": {"shorter": 72}}])
    a, k = decode_image_scaled(str(p), "rgb8", True, need)
    assert k == 4 and a.shape == (192, 256, 3)
    full = decode_image_file(str(p))
    assert psnr(F.resize_hwc(a, 72, 96), F.resize_hwc(full, 72, 96)) >= 40
