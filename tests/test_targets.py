"""Detection targets as models take them (issue 35): ``Loader(..., targets="list")`` and
``precompile.collate(ds)`` (a plain DataLoader over ``precompile.open``).

torchvision is not installable here, so the dicts are held to the contract its detection models document
(``torchvision.models.detection.fasterrcnn_resnet50_fpn`` / ``maskrcnn_resnet50_fpn`` /
``keypointrcnn_resnet50_fpn``: in training, a list of one dict per image with ``boxes`` FloatTensor[N, 4]
``x1, y1, x2, y2``, ``labels`` Int64Tensor[N], ``masks`` UInt8Tensor[N, H, W], ``keypoints`` FloatTensor[N, K, 3]
``x, y, visibility``), and sample by sample to the Loader's own padded batch and to ``precompile.open(...)[i]``,
including images left with zero boxes after the Loader's device random_crop and random_flip."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import precompile
from precompile import Loader
from precompile import build as run_build
from precompile.errors import ShapeMismatchError
from precompile.reader.ragged import count_name

from annotated_decoder import K  # noqa: F401  (registers the test decoders)
from test_annotation_builds import make_inputs, make_instance_inputs, recipe

H, W = 64, 96


@pytest.fixture(scope="module")
def det_build(tmp_path_factory):
    """23 samples with boxes, box_labels, keypoints (sample 0 has none); no instance mask."""
    tmp = tmp_path_factory.mktemp("det")
    make_inputs(str(tmp / "in"), n=23)
    return run_build(recipe(tmp, "hdf5"), out_dir=str(tmp / "out"))["output"]


@pytest.fixture(scope="module")
def inst_build(tmp_path_factory):
    """9 64x96 images, up to 12 painted rectangles each, their uint16 instance mask tied to the boxes."""
    tmp = tmp_path_factory.mktemp("inst")
    make_instance_inputs(str(tmp / "in"))
    return run_build(inst_recipe(tmp / "in", "hdf5"), out_dir=str(tmp / "out"))["output"]


def check_contract(t: dict, hw: tuple[int, int] | None, k: int = 3) -> int:
    """torchvision's documented detection target: the dtypes and shapes of one image's dict; returns N."""
    n = t["boxes"].shape[0]
    assert t["boxes"].dtype == torch.float32 and t["boxes"].shape == (n, 4)
    assert t["labels"].dtype == torch.int64 and t["labels"].shape == (n,)
    assert t["keypoints"].dtype == torch.float32 and t["keypoints"].shape == (n, k, 3)
    if hw is not None:
        assert t["masks"].dtype == torch.uint8 and t["masks"].shape == (n, *hw)
        assert set(torch.unique(t["masks"]).tolist()) <= {0, 1}
    else:
        assert "masks" not in t
    assert torch.isfinite(t["boxes"]).all() and torch.isfinite(t["keypoints"]).all()   # no padding left in
    # GeneralizedRCNN refuses boxes without positive width and height (these inputs have none at the build)
    assert (t["boxes"][:, 2] > t["boxes"][:, 0]).all() and (t["boxes"][:, 3] > t["boxes"][:, 1]).all()
    return n


def padded_target(batch: dict, j: int, mask: str | None) -> dict[str, np.ndarray]:
    """Sample j of a padded batch, cut to its count: the reference the dicts must equal."""
    n = int(batch[count_name("boxes")][j])
    out = {"boxes": batch["boxes"][j, :n].numpy(), "labels": batch["box_labels"][j, :n].numpy(),
           "keypoints": batch["keypoints"][j, :n].numpy()}
    if mask is not None:
        ids = batch[mask][j].numpy()[..., 0]
        out["masks"] = (ids[None] == np.arange(1, n + 1)[:, None, None]).astype(np.uint8)
    return out


def assert_target_equal(t: dict, want: dict[str, np.ndarray], msg: str) -> None:
    assert set(t) == set(want), msg
    for k, v in want.items():
        got = t[k].numpy()
        assert got.shape == v.shape, f"{msg}: {k} {got.shape} != {v.shape}"
        np.testing.assert_array_equal(got, v.astype(got.dtype), err_msg=f"{msg}: {k}")


STEPS = [{"random_crop": {"size": [24, 40], "min_visibility": 0.3}},
         {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": [[0, 1]]}}]


def test_loader_targets_list_equal_the_padded_batch_after_device_steps(inst_build):
    """Two Loaders alike but for targets: each image's dict is its padded rows cut to its count, the masks
    ``instances == r + 1`` of the batch's (renumbered) instance mask, through a crop that drops boxes (some
    images to zero) and a flip that moves them; the padded fields and their counts are gone from the batch."""
    kw = dict(batch_size=4, shuffle=True, seed=5, device="cpu", gpu_steps=STEPS, num_threads=0)
    padded, listed = Loader(inst_build, **kw), Loader(inst_build, targets="list", **kw)
    ds = precompile.open(inst_build)
    empty = dropped = 0
    for epoch in (0, 1):
        padded.set_epoch(epoch)
        listed.set_epoch(epoch)
        for b, (p, got) in enumerate(zip(padded, listed, strict=True)):
            assert set(got) == {"image", "instances", "targets"}, sorted(got)
            assert torch.equal(got["image"], p["image"]) and torch.equal(got["instances"], p["instances"])
            assert isinstance(got["targets"], list) and len(got["targets"]) == len(p["image"])
            rows = listed.batch_indices(epoch)[b]
            for j, t in enumerate(got["targets"]):
                n = check_contract(t, (24, 40))
                assert_target_equal(t, padded_target(p, j, "instances"), f"epoch {epoch} batch {b} sample {j}")
                empty += n == 0
                dropped += len(ds[int(rows[j])]["boxes"]) - n
    assert empty and dropped   # the steps left some images without boxes, and dropped boxes of others


def test_loader_targets_list_equal_precompile_open(inst_build, det_build):
    """Without device steps, each dict holds exactly ``precompile.open(...)[i]``'s rows (image 0 of the
    det build: zero boxes); a build without an instance mask gives no ``masks``."""
    for path, mask in ((inst_build, "instances"), (det_build, None)):
        ds = precompile.open(path)
        loader = Loader(path, batch_size=5, shuffle=True, seed=1, device="cpu", targets="list", num_threads=0)
        seen, zero = 0, 0
        for b, batch in enumerate(loader):
            for j, (i, t) in enumerate(zip(loader.batch_indices(0)[b], batch["targets"], strict=True)):
                s = ds[int(i)]
                hw = s[mask].shape[:2] if mask else None
                zero += check_contract(t, hw) == 0
                want = {"boxes": s["boxes"], "labels": s["box_labels"], "keypoints": s["keypoints"]}
                if mask:
                    ids = s[mask][..., 0]
                    want["masks"] = (ids[None] == np.arange(1, len(s["boxes"]) + 1)[:, None, None]).astype(np.uint8)
                assert_target_equal(t, want, f"{path} row {i}")
                seen += 1
        assert seen == len(ds)
        if mask is None:
            assert zero >= 1   # sample 0


def test_plain_dataloader_with_precompile_collate_pads_like_the_loader(det_build):
    """torch's default collate cannot stack ragged boxes; ``precompile.collate(ds)`` pads them as the Loader
    does (NaN / -1 past a sample's rows, ``<field>__count``), batch for batch equal to an unshuffled Loader's,
    in worker processes too."""
    ds = precompile.open(det_build)
    with pytest.raises(RuntimeError):   # the issue: every user met this
        next(iter(DataLoader(ds, batch_size=5)))
    ref = list(Loader(det_build, batch_size=5, shuffle=False, device="cpu", num_threads=0))
    for workers in (0, 1):
        got = list(DataLoader(ds, batch_size=5, collate_fn=precompile.collate(ds), num_workers=workers))
        assert len(got) == len(ref)
        for b, (g, r) in enumerate(zip(got, ref)):
            assert set(g) == set(r), (sorted(g), sorted(r))
            for k in r:
                assert g[k].dtype == r[k].dtype and g[k].shape == r[k].shape, (b, k)
                np.testing.assert_array_equal(g[k].numpy(), r[k].numpy(), err_msg=f"batch {b} {k}")


def test_collate_targets_list_equals_the_loaders(inst_build, det_build):
    """``precompile.collate(ds, targets="list")``: the same dicts as ``Loader(targets="list")``."""
    for path in (inst_build, det_build):
        ds = precompile.open(path)
        ref = list(Loader(path, batch_size=4, shuffle=False, device="cpu", targets="list", num_threads=0))
        got = list(DataLoader(ds, batch_size=4, collate_fn=precompile.collate(ds, targets="list")))
        for b, (g, r) in enumerate(zip(got, ref, strict=True)):
            assert set(g) == set(r), (sorted(g), sorted(r))
            for k in r:
                if k != "targets":
                    assert torch.equal(g[k], r[k]), (b, k)
            for j, (tg, tr) in enumerate(zip(g["targets"], r["targets"], strict=True)):
                assert_target_equal(tg, {k: v.numpy() for k, v in tr.items()}, f"{path} batch {b} sample {j}")


def inst_recipe(root, fmt: str) -> dict:
    return {"name": "inst", "seed": 1, "inputs": {"root": str(root), "match": "{label}/{name}.npz",
                                                  "fields": {"image": {"decoder": "_instances_test"}}},
            "steps": [{"resize": {"size": [H, W]}}], "output": {"format": fmt, "samples_per_shard": 4}}


@pytest.mark.parametrize("kind", ["det", "inst"])
def test_collate_over_a_folder_build_equals_the_hdf5_build(tmp_path, kind):
    """A PNG-folder build's images and instance masks are read-only arrays: the collate copies them (torch's
    default collate and ``torch.from_numpy`` warn, an error under this suite's warnings-as-errors), and its
    batches and dicts equal those of the HDF5 build of the same recipe."""
    if kind == "det":
        make_inputs(str(tmp_path / "in"), n=7)
    else:
        make_instance_inputs(str(tmp_path / "in"), n=5)
    got = {}
    for fmt in ("png", "hdf5"):
        r = recipe(tmp_path, fmt) if kind == "det" else inst_recipe(tmp_path / "in", fmt)
        ds = precompile.open(run_build(r, out_dir=str(tmp_path / fmt))["output"])
        got[fmt] = [list(DataLoader(ds, batch_size=3, collate_fn=precompile.collate(ds, targets=t))) for t in (None, "list")]
    for padded, listed in zip(*[got[f] for f in ("png", "hdf5")], strict=True):
        for b, (x, y) in enumerate(zip(padded, listed, strict=True)):
            assert set(x) == set(y)
            for k in x:
                if k == "targets":
                    for j, (tx, ty) in enumerate(zip(x[k], y[k], strict=True)):
                        assert_target_equal(tx, {kk: v.numpy() for kk, v in ty.items()}, f"batch {b} sample {j}")
                else:
                    assert x[k].dtype == y[k].dtype
                    np.testing.assert_array_equal(x[k].numpy(), y[k].numpy(), err_msg=f"batch {b} {k}")


def test_collate_names_the_field_of_samples_that_cannot_stack(tmp_path):
    make_inputs(str(tmp_path / "in"), n=3)
    r = {"name": "raw", "inputs": {"root": str(tmp_path / "in"), "match": "{label}/{name}.npz",
                                   "fields": {"image": {"decoder": "_annotations_test"}}},
         "output": {"format": "hdf5"}}
    ds = precompile.open(run_build(r, out_dir=str(tmp_path / "out"))["output"])
    shapes = [ds[i]["image"].shape for i in range(2)]
    want = (f"field 'image': cannot stack samples of different shapes {shapes[0]} (batch position 0) and "
            f"{shapes[1]} (batch position 1)")
    with pytest.raises(ShapeMismatchError, match=re.escape(want)):
        precompile.collate(ds)([ds[0], ds[1]])
    with pytest.raises(TypeError, match=r"collate_fn=precompile.collate\(ds\)"):
        precompile.collate([ds[0]])


def test_targets_are_refused_where_they_cannot_be_made(inst_build, det_build):
    with pytest.raises(ValueError, match="targets must be None .* or 'list'.*got 'dict'"):
        Loader(det_build, batch_size=2, device="cpu", targets="dict")
    with pytest.raises(ValueError, match=r"one boxes field; none is loaded \(loaded: image\)"):
        Loader(det_build, batch_size=2, device="cpu", targets="list", fields=["image"])
    with pytest.raises(ValueError, match=r"convert_fields: 'instances' is a mask field \(class or instance ids\), "
                                         r"which the conversion .* leave 'instances' out"):
        Loader(inst_build, batch_size=2, device="cpu", targets="list", dtype="float32",
               convert_fields=["image", "instances"])
    with pytest.raises(ValueError, match=r"one boxes field; none is loaded \(loaded: image\)"):
        precompile.collate(precompile.open(det_build, fields=["image"]), targets="list")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
def test_cuda_targets_equal_the_cpu_targets(inst_build):
    """On CUDA (the ring, and the fields resident on the device) the dicts are on the device and equal the CPU
    Loader's, the binary masks made from the uint16 instance mask there included."""
    kw = dict(batch_size=4, shuffle=True, seed=5, gpu_steps=STEPS, targets="list")
    cpu = list(Loader(inst_build, device="cpu", num_threads=0, **kw))
    for extra in ({}, {"in_memory": "gpu"}):
        got = list(Loader(inst_build, device="cuda", **kw, **extra))
        for b, (x, y) in enumerate(zip(cpu, got, strict=True)):
            for j, (tx, ty) in enumerate(zip(x["targets"], y["targets"], strict=True)):
                assert set(tx) == set(ty) == {"boxes", "labels", "masks", "keypoints"}
                for k in tx:
                    assert ty[k].device.type == "cuda" and ty[k].dtype == tx[k].dtype, (extra, b, j, k)
                    assert torch.equal(ty[k].cpu(), tx[k]), (extra, b, j, k)
