"""Hostile recipes: YAML is safe-loaded, and a recipe cannot write outside its output folder."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from precompile.errors import RecipeError
from precompile.recipe import load_recipe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "precompile", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _inputs(tmp_path):
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "a.png")
    return root


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system ['touch {marker}']",
                                 "!!python/object/new:os.system ['touch {marker}']",
                                 "!!python/name:os.system"])
def test_python_tags_are_refused(tmp_path, tag):
    marker = tmp_path / "pwned"
    root = _inputs(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_text(f"name: x\nseed: {tag.format(marker=marker)}\ninputs:\n  root: {root}\n  match: '{{n}}.png'\n"
                 f"  fields: {{image: {{decoder: image}}}}\n")
    with pytest.raises(RecipeError, match="not valid YAML") as ei:
        load_recipe(p)
    assert str(p) in str(ei.value)
    r = _cli("build", str(p), "-o", str(tmp_path / "out"), "--no-progress")
    assert r.returncode == RecipeError.exit_code and "Traceback" not in r.stderr
    assert "could not determine a constructor" in r.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../escape", "sub/dir", "/tmp/abs", "..", "a\\b"])
def test_output_name_cannot_leave_the_output_folder(tmp_path, name):
    root = _inputs(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_text(f"name: x\ninputs:\n  root: {root}\n  match: '{{n}}.png'\n  fields: {{image: {{decoder: image}}}}\n"
                 f"steps: [{{resize: {{size: [4, 4]}}}}]\noutput: {{name: '{name}'}}\n")
    out = tmp_path / "deep" / "out"
    before = sorted(os.listdir(tmp_path))
    r = _cli("build", str(p), "-o", str(out), "--no-progress")
    assert r.returncode == RecipeError.exit_code, r.stdout
    assert "output.name" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == before and not os.path.exists("/tmp/abs.h5")


@pytest.mark.parametrize("name", ["../evil", "a/b"])
def test_recipe_name_cannot_leave_the_output_folder(tmp_path, name):
    root = _inputs(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_text(f"name: '{name}'\ninputs:\n  root: {root}\n  match: '{{n}}.png'\n  fields: {{image: {{decoder: image}}}}\n")
    r = _cli("validate", str(p))
    assert r.returncode == RecipeError.exit_code and "r.yaml: name:" in r.stderr


def test_match_pattern_cannot_climb_out_of_root(tmp_path):
    root = _inputs(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_text(f"name: x\ninputs:\n  root: {root}\n  match: '../{{n}}.png'\n  fields: {{image: {{decoder: image}}}}\n")
    with pytest.raises(RecipeError, match="inputs.match"):
        load_recipe(p)


def test_output_root_itself_may_be_anywhere(tmp_path):
    """The -o folder is the user's choice (absolute or with '..'); everything lands inside it."""
    root = _inputs(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_text(f"name: x\ninputs:\n  root: {root}\n  match: '{{n}}.png'\n  fields: {{image: {{decoder: image}}}}\n"
                 f"steps: [{{resize: {{size: [4, 4]}}}}]\n")
    (tmp_path / "work").mkdir()
    r = _cli("build", str(p), "-o", "../elsewhere", "--no-progress", cwd=str(tmp_path / "work"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "elsewhere")) == ["x.h5", "x.report.json", "x.shards"]
