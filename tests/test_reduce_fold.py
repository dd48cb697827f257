"""A reduced JPEG decode's geometry correction folded into the first resize (issue 33).

libjpeg's 1/k decode of a W x H JPEG is ceil(W/k) x ceil(H/k) pixels whose last column and row show partly
the padding past the source's edge; the source covers [0, W/k) x [0, H/k) of them. Before, the decoder
resampled that box back onto the whole grid (Pillow's bicubic, ``image._cover_source``) and the resize then
resampled again. Now, when the recipe's first step on the field is a ``resize`` (auto/area), the decoder
hands it the extent and the resize samples from it in one resample.

Truths the code does not compute: the exact area average over the extent, written out here in numpy (each
source pixel weighed by its overlap with the output pixel's box) over simplejpeg's own 1/k decode; step edges
at known source columns and rows, located by their dark area, against Pillow's full decode.
"""
from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import precompile
from precompile.decoders import image as I
from precompile.decoders import jpeg_reduce as JR
from precompile.kinds import Kind
from precompile.recipe import load_recipe, parse_recipe
from precompile.sample import Sample
from precompile.transforms import source_map
from precompile.transforms.base import replay

from conftest import write_recipe
from test_jpeg_reduce import photo
from test_reduce_alignment import BRIGHT, DARK, edges, pillow_edges, step_image


def area_weights(extent: float, n: int, N: int) -> np.ndarray:
    """(n, N): output pixel j averages [j s, (j + 1) s) of N source pixels, s = extent / n, by overlap."""
    s = extent / n
    lo = np.arange(n)[:, None] * s
    i = np.arange(N)[None, :]
    return np.clip(np.minimum(lo + s, i + 1) - np.maximum(lo, i), 0, None) / s


def exact_area(a: np.ndarray, eh: float, ew: float, h: int, w: int) -> np.ndarray:
    Ry, Rx = area_weights(eh, h, a.shape[0]), area_weights(ew, w, a.shape[1])
    return np.einsum("yxc,jx->yjc", np.tensordot(Ry, a.astype(np.float64), (1, 0)), Rx)


def _recipe(root, steps, **image) -> dict:
    return {"name": "f", "seed": 0,
            "inputs": {"root": str(root), "match": "{n}.jpg", "fields": {"image": {"decoder": "image", **image}}},
            "steps": steps, "output": {"format": "hdf5"}}


def _run(recipe, path: str) -> Sample:
    dec = recipe.decoders["image"]
    got = dec.read(path)
    arr, meta = got if isinstance(got, tuple) else (got, {})
    s = Sample(key="k", fields={"image": arr}, kinds={"image": Kind.IMAGE}, meta={"image": meta} if meta else {})
    (out,) = replay(recipe.steps, s, [])
    return out


# (H, W): the peers' 375 x 500 photos (k = 2 for 64 x 64: 375 rows are odd) and sizes odd modulo 8
@pytest.mark.parametrize("H, W, size", [(375, 500, [64, 64]), (501, 375, [64, 48]), (755, 1001, [72, 96])])
def test_the_first_resize_samples_a_reduced_decode_from_the_source_extent_in_one_resample(tmp_path, H, W, size):
    p = tmp_path / "a.jpg"
    Image.fromarray(photo(H, W, seed=H)).save(p, "JPEG", quality=90)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", _recipe(tmp_path, [{"resize": {"size": size}}])))
    need = recipe.decoders["image"].need
    assert need is not None and need.fold
    out = _run(recipe, str(p))
    k = out.meta["image"]["reduce"]
    assert k > 1 and (H % k or W % k)
    raw = simplejpeg.decode_jpeg(p.read_bytes(), "RGB", min_height=-(-H // k), min_width=-(-W // k))
    want = exact_area(raw, H / k, W / k, *size)
    got = out.fields["image"].astype(np.float64)
    # one exact area resample, rounded to the nearest level (before, bicubic onto the grid and then the area
    # resize: 0.89, 0.92 and 1.33 levels off at these sizes)
    assert np.abs(got - want).max() <= 0.51, np.abs(got - want).max()
    m = out.meta["image"]
    assert source_map.EXTENT not in m
    np.testing.assert_allclose(m["to_source"], [[W / size[1], 0, 0], [0, H / size[0], 0]], rtol=1e-12, atol=1e-9)


SIZES = st.tuples(st.integers(24, 120), st.sampled_from([1, 3, 5, 6, 7])).map(lambda t: 8 * t[0] + t[1])


@settings(max_examples=25, deadline=None)
@given(H=SIZES, W=SIZES, fx=st.floats(0.2, 0.8), fy=st.floats(0.2, 0.8), out=st.integers(16, 48))
def test_edges_land_within_005_output_px_of_a_full_decode_and_the_same_resize(tmp_path_factory, H, W, fx, fy, out):
    """Sizes not divisible by 2, 4 or 8; the reference is Pillow's full decode, its edges scaled to the output."""
    d = tmp_path_factory.mktemp("e")
    x0, y0 = int(W * fx), int(H * fy)
    p = str(d / "s.jpg")
    Image.fromarray(step_image(H, W, x0, y0)).save(p, "JPEG", quality=95)
    recipe = parse_recipe(_recipe(d, [{"resize": {"size": [out, out]}}]), base_dir=str(d))
    JR.configure(recipe)
    s = _run(recipe, p)
    a = s.fields["image"]
    assert a.shape == (out, out, 3) and source_map.EXTENT not in s.meta.get("image", {})
    top, left = max(1, y0 * out // H - 2), max(1, x0 * out // W - 2)
    ex, ey = edges(a, top, left)
    fx_, fy_ = pillow_edges(p, -(-top * H // out), -(-left * W // out))
    assert abs(ex - fx_ * out / W) < 0.05 and abs(ey - fy_ * out / H) < 0.05, (ex, fx_ * out / W, ey, fy_ * out / H)


def test_sizes_divisible_by_k_store_the_bytes_they_stored_before(tmp_path):
    """No extent to hand over: libjpeg's 1/k pixels, resized as before (the same call)."""
    from precompile.transforms.kernels.geometry import resize_hwc

    p = tmp_path / "d.jpg"
    Image.fromarray(photo(376, 504, seed=3)).save(p, "JPEG", quality=90)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", _recipe(tmp_path, [{"resize": {"size": [64, 64]}}])))
    out = _run(recipe, str(p))
    k = out.meta["image"]["reduce"]
    raw = simplejpeg.decode_jpeg(p.read_bytes(), "RGB", min_height=376 // k, min_width=504 // k)
    assert out.fields["image"].tobytes() == resize_hwc(raw, 64, 64, "area").tobytes()


@pytest.mark.parametrize("steps, why", [
    ([{"random_flip": {"horizontal": 0.5}}, {"resize": {"size": [32, 32]}}], "moves the pixels"),
    ([{"resize": {"size": [32, 32], "fast": True}}], "fast: true"),
    ([{"random_resized_crop": {"size": 16, "scale": [0.5, 1.0]}}], None),
])
def test_a_first_resample_that_cannot_take_the_extent_gets_an_image_covering_the_source(tmp_path, steps, why):
    """A flip before the resize (libjpeg's padding would change sides), the fast resize, a random crop: the
    decoder resamples onto the grid as before; the key tells the two apart."""
    p = tmp_path / "o.jpg"
    Image.fromarray(photo(301, 403, seed=1)).save(p, "JPEG", quality=90)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", _recipe(tmp_path, steps)))
    need = recipe.decoders["image"].need
    assert need is not None and not need.fold and "fold" not in need.describe()
    if why is not None:
        assert why in JR.fold_reason(recipe, {}, recipe.steps[need.index].params,
                                     "steps[0] random_flip" if len(steps) > 1 else None)
    arr, meta = recipe.decoders["image"].read(str(p))
    assert source_map.EXTENT not in meta and arr.shape[:2] == JR.reduced_size(301, 403, meta["reduce"])


def test_a_sample_with_a_video_field_keeps_the_covering_decode(tmp_path):
    from precompile.sample import FieldSpec

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", _recipe(tmp_path, [{"resize": {"size": [32, 32]}}])))
    p = recipe.steps[0].params
    assert JR.fold_reason(recipe, {"image": FieldSpec(Kind.IMAGE, (None, None, 3), "uint8")}, p, None) is None
    specs = {"image": FieldSpec(Kind.IMAGE, (None, None, 3), "uint8"),
             "clip": FieldSpec(Kind.VIDEO, (None, None, None, 3), "uint8")}
    assert JR.fold_reason(recipe, specs, p, None) == "the sample has a video field"


def test_the_recipe_key_changes_only_where_the_first_resize_takes_the_extent():
    base = _recipe(".", [{"resize": {"size": [64, 64]}}])
    fold = JR.key_parts(parse_recipe(base, base_dir="."))["image"]
    assert fold["fold"] == JR.FOLD_VERSION
    rrc = JR.key_parts(parse_recipe(_recipe(".", [{"random_resized_crop": {"size": 64}}]), base_dir="."))["image"]
    assert "fold" not in rrc


def test_an_extent_no_resize_took_is_settled_onto_the_grid():
    """The safety net at the end of the steps: an image still carrying an extent is resampled (linear) from it
    onto its own grid, its map scaled with it. Two columns, dark and bright, of which the source covers 1.5:
    stored column 1's centre, 1.5 x 0.75 = 1.125 in the decoded grid, lies 0.625 of the way from the dark
    centre (0.5) to the bright one (1.5)."""
    a = np.zeros((4, 2, 1), np.uint8)
    a[:, 1] = 200
    s = Sample(key="k", fields={"image": a}, kinds={"image": Kind.IMAGE},
               meta={"image": {"reduce": 2, "source_size": [8, 3], source_map.EXTENT: [4.0, 1.5]}})
    out = source_map.settle(s)
    m = out.meta["image"]
    assert source_map.EXTENT not in m
    np.testing.assert_allclose(m["to_source"], [[1.5, 0, 0], [0, 2, 0]])   # 3 source columns over 2
    assert out.fields["image"][:, :, 0].tolist() == [[0, 125]] * 4
    assert source_map.settle(out) is out
