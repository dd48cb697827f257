"""Resampling interpolates: every resampling step x every kind it accepts x every interpolation order.

Both resampling steps put output pixel (voxel) centres at ``(i + 0.5) / k - 0.5`` in
input coordinates (OpenCV's convention for ``resize``; ``scipy.ndimage.zoom`` with
``grid_mode=True`` for ``resample_volume``). Upsampling by an odd integer factor
``k`` therefore puts output centre ``k*i + (k-1)/2`` exactly on input centre ``i``,
and an interpolating kernel must return the input value there. Two properties:

- upsample by odd factors, then take every ``k``-th value from ``(k-1)/2``: the
  original comes back (flow vectors scaled by the factor, as ``resize`` scales them);
- resampling onto the same grid is the identity.

The tolerance: the kernel weights at an aligned point are (0, 1, 0, ...) exactly, so
integer data must come back bit-exact; float data gets 1e-5 relative to the data's
range (float32 arithmetic on spline coefficients computed in float64, whose
neighbours' weights are exact zeros up to rounding of the prefilter's recursion).
A smoothing kernel fails by far: the cubic B-spline without its prefilter returns
1/6 + 4/6 + 1/6 blends of neighbours, an error of a third of the local contrast.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy import ndimage

from precompile import load_recipe
from precompile.formats import names as fmt
from precompile.kinds import Kind
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.seeding import rng_for
from precompile.transforms.kernels.volume import zoom_volume

load_builtins()

RESAMPLING = {"resize": ("interpolation", ["auto", "linear", "cubic", "nearest", "area"]),
              "resample_volume": ("order", [0, 1, 2, 3])}
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(step_name: str, params: dict, fields: dict, kinds: dict) -> Sample:
    step = STEPS.get(step_name)(STEPS.get(step_name).Params(**params))
    out = step.run(Sample("k", fields, kinds), rng_for(0, "k", 0))
    assert len(out) == 1
    return out[0]


def _planar_fields(seed: int, H: int, W: int) -> tuple[dict, dict]:
    """One field of every kind ``resize`` accepts (and flow_valid, derived from the flow)."""
    r = np.random.default_rng(seed)
    flow = r.normal(0, 3, (H, W, 2)).astype(np.float32)
    flow[0, 0] = np.nan
    fields = {"u8": r.integers(0, 256, (H, W, 3), dtype=np.uint8),
              "u16": r.integers(0, 65536, (H, W, 1), dtype=np.uint16),
              "f32": r.normal(0, 100, (H, W, 2)).astype(np.float32),
              "mask": r.choice(np.array([0, 3, 7, 200], np.uint8), (H, W, 1)),
              "flow": flow, "flow_valid": np.zeros((H, W, 1), np.uint8),
              "video": r.integers(0, 256, (2, H, W, 3), dtype=np.uint8)}
    kinds = {"u8": "image", "u16": "image", "f32": "image", "mask": "mask", "flow": "flow",
             "flow_valid": "flow_valid", "video": "video"}
    return fields, kinds


def _assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        fin = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=what)
        span = (float(np.ptp(want[fin])) if fin.any() else 0.0) or 1.0
        np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-5 * span, err_msg=what)


def test_every_resampling_step_is_covered():
    """A new step that resamples a grid must be added here (its name says so)."""
    names = {n for n in STEPS if "resiz" in n or "resampl" in n or "zoom" in n or "rescal" in n}
    assert names - {"random_resized_crop"} == set(RESAMPLING)  # random_resized_crop: a crop, then resize's kernel


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), H=st.integers(2, 9), W=st.integers(2, 9), k=st.sampled_from([3, 5]),
       interp=st.sampled_from(RESAMPLING["resize"][1]))
def test_resize_up_then_grid_points_is_the_original(seed, H, W, k, interp):
    fields, kinds = _planar_fields(seed, H, W)
    out = _run("resize", {"size": [k * H, k * W], "interpolation": interp}, fields, kinds)
    o = (k - 1) // 2
    for f, a in fields.items():
        got = out.fields[f]
        assert got.shape[-3:-1] == (k * H, k * W), f
        back = got[..., o::k, o::k, :]
        if kinds[f] == "flow":
            back = back / np.float32(k)
        if kinds[f] == "flow_valid":
            a = np.isfinite(fields["flow"]).all(-1, keepdims=True).astype(np.uint8)
        _assert_close(back, a, f"{f} ({kinds[f]}, {interp}, x{k})")


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), H=st.integers(1, 9), W=st.integers(1, 9),
       interp=st.sampled_from(RESAMPLING["resize"][1]))
def test_resize_to_the_same_grid_is_the_identity(seed, H, W, interp):
    fields, kinds = _planar_fields(seed, H, W)
    out = _run("resize", {"size": [H, W], "interpolation": interp}, fields, kinds)
    for f, a in fields.items():
        if kinds[f] != "flow_valid":
            _assert_close(out.fields[f], a, f"{f} ({interp})")


def _volume_fields(seed: int, shape: tuple[int, int, int]) -> tuple[dict, dict]:
    r = np.random.default_rng(seed)
    fields = {"ct": r.integers(-1024, 3000, shape).astype(np.int16),
              "f32": ndimage.gaussian_filter(r.normal(0, 50, shape), 0.7).astype(np.float32),
              "u8": r.integers(0, 256, shape, dtype=np.uint8),
              "seg": r.choice(np.array([0, 5, 9], np.uint8), shape)}
    return fields, {"ct": "volume", "f32": "volume", "u8": "volume", "seg": "volume_mask"}


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), shape=st.tuples(*[st.integers(2, 6)] * 3),
       ks=st.tuples(*[st.sampled_from([1, 3, 5])] * 3), order=st.sampled_from(RESAMPLING["resample_volume"][1]))
def test_resample_volume_up_then_grid_points_is_the_original(seed, shape, ks, order):
    fields, kinds = _volume_fields(seed, shape)
    big = [n * k for n, k in zip(shape, ks)]
    out = _run("resample_volume", {"shape": big, "order": order}, fields, kinds)
    sl = tuple(slice((k - 1) // 2, None, k) for k in ks)
    for f, a in fields.items():
        assert out.fields[f].shape == tuple(big), f
        _assert_close(out.fields[f][sl], a, f"{f} ({kinds[f]}, order {order}, x{ks})")


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), shape=st.tuples(*[st.integers(1, 6)] * 3),
       order=st.sampled_from(RESAMPLING["resample_volume"][1]))
def test_resample_volume_to_the_same_grid_is_the_identity(seed, shape, order):
    fields, kinds = _volume_fields(seed, shape)
    out = _run("resample_volume", {"shape": list(shape), "order": order}, fields, kinds)
    for f, a in fields.items():
        _assert_close(out.fields[f], a, f"{f} (order {order})")


@pytest.mark.parametrize("order", [2, 3])
def test_cubic_keeps_an_impulse_and_the_noise(order):
    """The issue's figures: an impulse of 1000 upsampled 3x kept its peak (296 without the prefilter),
    and smooth noise keeps its standard deviation; scipy's own prefiltered zoom is the reference."""
    v = np.zeros((5, 5, 5), np.float32)
    v[2, 2, 2] = 1000
    up = zoom_volume(v, (15, 15, 15), order)
    assert up.max() == pytest.approx(1000, abs=1e-2)
    noise = ndimage.gaussian_filter(np.random.default_rng(1).normal(0, 60, (12, 12, 12)), 1.0).astype(np.float32)
    up = zoom_volume(noise, (36, 36, 36), order)
    ref = ndimage.zoom(noise, 3, order=order, mode="nearest", grid_mode=True, prefilter=True)
    np.testing.assert_allclose(up, ref, rtol=0, atol=1e-3)
    assert up.std() == pytest.approx(noise.std(), rel=0.05)
    smoothed = ndimage.zoom(noise, 3, order=order, mode="nearest", grid_mode=True, prefilter=False)
    assert smoothed.std() < 0.95 * noise.std()  # what the old kernel did: the check above can fail


def test_integer_cubic_overshoot_is_clipped():
    v = np.zeros((4, 4, 4), np.uint8)
    v[:, :, 2:] = 255
    up = zoom_volume(v, (4, 4, 12), 3)
    assert up.dtype == np.uint8 and up.min() == 0 and up.max() == 255
    ref = ndimage.zoom(v.astype(np.float32), (1, 1, 3), order=3, mode="nearest", grid_mode=True)
    np.testing.assert_array_equal(up, np.clip(np.rint(ref), 0, 255).astype(np.uint8))


def _recipe(tmp_path, order: int):
    pytest.importorskip("nibabel", reason="nibabel is not installed (extra 'nifti')")   # the nifti decoder needs it
    p = tmp_path / f"r{order}.yaml"
    p.write_text(f"""
name: r
seed: 0
inputs: {{root: {tmp_path}, match: "{{name}}.nii.gz", fields: {{ct: {{decoder: nifti}}}}}}
steps:
  - resample_volume: {{shape: [8, 8, 8], order: {order}}}
output: {{format: hdf5}}
""")
    return load_recipe(str(p))


def test_spline_orders_make_their_old_shards_stale(tmp_path):
    """Orders 2 and 3 changed bytes (and every order's origin/spacing meta): the recipe key carries
    resample_volume's output_version 2, so builds made before it rebuild."""
    for order in (0, 1, 2, 3):
        r = _recipe(tmp_path, order)
        assert r.content_dict()["output_versions"] == {"steps[0]": 2}
        d = r.content_dict()
        d.pop("output_versions")
        assert r.content_hash() != hashlib.sha256(fmt.dumps(d).encode()).hexdigest()


def test_kind_rules_of_the_resampling_steps():
    assert STEPS.get("resize").rule(Kind.VOLUME) == "refuse"
    assert STEPS.get("resample_volume").rule(Kind.IMAGE) == "refuse"
