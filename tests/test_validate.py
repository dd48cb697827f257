"""``precompile validate`` runs every plan-time check that needs no input listing and no decoding:
the decoders' specs, every step's kind rules and field matching, the writer's options and its spec
checks, copies. A recipe that ``plan`` refuses for any of those, ``validate`` refuses with the same
message and exit code; a recipe ``validate`` accepts, ``plan`` accepts (given inputs to list)."""
from __future__ import annotations

import copy
import glob
import os

import pytest
from click.testing import CliRunner

from conftest import image_recipe, write_recipe
from precompile.cli import main
from precompile.compiler import check_recipe
from precompile.recipe import load_recipe

RECIPES = os.path.join(os.path.dirname(__file__), "..", "recipes")


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def _refusals(tree) -> dict[str, tuple[dict, str]]:
    """name -> (recipe, the words of the plan's message)."""
    base = image_recipe(tree)
    out: dict[str, tuple[dict, str]] = {}

    def case(name: str, words: str, **over) -> None:
        r = copy.deepcopy(base)
        for k, v in over.items():
            if k == "fields":
                r["inputs"]["fields"] = v
            elif k == "kind":
                r["inputs"]["kind"] = v
            elif k == "out":
                r["output"] = v
            else:
                r[k] = v
        out[name] = (r, words)

    case("hu_window on an image", "steps[2].hu_window: matches no field",
         steps=[*base["steps"], {"hu_window": {"level": 40, "width": 400}}])
    case("a volume step on an image", "steps[0].resample_volume: cannot handle field 'image' of kind image",
         steps=[{"resample_volume": {"shape": [4, 4, 4]}}])
    case("a field that is not there", "steps[0].resize: no field 'img'",
         steps=[{"resize": {"size": [8, 8], "fields": ["img"]}}])
    case("copies without a random step", "copies: copies > 0 needs at least one random step", copies=2)
    case("an unknown writer option", "output.options.bogus", out={"format": "hdf5", "options": {"bogus": 1}})
    case("a field a folder format cannot store", "output.format: field 'image'",
         steps=[{"resize": {"size": [8, 8]}}, {"convert": {"mode": "gray16"}}], out={"format": "bmp"})
    case("a folder decoder on files", "inputs.fields.ct: decoder 'dicom_series' reads folders",
         fields={"ct": {"decoder": "dicom_series"}}, steps=[])
    return out


@pytest.mark.parametrize("name", ["hu_window on an image", "a volume step on an image", "a field that is not there",
                                  "copies without a random step", "an unknown writer option",
                                  "a field a folder format cannot store", "a folder decoder on files"])
def test_validate_refuses_what_plan_refuses_with_the_same_message(tmp_path, image_tree, name):
    recipe, words = _refusals(image_tree)[name]
    p = str(write_recipe(tmp_path / "r.yaml", recipe))
    plan, val = _invoke("plan", p), _invoke("validate", p)
    assert plan.exit_code == 2 and words in plan.output, plan.output
    assert (val.exit_code, val.output) == (plan.exit_code, plan.output)
    assert len(val.output.strip().splitlines()) == 1


def test_validate_ok_says_what_it_checked(image_recipe_file):
    r = _invoke("validate", str(image_recipe_file))
    assert r.exit_code == 0
    assert r.output.strip() == (f"{image_recipe_file}: ok (1 field(s), 2 step(s), output hdf5; kinds, fields and "
                                f"output checked; inputs not listed: `precompile plan` lists them)")


def test_validate_lists_no_inputs(tmp_path, image_tree):
    """The one plan check validate leaves out: an empty input folder (listing may mean a remote bucket)."""
    r = image_recipe(image_tree)
    r["inputs"]["root"] = str(tmp_path / "empty")
    os.mkdir(tmp_path / "empty")
    p = str(write_recipe(tmp_path / "r.yaml", r))
    assert _invoke("validate", p).exit_code == 0
    plan = _invoke("plan", p)
    assert plan.exit_code != 0 and "no inputs under" in plan.output


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(RECIPES, "*.yaml"))), ids=os.path.basename)
def test_every_sample_recipe_validates_to_the_plan_specs(path):
    from precompile.compiler.plan import make_plan

    r = load_recipe(path)
    specs = check_recipe(r)
    if not os.path.isdir(r.input_root):
        pytest.skip(f"{r.input_root} is absent (sample_data/make_sample_data.py makes it)")
    assert specs == make_plan(r).specs
