"""Recipe validation: every error names the file, the key path and what was expected."""
from __future__ import annotations

import pytest

from precompile.errors import PlanError, RecipeError
from precompile.compiler.plan import make_plan
from precompile.recipe import load_recipe

from conftest import image_recipe, write_recipe


def _err(tmp_path, data) -> RecipeError:
    p = write_recipe(tmp_path / "r.yaml", data)
    with pytest.raises(RecipeError) as ei:
        make_plan(load_recipe(p))
    return ei.value


def test_valid_recipe_plans_shapes_before_decoding(image_recipe_file):
    plan = make_plan(load_recipe(image_recipe_file))
    assert len(plan.items) == 10
    assert len(plan.shards) == 3  # 4 + 4 + 2
    assert plan.specs["image"].shape == (32, 32, 3) and plan.specs["image"].dtype == "uint8"
    assert plan.specs["label"].shape == () and plan.specs["label"].dtype == "int64"
    assert plan.label_names == ["cat", "dog"]
    assert plan.data_bytes() == 10 * (32 * 32 * 3 + 8)
    assert [it.key for it in plan.items] == sorted(it.key for it in plan.items)


def test_step_option_error_has_key_path(tmp_path, image_tree):
    r = image_recipe(image_tree, steps=[{"resize": {"shorter": 36}}, {"center_crop": {"size": [1, 2, 3]}}])
    e = _err(tmp_path, r)
    assert e.loc == "steps[1].center_crop.size"
    assert "2 integers" in str(e) and "got 3" in str(e)
    assert str(tmp_path / "r.yaml") in str(e)


def test_unknown_step_lists_close_matches(tmp_path, image_tree):
    e = _err(tmp_path, image_recipe(image_tree, steps=[{"resise": {"size": 8}}]))
    assert e.loc == "steps[0]"
    assert "unknown step 'resise'" in str(e) and "did you mean 'resize'" in str(e)


def test_unknown_decoder_lists_close_matches(tmp_path, image_tree):
    r = image_recipe(image_tree)
    r["inputs"]["fields"]["image"]["decoder"] = "imag"
    e = _err(tmp_path, r)
    assert e.loc == "inputs.fields.image.decoder" and "did you mean 'image'" in str(e)


def test_decoder_option_checked_by_its_own_schema(tmp_path, image_tree):
    r = image_recipe(image_tree)
    r["inputs"]["fields"]["image"]["mode"] = "rgb9"
    e = _err(tmp_path, r)
    assert e.loc == "inputs.fields.image.mode"
    assert "rgb8" in str(e)


def test_unknown_top_level_key_and_missing_key(tmp_path, image_tree):
    r = image_recipe(image_tree)
    r["outptu"] = {}
    assert _err(tmp_path, r).loc == "outptu"
    r = image_recipe(image_tree)
    del r["inputs"]["match"]
    e = _err(tmp_path, r)
    assert e.loc == "inputs.match" and "required" in str(e)


def test_crop_larger_than_fixed_input_is_a_plan_time_error(tmp_path, image_tree):
    r = image_recipe(image_tree, steps=[{"resize": {"size": [16, 16]}}, {"center_crop": {"size": 32}}])
    e = _err(tmp_path, r)
    assert e.loc == "steps[1].center_crop" and "larger than the input 16x16" in str(e)


def test_unfixed_shape_is_planned_as_variable(tmp_path, image_tree):
    from precompile.compiler import check_plan

    r = image_recipe(image_tree, steps=[{"resize": {"shorter": 36}}])
    plan = make_plan(load_recipe(write_recipe(tmp_path / "r.yaml", r)))
    check_plan(plan)  # HDF5 stores it in the variable-shape layout
    assert plan.specs["image"].shape == (None, None, 3) and not plan.specs["image"].fixed
    assert plan.estimated_bytes() is None


def test_output_name_cannot_escape(tmp_path, image_tree):
    for bad in ("../evil", "/tmp/evil", "a/b"):
        r = image_recipe(image_tree, output={"format": "hdf5", "name": bad})
        e = _err(tmp_path, r)
        assert e.loc == "output.name"


def test_yaml_is_safe_loaded(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    assert "not valid YAML" in str(ei.value)


def test_capture_used_in_field_path_must_exist(tmp_path, image_tree):
    r = image_recipe(image_tree)
    r["inputs"]["fields"]["mask"] = {"decoder": "image", "path": "{label}/{nope}.png", "mode": "gray8"}
    e = _err(tmp_path, r)
    assert e.loc == "inputs.fields.mask.path" and "nope" in str(e)


def test_no_matching_inputs_is_a_plan_error(tmp_path, image_tree):
    r = image_recipe(image_tree)
    r["inputs"]["where"] = {"ext": "tif"}
    p = write_recipe(tmp_path / "r.yaml", r)
    with pytest.raises(PlanError, match="no inputs"):
        make_plan(load_recipe(p))


def test_sibling_fields_and_class_list(tmp_path, image_tree):
    r = image_recipe(image_tree)
    r["inputs"]["fields"]["again"] = {"decoder": "image", "path": "{label}/{name}.{ext}", "mode": "gray8"}
    r["inputs"]["label"]["classes"] = ["dog", "cat", "bird"]
    plan = make_plan(load_recipe(write_recipe(tmp_path / "r.yaml", r)))
    assert plan.label_names == ["dog", "cat", "bird"]
    assert plan.specs["again"].shape == (32, 32, 1)
    first = plan.items[0]
    assert first.paths["again"] == first.paths["image"] and first.label == 1  # cat
