"""Property tests: every registered spatial step x every kind it accepts, build side and Loader side.

Samples are consistent by construction:

- a 2D scene: ``img1`` is a smooth analytic texture T, ``flow`` an affine field
  f(x) = A (x - c) + t with a block of unknown (NaN) vectors, and ``img2`` is T
  moved by exactly that field, so that ``img2(x + f(x)) = img1(x)``; ``video``
  holds the two frames; ``mask`` a multi-class label map with ids {0, 3, 7, 15};
  ``flow_valid`` is derived from the flow; ``cover`` is an all-255 image that
  shows where a step padded or filled;
- a 3D scene: a volume with a bright ellipsoid (a brighter core) on a dark
  background and its ``volume_mask`` (5 outer shell, 9 core: ids that no blend
  of 0 and 9 can produce).

After each step and each seeded draw (hypothesis picks the seed and sizes):

- mask values are a subset of the input's (never blended or invented);
- ``flow_valid == isfinite(flow)``;
- warping the stored ``img2`` by the stored flow matches ``img1`` much better
  than no warp (mean abs error ratio under 0.6), on the pixels that hold data;
- the video's frames moved exactly as the images did;
- a volume mask still covers the object: it agrees with the thresholded volume.

The Loader's device steps get the same checks on a batch, and must equal the
build step's own kernels applied with the same drawn parameters.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from precompile.kinds import PLANAR, VOLUMETRIC, Kind
from precompile.reader import gpu
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.seeding import rng_for

load_builtins()

MASK_IDS = (0, 3, 7, 15)

# step -> parameter variants for the property test (each runs over the kinds the step applies to)
CASES_2D: dict[str, list[dict]] = {
    "resize": [{"size": [20, 26]}, {"size": [56, 64]}, {"shorter": 24}, {"size": [30, 30], "keep_aspect": True}],
    "center_crop": [{"size": [24, 28]}, {"size": [48, 20], "pad": True}],
    "convert": [{"mode": "gray8"}],
    "random_crop": [{"size": [24, 28]}, {"size": [32, 32], "padding": 4}, {"size": [50, 20], "pad": True}],
    "random_resized_crop": [{"size": [24, 24], "scale": [0.3, 1.0]}, {"size": [48, 40], "scale": [0.5, 1.0]}],
    "random_flip": [{"horizontal": 0.5, "vertical": 0.5}, {"horizontal": 1.0}],
    "random_affine": [{"degrees": 25, "scale": [0.8, 1.2], "translate": 0.1},
                      {"degrees": 15, "interpolation": "nearest"}],
    "color_jitter": [{"brightness": 0.2, "contrast": 0.2, "saturation": 0.2}],
    "gaussian_noise": [{"std": 2.0}],
    "clips": [{"length": 1}],
    "temporal_jitter": [{"length": 2}],
}
CASES_3D: dict[str, list[dict]] = {
    "resample_volume": [{"spacing": [1.5, 1.0, 1.3]}, {"shape": [9, 14, 11]}],
    "crop_pad_volume": [{"shape": [10, 20, 8]}],
    "patches3d": [{"size": [8, 8, 8], "stride": [6, 6, 6]}],
    "random_flip3d": [{"prob": 0.5}],
    "random_rot90": [{"k": [0, 1, 2, 3], "planes": [[1, 2]]}],
    "elastic": [{"magnitude": 1.5}],
    "hu_window": [{"window": [-100, 1700]}],
    "standardise": [{"per_sample": True}],
    "apply_mask": [{"mask": "mask", "fill": 0}],
    "lung_mask": [{"threshold": 500, "out": "lung"}],
    "gaussian_noise": [{"std": 5.0}],
}


def _spatial_steps() -> list[str]:
    """Built-in steps that apply to a 2D or 3D grid kind."""
    return sorted(n for n, c in STEPS.items() if c.__module__.startswith("precompile.") and c.applies & (PLANAR | VOLUMETRIC))


def _make(name: str, params: dict):
    cls = STEPS.get(name)
    return cls(cls.Params.model_validate(params))


# -- consistent scenes ----------------------------------------------------------------------
def _texture(x: np.ndarray, y: np.ndarray, ph: np.ndarray) -> np.ndarray:
    """A smooth RGB texture T(x, y) in [0, 255], float64 (H, W, 3)."""
    chans = [127.5 + 60 * np.sin(x / (8.0 + c) + ph[c]) + 60 * np.cos(y / (9.0 + 2 * c) + ph[c + 3]) for c in range(3)]
    return np.stack(chans, axis=-1)


def scene_2d(seed: int, H: int, W: int) -> Sample:
    r = np.random.default_rng(seed)
    ph = r.uniform(0, 2 * math.pi, 6)
    A = r.uniform(-0.05, 0.05, (2, 2))
    t = r.uniform(2, 4, 2) * r.choice([-1, 1], 2)   # motion of a few pixels: a missing warp shows
    c = np.array([(W - 1) / 2, (H - 1) / 2])
    ys, xs = np.mgrid[0:H, 0:W].astype(np.float64)
    dx, dy = xs - c[0], ys - c[1]
    u = A[0, 0] * dx + A[0, 1] * dy + t[0]
    v = A[1, 0] * dx + A[1, 1] * dy + t[1]
    img1 = _texture(xs, ys, ph)
    # x' = x + f(x) = c + (I + A)(x - c) + t, so img2(x') = T(c + (I + A)^-1 (x' - c - t))
    Mi = np.linalg.inv(np.eye(2) + A)
    px, py = xs - c[0] - t[0], ys - c[1] - t[1]
    sx, sy = c[0] + Mi[0, 0] * px + Mi[0, 1] * py, c[1] + Mi[1, 0] * px + Mi[1, 1] * py
    img2 = _texture(sx, sy, ph)
    flow = np.stack([u, v], axis=-1).astype(np.float32)
    y0, x0 = int(r.integers(0, H // 2)), int(r.integers(0, W // 2))
    flow[y0:y0 + H // 5, x0:x0 + W // 5] = np.nan              # unknown vectors
    region = (np.sin(xs / 5 + ph[0]) + np.cos(ys / 4 + ph[1]))
    mask = np.asarray(MASK_IDS, np.uint8)[np.clip(((region + 2) * 2).astype(int), 0, 3)][..., None]
    i1, i2 = (np.clip(np.rint(a), 0, 255).astype(np.uint8) for a in (img1, img2))
    fields = {"img1": i1, "img2": i2, "flow": flow, "flow_valid": np.zeros((H, W, 1), np.uint8),
              "mask": mask, "video": np.stack([i1, i2]), "cover": np.full((H, W, 1), 255, np.uint8)}
    kinds = {"img1": "image", "img2": "image", "flow": "flow", "flow_valid": "flow_valid", "mask": "mask",
             "video": "video", "cover": "image"}
    s = Sample(f"scene/{seed}", fields, kinds)
    return s.replace_fields({"flow": flow})  # derives flow_valid


def scene_3d(seed: int, D: int, H: int, W: int) -> Sample:
    r = np.random.default_rng(seed)
    zz, yy, xx = np.mgrid[0:D, 0:H, 0:W].astype(np.float64)
    c = [r.uniform(0.35, 0.65) * n for n in (D, H, W)]
    rad = [r.uniform(0.22, 0.32) * n for n in (D, H, W)]
    d2 = ((zz - c[0]) / rad[0]) ** 2 + ((yy - c[1]) / rad[1]) ** 2 + ((xx - c[2]) / rad[2]) ** 2
    mask = np.where(d2 <= 0.35, 9, np.where(d2 <= 1.0, 5, 0)).astype(np.uint8)  # ids no blend of 0 and 9 gives
    vol = (np.where(mask > 0, 1000.0, 0.0) + np.where(mask == 9, 400.0, 0.0) + r.normal(0, 15, mask.shape))
    return Sample(f"vol/{seed}", {"volume": vol.astype(np.float32), "mask": mask},
                  {"volume": "volume", "mask": "volume_mask"}, meta={"volume": {"spacing": [2.0, 1.0, 1.0]}})


# -- checks ----------------------------------------------------------------------------------
def backward_warp(img: np.ndarray, flow: np.ndarray) -> np.ndarray:
    import cv2

    h, w = flow.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    f = np.nan_to_num(flow)
    out = cv2.remap(img.astype(np.float32), xs + f[..., 0], ys + f[..., 1], cv2.INTER_LINEAR,
                    borderMode=cv2.BORDER_REPLICATE)
    return out.reshape(img.shape)


def warp_ratio(img1: np.ndarray, img2: np.ndarray, flow: np.ndarray, cover: np.ndarray) -> float | None:
    """Mean |img1 - warp(img2, flow)| over |img1 - img2|, on pixels with a known vector whose
    both ends hold data (not padding); None when too few such pixels are left to judge."""
    h, w = flow.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w]
    ok = np.isfinite(flow).all(-1) & (cover[..., 0] == 255)
    x0 = np.floor(xs + np.nan_to_num(flow[..., 0])).astype(int)
    y0 = np.floor(ys + np.nan_to_num(flow[..., 1])).astype(int)
    inside = (x0 >= 0) & (x0 < w - 1) & (y0 >= 0) & (y0 < h - 1)
    ok &= inside
    for dy in (0, 1):  # the bilinear sample's four source pixels all hold data
        for dx in (0, 1):
            ok[inside] &= cover[y0[inside] + dy, x0[inside] + dx, 0] == 255
    if ok.sum() < 40:
        return None
    a1, a2 = img1.astype(np.float32), img2.astype(np.float32)
    warped = backward_warp(a2, flow)
    return float(np.abs(a1 - warped)[ok].mean() / max(np.abs(a1 - a2)[ok].mean(), 1e-6))


def check_2d(before: Sample, after: Sample, where: str, own_noise: bool = False) -> None:
    """``own_noise``: the step gives every field its own noise (gaussian_noise), so frames and
    images agree only approximately."""
    f = after.fields
    assert set(np.unique(f["mask"])) <= set(np.unique(before.fields["mask"])), f"{where}: mask values invented"
    assert np.array_equal(f["flow_valid"][..., 0], np.isfinite(f["flow"]).all(-1)), f"{where}: flow_valid != isfinite"
    assert f["flow_valid"].dtype == np.uint8 and f["flow"].dtype == np.float32
    if f["video"].shape[0] == 2:  # frames move exactly as the images (clips/temporal steps pick frames)
        if own_noise:
            diff = [np.abs(f["video"][i].astype(int) - f[k].astype(int)).mean() for i, k in enumerate(("img1", "img2"))]
            assert max(diff) < 6, f"{where}: video frames moved differently from the images"
        else:
            assert np.array_equal(f["video"][0], f["img1"]) and np.array_equal(f["video"][1], f["img2"]), \
                f"{where}: video frames moved differently from the images"
    ratio = warp_ratio(f["img1"], f["img2"], f["flow"], f["cover"])
    if ratio is not None:
        assert ratio < 0.6, f"{where}: warping img2 by the stored flow does not give img1 (ratio {ratio:.2f})"


def check_3d(before: Sample, after: Sample, where: str) -> None:
    m, v = after.fields["mask"], after.fields["volume"].astype(np.float64)
    assert m.shape == v.shape[:3], f"{where}: mask {m.shape} and volume {v.shape} no longer share a grid"
    assert set(np.unique(m)) <= set(np.unique(before.fields["mask"])), f"{where}: mask values invented"
    if not (m > 0).any() or (m > 0).all():
        return  # a patch wholly inside or outside the object: nothing to compare against
    mid = (v[m > 0].mean() + v[m == 0].mean()) / 2
    agree = np.mean((v > mid) == (m > 0)) if v[m > 0].mean() > v[m == 0].mean() else 0.0
    assert agree > 0.93, f"{where}: the mask covers other voxels than the object ({agree:.3f} agree)"
    if "lung" in after.fields:
        assert set(np.unique(after.fields["lung"])) <= {0, 1}


def _cases(table: dict[str, list[dict]]) -> list:
    return [pytest.param(n, p, id=f"{n}-{i}") for n, ps in sorted(table.items()) for i, p in enumerate(ps)]


# -- contract: every spatial step has cases for every kind it claims ---------------------------
def test_every_spatial_step_has_property_cases_for_its_kinds():
    s2, s3 = scene_2d(0, 32, 40), scene_3d(0, 12, 14, 16)
    missing = []
    for name in _spatial_steps():
        cls = STEPS.get(name)
        planar, volumetric = cls.applies & PLANAR, cls.applies & VOLUMETRIC
        if planar and (name not in CASES_2D or not planar <= {k for k in s2.kinds.values()}):
            missing.append(f"{name}: 2D kinds {sorted(k.value for k in planar)}")
        if volumetric and (name not in CASES_3D or not volumetric <= {k for k in s3.kinds.values()}):
            missing.append(f"{name}: 3D kinds {sorted(k.value for k in volumetric)}")
    assert not missing, "spatial steps without property cases: " + "; ".join(missing)
    # and every case names a registered step that applies to what its scene holds
    for name in CASES_2D:
        assert STEPS.get(name).applies & PLANAR, name
    for name in CASES_3D:
        assert STEPS.get(name).applies & VOLUMETRIC, name


def test_scenes_are_consistent_by_construction():
    s = scene_2d(3, 40, 48)
    assert warp_ratio(s.fields["img1"], s.fields["img2"], s.fields["flow"], s.fields["cover"]) < 0.2
    flipped_u = s.fields["flow"] * np.array([-1, 1], np.float32)   # a wrong flow is caught
    assert warp_ratio(s.fields["img1"], s.fields["img2"], flipped_u, s.fields["cover"]) > 0.6
    assert set(np.unique(s.fields["mask"])) == set(MASK_IDS)
    v = scene_3d(3, 12, 14, 16)
    check_3d(v, v, "identity")


# -- build side --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, params", _cases(CASES_2D))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 31), H=st.integers(30, 44), W=st.integers(30, 52))
def test_2d_steps_keep_every_kind_consistent(name, params, seed, H, W):
    step = _make(name, params)
    before = scene_2d(seed, H, W)
    kept = {f: a.copy() for f, a in before.fields.items()}
    for copy in (1, 2):
        for out in step.run(before, rng_for(seed, before.key, copy)):
            check_2d(before, out, f"{name} {params} seed={seed} {H}x{W} copy {copy}", name == "gaussian_noise")
            for f, k in out.kinds.items():  # a kind the step keeps is kept byte for byte
                if step.rule(k) == "keep" and k is not Kind.FLOW_VALID and f in kept:
                    assert np.array_equal(out.fields[f], kept[f], equal_nan=True), f"{name} changed {f} ({k.value})"
    if step.random and not step.expands:
        (orig,) = step.run_original(before)
        check_2d(before, orig, f"{name} original")


@pytest.mark.parametrize("name, params", _cases(CASES_3D))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 31), D=st.integers(10, 16), H=st.integers(12, 20), W=st.integers(12, 20))
def test_3d_steps_move_label_volumes_with_their_volume(name, params, seed, D, H, W):
    step = _make(name, params)
    before = scene_3d(seed, D, H, W)
    for copy in (1, 2):
        outs = step.run(before, rng_for(seed, before.key, copy))
        assert outs or name == "patches3d"
        for out in outs:
            check_3d(before, out, f"{name} {params} seed={seed} {D}x{H}x{W} copy {copy}")


def test_property_case_count():
    """The number of (step, variant, kind) cases the two property tests run (each on many draws)."""
    n2 = sum(len(ps) * len(STEPS.get(n).applies & PLANAR) for n, ps in CASES_2D.items())
    n3 = sum(len(ps) * len(STEPS.get(n).applies & VOLUMETRIC) for n, ps in CASES_3D.items())
    assert n2 >= 60 and n3 >= 15, (n2, n3)


# -- Loader side: device steps on a batch ----------------------------------------------------------
DEVICE_CASES = [("random_flip", {"horizontal": 0.5, "vertical": 0.5}), ("random_flip", {"horizontal": 1.0}),
                ("random_crop", {"size": [24, 28]}), ("random_crop", {"size": [32, 32], "padding": 4}),
                ("random_crop", {"size": [48, 20], "pad": True, "pad_value": 9})]


def test_every_device_step_has_property_cases():
    assert {n for n, _ in DEVICE_CASES} == set(gpu.STEP_NAMES)


@pytest.mark.parametrize("name, params", [pytest.param(n, p, id=f"{n}-{i}") for i, (n, p) in enumerate(DEVICE_CASES)])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 31), H=st.integers(30, 40), W=st.integers(30, 44))
def test_device_steps_keep_every_kind_consistent_and_equal_the_build_kernels(name, params, seed, H, W):
    scenes = [scene_2d(seed + i, H, W) for i in range(4)]
    fields = list(scenes[0].fields)
    specs = {f: {"kind": scenes[0].kinds[f].value, **({"of": "flow"} if f == "flow_valid" else {})} for f in fields}
    step = gpu.parse_steps([{name: params}])[0]
    bound = step.bind(specs, {f: scenes[0].fields[f].shape for f in fields})
    assert set(bound) == set(fields)  # every grid field moves, flow_valid included
    (p,) = gpu.step_params([step], seed, 0, 0, 0, len(scenes))
    batch = {f: torch.from_numpy(np.stack([s.fields[f] for s in scenes])) for f in fields}
    out = gpu.run_steps(dict(batch), [step], [p])
    build = step.step
    for i, s in enumerate(scenes):
        one = {k: (bool(v[i]) if v.dtype == bool else int(v[i])) for k, v in p.items()}
        got = Sample(s.key, {f: out[f][i].numpy() for f in fields}, s.kinds, links=s.links)
        check_2d(s, got, f"device {name} {params} seed={seed} sample {i}")
        ref = build.replay(s, one)  # the build step's kernels with the same parameters
        for f in fields:
            np.testing.assert_array_equal(got.fields[f], ref.fields[f], err_msg=f"device {name} {f} != build kernel")

