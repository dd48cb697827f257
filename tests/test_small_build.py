"""The small-build rule (compiler/backends.py ``small_build``): a ``-j N`` build whose shards to build hold
fewer than 32 inputs and 512 KiB of input per worker builds them in its own process, says so in one line,
and writes the same bytes, failures and report as with its workers; a build past either bound gets them.

conftest.py turns the rule off for every other test (``PRECOMPILE_SMALL_BUILD=0``); these tests unset it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.compiler import backends
from precompile.errors import BuildError

from conftest import REPO

ENV = "PRECOMPILE_SMALL_BUILD"


def _inputs(root: Path, n: int, side: int = 16, bad: int = -1) -> Path:
    """``n`` PNGs of random pixels (``side`` x ``side``); input ``bad`` is not a PNG."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    for i in range(n):
        p = root / f"img_{i:03d}.png"
        if i == bad:
            p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not a png" * 4)
        else:
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(p)
    return root


def _recipe(root: Path, per_shard: int = 2, **top) -> dict:
    return {"name": "small", "seed": 1, "inputs": {"root": str(root), "match": "{name}.png",
                                                    "fields": {"image": {"decoder": "image"}}},
            "steps": [{"random_crop": {"size": [8, 8]}}], "output": {"samples_per_shard": per_shard}, **top}


def _forks(monkeypatch) -> list[int]:
    """Calls of the forked-worker backend, recorded (each then runs as usual)."""
    calls: list[int] = []
    real = backends.run_fork

    def run_fork(todo, *a, **k):
        calls.append(len(todo))
        return real(todo, *a, **k)

    monkeypatch.setattr(backends, "run_fork", run_fork)
    return calls


def _shards(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "small.shards").glob("*.h5"))}


@pytest.fixture(autouse=True)
def rule_on(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("PRECOMPILE_WORKERS", "fork")


def test_a_small_j2_build_runs_in_one_process_says_why_and_writes_the_workers_bytes(tmp_path, monkeypatch):
    root = _inputs(tmp_path / "in", 8)
    nbytes = sum(p.stat().st_size for p in root.iterdir())
    forks = _forks(monkeypatch)
    rep = precompile.build(_recipe(root), tmp_path / "one", n_jobs=2)
    assert forks == []
    assert rep["events"] == [
        f"built in one process although -j 2 was asked: 8 input(s) and {nbytes / 1024:.1f} KiB to build, "
        f"under 32 inputs and 512.0 KiB per worker: too little work to pay for starting workers "
        f"(docs/reference-build.md#small-builds)"]
    assert rep["jobs"] == 2 and rep["shards"]["built"] == 4
    monkeypatch.setenv(ENV, "0")   # off: the same build on two forked workers
    rep2 = precompile.build(_recipe(root), tmp_path / "two", n_jobs=2)
    assert forks == [4] and rep2["events"] == []
    one, two = _shards(tmp_path / "one"), _shards(tmp_path / "two")
    assert len(one) == 4 and one == two


@pytest.mark.parametrize("bounds, workers", [("9,100000", False), ("4,100000", True), ("32,1", True),
                                             ("0", True)])
def test_either_bound_reached_gets_the_workers(tmp_path, monkeypatch, bounds, workers):
    """8 inputs in 4 shards at -j 2: in one process under 9 inputs per worker (18 for two); at 4 per
    worker (8 for two) or past 1 byte per worker the workers build it; 0 turns the rule off."""
    root = _inputs(tmp_path / "in", 8)
    forks = _forks(monkeypatch)
    monkeypatch.setenv(ENV, bounds)
    rep = precompile.build(_recipe(root), tmp_path / "out", n_jobs=2)
    assert forks == ([4] if workers else [])
    assert bool(rep["events"]) is not workers


def test_the_bounds_count_workers_as_at_most_one_per_shard_to_build(tmp_path, monkeypatch):
    """-j 8 on 2 shards of 4 inputs: 2 workers, so 8 inputs are past 4 per worker (8 in all)."""
    root = _inputs(tmp_path / "in", 8)
    forks = _forks(monkeypatch)
    monkeypatch.setenv(ENV, "4,100000")
    precompile.build(_recipe(root, per_shard=4), tmp_path / "out", n_jobs=8)
    assert forks == [2]
    monkeypatch.setenv(ENV, "5,100000")
    rep = precompile.build(_recipe(root, per_shard=4), tmp_path / "out", n_jobs=8, force=True)
    assert forks == [2] and rep["events"][0].startswith("built in one process although -j 8 was asked: 8 input(s)")


@pytest.mark.parametrize("seconds, inline", [("0", 1), ("1000", 4)])
def test_a_small_build_whose_first_shards_took_long_hands_the_rest_to_workers(tmp_path, monkeypatch, seconds,
                                                                              inline):
    """Within the bounds, 4 shards: past SECONDS of work left (estimated from the first shard's seconds per
    sample) the workers build the 3 shards left, and say so; the bytes are the same either way."""
    root = _inputs(tmp_path / "in", 8)
    forks = _forks(monkeypatch)
    monkeypatch.setenv(ENV, f"32,100000,{seconds}")
    rep = precompile.build(_recipe(root), tmp_path / "out", n_jobs=2)
    assert forks == ([] if inline == 4 else [3]) and rep["shards"]["built"] == 4
    assert len(rep["events"]) == 1
    if inline == 1:
        assert rep["events"][0].startswith("built 1 of 4 shard(s) in one process (a small build), then started "
                                           "workers for the other 3: ")
    else:
        assert rep["events"][0].startswith("built in one process although -j 2 was asked")
    monkeypatch.setenv(ENV, "0")
    precompile.build(_recipe(root), tmp_path / "workers", n_jobs=2)
    assert _shards(tmp_path / "out") == _shards(tmp_path / "workers")


def test_the_bounds_count_inputs_not_their_copies(tmp_path, monkeypatch):
    """8 inputs, 9 samples each (8 copies and the original): 72 samples, 8 inputs, under 32 per worker; the
    copies' cost is the measured part's to judge."""
    root = _inputs(tmp_path / "in", 8)
    forks = _forks(monkeypatch)
    rep = precompile.build(_recipe(root, copies=8, keep_original=True), tmp_path / "out", n_jobs=2)
    assert forks == [] and rep["num_samples"] == 72
    assert rep["events"][0].startswith("built in one process although -j 2 was asked: 8 input(s) and ")


def test_a_video_counts_four_times_its_bytes(tmp_path, monkeypatch):
    """Two tiny MPEG-4 videos of V bytes in two shards at -j 2, bounded at 2V per worker (4V for two): 8V as
    videos, so the workers build them; as images (not decoded here) the same bytes would be under it."""
    import cv2

    root = tmp_path / "in"
    root.mkdir()
    for i in range(2):
        wr = cv2.VideoWriter(str(root / f"v{i}.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 25, (32, 32))
        for t in range(8):
            wr.write(np.full((32, 32, 3), 20 * t + 40 * i, np.uint8))
        wr.release()
    size = max(p.stat().st_size for p in root.iterdir())
    recipe = {"name": "small", "seed": 1, "inputs": {"root": str(root), "match": "{name}.mp4",
                                                      "fields": {"video": {"decoder": "video"}}},
              "output": {"samples_per_shard": 1}}
    forks = _forks(monkeypatch)
    monkeypatch.setenv(ENV, f"32,{2 * size}")
    rep = precompile.build(recipe, tmp_path / "out", n_jobs=2)
    assert forks == [2] and rep["events"] == []
    monkeypatch.setenv(ENV, f"32,{8 * size + 1}")
    rep = precompile.build(recipe, tmp_path / "out", n_jobs=2, force=True)
    assert forks == [2] and " KiB to build (videos counted 4x), under 32 inputs" in rep["events"][0]


def test_on_error_in_one_process_is_the_workers(tmp_path, monkeypatch):
    """A bad input at -j 2: skipped with the same message in one process as on the workers; with on_error:
    fail, the same error stops both."""
    root = _inputs(tmp_path / "in", 6, bad=3)
    rep = precompile.build(_recipe(root, on_error="skip"), tmp_path / "one", n_jobs=2)
    monkeypatch.setenv(ENV, "0")
    rep2 = precompile.build(_recipe(root, on_error="skip"), tmp_path / "two", n_jobs=2)
    assert len(rep["failures"]) == 1 and "img_003.png" in rep["failures"][0]["message"]
    assert rep["failures"] == rep2["failures"] and _shards(tmp_path / "one") == _shards(tmp_path / "two")
    errors = []
    for env in ("", "0"):
        monkeypatch.setenv(ENV, env)
        with pytest.raises(BuildError) as e:
            precompile.build(_recipe(root), tmp_path / f"fail{env}", n_jobs=2)
        errors.append(str(e.value).replace(str(tmp_path / f"fail{env}"), "OUT"))
    assert errors[0] == errors[1] and "img_003.png" in errors[0]


def test_loky_workers_are_always_used(tmp_path, monkeypatch):
    """PRECOMPILE_WORKERS=loky: no small-build rule (its workers start while the build plans, and must not
    be left starting while the parent builds inline: they watch their parent only once a task runs)."""
    root = _inputs(tmp_path / "in", 4)
    monkeypatch.setenv("PRECOMPILE_WORKERS", "loky")
    calls: list[int] = []
    real = backends.run_loky
    monkeypatch.setattr(backends, "run_loky", lambda todo, *a, **k: calls.append(len(todo)) or real(todo, *a, **k))
    rep = precompile.build(_recipe(root), tmp_path / "out", n_jobs=2)
    assert calls == [2] and rep["events"] == []


def test_input_bytes_of_files_folders_urls(tmp_path):
    (tmp_path / "series" / "sub").mkdir(parents=True)
    (tmp_path / "series" / "a.dcm").write_bytes(b"x" * 300)
    (tmp_path / "series" / "sub" / "b.dcm").write_bytes(b"x" * 500)
    assert backends._input_bytes(str(tmp_path / "series" / "a.dcm"), 10 ** 6) == 300
    assert backends._input_bytes(str(tmp_path / "series"), 10 ** 6) == 800
    assert backends._input_bytes(str(tmp_path / "series"), 100) in (300, 500)   # stops once past the limit
    assert backends._input_bytes("s3://bucket/a.jpg", 1000) == 1001             # a URL counts as large
    assert backends._input_bytes(str(tmp_path / "missing.png"), 1000) == 0       # its task says it is missing


@pytest.mark.parametrize("raw", ["many", "32", "1,2,x", "-1,5", "1,2,3,4", "1,2,-1", "1,2,nan"])
def test_a_malformed_setting_is_an_error_naming_it(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(BuildError) as e:
        backends.small_bounds()
    assert str(e.value) == (f"PRECOMPILE_SMALL_BUILD={raw!r}: use INPUTS,BYTES[,SECONDS] (per worker; e.g. "
                            f"32,524288,0.3) or 0 (off)")


def test_the_cli_says_in_one_line_that_it_built_in_one_process(tmp_path):
    root = _inputs(tmp_path / "in", 4)
    (tmp_path / "r.json").write_text(json.dumps(_recipe(root)))   # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "precompile", "build", str(tmp_path / "r.json"), "-o",
                        str(tmp_path / "out"), "-j", "2", "--no-progress"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    notes = [ln for ln in p.stderr.splitlines() if "one process" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: built in one process although -j 2 was asked: "
                                                   "4 input(s) and ")
