"""``precompile schema``: the exported JSON Schema accepts what the recipe parser accepts and refuses misspellings."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import pytest
import yaml
from click.testing import CliRunner
from pydantic import Field

import step_cases_random
import step_cases_planar
import step_cases_temporal_audio_volume
from conftest import image_recipe
from precompile.cli import main
from precompile.errors import RecipeError
from precompile.recipe import parse_params, parse_recipe
from precompile.registry import DECODERS, STEPS, WRITERS, load_builtins
from precompile.tools.schema import DIALECT, recipe_schema
from precompile.transforms.base import Step, StepParams

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (test dependency)")

REPO = Path(__file__).resolve().parents[1]
CASE_MODULES = (step_cases_planar, step_cases_random, step_cases_temporal_audio_volume)


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    s = recipe_schema()
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


def _errors(v: jsonschema.Draft202012Validator, data: dict) -> list[str]:
    return [e.message for e in v.iter_errors(data)]


def _parser_accepts(data: dict) -> bool:
    """What the recipe parser accepts, plus the writer's options (checked when a build is planned,
    as ``build.check_plan`` and ``precompile validate`` do)."""
    try:
        r = parse_recipe(copy.deepcopy(data), source="t.yaml", base_dir=".")
        out = r.model.output
        parse_params(WRITERS.get(out.format).Options, out.options, "t.yaml", ("output", "options"))
    except RecipeError:
        return False
    return True


def _with_step(step: dict) -> dict:
    return {"name": "t", "inputs": {"root": ".", "match": "{name}.png", "fields": {"image": {"decoder": "image"}}},
            "steps": [step]}


def test_schema_is_draft_2020_12_and_lists_every_registered_name():
    load_builtins()
    s = recipe_schema()
    assert s["$schema"] == DIALECT == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(s)
    steps = {v["title"].removeprefix("step "): v for v in s["$defs"]["step"]["oneOf"]}
    assert sorted(steps) == sorted(STEPS)
    decoders = {v["title"].removeprefix("decoder "): v for v in s["$defs"]["field"]["oneOf"]}
    assert sorted(decoders) == sorted(DECODERS)
    formats = [v["title"].removeprefix("output ") for v in s["$defs"]["output"]["oneOf"]]
    assert sorted(formats) == sorted(WRITERS)
    # typed options with the class docstring as description
    resize = steps["resize"]
    assert resize["description"].startswith("Resize: `size: [h, w]` exactly")
    opts = resize["properties"]["resize"]["properties"]   # not nullable: `- resize:` is refused
    assert set(opts) == set(STEPS.get("resize").Params.model_fields)
    assert opts["interpolation"]["enum"] == ["auto", "area", "linear", "cubic", "nearest"]
    # options without a pydantic description take the comment on their line in the source
    assert opts["fields"]["description"].startswith("restrict the step to these fields")
    assert decoders["flow_mask"]["properties"]["invert"]["description"].startswith("1 where the pixel is zero")
    # a decoder option is its own schema, or (table inputs) {column: NAME}, the row's value
    mode = decoders["image"]["properties"]["mode"]["anyOf"]
    assert mode[0]["enum"] == ["rgb8", "gray8", "gray16", "rgba8"] and mode[1] == {"$ref": "#/$defs/row_value"}
    assert decoders["image"]["properties"]["decoder"] == {"const": "image",
                                                         "description": decoders["image"]["description"]}


def test_every_example_recipe_validates(validator):
    files = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(files) >= 9
    for f in files:
        data = yaml.safe_load(f.read_text())
        assert _errors(validator, data) == [], f.name


def test_recipes_the_tests_write_validate(validator, tmp_path):
    assert _errors(validator, image_recipe(tmp_path)) == []
    n = 0
    for mod in CASE_MODULES:
        for name, cases in mod.CASES.items():
            for params, _factory in cases:
                data = _with_step({name: params})
                assert _errors(validator, data) == [], (name, params)
                assert _parser_accepts(data), (name, params)
                n += 1
    assert n >= 60
    # `- random_flip:` (no options) means the defaults: both accept it
    data = _with_step({"random_flip": None})
    assert _errors(validator, data) == [] and _parser_accepts(data)
    # a shorthand the parser takes through a validator (one number for [z, y, x]) is in the schema too
    data = _with_step({"resample_volume": {"spacing": 2}})
    assert _errors(validator, data) == [] and _parser_accepts(data)


BAD = {
    "misspelt step option": _with_step({"resize": {"sise": [8, 8]}}),
    "unknown step": _with_step({"rezise": {"size": [8, 8]}}),
    "two steps in one entry": _with_step({"resize": {"size": [8, 8]}, "center_crop": {"size": [4, 4]}}),
    "wrong option type": _with_step({"random_flip": {"horizontal": "often"}}),
    "enum option": _with_step({"resize": {"size": [8, 8], "interpolation": "bicubic-ish"}}),
    "misspelt decoder option": {"name": "t", "inputs": {"root": ".", "match": "{n}.png",
                                                        "fields": {"image": {"decoder": "image", "mdoe": "rgb8"}}}},
    "unknown decoder": {"name": "t", "inputs": {"root": ".", "match": "{n}.png",
                                                "fields": {"image": {"decoder": "imag"}}}},
    "missing decoder": {"name": "t", "inputs": {"root": ".", "match": "{n}.png", "fields": {"image": {"path": "x"}}}},
    "another format's option": {"name": "t", "inputs": {"root": ".", "match": "{n}.png",
                                                        "fields": {"image": {"decoder": "image"}}},
                                "output": {"format": "png", "options": {"subtype": "PCM_16"}}},
    "option of the default format": {"name": "t", "inputs": {"root": ".", "match": "{n}.png",
                                                             "fields": {"image": {"decoder": "image"}}},
                                     "output": {"options": {"extra_fields": "npy"}}},
    "misspelt top-level key": {"name": "t", "seeed": 1, "inputs": {"root": ".", "match": "{n}.png",
                                                                   "fields": {"image": {"decoder": "image"}}}},
    "bad shard size": {"name": "t", "inputs": {"root": ".", "match": "{n}.png", "fields": {"image": {"decoder": "image"}}},
                       "output": {"samples_per_shard": 0}},
}


@pytest.mark.parametrize("why", sorted(BAD))
def test_schema_and_parser_refuse_the_same_mistakes(validator, why):
    data = BAD[why]
    assert _errors(validator, data), f"schema accepted: {why}"
    assert not _parser_accepts(data), f"parser accepted: {why}"


def test_the_best_error_points_at_the_misspelt_option(validator):
    best = jsonschema.exceptions.best_match(validator.iter_errors(BAD["misspelt step option"]))
    assert list(best.absolute_path) == ["steps", 0, "resize"] and "'sise' was unexpected" in best.message
    best = jsonschema.exceptions.best_match(validator.iter_errors(BAD["unknown step"]))
    assert list(best.absolute_path) == ["steps", 0] and "'rezise' is not one of" in best.message


def test_a_newly_registered_step_appears_with_its_options():
    class Params(StepParams):
        strength: float = Field(0.5, ge=0, le=1, description="how much to sharpen")
        mode: Literal["soft", "hard"] = "soft"

    class Sharpen(Step):
        """Sharpen images (a test step)."""

        name = "test_sharpen_schema"
        kinds = frozenset({"image"})

    Sharpen.Params = Params
    load_builtins()
    STEPS.register()(Sharpen)
    try:
        s = recipe_schema()
        v = jsonschema.Draft202012Validator(s)
        variant = next(x for x in s["$defs"]["step"]["oneOf"] if x["title"] == "step test_sharpen_schema")
        assert variant["description"] == "Sharpen images (a test step)."
        props = variant["properties"]["test_sharpen_schema"]["anyOf"][0]["properties"]
        assert props["strength"]["description"] == "how much to sharpen"
        assert _errors(v, _with_step({"test_sharpen_schema": {"strength": 0.2, "mode": "hard"}})) == []
        assert _errors(v, _with_step({"test_sharpen_schema": {"strength": 2}}))
        assert _errors(v, _with_step({"test_sharpen_schema": {"mode": "medium"}}))
        assert _errors(v, _with_step({"test_sharpen_schema": {"strenght": 0.2}}))
    finally:
        del STEPS._items["test_sharpen_schema"]
    assert "test_sharpen_schema" not in json.dumps(recipe_schema())


def test_cli_prints_and_writes_the_schema(tmp_path):
    r = CliRunner().invoke(main, ["schema"])
    assert r.exit_code == 0
    assert json.loads(r.output) == recipe_schema()
    out = tmp_path / "recipe.schema.json"
    r = CliRunner().invoke(main, ["schema", "-o", str(out)])
    assert r.exit_code == 0 and out.read_text() == CliRunner().invoke(main, ["schema"]).output


def test_draft7_variant_accepts_and_refuses_the_same(validator):
    s7 = json.loads(CliRunner().invoke(main, ["schema", "--draft", "7"]).output)
    assert s7["$schema"] == "http://json-schema.org/draft-07/schema#" and "$defs" not in s7
    assert "#/$defs/" not in json.dumps(s7)
    jsonschema.Draft7Validator.check_schema(s7)
    v7 = jsonschema.Draft7Validator(s7)
    for f in sorted((REPO / "recipes").glob("*.yaml")):
        assert not list(v7.iter_errors(yaml.safe_load(f.read_text()))), f.name
    for why, data in BAD.items():
        assert list(v7.iter_errors(data)), why


def test_cli_imports_plugin_modules_first(tmp_path, monkeypatch):
    (tmp_path / "my_steps_for_schema.py").write_text(
        "from typing import Literal\n"
        "from precompile.registry import STEPS\n"
        "from precompile.transforms.base import Step, StepParams\n"
        "@STEPS.register()\n"
        "class Posterize(Step):\n"
        "    \"\"\"Posterize images (a plugin step).\"\"\"\n"
        "    name = 'test_posterize_schema'\n"
        "    kinds = frozenset({'image'})\n"
        "    class Params(StepParams):\n"
        "        bits: Literal[2, 4] = 4  # bits kept per channel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        r = CliRunner().invoke(main, ["schema", "--import", "my_steps_for_schema"])
        assert r.exit_code == 0, r.output
        s = json.loads(r.output)
        variant = next(x for x in s["$defs"]["step"]["oneOf"] if x["title"] == "step test_posterize_schema")
        bits = variant["properties"]["test_posterize_schema"]["anyOf"][0]["properties"]["bits"]
        assert bits["enum"] == [2, 4] and bits["description"] == "bits kept per channel"
        v = jsonschema.Draft202012Validator(s)
        assert not list(v.iter_errors(_with_step({"test_posterize_schema": {"bits": 2}})))
        assert list(v.iter_errors(_with_step({"test_posterize_schema": {"bits": 3}})))
    finally:
        STEPS._items.pop("test_posterize_schema", None)
        import sys
        sys.modules.pop("my_steps_for_schema", None)
    r = CliRunner().invoke(main, ["schema", "--import", "no_such_module_xyz"])
    assert r.exit_code == 2 and "cannot import 'no_such_module_xyz'" in r.output and "Traceback" not in r.output


def _option_props(variant: dict, key: str) -> dict:
    """The options of one schema variant (a step, decoder or output format)."""
    if key == "step":
        (p,) = variant["properties"].values()
        return (p["anyOf"][0] if "anyOf" in p else p).get("properties", {})
    if key == "output":
        return variant["properties"]["options"].get("properties", {})
    return {k: v for k, v in variant["properties"].items() if k not in ("decoder", "path")}


def test_every_registered_option_has_a_description():
    s = recipe_schema()
    prefix = {"step": "step ", "field": "decoder ", "output": "output "}
    builtin = {f"{prefix[k]}{n}" for k, reg in (("step", STEPS), ("field", DECODERS), ("output", WRITERS))
               for n, cls in reg.items() if cls.__module__.startswith("precompile.")}   # not other tests' plugins
    missing, n = [], 0
    for key in ("step", "field", "output"):
        for v in s["$defs"][key]["oneOf"]:
            if v["title"] not in builtin:
                continue
            for name, prop in _option_props(v, key).items():
                n += 1
                if not str(prop.get("description", "")).strip():
                    missing.append(f"{v['title']}: {name}")
    assert n >= 170   # every option of every builtin step, decoder and writer was walked
    assert missing == []


# (step, options): values the build refuses; the schema must refuse each too
BAD_STEP_OPTIONS = [
    ("resize", {}), ("resize", None), ("resize", {"shorter": -5}), ("resize", {"longer": 0}),
    ("resize", {"size": 0}), ("resize", {"size": [8, -1]}), ("resize", {"size": 8, "shorter": 4}),
    ("center_crop", {}), ("center_crop", {"size": -2}), ("center_crop", {"size": 4, "min_visibility": 1.5}),
    ("random_crop", {"size": 4, "padding": -1}), ("random_crop", {"size": 0}),
    ("random_resized_crop", {"size": 4, "scale": [0.5, 1.5]}), ("random_resized_crop", {"size": 4, "ratio": [0, 1]}),
    ("random_flip", {"horizontal": 1.5}), ("random_flip", {"vertical": -0.1}),
    ("random_affine", {"translate": 2}), ("random_affine", {"degrees": -10}), ("random_affine", {"scale": 0}),
    ("random_affine", {"min_visibility": -1}),
    ("color_jitter", {"brightness": -0.5}), ("gaussian_noise", {"std": -1}), ("gaussian_noise", {}),
    ("convert", {}), ("convert", {"mode": "cmyk"}),
    ("temporal_jitter", {"length": 0}), ("temporal_jitter", {"length": 4, "strides": []}),
    ("temporal_jitter", {"length": 4, "strides": [0]}), ("temporal_jitter", {"length": 4, "jitter": -1}),
    ("fix_length", {"length": 0}), ("windows", {"length": 10, "hop": 0}),
    ("random_gain", {"db": -3}), ("time_shift", {"max_fraction": 1.5}), ("time_shift", {"max_shift": -1}),
    ("resample_volume", {"spacing": -1}), ("resample_volume", {"shape": [0, 4, 4]}),
    ("hu_window", {"level": 40, "width": 0}), ("hu_window", {"window": [1, 2, 3]}),
    ("standardise", {"mean": 0, "std": 0}), ("lung_mask", {"components": 0}), ("lung_mask", {"closing": 9}),
    ("crop_pad_volume", {"shape": [0, 4, 4]}), ("patches3d", {"size": 0}), ("patches3d", {"size": 4, "stride": -1}),
    ("patches3d", {"size": 4, "min_fraction": 2}), ("patches3d", {"size": 4, "max_patches": 0}),
    ("random_flip3d", {"prob": 2}), ("random_flip3d", {"axes": [3]}), ("random_flip3d", {"axes": [0, 0]}),
    ("random_rot90", {"k": [4]}), ("random_rot90", {"k": []}), ("random_rot90", {"planes": [[0, 3]]}),
    ("random_rot90", {"planes": []}), ("elastic", {"grid": 1}), ("elastic", {"grid": 64}),
    ("elastic", {"magnitude": -1}),
]


@pytest.mark.parametrize("step,params", BAD_STEP_OPTIONS, ids=[f"{n}-{p}" for n, p in BAD_STEP_OPTIONS])
def test_schema_refuses_what_the_build_refuses(validator, step, params, tmp_path):
    from precompile.recipe import load_recipe

    data = _with_step({step: copy.deepcopy(params)})
    assert _errors(validator, data), f"schema accepted {step}: {params}"
    assert not _parser_accepts(data), f"parser accepted {step}: {params}"
    with pytest.raises(RecipeError, match=step):   # the build's own entry point, from a file
        p = tmp_path / "r.yaml"
        p.write_text(yaml.safe_dump(data))
        load_recipe(str(p))


def test_good_values_at_the_bounds_pass_both(validator):
    for step, params in [("resize", {"shorter": 1}), ("random_flip", {"horizontal": 1.0, "vertical": 0}),
                         ("random_affine", {"translate": 1, "degrees": [-5, 5], "scale": [0.5, 2]}),
                         ("elastic", {"grid": 32, "magnitude": [0, 3]}), ("random_rot90", {"planes": [[0, 2]]}),
                         ("time_shift", {"max_fraction": 0.0}), ("color_jitter", {"brightness": [0, 2]})]:
        data = _with_step({step: params})
        assert _errors(validator, data) == [], (step, params)
        assert _parser_accepts(data), (step, params)


def test_cli_import_finds_a_module_in_the_current_folder(tmp_path, monkeypatch):
    import os
    import sys

    (tmp_path / "my_cwd_steps_for_schema.py").write_text(
        "from precompile.registry import STEPS\n"
        "from precompile.transforms.base import Step, StepParams\n"
        "@STEPS.register()\n"
        "class Blur(Step):\n"
        "    \"\"\"Blur images (a plugin step beside the recipe).\"\"\"\n"
        "    name = 'test_cwd_blur_schema'\n"
        "    kinds = frozenset({'image'})\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    try:
        r = CliRunner().invoke(main, ["schema", "--import", "my_cwd_steps_for_schema"])
        assert r.exit_code == 0, r.output
        titles = [x["title"] for x in json.loads(r.output)["$defs"]["step"]["oneOf"]]
        assert "step test_cwd_blur_schema" in titles
    finally:
        STEPS._items.pop("test_cwd_blur_schema", None)
        sys.modules.pop("my_cwd_steps_for_schema", None)
