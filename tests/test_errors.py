"""Bad inputs: on_error fail/skip, max_failures, per-input timeouts, and workers that die.

Faults are real: corrupt and truncated image files, and test-only decoders
(registered from a plugin module written to tmp_path) that hang, SIGSEGV or
``os._exit`` inside ``decode`` on chosen inputs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
import yaml

from precompile import build
from precompile.errors import BuildError, RecipeError
from precompile.formats import open_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLUGIN = '''"""Test-only decoder and step that misbehave on chosen inputs (names unique to this module)."""
import os
import signal
import time

from precompile.decoders.base import Decoder, DecoderParams
from precompile.decoders.image import decode_image_file
from precompile.registry import DECODERS, STEPS
from precompile.sample import FieldSpec
from precompile.transforms.base import Step


@DECODERS.register()
class Flaky(Decoder):
    name = "MOD_image"
    kind = "image"

    class Params(DecoderParams):
        delay: float = 0.0

    def spec(self):
        return FieldSpec("image", (None, None, 3), "uint8")

    def read(self, path):
        base = os.path.basename(path)
        if "segv" in base:
            os.kill(os.getpid(), signal.SIGSEGV)   # what a crashing codec does
        if "exit" in base:
            os._exit(7)                            # what an out-of-memory kill looks like from outside
        if "hang" in base:
            while True:                            # a decoder stuck in a loop
                time.sleep(60)
        if self.params.delay:
            time.sleep(self.params.delay)
        return decode_image_file(path, "rgb8")


@STEPS.register()
class CrashStep(Step):
    name = "MOD_crash_step"
    kinds = frozenset({"image"})

    def run(self, sample, rng):
        if "stepsegv" in sample.key:
            os.kill(os.getpid(), signal.SIGSEGV)
        return [sample]
'''


def make_images(root: str, names: list[str], size: int = 16) -> None:
    from PIL import Image

    os.makedirs(root, exist_ok=True)
    for i, n in enumerate(names):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(os.path.join(root, n))


def write_recipe(path: str, root: str, decoder: dict | None = None, steps: list | None = None, **top) -> str:
    data = {"name": "t", "seed": 0,
            "inputs": {"root": root, "match": "{name}.png", "fields": {"image": decoder or {"decoder": "image"}}},
            "steps": steps if steps is not None else [{"resize": {"size": [8, 8]}}],
            "output": {"samples_per_shard": 4}, **top}
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Import a fresh plugin module from tmp_path (on sys.path, so loky workers and helpers import it too)."""
    mod = f"pcplug_{uuid.uuid4().hex[:10]}"
    d = tmp_path / "plug"
    d.mkdir()
    (d / f"{mod}.py").write_text(PLUGIN.replace("MOD", mod))
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), REPO, os.environ.get("PYTHONPATH", "")]))
    __import__(mod)
    return mod


def _corrupt(root: str) -> str:
    p = os.path.join(root, "img_005.png")
    with open(p, "r+b") as f:  # keep the PNG signature and header, cut the image data short
        f.truncate(60)
    return p


def _cli(*args: str, plugin: str | None = None) -> subprocess.CompletedProcess:
    """``python -m precompile ARGS``; with a plugin, the same module run after importing the plugin."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([REPO, e.get("PYTHONPATH", "")])
    cmd = ["-m", "precompile"] if plugin is None else [
        "-c", f"import {plugin}, runpy; runpy.run_module('precompile', run_name='__main__')"]
    return subprocess.run([sys.executable, *cmd, *args], capture_output=True, text=True, env=e, timeout=120)


def test_fail_names_file_field_stage_cause_in_one_clean_cli_line(tmp_path):
    root = tmp_path / "in"
    make_images(str(root), [f"img_{i:03d}.png" for i in range(10)])
    bad = _corrupt(str(root))
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root))
    r = _cli("build", recipe, "-o", str(tmp_path / "out"), "--no-progress")
    assert r.returncode == 3
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    msg = lines[0]
    assert msg.startswith("error: build of 't' stopped")
    assert bad in msg and "stage decode" in msg and "field 'image'" in msg
    assert "truncated" in msg.lower() or "corrupt" in msg.lower()
    assert not (tmp_path / "out" / "t.h5").exists()  # no index for a failed build
    rep = json.loads((tmp_path / "out" / "t.report.json").read_text())
    assert rep["status"] == "failed" and rep["failures"][0]["path"] == bad


def test_fail_with_workers_names_the_file(tmp_path):
    root = tmp_path / "in"
    make_images(str(root), [f"img_{i:03d}.png" for i in range(16)])
    bad = _corrupt(str(root))
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root))
    with pytest.raises(BuildError, match="stage decode, field 'image'") as ei:
        build(recipe, tmp_path / "out", n_jobs=2)
    assert bad in str(ei.value)


def test_skip_drops_sample_and_lists_it_in_report_and_cli(tmp_path):
    root = tmp_path / "in"
    names = [f"img_{i:03d}.png" for i in range(10)]
    make_images(str(root), names)
    bad = _corrupt(str(root))
    with open(os.path.join(str(root), "img_007.png"), "wb") as f:
        f.write(b"this is not an image at all")
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), on_error="skip")
    rep = build(recipe, tmp_path / "out")
    assert rep["status"] == "ok" and rep["skipped_inputs"] == 2
    by_path = {f["path"]: f for f in rep["failures"]}
    assert set(by_path) == {bad, os.path.join(str(root), "img_007.png")}
    assert by_path[bad]["stage"] == "decode" and by_path[bad]["field"] == "image"
    assert "not an image" in by_path[os.path.join(str(root), "img_007.png")]["message"]
    on_disk = json.loads((tmp_path / "out" / "t.report.json").read_text())
    assert {f["path"] for f in on_disk["failures"]} == set(by_path)
    ds = open_dataset(str(tmp_path / "out" / "t.h5"))
    assert len(ds) == 8
    assert ds.keys == [n for n in names if n not in ("img_005.png", "img_007.png")]
    # the same build again: every shard is up to date, and the skipped inputs are still reported
    rep2 = build(recipe, tmp_path / "out")
    assert rep2["shards"]["built"] == 0 and rep2["skipped_inputs"] == 2
    assert all(f["previous_build"] for f in rep2["failures"])
    # and the CLI lists them at the end of its output
    r = _cli("build", recipe, "-o", str(tmp_path / "out"), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "skipped 2 input(s)" in r.stderr and bad in r.stderr and "img_007.png" in r.stderr


def test_cli_on_error_override_does_not_rebuild(tmp_path):
    root = tmp_path / "in"
    make_images(str(root), [f"img_{i:03d}.png" for i in range(10)])
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root))
    assert build(recipe, tmp_path / "out")["shards"]["built"] == 3
    bad = _corrupt(str(root))
    r = _cli("build", recipe, "-o", str(tmp_path / "out"), "--no-progress", "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert "1 shard(s) built, 2 up to date" in r.stdout  # only the corrupted input's shard
    assert bad in r.stderr


def test_max_failures_stops_a_mostly_failing_run(tmp_path):
    root = tmp_path / "in"
    make_images(str(root), [f"img_{i:03d}.png" for i in range(12)])
    for i in range(1, 12):
        with open(os.path.join(str(root), f"img_{i:03d}.png"), "wb") as f:
            f.write(b"\x89PNG garbage")
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), on_error="skip", max_failures=2)
    with pytest.raises(BuildError, match=r"more than max_failures=2") as ei:
        build(recipe, tmp_path / "out")
    assert "img_001.png" in str(ei.value)  # the first failure is named
    rep = json.loads((tmp_path / "out" / "t.report.json").read_text())
    assert rep["status"] == "failed"
    # it stopped early: the first shard (4 inputs, 3 bad) already exceeded the limit
    assert rep["skipped_inputs"] == 3
    r = _cli("build", recipe, "-o", str(tmp_path / "out"), "--no-progress", "--max-failures", "100")
    assert r.returncode == 0 and "skipped 11 input(s)" in r.stderr


def test_hanging_decode_is_timed_out_and_skipped(tmp_path, plugin):
    root = tmp_path / "in"
    names = [f"img_{i:03d}.png" for i in range(6)] + ["img_003_hang.png"]
    make_images(str(root), names)
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), decoder={"decoder": f"{plugin}_image"},
                          on_error="skip", timeout_s=1.0)
    rep = build(recipe, tmp_path / "out")
    assert rep["skipped_inputs"] == 1
    f, = rep["failures"]
    assert f["path"].endswith("img_003_hang.png") and f["field"] == "image" and f["stage"] == "decode"
    assert "timed out after 1 s" in f["message"]
    ds = open_dataset(str(tmp_path / "out" / "t.h5"))
    assert len(ds) == 6 and "img_003_hang.png" not in ds.keys
    # same bytes as a build without the timeout machinery (decoding in-process)
    os.remove(os.path.join(str(root), "img_003_hang.png"))
    write_recipe(str(tmp_path / "r2.yaml"), str(root), decoder={"decoder": f"{plugin}_image"})
    build(str(tmp_path / "r2.yaml"), tmp_path / "ref")
    ref = open_dataset(str(tmp_path / "ref" / "t.h5"))
    assert np.array_equal(ref.batch(list(range(6)))["image"], ds.batch(list(range(6)))["image"])


def test_hanging_decode_fails_the_build_under_fail(tmp_path, plugin):
    root = tmp_path / "in"
    make_images(str(root), ["a.png", "b_hang.png"])
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), decoder={"decoder": f"{plugin}_image"})
    r = _cli("build", recipe, "-o", str(tmp_path / "out"), "--no-progress", "--timeout", "0.5", plugin=plugin)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert "b_hang.png, stage decode, field 'image': timed out after 0.5 s" in r.stderr


@pytest.mark.parametrize("culprit,why", [("img_005_segv.png", "SIGSEGV"), ("img_005_exit.png", "exit code 7")])
def test_dead_worker_fails_only_its_input(tmp_path, plugin, culprit, why):
    root = tmp_path / "in"
    out = tmp_path / "out"
    names = [f"img_{i:03d}.png" for i in range(12)] + [culprit]
    make_images(str(root), names)
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), decoder={"decoder": f"{plugin}_image"})
    # on_error: fail -> the build stops, naming the input whose decode killed the worker
    r = _cli("build", recipe, "-o", str(out), "-j", "2", "--no-progress", plugin=plugin)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert culprit in r.stderr and "the decoding process died" in r.stderr and why in r.stderr
    rep = json.loads((out / "t.report.json").read_text())
    assert any("worker process died" in e for e in rep["events"])
    # on_error: skip -> the build finishes without that input
    r = _cli("build", recipe, "-o", str(out), "-j", "2", "--no-progress", "--on-error", "skip", plugin=plugin)
    assert r.returncode == 0, r.stderr
    assert "skipped 1 input(s)" in r.stderr and culprit in r.stderr
    rep = json.loads((out / "t.report.json").read_text())
    assert rep["status"] == "ok" and rep["skipped_inputs"] == 1
    assert rep["failures"][0]["path"].endswith(culprit)
    ds = open_dataset(str(out / "t.h5"))
    assert len(ds) == 12 and culprit not in ds.keys


def test_crash_with_timeout_set_is_isolated_even_in_process(tmp_path, plugin):
    root = tmp_path / "in"
    make_images(str(root), ["a.png", "b_segv.png", "c.png"])
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), decoder={"decoder": f"{plugin}_image"},
                          on_error="skip", timeout_s=30)
    rep = build(recipe, tmp_path / "out")  # -j1: the build runs in this very process and survives
    assert [f["path"].endswith("b_segv.png") for f in rep["failures"]] == [True]
    assert "SIGSEGV" in rep["failures"][0]["message"]
    assert open_dataset(str(tmp_path / "out" / "t.h5")).keys == ["a.png", "c.png"]


def test_worker_dying_twice_fails_its_shard_naming_inputs(tmp_path, plugin):
    root = tmp_path / "in"
    names = [f"img_{i:03d}.png" for i in range(8)] + ["img_005_stepsegv.png"]
    make_images(str(root), names)
    recipe = write_recipe(str(tmp_path / "r.yaml"), str(root), steps=[{f"{plugin}_crash_step": {}}, {"resize": {"size": [8, 8]}}])
    r = _cli("build", recipe, "-o", str(tmp_path / "out"), "-j", "2", "--no-progress", plugin=plugin)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    msg = r.stderr
    assert "shard 1 (inputs img_004.png, img_005.png, img_005_stepsegv.png, img_006.png)" in msg
    assert "died" in msg and "twice" in msg and "SIGSEGV" in msg


def test_bad_option_values_are_recipe_errors(tmp_path):
    root = tmp_path / "in"
    make_images(str(root), ["a.png"])
    with pytest.raises(RecipeError, match="timeout_s"):
        build(write_recipe(str(tmp_path / "r.yaml"), str(root), timeout_s=0), tmp_path / "out")
