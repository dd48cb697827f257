"""Boxes, box_labels and keypoints through a real build: ragged storage round trips in HDF5 and the
folder formats (0 rows included), the stored rows equal the steps replayed from their records, and
a build is byte-identical for any worker count."""
from __future__ import annotations

import os

import numpy as np
import pytest
import yaml

import precompile
from precompile import build as run_build
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.transforms.base import replay

from annotated_decoder import K   # registers the test decoder; a build's workers import that module, not this one

load_builtins()

STEP_LIST = [{"resize": {"size": [40, 48]}},
             {"random_crop": {"size": [32, 32], "padding": 4, "min_visibility": 0.3}},
             {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}}]


def make_inputs(root: str, n: int = 7) -> dict[str, dict[str, np.ndarray]]:
    """n samples of random sizes; sample 0 has no boxes at all."""
    rng = np.random.default_rng(4)
    out = {}
    os.makedirs(os.path.join(root, "a"), exist_ok=True)
    for k in range(n):
        h, w = int(rng.integers(30, 50)), int(rng.integers(30, 60))
        m = 0 if k == 0 else int(rng.integers(1, 6))
        x1, y1 = rng.uniform(0, w - 4, m), rng.uniform(0, h - 4, m)
        x2, y2 = x1 + rng.uniform(1, w - x1), y1 + rng.uniform(1, h - y1)
        boxes = np.stack([x1, y1, x2, y2], 1).astype(np.float32).reshape(-1, 4)
        kp = np.concatenate([rng.uniform(0, 1, (m, K, 2)) * [w, h], rng.integers(0, 3, (m, K, 1))], -1)
        arrays = {"image": rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "boxes": boxes,
                  "box_labels": rng.integers(0, 4, m).astype(np.int64), "keypoints": kp.astype(np.float32)}
        key = f"a/s{k}.npz"
        np.savez(os.path.join(root, key), **arrays)
        out[key] = arrays
    return out


def recipe(tmp_path, fmt: str = "hdf5") -> str:
    r = {"name": "det", "seed": 3, "inputs": {"root": str(tmp_path / "in"), "match": "{label}/{name}.npz",
                                              "fields": {"image": {"decoder": "_annotations_test"}}},
         "steps": STEP_LIST, "output": {"format": fmt, "samples_per_shard": 3}}
    p = tmp_path / f"det-{fmt}.yaml"
    p.write_text(yaml.safe_dump(r))
    return str(p)


def _steps():
    return [STEPS.get(n)(STEPS.get(n).Params.model_validate(p)) for d in STEP_LIST for n, p in d.items()]


@pytest.mark.parametrize("fmt", ["hdf5", "png", "bmp"])
def test_annotations_round_trip_and_equal_the_replayed_steps(tmp_path, fmt):
    src = make_inputs(str(tmp_path / "in"))
    rep = run_build(recipe(tmp_path, fmt), out_dir=str(tmp_path / "out"))
    ds = precompile.open(rep["output"])
    assert len(ds) == len(src)
    for name, shape in (("boxes", [None, 4]), ("box_labels", [None]), ("keypoints", [None, K, 3])):
        assert list(ds.field_specs[name]["shape"]) == shape, (name, ds.field_specs[name])
    assert ds.field_specs["box_labels"].get("of") == "boxes" and ds.field_specs["keypoints"].get("of") == "boxes"
    dropped = 0
    for i in range(len(ds)):
        got, key = ds[i], ds.key(i)
        a = src[key]
        fresh = Sample(key, dict(a), {"image": "image", "boxes": "boxes", "box_labels": "box_labels",
                                      "keypoints": "keypoints"})
        (want,) = replay(_steps(), fresh, ds.meta(i)["augment"])
        for f in ("boxes", "box_labels", "keypoints"):
            assert got[f].dtype == want.fields[f].dtype, f
            np.testing.assert_array_equal(got[f], want.fields[f], err_msg=f"{fmt} {key} {f}")
        np.testing.assert_array_equal(got["image"], want.fields["image"])
        assert len(got["boxes"]) == len(got["box_labels"]) == len(got["keypoints"])
        dropped += len(a["boxes"]) - len(got["boxes"])
    assert ds[[ds.key(i) for i in range(len(ds))].index("a/s0.npz")]["boxes"].shape == (0, 4)
    assert dropped > 0   # the crops dropped some boxes: the tie was exercised


def test_annotation_build_is_byte_identical_for_any_worker_count(tmp_path):
    make_inputs(str(tmp_path / "in"))
    outs = []
    for workers in (1, 2):
        rep = run_build(recipe(tmp_path, "hdf5"), out_dir=str(tmp_path / f"out{workers}"), n_jobs=workers)
        ds = precompile.open(rep["output"])
        outs.append([(ds.key(i), {f: a.tobytes() for f, a in ds[i].items()}) for i in range(len(ds))])
    assert outs[0] == outs[1]


# -- the Loader: padded tensors + counts; device steps move annotations like the build -------------
import torch  # noqa: E402  (the reader side only)

from precompile import Loader  # noqa: E402
from precompile.reader import feed, gpu  # noqa: E402
from precompile.reader.ragged import count_name  # noqa: E402

from test_loader_device import FakeRing  # noqa: E402

NOTES = ("boxes", "box_labels", "keypoints")


@pytest.fixture(scope="module")
def det_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("det")
    make_inputs(str(tmp / "in"), n=23)
    return run_build(recipe(tmp, "hdf5"), out_dir=str(tmp / "out"))["output"]


def _padded_rows(batch, name):
    a, n = batch[name].numpy(), batch[count_name(name)].numpy()
    pad = np.isnan(a[~_row_mask(n, a.shape)]).all() if a.dtype.kind == "f" else (a[~_row_mask(n, a.shape)] == -1).all()
    assert pad, f"{name}: padding is not NaN / -1"
    assert a.shape[1] == max(1, int(n.max())), f"{name}: padded to {a.shape[1]}, largest count {n.max()}"
    return [a[i, :int(n[i])] for i in range(len(n))]


def _row_mask(n, shape):
    m = np.zeros(shape[:2], bool)
    for i, c in enumerate(n):
        m[i, :int(c)] = True
    return m


def test_loader_gives_padded_annotations_and_counts(det_build):
    ds = precompile.open(det_build)
    loader = Loader(det_build, batch_size=5, shuffle=True, seed=2, device="cpu", num_threads=0)
    seen = 0
    for b, batch in enumerate(loader):
        rows = loader.batch_indices(0)[b]
        assert batch["boxes"].dtype == torch.float32 and batch["box_labels"].dtype == torch.int64
        assert batch[count_name("boxes")].dtype == torch.int64 and batch[count_name("boxes")].shape == (len(rows),)
        for name in NOTES:
            for i, r in zip(rows, _padded_rows(batch, name)):
                np.testing.assert_array_equal(r, ds[int(i)][name], err_msg=f"{name} row {i}")
        np.testing.assert_array_equal(batch["image"].numpy(), np.stack([ds[int(i)]["image"] for i in rows]))
        seen += len(rows)
    assert seen == len(ds)


def _build_replay(ds, rows, steps, params):
    """The build steps' own rules, sample by sample, with the device steps' drawn parameters."""
    out = []
    for j, i in enumerate(rows):
        s = ds[int(i)]
        sample = Sample(ds.key(int(i)), {f: s[f] for f in ("image", *NOTES)},
                        {"image": "image", **{f: f for f in NOTES}})
        for step, p in zip(steps, params):
            one = {k: (bool(v[j]) if v.dtype == bool else int(v[j])) for k, v in p.items()}
            sample = step.step.replay(sample, one)
        out.append(sample)
    return out


@pytest.mark.parametrize("threads", [0, 2])
def test_device_steps_move_annotations_like_the_build_on_cpu_and_ring(det_build, threads, monkeypatch):
    ds = precompile.open(det_build)
    gpu_steps = [{"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}},
                 {"random_crop": {"size": [20, 24], "padding": 2, "min_visibility": 0.4}}]
    kw = dict(batch_size=4, shuffle=True, seed=5, device="cpu", gpu_steps=gpu_steps, num_threads=threads)
    loader = Loader(det_build, **kw)
    got = list(loader)
    monkeypatch.setattr(feed, "GROUP_BYTES", 3 * 4 * (32 * 32 * 3 + 8))   # tasks of 3 batches, split + trimmed
    ringed = Loader(det_build, **kw)
    ringed.feeder = ringed.make_feeder(make_ring=FakeRing)
    dropped = 0
    for b, (batch, other) in enumerate(zip(got, list(ringed))):
        rows = loader.batch_indices(0)[b]
        params = gpu.step_params(loader.steps, loader.seed, 0, 0, b, len(rows))
        want = _build_replay(ds, rows, loader.steps, params)
        for name in NOTES:
            assert torch.equal(batch[count_name(name)], other[count_name(name)])
            assert torch.equal(batch[name].nan_to_num(-7), other[name].nan_to_num(-7)), f"ring != cpu: {name}"
            for j, r in enumerate(_padded_rows(batch, name)):
                np.testing.assert_array_equal(r, want[j].fields[name], err_msg=f"batch {b} sample {j} {name}")
        np.testing.assert_array_equal(batch["image"].numpy(), np.stack([w.fields["image"] for w in want]))
        dropped += sum(len(ds[int(i)]["boxes"]) for i in rows) - int(batch[count_name("boxes")].sum())
    assert dropped > 0


def test_device_steps_refuse_annotations_without_a_grid(det_build):
    with pytest.raises(ValueError, match="random_flip: boxes and keypoints move on the grid of the image fields"):
        Loader(det_build, batch_size=4, device="cpu",
               gpu_steps=[{"random_flip": {"fields": ["boxes"], "flip_pairs": []}}])
    with pytest.raises(ValueError, match="random_flip: keypoints field 'keypoints': a mirror swaps left and right"):
        Loader(det_build, batch_size=4, device="cpu", gpu_steps=[{"random_flip": {}}])


# -- preview and stats ------------------------------------------------------------------------------
def test_stats_count_boxes_per_class(det_build):
    from precompile.tools.stats import box_counts, compute_stats, describe

    ds = precompile.open(det_build)
    res = compute_stats(det_build, fields=["box_labels", "boxes"])
    every = np.concatenate([ds[i]["box_labels"] for i in range(len(ds))])
    want = {str(v): int(c) for v, c in zip(*np.unique(every, return_counts=True))}
    assert box_counts(res) == {"box_labels": want}
    b = res["fields"]["boxes"]   # x1, y1, x2, y2 as 4 channels
    allb = np.concatenate([ds[i]["boxes"] for i in range(len(ds))])
    assert b["channels"] == 4 and b["count"] == [len(allb)] * 4
    np.testing.assert_allclose(b["mean"], allb.astype(np.float64).mean(0), rtol=1e-9)
    assert "classes " in describe(res)


def test_draw_annotations_outlines_boxes_in_their_class_colour_and_dots_keypoints():
    from precompile.tools.preview import PALETTE, draw_annotations

    rgb = np.zeros((16, 16, 3), np.uint8)
    boxes = np.array([[2, 3, 10, 12]], np.float32)
    kp = np.array([[[5.5, 8.5, 2], [12.5, 2.5, 0]]], np.float32)
    pic = draw_annotations(rgb, boxes, np.array([4]), ["a", "b", "c", "d", "cat"], kp, min_side=160)
    s = 10   # 16 px -> 160
    colour = PALETTE[1 + 4 % (len(PALETTE) - 1)]
    assert tuple(pic[3 * s + 20, 2 * s]) == colour and tuple(pic[12 * s - 1, 5 * s]) == colour   # left, bottom edge
    assert tuple(pic[3 * s, 6 * s]) == colour and tuple(pic[7 * s, 10 * s - 1]) == colour        # top, right edge
    assert tuple(pic[int(8.5 * s), int(5.5 * s)]) == colour                                       # a visible keypoint
    assert not pic[int(2.5 * s) - 4:int(2.5 * s) + 4, int(12.5 * s) - 4:int(12.5 * s) + 4].any()   # visibility 0: none
    assert not pic[:, 11 * s:].any() or not pic[13 * s:, :].any()                                 # nothing outside
    plain = draw_annotations(rgb, boxes, None, [], None, min_side=160)
    inside = (slice(3 * s + 2, 3 * s + 16), slice(2 * s + 2, 2 * s + 40))
    assert pic[inside].any() and not plain[inside].any()    # the class name is written inside the box's corner


def test_preview_draws_the_boxes_panel(det_build):
    from precompile.tools.preview import render

    p = render(det_build, n=3)
    fields = [b["field"] for b in p.panels]
    assert "boxes" in fields and "box_labels" not in fields and "keypoints" not in fields
    again = render(det_build, n=3, fields=["boxes"])
    assert {b["field"] for b in again.panels} == {"boxes"}
    assert np.array_equal(render(det_build, n=3).sheet, p.sheet)   # deterministic
