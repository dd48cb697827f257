"""Workers that start warm (compiler/backends.py start_pool): a build with several jobs on loky workers
(``PRECOMPILE_WORKERS=loky``; the default where fork is missing) starts them, each importing the shard task
and every decoder and step, before it plans; a rebuild of an unchanged recipe (most likely nothing to do)
starts none. Forked workers (the default on Linux) need no warm-up: they start with the build path imported."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, image_recipe, make_image_tree, write_recipe
from precompile import build
from precompile.compiler import backends, driver


@pytest.fixture()
def loky(monkeypatch):
    monkeypatch.setenv("PRECOMPILE_WORKERS", "loky")


@pytest.fixture()
def seen(monkeypatch):
    """Whether a warm-up was under way when the plan started, per build."""
    out: list[bool] = []
    real = driver.make_plan

    def plan(recipe, *a, **k):
        out.append(backends._warm is not None)
        return real(recipe, *a, **k)
    monkeypatch.setattr(driver, "make_plan", plan)
    return out


def test_the_pool_starts_before_the_plan_unless_the_recipe_is_unchanged(tmp_path, seen, loky):
    recipe = write_recipe(tmp_path / "r.yaml", image_recipe(make_image_tree(tmp_path / "in", per_class=3)))
    first = build(recipe, tmp_path / "out", n_jobs=2)
    again = build(recipe, tmp_path / "out", n_jobs=2)
    forced = build(recipe, tmp_path / "out", n_jobs=2, force=True)
    single = build(recipe, tmp_path / "one", n_jobs=1)
    assert seen == [True, False, True, False]
    assert first["shards"]["built"] == 2 and again.get("up_to_date") and forced["shards"]["built"] == 2
    assert single["shards"]["built"] == 2 and backends._warm is None   # the run took the warm-up's results


@pytest.mark.skipif(not backends.worker_start() == "fork", reason="workers are forked on Linux only")
def test_forked_workers_start_with_the_shards_and_need_no_warm_up(tmp_path, seen):
    recipe = write_recipe(tmp_path / "r.yaml", image_recipe(make_image_tree(tmp_path / "in", per_class=3)))
    forked = build(recipe, tmp_path / "out", n_jobs=2)
    single = build(recipe, tmp_path / "one", n_jobs=1)
    assert seen == [False, False] and backends._warm is None
    assert forked["shards"]["built"] == 2 and single["shards"]["built"] == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "out" / "imgs.shards").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "one" / "imgs.shards").iterdir()}


def test_a_warm_up_runs_the_imports_in_the_workers(tmp_path, loky):
    backends.start_pool(2, None, str(tmp_path / "nothing.h5"), "0" * 64)
    pids = backends._settle_warm()
    assert len(pids) == 2 and os.getpid() not in pids


_FAILS = """
import sys
from precompile import build
try:
    build(sys.argv[1], sys.argv[2], n_jobs=2)
except Exception as e:
    print(type(e).__name__)
"""


@pytest.mark.parametrize("workers", ["loky", "fork"])
def test_a_build_that_stops_at_its_plan_leaves_no_warning_and_no_worker(tmp_path, workers):
    """The warm-up no run used is collected at exit: no joblib warning about unused results, and the
    process ends (its loky workers with it)."""
    (tmp_path / "in").mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", image_recipe(tmp_path / "in"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PRECOMPILE_WORKERS=workers)
    r = subprocess.run([sys.executable, "-c", _FAILS, str(recipe), str(tmp_path / "out")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.stdout.strip() == "PlanError", r.stderr
    assert "Warning" not in r.stderr, r.stderr


def test_the_exit_hook_is_registered_once_for_many_builds(tmp_path, monkeypatch, loky):
    import atexit

    hooks: list = []
    real_register = atexit.register
    monkeypatch.setattr(atexit, "register", lambda f, *a, **k: hooks.append(f) or real_register(f, *a, **k))
    monkeypatch.setattr(backends, "_exit_hook", False)
    for i in range(3):
        backends.start_pool(2, None, str(tmp_path / "nothing.h5"), "0" * 64)
        assert len(backends._settle_warm()) == 2
    assert hooks.count(backends._settle_warm) == 1
