"""Recipe values are bounded before any work: YAML alias bombs and deep nesting are refused while parsing (in
bounded memory, with the line), NaN/inf options are refused by validation, and every output field name is a valid
dataset name (a '/' would silently make an HDF5 group)."""
from __future__ import annotations

import re
import tracemalloc

import pytest

import precompile
from precompile.compiler.plan import make_plan
from precompile.errors import RecipeError
from precompile.recipe import MAX_YAML_DEPTH, MAX_YAML_NODES

from conftest import REPO

SAMPLE = REPO / "sample_data"

HEAD = 'inputs: {root: ., match: "{n}.png", fields: {image: {decoder: image}}}\n'


def bomb(levels: int, where: str) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: bomb\n{where}\n" + HEAD


@pytest.mark.parametrize("where", ["seed: *a8", "steps: [{resize: *a8}]", "unknown_key: *a8"])
def test_alias_bomb_is_refused_before_expansion(tmp_path, where):
    p = tmp_path / "bomb.yaml"
    p.write_text(bomb(9, where))   # 10^9 values once expanded
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError, match=f"refused: its aliases expand to more than {MAX_YAML_NODES:,} values"):
            precompile.load_recipe(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"{peak / 2**20:.1f} MiB to refuse a bomb"


def test_aliases_below_the_limit_still_work(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("name: ok\nsteps: [{resize: {size: &s [32, 32]}}, {center_crop: {size: *s}}]\n" + HEAD)
    r = precompile.load_recipe(p)
    assert [list(s.params.size) for s in r.steps] == [[32, 32], [32, 32]]


@pytest.mark.parametrize("depth", [MAX_YAML_DEPTH + 1, 50_000])
def test_deep_nesting_is_refused_with_its_line(tmp_path, depth):
    p = tmp_path / "deep.yaml"
    p.write_text("name: deep\nseed: " + "[" * depth + "]" * depth + "\n" + HEAD)
    with pytest.raises(RecipeError, match=f"deep.yaml: refused: line 2: nested deeper than {MAX_YAML_DEPTH} levels"):
        precompile.load_recipe(p)


def test_recursive_alias_is_refused(tmp_path):
    p = tmp_path / "rec.yaml"
    p.write_text("loop: &a [*a]\nname: rec\n" + HEAD)
    with pytest.raises(RecipeError, match="refused: an alias refers to the list or mapping that contains it"):
        precompile.load_recipe(p)


def _recipe(steps=(), **inputs):
    return {"name": "t", "inputs": {"root": str(SAMPLE / "images"), "match": "{c}/{n}.jpg",
                                    "fields": {"image": {"decoder": "image"}}, **inputs}, "steps": list(steps)}


@pytest.mark.parametrize("step,loc", [({"color_jitter": {"brightness": float("nan")}}, "steps[0].color_jitter"),
                                      ({"resize": {"size": [float("inf"), 8]}}, "steps[0].resize"),
                                      ({"gaussian_noise": {"std": [float("nan"), 1.0]}}, "steps[0].gaussian_noise")])
def test_nan_and_inf_options_are_refused_by_validation(step, loc):
    with pytest.raises(RecipeError, match=re.escape(loc)):
        precompile.load_recipe(_recipe([step]))


def test_label_field_must_name_a_dataset():
    with pytest.raises(RecipeError, match=r"inputs.label.field: String should match pattern .*got 'a/b'"):
        precompile.load_recipe(_recipe(label={"capture": "c", "field": "a/b"}))


@pytest.mark.parametrize("step", [{"clips": {"length": 2, "index_field": "x/y"}},
                                  {"clips": {"length": 2, "index_field": "idx y"}}])
def test_step_made_field_names_are_checked_at_plan_time(step):
    r = precompile.load_recipe({"name": "v", "inputs": {"root": str(SAMPLE / "video"), "match": "{n}.mp4",
                                                       "fields": {"video": {"decoder": "video"}}},
                                "steps": [step]})
    with pytest.raises(RecipeError, match="output field name '.*' must be letters, digits"):
        make_plan(r)
