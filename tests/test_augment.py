"""Seeded augmentation: kernels and steps on real arrays, hypothesis properties, byte-identical
builds (twice, -j1 vs -j2), seeds that change the copies, replay from the recorded parameters,
the original copy, and the per-epoch copy schedule of ``reader/copies.py``."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

import precompile
from precompile import build as build_recipe
from precompile.formats import names as fmt
from precompile.compiler.shard import decode_item
from precompile.errors import RecipeError, StepError
from precompile.compiler.plan import make_plan
from precompile.reader.copies import CopySchedule, epoch_rows, epoch_view
from precompile.recipe import load_recipe
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.seeding import rng_for
from precompile import transforms as T
from precompile.transforms.kernels import audio as KA, colour as KC, geometry as KG, volume as KV

load_builtins()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = os.path.join(REPO, "sample_data", "images")


def step(name: str, **params):
    cls = STEPS.get(name)
    return cls(cls.Params.model_validate(params))


# ----------------------------------------------------------------------------------------
# one draw for every field
# ----------------------------------------------------------------------------------------
def coord_sample(h: int = 24, w: int = 32) -> Sample:
    """image and mask hold the code y * 100 + x of each pixel; flow is a constant (1.5, -0.5)."""
    code = (np.arange(h)[:, None] * 100 + np.arange(w)[None, :]).astype(np.uint16)[..., None]
    flow = np.empty((h, w, 2), np.float32)
    flow[..., 0], flow[..., 1] = 1.5, -0.5
    return Sample("k", {"image": code.copy(), "mask": code.copy(), "flow": flow},
                  {"image": "image", "mask": "mask", "flow": "flow"})


def test_crop_and_flip_move_every_field_together():
    crop, flip = step("random_crop", size=[10, 12]), step("random_flip", horizontal=0.5, vertical=0.5)
    seen = set()
    for seed in range(12):
        rng = rng_for(seed, "k", 1)
        (s,) = crop.run(coord_sample(), rng)
        (s,) = flip.run(s, rng)
        c, f = s.meta["augment"]
        seen.add((f["horizontal"], f["vertical"]))
        assert np.array_equal(s.fields["mask"], s.fields["image"])
        img = s.fields["image"][..., 0].astype(int)
        # undo the recorded flip and check the window is the recorded one
        if f["horizontal"]:
            img = img[:, ::-1]
        if f["vertical"]:
            img = img[::-1]
        assert img[0, 0] == c["top"] * 100 + c["left"] and img[-1, -1] == (c["top"] + 9) * 100 + c["left"] + 11
        u, v = s.fields["flow"][..., 0], s.fields["flow"][..., 1]
        assert np.all(u == (-1.5 if f["horizontal"] else 1.5)) and np.all(v == (0.5 if f["vertical"] else -0.5))
    assert len(seen) == 4  # all four flip combinations occurred


def test_fields_of_different_sizes_are_an_error():
    s = coord_sample()
    s.fields["mask"] = np.zeros((12, 16, 1), np.uint8)
    with pytest.raises(StepError, match="differ in size"):
        step("random_crop", size=8).run(s, rng_for(0, "k", 1))


def test_affine_nearest_keeps_fields_aligned_and_mask_labels():
    st_ = step("random_affine", degrees=40, scale=[0.7, 1.3], translate=0.1, interpolation="nearest", fill=0)
    (s,) = st_.run(coord_sample(), rng_for(3, "k", 1))
    assert np.array_equal(s.fields["mask"], s.fields["image"])
    lin = step("random_affine", degrees=40, scale=[0.7, 1.3])
    m = coord_sample()
    m.fields["mask"] = (m.fields["mask"] % 3).astype(np.uint8) + 1
    (s,) = lin.run(m, rng_for(3, "k", 1))
    assert set(np.unique(s.fields["mask"])) <= {0, 1, 2, 3}


def test_affine_rotates_and_scales_flow_vectors():
    flow = np.zeros((31, 31, 2), np.float32)
    flow[..., 0] = 1.0  # everything moves right by one pixel
    rot = KG.warp_flow(flow, KG.affine_matrix(31, 31, 90, 1.0))
    # rotated 90 degrees counter-clockwise (as displayed, y down): right becomes up
    np.testing.assert_allclose(rot[5:-5, 5:-5, 0], 0, atol=1e-5)
    np.testing.assert_allclose(rot[5:-5, 5:-5, 1], -1, atol=1e-5)
    big = KG.warp_flow(flow, KG.affine_matrix(31, 31, 0, 2.0))
    np.testing.assert_allclose(big[..., 0], 2, atol=1e-5)
    small = KG.warp_flow(flow, KG.affine_matrix(31, 31, 0, 0.5))
    assert np.isnan(small[0, 0]).all() and np.isnan(small[15, 2]).all()  # from outside: invalid
    np.testing.assert_allclose(small[15, 15], [0.5, 0], atol=1e-5)


def test_affine_keeps_invalid_flow_out_of_its_neighbours():
    flow = np.ones((20, 20, 2), np.float32)
    flow[8:12, 8:12] = np.nan
    out = KG.warp_flow(flow, KG.affine_matrix(20, 20, 10, 1.0))
    fin = out[np.isfinite(out).all(-1)]
    assert fin.size and np.abs(np.linalg.norm(fin, axis=-1) - np.sqrt(2)).max() < 1e-4  # rotation keeps length
    assert np.isnan(out[10, 10]).all()


def test_random_resized_crop_scales_flow_with_the_window():
    s = coord_sample(40, 60)
    s.fields["flow"][:] = 1.0
    rrc = step("random_resized_crop", size=[16, 16], scale=[0.2, 0.6])
    (o,) = rrc.run(s, rng_for(1, "k", 1))
    r = o.meta["augment"][0]
    np.testing.assert_allclose(o.fields["flow"][..., 0], 16 / r["width"], rtol=1e-5)
    np.testing.assert_allclose(o.fields["flow"][..., 1], 16 / r["height"], rtol=1e-5)
    codes = np.unique(o.fields["mask"])
    assert codes.min() >= r["top"] * 100 + r["left"]  # nearest: only codes from inside the window
    assert codes.max() <= (r["top"] + r["height"] - 1) * 100 + r["left"] + r["width"] - 1


def test_color_jitter_touches_only_images_and_keeps_alpha():
    s = coord_sample()
    s.fields["rgba"] = np.dstack([np.full((24, 32, 3), 100, np.uint8), np.full((24, 32, 1), 77, np.uint8)])
    s.kinds["rgba"] = "image"
    s.fields["image"] = np.full((24, 32, 3), 200, np.uint8)
    before = {f: a.copy() for f, a in s.fields.items()}
    (o,) = step("color_jitter", brightness=[2.0, 2.0]).run(s, rng_for(0, "k", 1))
    assert np.array_equal(o.fields["mask"], before["mask"]) and np.array_equal(o.fields["flow"], before["flow"])
    assert (o.fields["image"] == 255).all()          # 400 clipped to the uint8 range
    assert (o.fields["rgba"][..., :3] == 200).all() and (o.fields["rgba"][..., 3] == 77).all()
    gray = KC.color_jitter(np.array([[[200, 100, 50]]], np.uint8), False, saturation=0.0)
    assert gray.tolist() == [[[124, 124, 124]]]      # 0.299*200 + 0.587*100 + 0.114*50 = 124.2
    flat = KC.color_jitter(np.array([[[10], [30]]], np.uint8), False, contrast=0.0)
    assert flat.tolist() == [[[20], [20]]]           # contrast 0: the mean grey everywhere



def test_gaussian_noise_gives_each_field_its_own_noise():
    s = Sample("k", {"a": np.zeros((64, 64, 1), np.float32), "b": np.zeros((64, 64, 1), np.float32)},
               {"a": "image", "b": "image"})
    (o,) = step("gaussian_noise", std=2.0).run(s, rng_for(0, "k", 1))
    assert not np.array_equal(o.fields["a"], o.fields["b"])
    assert 1.8 < o.fields["a"].std() < 2.2 and abs(o.fields["a"].mean()) < 0.1
    rec = o.meta["augment"][0]
    assert set(rec["seed"]) == {"a", "b"} and rec["std"] == 2.0


# ----------------------------------------------------------------------------------------
# clips, audio, volumes
# ----------------------------------------------------------------------------------------
def frames(t: int) -> Sample:
    v = np.broadcast_to(np.arange(t, dtype=np.uint8)[:, None, None, None], (t, 4, 5, 3)).copy()
    return Sample("clip", {"video": v}, {"video": "video"})


def test_temporal_jitter_takes_the_recorded_frames_in_order():
    tj = step("temporal_jitter", length=5, strides=[1, 2, 3], jitter=1)
    strides = set()
    for seed in range(20):
        (o,) = tj.run(frames(20), rng_for(seed, "clip", 1))
        idx = o.meta["augment"][0]["indices"]
        assert len(idx) == 5 and idx == sorted(idx) and 0 <= idx[0] and idx[-1] < 20
        assert o.fields["video"][:, 0, 0, 0].tolist() == idx
        strides.add(idx[-1] - idx[0])
    assert len(strides) > 3
    (short,) = step("temporal_jitter", length=6).run(frames(4), rng_for(0, "clip", 1))
    assert short.fields["video"][:, 0, 0, 0].tolist() == [0, 1, 2, 3, 3, 3]
    (orig,) = step("temporal_jitter", length=4, strides=[2]).run_original(frames(11))
    assert orig.meta["augment"][0]["indices"] == [2, 4, 6, 8]  # the centred span


def test_audio_gain_and_shift():
    a = np.random.default_rng(0).normal(0, 0.1, (2, 100)).astype(np.float32)
    np.testing.assert_allclose(KA.apply_gain(a, 20 * np.log10(2)), 2 * a, rtol=1e-5)
    assert KA.apply_gain(a, 0.0).dtype == np.float32
    assert np.array_equal(KA.shift_time(KA.shift_time(a, 7), -7), a)
    z = KA.shift_time(a, 10, "zero")
    assert (z[:, :10] == 0).all() and np.array_equal(z[:, 10:], a[:, :90])
    z = KA.shift_time(a, -10, "zero")
    assert (z[:, 90:] == 0).all() and np.array_equal(z[:, :90], a[:, 10:])
    (o,) = step("time_shift", max_shift=30).run(Sample("w", {"audio": a}, {"audio": "audio"}), rng_for(1, "w", 1))
    sh = o.meta["augment"][0]["shift"]
    assert -30 <= sh <= 30 and np.array_equal(o.fields["audio"], np.roll(a, sh, axis=1))


def volume_sample() -> Sample:
    mask = np.zeros((12, 14, 16), np.uint8)
    mask[3:9, 4:10, 5:12] = 1
    mask[5:7, 6:8, 7:9] = 2
    return Sample("vol", {"volume": mask.astype(np.int16) * 1000, "mask": mask}, {"volume": "volume", "mask": "volume_mask"})


def volume_and_slice_sample() -> Sample:
    s = volume_sample()
    s.fields["slice_mask"] = np.arange(14 * 16, dtype=np.uint8).reshape(14, 16, 1)
    s.kinds["slice_mask"] = "mask"
    return s


def test_volume_steps_move_volume_and_mask_together():
    for name, params in [("random_flip3d", {"prob": 0.5}), ("random_rot90", {"k": [0, 2], "planes": [[0, 1], [1, 2]]}),
                         ("elastic", {"magnitude": 1.5})]:
        for seed in range(4):
            # a 2D (H, W, 1) mask beside a volume: the 3D step refuses it unless fields: names what moves
            with pytest.raises(StepError, match="cannot handle field 'slice_mask' of kind mask"):
                step(name, **params).run(volume_and_slice_sample(), rng_for(seed, "vol", 1))
            (o,) = step(name, **params, fields=["volume", "mask"]).run(volume_and_slice_sample(), rng_for(seed, "vol", 1))
            assert np.array_equal(o.fields["slice_mask"], volume_and_slice_sample().fields["slice_mask"])
            m, v = o.fields["mask"], o.fields["volume"]
            assert set(np.unique(m)) <= {0, 1, 2}
            if name == "elastic":  # linear volume vs nearest mask: agree away from label edges
                assert not np.array_equal(m, volume_sample().fields["mask"])  # it did deform
                assert np.mean(np.abs(v.astype(int) - m.astype(int) * 1000) < 500) > 0.95
                # the same displacement: the volume resampled as a mask lands exactly on the mask
                rec = o.meta["augment"][-1]
                again = KV.elastic(volume_sample().fields["volume"], 4, rec["magnitude"], rec["seed"], label=True)
                assert np.array_equal(again, m.astype(np.int16) * 1000)
            else:
                assert np.array_equal(v, m.astype(np.int16) * 1000)


def test_volume_kernels_invert():
    v = np.random.default_rng(0).normal(size=(5, 6, 6)).astype(np.float32)
    assert np.array_equal(KV.flip_axes(KV.flip_axes(v, [0, 2]), [0, 2]), v)
    assert np.array_equal(KV.rot90(KV.rot90(v, 1, [1, 2]), 3, [1, 2]), v)
    assert np.array_equal(KV.elastic(v, 4, 0.0, 123), v)
    e1, e2 = KV.elastic(v, 4, 2.0, 1), KV.elastic(v, 4, 2.0, 2)
    assert not np.array_equal(e1, e2) and np.array_equal(e1, KV.elastic(v, 4, 2.0, 1))


def test_2d_steps_refuse_volumes_unless_fields_are_named():
    s = volume_sample()
    s.fields["image"] = np.zeros((14, 16, 3), np.uint8)
    s.kinds["image"] = "image"
    specs = s.specs()
    with pytest.raises(ValueError, match="cannot handle field 'volume' of kind volume"):
        step("random_flip").targets(specs)
    assert step("random_flip", fields=["image"]).targets(specs) == ["image"]


# ----------------------------------------------------------------------------------------
# hypothesis properties
# ----------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["image", "mask", "flow", "video"]), h=st.integers(1, 9), w=st.integers(1, 9),
       seed=st.integers(0, 2 ** 32 - 1), vertical=st.booleans())
def test_two_flips_are_the_identity(kind, h, w, seed, vertical):
    r = np.random.default_rng(seed)
    if kind == "flow":
        a = r.normal(size=(h, w, 2)).astype(np.float32)
        a[r.random((h, w)) < 0.2] = np.nan
    elif kind == "video":
        a = r.integers(0, 256, (3, h, w, 3), dtype=np.uint8)
    else:
        a = r.integers(0, 256, (h, w, 1 if kind == "mask" else 3), dtype=np.uint8)
    fl = step("random_flip")
    once = fl.apply(a, kind, horizontal=True, vertical=vertical)
    twice = fl.apply(once, kind, horizontal=True, vertical=vertical)
    assert twice.tobytes() == a.tobytes()
    if w > 1 and kind != "flow":
        assert not np.array_equal(once, a) or np.array_equal(a, a[..., ::-1, :] if kind != "video" else a)


def smooth(h: int, w: int, dx: float, dy: float) -> np.ndarray:
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    x, y = xs - dx, ys - dy
    f = np.sin(x / 5.0) + np.cos(y / 7.0) + 0.5 * np.sin((x + y) / 9.0)
    return f.astype(np.float32)[..., None]


def backward_warp(frame2: np.ndarray, flow: np.ndarray) -> np.ndarray:
    import cv2

    h, w = flow.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    return cv2.remap(frame2[..., 0], xs + flow[..., 0], ys + flow[..., 1], cv2.INTER_LINEAR)


@settings(max_examples=30, deadline=None)
@given(du=st.floats(-3, 3), dv=st.floats(-3, 3), horizontal=st.booleans(), vertical=st.booleans(),
       angle=st.floats(-30, 30), scale=st.floats(0.8, 1.25))
@example(du=-1.125, dv=-3.0, horizontal=True, vertical=True, angle=-18.0, scale=1.0)  # u near 0 after the turn
@example(du=3.0, dv=3.0, horizontal=False, vertical=False, angle=27.0, scale=1.25)  # the warp reaches 6 px
def test_transformed_flow_still_explains_the_transformed_pair(du, dv, horizontal, vertical, angle, scale):
    import cv2

    h, w = 48, 64
    f1, f2 = smooth(h, w, 0, 0), smooth(h, w, du, dv)   # frame1(p) = frame2(p + (du, dv))
    flow = np.empty((h, w, 2), np.float32)
    flow[..., 0], flow[..., 1] = du, dv
    fields = {"frame1": f1, "frame2": f2, "flow": flow, "cover": np.ones((h, w, 1), np.float32)}
    for st_, params in [(step("random_flip"), {"horizontal": horizontal, "vertical": vertical}),
                        (step("random_affine"), {"angle": angle, "scale": scale, "tx": 0.0, "ty": 0.0})]:
        fields = {k: st_.apply(a, "flow" if k == "flow" else "image", **params) for k, a in fields.items()}
    # compare where the transformed frames hold input pixels, away from the uncovered border by more than the
    # warp reaches: the bilinear sample at p + flow reads up to ceil(|u|), ceil(|v|) pixels away (the scale can
    # stretch a drawn 3 px to 3.75 px and the turn a (3, 3) to u = 5.04, past a fixed 5 px margin)
    m = int(np.ceil(np.nanmax(np.abs(fields["flow"])))) + 1   # NaN: flow where the input had none
    inside = cv2.erode((fields["cover"][..., 0] > 0.999).astype(np.uint8), np.ones((2 * m + 1, 2 * m + 1), np.uint8),
                       borderType=cv2.BORDER_CONSTANT, borderValue=0)
    assert inside.sum() > 500
    rec = backward_warp(fields["frame2"], fields["flow"])
    err = np.abs(rec - fields["frame1"][..., 0])[inside > 0]
    assert err.max() < 0.05
    u = np.abs(fields["flow"][..., 0])[inside > 0]
    # the same check catches a flip that forgets to negate u, where the stored u is large enough to tell
    # (not the drawn du: a rotation after the flip can turn (du, dv) until its u is near 0)
    if horizontal and u.min() > 1:
        wrong = fields["flow"].copy()
        wrong[..., 0] *= -1
        assert np.abs(backward_warp(fields["frame2"], wrong) - fields["frame1"][..., 0])[inside > 0].max() > 0.1


# ----------------------------------------------------------------------------------------
# builds: byte-identical, seeds, copies, replay
# ----------------------------------------------------------------------------------------
def write_recipe(tmp_path, name="aug", seed=0, copies=2, keep_original=True, steps=None, per_shard=8):
    steps = steps if steps is not None else [
        {"resize": {"shorter": 40}},
        {"random_resized_crop": {"size": [32, 32], "scale": [0.4, 1.0]}},
        {"random_flip": {"horizontal": 0.5}},
        {"random_affine": {"degrees": 15, "scale": [0.9, 1.1], "translate": 0.05}},
        {"color_jitter": {"brightness": 0.3, "contrast": 0.3, "saturation": 0.3}},
        {"gaussian_noise": {"std": [0.0, 6.0]}},
    ]
    doc = {"name": name, "seed": seed, "copies": copies, "keep_original": keep_original,
           "inputs": {"root": IMAGES, "match": "{label}/{name}.{ext}", "where": {"ext": "jpg|png"},
                      "fields": {"image": {"decoder": "image", "mode": "rgb8"}}, "label": {"capture": "label"}},
           "steps": steps, "output": {"samples_per_shard": per_shard}}
    p = tmp_path / f"{name}-{seed}-{copies}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def digests(index: str) -> dict[str, str]:
    import h5py

    out = {}
    with h5py.File(index, "r") as f:
        for name in sorted(f):
            data = f[name][()]
            raw = ("\n".join(x.decode() if isinstance(x, bytes) else x for x in data).encode()
                   if data.dtype.kind == "O" else np.ascontiguousarray(data).tobytes())
            out[name] = hashlib.sha256(raw).hexdigest()
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aug")
    recipe = write_recipe(tmp)
    rep = build_recipe(recipe, out_dir=str(tmp / "a"), n_jobs=1)
    return recipe, rep["output"], tmp


def test_build_twice_and_with_two_jobs_is_byte_identical(built):
    recipe, index, tmp = built
    first = digests(index)
    assert {"image", "label", fmt.KEY, fmt.COPY, fmt.META} <= set(first)
    again = build_recipe(recipe, out_dir=str(tmp / "b"), n_jobs=1)
    two = build_recipe(recipe, out_dir=str(tmp / "c"), n_jobs=2)
    assert two["jobs"] == 2 and two["shards"]["built"] == 5
    assert digests(again["output"]) == first
    assert digests(two["output"]) == first


def test_copies_layout_and_seed_changes_only_the_copies(built, tmp_path):
    recipe, index, _ = built
    ds = precompile.open(index)
    assert len(ds) == 36 * 3
    assert ds.copies.tolist() == [0, 1, 2] * 36
    other = build_recipe(write_recipe(tmp_path, seed=1), out_dir=str(tmp_path / "s1"))
    ds1 = precompile.open(other["output"])
    assert ds1.keys == ds.keys
    a, b = ds.batch(range(len(ds)))["image"], ds1.batch(range(len(ds1)))["image"]
    orig = ds.copies == 0
    assert np.array_equal(a[orig], b[orig])                      # the original does not depend on the seed
    differ = [not np.array_equal(x, y) for x, y in zip(a[~orig], b[~orig])]
    assert all(differ)
    # and the copies of one sample differ from each other
    assert not np.array_equal(a[1], a[2]) and not np.array_equal(a[0], a[1])


def test_every_stored_copy_replays_from_its_recorded_parameters(built):
    recipe_path, index, _ = built
    recipe = load_recipe(recipe_path)
    items = {it.key: it for it in make_plan(recipe).items}
    ds = precompile.open(index)
    decoded = {}
    for i in range(0, len(ds), 5):  # a spread of originals and copies
        key = ds.keys[i]
        if key not in decoded:
            decoded[key] = decode_item(recipe, items[key], {"decode": 0.0})
        meta = ds.meta(i)
        recs = meta["augment"]
        assert [r["step"] for r in recs] == ["random_resized_crop", "random_flip", "random_affine", "color_jitter",
                                             "gaussian_noise"]
        (again,) = T.replay(recipe.steps, decoded[key], recs)
        stored = ds[i]
        for f in stored:
            assert again.fields[f].tobytes() == stored[f].tobytes(), (i, f)
        assert again.meta == meta
    with pytest.raises(ValueError, match="not 'random_flip'"):
        T.replay(recipe.steps, decoded[ds.keys[0]], [recs[0], recs[2], recs[1], recs[3], recs[4]])


def test_original_copy_is_the_deterministic_counterpart(tmp_path):
    aug = write_recipe(tmp_path, name="rc", copies=2, steps=[
        {"resize": {"shorter": 40}}, {"random_crop": {"size": [32, 32]}}, {"random_flip": {}},
        {"color_jitter": {"brightness": 0.5}}])
    plain = write_recipe(tmp_path, name="cc", copies=0, steps=[
        {"resize": {"shorter": 40}}, {"center_crop": {"size": [32, 32]}}])
    a = precompile.open(build_recipe(aug, out_dir=str(tmp_path / "o"))["output"])
    b = precompile.open(build_recipe(plain, out_dir=str(tmp_path / "o"))["output"])
    rows = np.flatnonzero(a.copies == 0)
    assert np.array_equal(a.batch(rows)["image"], b.batch(range(len(b)))["image"])


def test_copies_zero_augments_once_and_keep_original_false(tmp_path):
    steps = [{"resize": {"size": [24, 24]}}, {"random_flip": {"horizontal": 0.5}},
             {"color_jitter": {"brightness": 0.5}}]
    zero = precompile.open(build_recipe(write_recipe(tmp_path, name="z", copies=0, steps=steps),
                                            out_dir=str(tmp_path / "o"))["output"])
    assert len(zero) == 36 and set(zero.copies.tolist()) == {0}
    factors = {zero.meta(i)["augment"][1]["brightness"] for i in range(len(zero))}
    assert len(factors) == 36  # random steps ran, drawn with copy index 0
    noorig = precompile.open(build_recipe(write_recipe(tmp_path, name="n", copies=3, keep_original=False,
                                                           steps=steps),
                                              out_dir=str(tmp_path / "o"))["output"])
    assert noorig.copies.tolist() == [1, 2, 3] * 36
    # copy 1 of the no-original build is copy 1 of any build with the same seed: draws depend on (seed, key, copy)
    with_orig = precompile.open(build_recipe(write_recipe(tmp_path, name="w", copies=1, steps=steps),
                                                 out_dir=str(tmp_path / "o"))["output"])
    assert np.array_equal(noorig.batch(np.flatnonzero(noorig.copies == 1))["image"],
                          with_orig.batch(np.flatnonzero(with_orig.copies == 1))["image"])


def test_plan_errors_name_the_random_step(tmp_path):
    with pytest.raises(RecipeError, match=r"steps\[1\]\.random_crop: size 64x64 is larger"):
        make_plan(load_recipe(write_recipe(tmp_path, name="big", steps=[{"resize": {"size": [32, 40]}},
                                                                         {"random_crop": {"size": 64}}])))
    with pytest.raises(RecipeError, match=r"steps\[0\]\.color_jitter\.brightness"):
        load_recipe(write_recipe(tmp_path, name="neg", steps=[{"color_jitter": {"brightness": -1}}]))


# ----------------------------------------------------------------------------------------
# the per-epoch copy schedule
# ----------------------------------------------------------------------------------------
def test_epoch_rows_show_every_copy_and_change_each_epoch():
    keys = [f"k{i}" for i in range(50) for _ in range(4)]
    copies = np.tile(np.arange(4), 50)
    picks = []
    for e in range(8):
        rows = epoch_rows(keys, copies, seed=3, epoch=e)
        assert rows.dtype == np.int64 and len(rows) == 50
        assert [keys[r] for r in rows] == [f"k{i}" for i in range(50)]   # first-appearance order
        picks.append(copies[rows])
    picks = np.array(picks)
    assert (picks[1:] != picks[:-1]).all()                          # consecutive epochs differ, wrap included
    for k in range(50):
        assert sorted(picks[:4, k]) == [0, 1, 2, 3]                    # every copy once per 4 epochs
    assert np.array_equal(picks[:4], picks[4:])
    assert len({tuple(picks[:, k]) for k in range(50)}) > 10           # per-key permutations
    other = np.array([copies[epoch_rows(keys, copies, 4, e)] for e in range(4)])
    assert not np.array_equal(other, picks[:4])                        # the seed matters
    assert np.array_equal(epoch_rows(keys, copies, 3, 5), epoch_rows(list(keys), copies.copy(), 3, 5))


def test_epoch_rows_uneven_and_shuffled_rows():
    keys = ["b", "a", "b", "c", "a", "b"]
    copies = np.array([2, 0, 0, 0, 1, 1])
    for e in range(6):
        rows = epoch_rows(keys, copies, 0, e)
        assert [keys[r] for r in rows] == ["b", "a", "c"]
    seen_b = {int(copies[epoch_rows(keys, copies, 0, e)[0]]) for e in range(3)}
    assert seen_b == {0, 1, 2}
    no0 = CopySchedule(keys, copies, 0, include_original=False)
    assert {int(copies[no0.rows(e)[1]]) for e in range(4)} == {1}      # 'a' without its original
    assert int(copies[no0.rows(0)[2]]) == 0                            # 'c' has only its original
    with pytest.raises(ValueError, match="keys but"):
        epoch_rows(keys, copies[:3], 0, 0)


def test_epoch_view_over_a_build(built):
    _, index, _ = built
    ds = precompile.open(index)
    v0, v1 = epoch_view(ds, 0), epoch_view(ds, 1)
    assert len(v0) == 36 and [v0.key(i) for i in range(36)] == list(dict.fromkeys(ds.keys))
    assert all(v0.copy(i) != v1.copy(i) for i in range(36))
    assert np.array_equal(v0[5]["image"], ds[int(v0.rows[5])]["image"])
    b = v1.batch([3, 0, 7])
    assert np.array_equal(b["image"][1], ds[int(v1.rows[0])]["image"])
    assert v1.meta(0) == ds.meta(int(v1.rows[0]))


def test_copies_module_needs_neither_torch_nor_h5py():
    code = ("import sys, numpy as np; from precompile.reader.copies import epoch_rows; "
            "epoch_rows(['a', 'a'], np.array([0, 1]), 0, 1); "
            "assert 'torch' not in sys.modules and 'h5py' not in sys.modules, sorted(sys.modules)")
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("name,params,factory", [
    ("random_flip", {"horizontal": 1.0, "vertical": 1.0}, coord_sample),
    ("random_affine", {"degrees": 30, "scale": [0.5, 2.0], "translate": 0.2}, coord_sample),
    ("color_jitter", {"brightness": 0.5, "contrast": 0.5, "saturation": 0.5}, coord_sample),
    ("gaussian_noise", {"std": 5.0}, coord_sample),
    ("random_flip3d", {"prob": 1.0}, volume_sample),
    ("random_rot90", {"k": [2]}, volume_sample),
    ("elastic", {"magnitude": 3.0}, volume_sample),
    ("random_gain", {"db": [3, 6]}, lambda: Sample("w", {"audio": np.ones((1, 50), np.float32)}, {"audio": "audio"})),
    ("time_shift", {"max_shift": 10}, lambda: Sample("w", {"audio": np.arange(50, dtype=np.float32)[None]},
                                                     {"audio": "audio"})),
])
def test_original_copy_of_pointwise_steps_is_the_input(name, params, factory):
    s = factory()
    (o,) = step(name, **params).run_original(s)
    for f, a in s.fields.items():
        assert o.fields[f].tobytes() == a.tobytes(), f
    assert o.meta["augment"][0]["step"] == name
    (r,) = step(name, **params).run(factory(), rng_for(0, s.key, 1))  # while a drawn copy changes something
    assert any(r.fields[f].tobytes() != a.tobytes() for f, a in s.fields.items())


@pytest.mark.parametrize("name, params", [("random_flip", {"horizontal": 1.0, "vertical": 0.0}),
                                          ("random_crop", {"size": [6, 8]})])
def test_boxes_move_on_the_grid_of_the_fields_the_step_was_given(name, params):
    """A sample whose planar fields differ in size (an 8x12 image and its mask, a 4x6 flow) and untied boxes:
    a step told ``fields: [image, mask, boxes]`` refused ("which one do the boxes annotate?") although the fields
    it moves share one grid, the boxes' (found by helper hfattack). The boxes now move on that grid, exactly as
    the image's pixels do; without ``fields:`` the sizes still differ and the step says so."""
    img = np.zeros((8, 12, 1), np.uint8)
    img[2:4, 1:5] = 255   # the box's own pixels
    boxes = np.array([[1, 2, 5, 4]], np.float32)
    s = Sample("k", {"image": img, "mask": img.copy(), "flow": np.zeros((4, 6, 2), np.float32), "boxes": boxes},
               {"image": "image", "mask": "mask", "flow": "flow", "boxes": "boxes"})
    (out,) = step(name, fields=["image", "mask", "boxes"], **params).run(s, rng_for(3, "k", 1))
    ys, xs = np.nonzero(out.fields["image"][..., 0])
    np.testing.assert_array_equal(out.fields["boxes"], [[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]])
    assert out.fields["flow"].shape == (4, 6, 2)   # not moved
    with pytest.raises(StepError, match=r"fields differ in size \(image 8x12, mask 8x12, flow 4x6\)"):
        step(name, **params).run(s, rng_for(3, "k", 1))   # (every field: which size? a random_crop asks first)
