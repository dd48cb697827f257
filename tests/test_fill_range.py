"""A constant a step writes into an array (a ``pad_value``, a ``fill``) must fit the field's dtype: outside its
range it used to wrap around silently (-7 padded into a uint8 volume stored 249, ``fill: -1000`` stored 24,
``pad_value: 300`` in a uint8 image 44). It is refused at plan time, naming the step, the option, the value, the
field and its dtype's range; and again at apply time on the array itself (a dtype known only after decoding),
as the input's StepError. A value the step never writes (``pad_value`` without ``pad: true``) is not checked."""
from __future__ import annotations

import numpy as np
import pytest

import precompile
from precompile.compiler.plan import plan_specs
from precompile.errors import RecipeError, StepError
from precompile.recipe import load_recipe
from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.seeding import rng_for

load_builtins()


def _range(dtype: str) -> str:
    return {"uint8": "0 to 255", "uint16": "0 to 65535", "int16": "-32768 to 32767",
            "float32": "-3.4028235e+38 to 3.4028235e+38"}[dtype]


def _msg(option: str, value: str, field: str, dtype: str) -> str:
    return (f"{option} {value} is outside the range of field {field!r}: its dtype {dtype} holds {_range(dtype)}; "
            f"give a value in that range")


IMAGE = {"image": {"decoder": "image", "mode": "rgb8"}}
GRAY16 = {"image": {"decoder": "image", "mode": "gray16"}}
VIDEO = {"video": {"decoder": "video"}}
VOLUME = {"volume": {"decoder": "nifti", "dtype": "int16"}}
VOLUME_F = {"volume": {"decoder": "nifti"}}
VOLUME_SEG = {"volume": {"decoder": "nifti", "dtype": "int16"},
              "seg": {"decoder": "nifti_labels", "path": "seg/{name}.nii.gz"}}
AUDIO16 = {"audio": {"decoder": "audio", "mono": False, "dtype": "int16"}}
U8 = {"hu_window": {"window": [-1000, 1000], "dtype": "uint8"}}

# (fields, steps, the index of the refused step, option, value as written, field, dtype)
REFUSED = [
    (VOLUME, [U8, {"crop_pad_volume": {"shape": [8, 4, 6], "pad_value": -7}}], 1, "pad_value", "-7", "volume", "uint8"),
    (VOLUME_SEG, [U8, {"apply_mask": {"mask": "seg", "fill": -1000}}], 1, "fill", "-1000", "volume", "uint8"),
    (VOLUME, [U8, {"patches3d": {"size": 4, "pad_value": 300}}], 1, "pad_value", "300", "volume", "uint8"),
    (VOLUME, [{"crop_pad_volume": {"shape": 4, "pad_value": 40000}}], 0, "pad_value", "40000", "volume", "int16"),
    (VOLUME_F, [{"crop_pad_volume": {"shape": 4, "pad_value": 1e39}}], 0, "pad_value", "1e+39", "volume", "float32"),
    (IMAGE, [{"center_crop": {"size": 8, "pad": True, "pad_value": -5}}], 0, "pad_value", "-5", "image", "uint8"),
    (IMAGE, [{"random_crop": {"size": 8, "padding": 2, "pad_value": -5}}], 0, "pad_value", "-5", "image", "uint8"),
    (IMAGE, [{"random_crop": {"size": 8, "pad": True, "pad_value": 256}}], 0, "pad_value", "256", "image", "uint8"),
    (IMAGE, [{"resize": {"size": 8, "keep_aspect": True, "pad_value": 300}}], 0, "pad_value", "300", "image", "uint8"),
    (IMAGE, [{"random_affine": {"degrees": 10, "fill": -1}}], 0, "fill", "-1", "image", "uint8"),
    (IMAGE, [{"center_crop": {"size": 8, "pad": True, "pad_value": 255.5}}], 0, "pad_value", "255.5", "image", "uint8"),
    (GRAY16, [{"center_crop": {"size": 8, "pad": True, "pad_value": 70000}}], 0, "pad_value", "70000", "image",
     "uint16"),
    (VIDEO, [{"resize": {"size": 8, "keep_aspect": True, "pad_value": -3}}], 0, "pad_value", "-3", "video", "uint8"),
    (AUDIO16, [{"fix_length": {"length": 100, "pad_value": 40000}}], 0, "pad_value", "40000", "audio", "int16"),
    (AUDIO16, [{"windows": {"length": 100, "hop": 50, "tail": "pad", "pad_value": -32769}}], 0, "pad_value",
     "-32769", "audio", "int16"),
]

ACCEPTED = [
    (IMAGE, [{"center_crop": {"size": 8, "pad_value": -5}}]),                  # never pads: never written
    (IMAGE, [{"random_crop": {"size": 8, "pad_value": 999}}]),                 # no padding, no pad: true
    (IMAGE, [{"resize": {"size": 8, "pad_value": 300}}]),                       # no keep_aspect
    (IMAGE, [{"center_crop": {"size": 8, "pad": True, "pad_value": 255}}]),
    (GRAY16, [{"center_crop": {"size": 8, "pad": True, "pad_value": 300}}]),
    (VOLUME, [{"crop_pad_volume": {"shape": 4, "pad_value": -1000}}]),          # int16 before hu_window
    (VOLUME, [U8, {"patches3d": {"size": 4, "pad": False, "pad_value": 300}}]),
    (VOLUME, [U8, {"standardise": {"mean": 0, "std": 1}}, {"crop_pad_volume": {"shape": 4, "pad_value": -7}}]),
    (AUDIO16, [{"fix_length": {"length": 100, "pad_value": -32768}}]),
    (AUDIO16, [{"windows": {"length": 100, "hop": 50, "pad_value": -40000}}]),   # drops short ones: never pads
]


def _recipe(fields: dict, steps: list, root: str = "/nonexistent") -> dict:
    return {"name": "r", "inputs": {"root": root, "match": "{name}.x", "fields": fields}, "steps": steps,
            "output": {"format": "hdf5", "samples_per_shard": 2}}


@pytest.mark.parametrize("fields, steps, i, option, value, field, dtype", REFUSED,
                         ids=[f"{next(iter(c[1][c[2]]))}-{c[3]}-{c[4]}-{c[6]}" for c in REFUSED])
def test_plan_refuses_a_value_outside_the_fields_dtype(fields, steps, i, option, value, field, dtype):
    with pytest.raises(RecipeError) as e:
        plan_specs(load_recipe(_recipe(fields, steps)))
    name = next(iter(steps[i]))
    assert e.value.loc == f"steps[{i}].{name}"
    assert e.value.detail == _msg(option, value, field, dtype)
    assert str(e.value) == f"steps[{i}].{name}: {_msg(option, value, field, dtype)}"


@pytest.mark.parametrize("fields, steps", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_plan_accepts_values_the_field_holds_or_never_written(fields, steps):
    plan_specs(load_recipe(_recipe(fields, steps)))


# -- real bytes through a build ---------------------------------------------------------------------------------
def _volume_tree(tmp_path):
    import nibabel as nib

    (tmp_path / "in" / "seg").mkdir(parents=True)
    vol = (np.arange(4 * 4 * 4, dtype=np.int16).reshape(4, 4, 4) * 10)        # 0..630: uint8 window 127..207
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(tmp_path / "in" / "v.nii.gz"))
    seg = np.zeros((4, 4, 4), np.uint8)
    seg[1:3, 1:3, 1:3] = 1
    nib.save(nib.Nifti1Image(seg, np.eye(4)), str(tmp_path / "in" / "seg" / "v.nii.gz"))
    return str(tmp_path / "in")


def _vol_recipe(root: str, step: dict) -> dict:
    return {"name": "v", "inputs": {"root": root, "match": "{name}.nii.gz", "fields": VOLUME_SEG},
            "steps": [U8, step], "output": {"format": "hdf5", "samples_per_shard": 1}}


def test_build_refuses_negative_pad_of_a_uint8_volume_and_pads_an_in_range_one(tmp_path):
    """The fuzzer's case N5-seed152: crop_pad_volume pad_value -7 after hu_window dtype uint8 stored 249."""
    root = _volume_tree(tmp_path)
    with pytest.raises(RecipeError, match="steps\\[1\\].crop_pad_volume: " + _msg("pad_value", "-7", "volume", "uint8")):
        precompile.build(_vol_recipe(root, {"crop_pad_volume": {"shape": 6, "pad_value": -7}}),
                         out_dir=str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "v.h5").exists()
    precompile.build(_vol_recipe(root, {"crop_pad_volume": {"shape": 6, "pad_value": 7}}), out_dir=str(tmp_path / "ok"))
    v = precompile.open(str(tmp_path / "ok" / "v.h5"))[0]["volume"]
    assert v.dtype == np.uint8 and v.shape == (6, 6, 6)
    border = np.ones((6, 6, 6), bool)
    border[1:5, 1:5, 1:5] = False           # a 4^3 volume centred in 6^3: one padded layer on every side
    assert (v[border] == 7).all() and (v[~border] >= 127).all()


def test_build_refuses_apply_mask_fill_outside_uint8_and_fills_an_in_range_one(tmp_path):
    """The fuzzer's case N5-apply-mask-seed462: apply_mask fill -1000 on a uint8 volume stored 24."""
    root = _volume_tree(tmp_path)
    with pytest.raises(RecipeError, match="steps\\[1\\].apply_mask: " + _msg("fill", "-1000", "volume", "uint8")):
        precompile.build(_vol_recipe(root, {"apply_mask": {"mask": "seg", "fill": -1000}}),
                         out_dir=str(tmp_path / "bad"))
    precompile.build(_vol_recipe(root, {"apply_mask": {"mask": "seg", "fill": 3}}), out_dir=str(tmp_path / "ok"))
    s = precompile.open(str(tmp_path / "ok" / "v.h5"))[0]
    outside = s["seg"] == 0
    assert outside.sum() == 64 - 8 and (s["volume"][outside] == 3).all() and (s["volume"][~outside] >= 127).all()


def test_build_refuses_negative_pad_of_a_uint8_image_and_pads_an_in_range_one(tmp_path):
    from PIL import Image

    (tmp_path / "in").mkdir()
    Image.fromarray(np.full((4, 6, 3), 100, np.uint8)).save(str(tmp_path / "in" / "a.png"))

    def recipe(pad_value):
        return {"name": "i", "inputs": {"root": str(tmp_path / "in"), "match": "{name}.png", "fields": IMAGE},
                "steps": [{"center_crop": {"size": [6, 8], "pad": True, "pad_value": pad_value}}],
                "output": {"format": "hdf5", "samples_per_shard": 1}}
    with pytest.raises(RecipeError, match="steps\\[0\\].center_crop: " + _msg("pad_value", "-5", "image", "uint8")):
        precompile.build(recipe(-5), out_dir=str(tmp_path / "bad"))
    precompile.build(recipe(5), out_dir=str(tmp_path / "ok"))
    im = precompile.open(str(tmp_path / "ok" / "i.h5"))[0]["image"]
    want = np.full((6, 8, 3), 5, np.uint8)
    want[1:5, 1:7] = 100
    np.testing.assert_array_equal(im, want)


# -- at apply time, on the array's own dtype -----------------------------------------------------------------------
def _img(dtype=np.uint8) -> Sample:
    return Sample("a.png", {"image": np.full((4, 6, 3), 9, dtype)}, {"image": "image"})


def _vol(dtype=np.uint8) -> Sample:
    mask = np.zeros((4, 4, 4), np.uint8)
    mask[1:3] = 1
    return Sample("v.nii", {"volume": np.full((4, 4, 4), 9, dtype), "seg": mask},
                  {"volume": "volume", "seg": "volume_mask"})


def _aud(dtype=np.int16) -> Sample:
    return Sample("a.wav", {"audio": np.full((1, 30), 9, dtype)}, {"audio": "audio"})


APPLY = [
    ("center_crop", {"size": 8, "pad": True, "pad_value": -5}, _img, "image", "uint8", "pad_value", "-5"),
    ("random_crop", {"size": 4, "padding": 1, "pad_value": 256}, _img, "image", "uint8", "pad_value", "256"),
    ("resize", {"size": 8, "keep_aspect": True, "pad_value": 300}, _img, "image", "uint8", "pad_value", "300"),
    ("random_affine", {"degrees": 30, "fill": -2}, _img, "image", "uint8", "fill", "-2"),
    ("crop_pad_volume", {"shape": 6, "pad_value": -7}, _vol, "volume", "uint8", "pad_value", "-7"),
    ("patches3d", {"size": 6, "pad_value": -7}, _vol, "volume", "uint8", "pad_value", "-7"),
    ("apply_mask", {"mask": "seg", "fill": -1000}, _vol, "volume", "uint8", "fill", "-1000"),
    ("fix_length", {"length": 40, "pad_value": 40000}, _aud, "audio", "int16", "pad_value", "40000"),
    ("windows", {"length": 40, "hop": 10, "short": "pad", "pad_value": -40000}, _aud, "audio", "int16",
     "pad_value", "-40000"),
]


@pytest.mark.parametrize("name, params, factory, field, dtype, option, value", APPLY, ids=[c[0] for c in APPLY])
def test_apply_refuses_a_value_outside_the_arrays_dtype(name, params, factory, field, dtype, option, value):
    """A dtype known only after decoding: the array's own dtype decides, as the input's StepError."""
    cls = STEPS.get(name)
    step = cls(cls.Params(**params))
    with pytest.raises(StepError) as e:
        step.run(factory(), rng_for(0, "k", 1))
    assert str(e.value) == f"field {field!r}: {name}: {_msg(option, value, field, dtype)}"
    assert e.value.field == field
    # the same step on a dtype that holds the value runs (float32 holds any of them)
    step.run(factory(np.float32), rng_for(0, "k", 1))
