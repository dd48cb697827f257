"""Every field kind keeps its meaning through a real build and read, and a kind a step or decoder
cannot handle is refused at plan time.

- the Loader's device steps flip and crop a flow (negating u) with its frames;
- a stored ``flow_valid`` equals the finite vectors of the stored ``flow`` after resize,
  random_resized_crop and random_affine;
- random 3D steps move a ``volume_mask`` (a lung mask) with its CT;
- multi-class label maps are moved by nearest neighbour only (never blended), and the ``mask``
  decoder checks, remaps and reads 16-bit maps;
- a PALETTE COLOR DICOM is refused naming the file; MONOCHROME1 is flagged or inverted;
- a step that matches no field, or cannot handle one, and a folder decoder on file inputs are plan errors.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
import torch
import yaml
from PIL import Image

import precompile
from precompile import build
from precompile.decoders.dicom import DicomDecoder
from precompile.decoders.flo import write_flo
from precompile.errors import DecodeError, RecipeError
from precompile.compiler.plan import make_plan
from precompile.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data"


def write(path: Path, recipe: dict) -> str:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def flow_tree(root: Path, n: int = 3, H: int = 36, W: int = 44) -> Path:
    """Frame pairs with flow fields that have blocks of unknown (NaN) vectors."""
    root.mkdir(parents=True)
    r = np.random.default_rng(5)
    for i in range(n):
        for k in (1, 2):
            Image.fromarray(r.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(root / f"p{i}_img{k}.png")
        flow = r.normal(0, 2, (H, W, 2)).astype(np.float32)
        flow[5 + i:14 + i, 7:19] = np.nan
        flow[20:23, 30 - i:41] = np.nan
        write_flo(str(root / f"p{i}_flow.flo"), flow)
    return root


def flow_recipe(root: Path, steps: list, copies: int = 0) -> dict:
    return {"name": "flow", "seed": 3, "copies": copies,
            "inputs": {"root": str(root), "match": "{name}_img1.png",
                       "fields": {"img1": {"decoder": "image"}, "img2": {"decoder": "image", "path": "{name}_img2.png"},
                                  "flow": {"decoder": "flo", "valid_mask": True, "path": "{name}_flow.flo"}}},
            "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 2}}


# 1 --------------------------------------------------------------------------------------------
def test_loader_device_steps_flip_and_crop_flow_with_the_frames(tmp_path):
    src = flow_tree(tmp_path / "data")
    build(write(tmp_path / "r.yaml", flow_recipe(src, [{"resize": {"size": [32, 48]}}])), out_dir=str(tmp_path / "o"))
    out = str(tmp_path / "o" / "flow.h5")
    ds = precompile.open(out)
    assert ds.field_specs["flow_valid"]["kind"] == "flow_valid" and ds.field_specs["flow_valid"]["of"] == "flow"
    flip = precompile.Loader(out, batch_size=2, shuffle=False, device="cpu",
                             gpu_steps=[{"random_flip": {"horizontal": 1.0}}])
    for b, i in zip(flip, flip.batch_indices()):
        ref = ds.batch(i)
        np.testing.assert_array_equal(b["img1"].numpy(), ref["img1"][:, :, ::-1])
        np.testing.assert_array_equal(b["flow"].numpy(), ref["flow"][:, :, ::-1] * np.float32([-1, 1]))
        np.testing.assert_array_equal(b["flow_valid"].numpy(), ref["flow_valid"][:, :, ::-1])
    crop = precompile.Loader(out, batch_size=2, shuffle=False, device="cpu",
                             gpu_steps=[{"random_crop": {"size": [16, 16]}}])
    for b in crop:
        assert b["img1"].shape[1:3] == b["img2"].shape[1:3] == b["flow"].shape[1:3] == b["flow_valid"].shape[1:3] == (16, 16)
        assert torch.equal(b["flow_valid"][..., 0].bool(), torch.isfinite(b["flow"]).all(-1))


# 2 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [
    [{"resize": {"size": [20, 30]}}],
    [{"random_resized_crop": {"size": [24, 24], "scale": [0.2, 1.0]}}],
    [{"random_affine": {"degrees": 30, "scale": [0.7, 1.3], "translate": 0.2}}],
], ids=["resize", "random_resized_crop", "random_affine"])
def test_stored_flow_valid_equals_the_finite_flow(tmp_path, steps):
    src = flow_tree(tmp_path / "data")
    random = any(next(iter(s)).startswith("random_") for s in steps)
    build(write(tmp_path / "r.yaml", flow_recipe(src, steps, copies=3 if random else 0)), out_dir=str(tmp_path / "o"))
    ds = precompile.open(str(tmp_path / "o" / "flow.h5"))
    assert len(ds) == (12 if random else 3)
    mixed = 0
    for i in range(len(ds)):
        s = ds[i]
        finite = np.isfinite(s["flow"]).all(-1)
        np.testing.assert_array_equal(s["flow_valid"][..., 0], finite.astype(np.uint8), err_msg=ds.key(i))
        mixed += bool(finite.any() and not finite.all())
    assert mixed >= len(ds) // 2  # the unknown blocks survived the steps: the check had something to check


# 3 --------------------------------------------------------------------------------------------
def ct_recipe(step: dict) -> dict:
    return {"name": "ct", "seed": 1, "copies": 2, "keep_original": True,
            "inputs": {"root": str(SAMPLE / "dicom"), "match": "{series}", "kind": "dir",
                       "fields": {"ct": {"decoder": "dicom_series"}}},
            "steps": [{"resample_volume": {"shape": [16, 24, 24]}}, {"lung_mask": {"out": "lung"}}, step],
            "output": {"format": "hdf5", "samples_per_shard": 3}}


@pytest.mark.parametrize("step", [{"random_flip3d": {"prob": 1.0, "axes": [2]}},
                                  {"random_rot90": {"k": [2], "planes": [[1, 2]]}},
                                  {"elastic": {"magnitude": 2.0}}], ids=lambda s: next(iter(s)))
def test_random_3d_steps_move_the_lung_mask_with_its_ct(tmp_path, step):
    build(write(tmp_path / "r.yaml", ct_recipe(step)), out_dir=str(tmp_path / "o"))
    ds = precompile.open(str(tmp_path / "o" / "ct.h5"))
    by_key: dict[str, dict[int, dict]] = {}
    for i in range(len(ds)):
        by_key.setdefault(ds.key(i), {})[int(ds.copies[i])] = ds[i]
    for key, copies in by_key.items():
        orig = copies[0]
        assert orig["lung"].sum() > 50
        for c in (1, 2):
            aug = copies[c]
            assert set(np.unique(aug["lung"])) <= {0, 1}
            if "random_flip3d" in step:
                np.testing.assert_array_equal(aug["lung"], orig["lung"][:, :, ::-1])
            elif "random_rot90" in step:
                np.testing.assert_array_equal(aug["lung"], np.rot90(orig["lung"], 2, axes=(1, 2)))
            # the mask still marks the air of the moved CT (the lung is air: below -320 HU)
            inside = aug["ct"][aug["lung"] > 0]
            assert np.mean(inside < -320) > 0.9, (key, c)


# 4 --------------------------------------------------------------------------------------------
def seg_tree(root: Path, ids=(0, 3, 7, 15), bits: int = 8) -> Path:
    (root / "img").mkdir(parents=True)
    (root / "seg").mkdir()
    r = np.random.default_rng(2)
    for i in range(3):
        Image.fromarray(r.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        lab = np.asarray(ids)[r.integers(0, len(ids), (6, 8))].repeat(5, 0).repeat(5, 1)
        if bits == 8:
            Image.fromarray(lab.astype(np.uint8), mode="L").save(root / "seg" / f"{i}.png")
        else:
            Image.fromarray(lab.astype(np.uint16)).save(root / "seg" / f"{i}.png")
    return root


def seg_recipe(root: Path, mask: dict, steps: list) -> dict:
    return {"name": "seg", "seed": 0, "copies": 2 if any("random_" in next(iter(s)) for s in steps) else 0,
            "inputs": {"root": str(root), "match": "img/{n}.png",
                       "fields": {"image": {"decoder": "image"}, "mask": {"decoder": "mask", "path": "seg/{n}.png", **mask}}},
            "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 4}}


STEPS_2D = [{"resize": {"size": [23, 31]}}, {"random_affine": {"degrees": 20, "scale": [0.8, 1.2]}},
            {"random_resized_crop": {"size": [16, 16], "scale": [0.3, 1.0]}}]


def test_multiclass_masks_are_never_blended(tmp_path):
    src = seg_tree(tmp_path / "d")
    path = write(tmp_path / "r.yaml", seg_recipe(src, {"classes": [0, 3, 7, 15]}, STEPS_2D))
    plan = make_plan(load_recipe(path))
    assert plan.specs["mask"].kind == "mask" and plan.specs["mask"].classes == 4
    assert plan.specs["mask"].class_ids == (0, 3, 7, 15)
    build(path, out_dir=str(tmp_path / "o"))
    ds = precompile.open(str(tmp_path / "o" / "seg.h5"))
    assert ds.field_specs["mask"]["classes"] == 4 and ds.field_specs["mask"]["class_ids"] == [0, 3, 7, 15]
    values = set()
    for i in range(len(ds)):
        values |= set(np.unique(ds[i]["mask"]).tolist())
    assert values <= {0, 3, 7, 15} and len(values) == 4
    # the same maps decoded as a grey image blend classes: the reason the mask kind exists
    grey = seg_recipe(src, {}, STEPS_2D)
    grey["inputs"]["fields"]["mask"] = {"decoder": "image", "mode": "gray8", "path": "seg/{n}.png"}
    build(write(tmp_path / "g.yaml", grey), out_dir=str(tmp_path / "g"))
    g = precompile.open(str(tmp_path / "g" / "seg.h5"))
    assert set(np.unique(np.concatenate([g[i]["mask"].ravel() for i in range(len(g))]))) - {0, 3, 7, 15}


def test_mask_decoder_remaps_checks_and_reads_16_bit(tmp_path):
    src = seg_tree(tmp_path / "d16", ids=(0, 300, 1000), bits=16)
    path = write(tmp_path / "r.yaml", seg_recipe(src, {"classes": [0, 300, 1000], "remap": True},
                                                   [{"resize": {"size": [15, 20]}}]))
    assert make_plan(load_recipe(path)).specs["mask"].classes == 3
    build(path, out_dir=str(tmp_path / "o"))
    ds = precompile.open(str(tmp_path / "o" / "seg.h5"))
    assert ds[0]["mask"].dtype == np.uint8 and set(np.unique(ds[0]["mask"])) <= {0, 1, 2}
    raw = write(tmp_path / "u.yaml", seg_recipe(src, {"dtype": "uint16"}, []))
    build(raw, out_dir=str(tmp_path / "u"))
    assert set(np.unique(precompile.open(str(tmp_path / "u" / "seg.h5"))[0]["mask"])) <= {0, 300, 1000}
    from precompile.decoders.mask import MaskDecoder

    with pytest.raises(DecodeError, match=r"label values \[300, 1000\] are not in classes \[0, 7\]"):
        MaskDecoder(MaskDecoder.Params(classes=[0, 7], dtype="uint16")).decode(str(src / "seg" / "0.png"), "m")
    with pytest.raises(DecodeError, match="does not fit uint8"):
        MaskDecoder().decode(str(src / "seg" / "0.png"), "m")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "rgb.png")
    with pytest.raises(DecodeError, match="RGB image is not a label map") as e:
        MaskDecoder().decode(str(tmp_path / "rgb.png"), "m")
    assert "rgb.png" in str(e.value)
    pal = Image.fromarray(np.array([[0, 1], [2, 1]], np.uint8), mode="P")
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * 759)
    pal.save(tmp_path / "pal.png")
    arr, meta = MaskDecoder().decode(str(tmp_path / "pal.png"), "m")
    assert arr["m"][..., 0].tolist() == [[0, 1], [2, 1]] and meta["values"] == [0, 1, 2]  # indices, not colours


# 5 --------------------------------------------------------------------------------------------
def dicom_file(path: Path, pi: str, pixels: np.ndarray, signed: int = 0) -> str:
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian

    ds = pydicom.Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = "1.2.3.1"
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = CTImageStorage, "1.2.3.1", "CR"
    ds.Rows, ds.Columns = pixels.shape[-2:]
    ds.SamplesPerPixel = pixels.shape[-1] if pixels.ndim == 3 else 1
    ds.PhotometricInterpretation = pi
    if ds.SamplesPerPixel > 1:
        ds.PlanarConfiguration = 0
    ds.BitsAllocated = 16 if pixels.dtype.itemsize == 2 else 8
    ds.BitsStored = 12 if ds.BitsAllocated == 16 else 8
    ds.HighBit, ds.PixelRepresentation = ds.BitsStored - 1, signed
    if pi == "PALETTE COLOR":
        ds.RedPaletteColorLookupTableDescriptor = [256, 0, 16]
        ds.GreenPaletteColorLookupTableDescriptor = [256, 0, 16]
        ds.BluePaletteColorLookupTableDescriptor = [256, 0, 16]
        lut = (np.arange(256, dtype=np.uint16) * 257).tobytes()
        ds.RedPaletteColorLookupTableData = ds.GreenPaletteColorLookupTableData = ds.BluePaletteColorLookupTableData = lut
    ds.PixelData = pixels.tobytes()
    pydicom.dcmwrite(str(path), ds, enforce_file_format=True)
    return str(path)


def test_colour_dicom_is_refused_naming_file_and_interpretation(tmp_path):
    pal = dicom_file(tmp_path / "palette.dcm", "PALETTE COLOR", np.arange(64, dtype=np.uint8).reshape(8, 8))
    with pytest.raises(DecodeError, match="photometric interpretation PALETTE COLOR: its pixel values are indices") as e:
        DicomDecoder().decode(pal, "ct")
    assert "palette.dcm" in str(e.value)
    ybr = dicom_file(tmp_path / "ybr.dcm", "YBR_FULL", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(DecodeError, match="photometric interpretation YBR_FULL: it is a colour image"):
        DicomDecoder().decode(ybr, "ct")
    rgb = dicom_file(tmp_path / "rgb.dcm", "RGB", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(DecodeError, match="RGB: it is a colour image"):
        DicomDecoder().decode(rgb, "ct")


def test_monochrome1_is_flagged_or_inverted_and_recorded(tmp_path):
    px = np.array([[0, 100], [4000, 4095]], np.uint16)
    m1 = dicom_file(tmp_path / "m1.dcm", "MONOCHROME1", px)
    arr, meta = DicomDecoder().decode(m1, "x")
    assert arr["x"][0].tolist() == px.tolist()
    assert meta["photometric"] == "MONOCHROME1" and meta["inverted"] is False
    assert any("MONOCHROME1" in w for w in meta["warnings"])
    arr, meta = DicomDecoder(DicomDecoder.Params(monochrome1="invert")).decode(m1, "x")
    assert arr["x"][0].tolist() == (4095 - px).tolist() and meta["inverted"] is True
    m2 = dicom_file(tmp_path / "m2.dcm", "MONOCHROME2", px)
    arr, meta = DicomDecoder(DicomDecoder.Params(monochrome1="invert")).decode(m2, "x")
    assert arr["x"][0].tolist() == px.tolist() and meta["photometric"] == "MONOCHROME2" and "inverted" not in meta


# 6 --------------------------------------------------------------------------------------------
def test_a_step_that_matches_no_field_is_a_plan_error(tmp_path, image_tree):
    from conftest import image_recipe

    r = image_recipe(image_tree, steps=[{"resize": {"size": [16, 16]}}, {"hu_window": {"window": [0, 100]}}])
    with pytest.raises(RecipeError, match=r"steps\[1\]\.hu_window: matches no field: it changes volume fields "
                                          r"and the sample has image \(image\)"):
        make_plan(load_recipe(write(tmp_path / "a.yaml", r)))
    r["steps"][1] = {"hu_window": {"window": [0, 100], "fields": []}}   # said on purpose: allowed
    make_plan(load_recipe(write(tmp_path / "b.yaml", r)))
    audio = yaml.safe_load((REPO / "recipes" / "audio.yaml").read_text())
    audio["inputs"]["root"] = str(SAMPLE / "audio")
    audio["steps"].append({"resize": {"size": [8, 8]}})
    with pytest.raises(RecipeError, match=r"steps\[1\]\.resize: matches no field"):
        make_plan(load_recipe(write(tmp_path / "c.yaml", audio)))


def test_a_step_that_cannot_handle_a_field_is_a_plan_error(tmp_path):
    r = ct_recipe({"resize": {"size": [8, 8]}})
    with pytest.raises(RecipeError, match=r"steps\[2\]\.resize: cannot handle field 'ct' of kind volume"):
        make_plan(load_recipe(write(tmp_path / "a.yaml", r)))
    r = ct_recipe({"random_flip": {"fields": ["lung"]}})
    with pytest.raises(RecipeError, match=r"cannot handle field 'lung' of kind volume_mask \(handles boxes, flow, image, keypoints, mask, video\)"):
        make_plan(load_recipe(write(tmp_path / "b.yaml", r)))
    src = flow_tree(tmp_path / "f")
    r = flow_recipe(src, [{"random_flip": {"fields": ["img1", "img2", "flow_valid"]}}])
    with pytest.raises(RecipeError, match="'flow_valid' is a flow_valid field: it is derived from its flow field 'flow'"):
        make_plan(load_recipe(write(tmp_path / "c.yaml", r)))


def test_a_folder_decoder_on_file_inputs_is_a_plan_error(tmp_path):
    r = ct_recipe({"random_flip3d": {}})
    r["inputs"]["kind"] = "file"
    r["inputs"]["match"] = "{series}/{f}"
    with pytest.raises(RecipeError, match=r"inputs.fields.ct: decoder 'dicom_series' reads folders \(inputs.kind: dir\), "
                                          r"but inputs.kind is 'file'"):
        make_plan(load_recipe(write(tmp_path / "a.yaml", r)))
