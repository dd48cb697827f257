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
from precompile.decoders.base import Decoder
from precompile.registry import DECODERS, STEPS, load_builtins
from precompile.sample import FieldSpec, Sample
from precompile.transforms.base import replay

load_builtins()

K = 3
STEP_LIST = [{"resize": {"size": [40, 48]}},
             {"random_crop": {"size": [32, 32], "padding": 4, "min_visibility": 0.3}},
             {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}}]


class _Annotated(Decoder):
    """Test decoder: an .npz (no pickles) -> an image and its boxes, labels and keypoints."""

    name = "_annotations_test"
    kind = "image"

    def output_specs(self, field):
        return {field: FieldSpec("image", (None, None, 3), "uint8"),
                "boxes": FieldSpec("boxes", (None, 4), "float32"),
                "box_labels": FieldSpec("box_labels", (None,), "int64", of="boxes"),
                "keypoints": FieldSpec("keypoints", (None, K, 3), "float32", of="boxes")}

    def decode(self, path, field):
        with np.load(path, allow_pickle=False) as z:
            return {field: z["image"], "boxes": z["boxes"], "box_labels": z["box_labels"],
                    "keypoints": z["keypoints"]}, {}


if _Annotated.name not in DECODERS:
    DECODERS.register()(_Annotated)


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
