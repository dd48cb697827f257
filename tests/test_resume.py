"""Crash-safe resume: SIGKILL a real ``python -m precompile build`` at several points, run it again,
and get the same bytes as an uninterrupted build, having redone only the missing shards.

The inputs are 240 tiny generated PNGs in 30 shards of 8. A test-only decoder (a
plugin module in tmp_path, imported before running the ``precompile`` module)
sleeps a few milliseconds per input so the kill lands mid-build; the shard folder
is polled to pick the moment. The whole process group (loky workers too) is killed.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from precompile.tools.verify import verify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_INPUTS, PER_SHARD = 240, 8
N_SHARDS = N_INPUTS // PER_SHARD
PLUGIN_MOD = "pcplug_resume_slow"
PLUGIN = f'''"""Test-only decoder: the image decoder, a few milliseconds slower per input."""
import time

from precompile.decoders.image import ImageDecoder
from precompile.registry import DECODERS


@DECODERS.register()
class SlowImage(ImageDecoder):
    name = "{PLUGIN_MOD}"

    def read(self, path):
        time.sleep(0.004)
        return super().read(path)
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    base = tmp_path_factory.mktemp("resume")
    (base / "plug").mkdir()
    (base / "plug" / f"{PLUGIN_MOD}.py").write_text(PLUGIN)
    root = base / "in"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(N_INPUTS):
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(root / f"img_{i:04d}.png")
    data = {"name": "res", "seed": 3, "inputs": {"root": str(root), "match": "{name}.png",
                                                  "fields": {"image": {"decoder": PLUGIN_MOD}}},
            "steps": [{"resize": {"size": [6, 6]}}], "output": {"samples_per_shard": PER_SHARD}}
    recipe = base / "r.yaml"
    recipe.write_text(yaml.safe_dump(data))
    env = dict(os.environ, SOURCE_DATE_EPOCH="1700000000",
               PYTHONPATH=os.pathsep.join([str(base / "plug"), REPO, os.environ.get("PYTHONPATH", "")]))
    ref = base / "ref"
    r = subprocess.run(_cmd(recipe, ref, 1), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return recipe, ref, env


def _cmd(recipe, out, jobs: int) -> list[str]:
    run = f"import {PLUGIN_MOD}, runpy; runpy.run_module('precompile', run_name='__main__')"
    return [sys.executable, "-c", run, "build", str(recipe), "-o", str(out), "-j", str(jobs), "--no-progress"]


def _finished(shard_dir: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(shard_dir, "shard-*.h5")))


def _tmps(shard_dir: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(shard_dir, "*.tmp-*")))


def _read(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


@pytest.mark.parametrize("point,jobs", [("tmp", 1), ("one", 1), ("several", 2)])
def test_sigkill_then_rerun_is_byte_identical(setup, tmp_path, point, jobs):
    recipe, ref, env = setup
    out = tmp_path / "out"
    shard_dir = str(out / "res.shards")
    proc = subprocess.Popen(_cmd(recipe, out, jobs), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    want = {"tmp": lambda: bool(_tmps(shard_dir)) and not _finished(shard_dir),
            "one": lambda: len(_finished(shard_dir)) >= 1,
            "several": lambda: len(_finished(shard_dir)) >= 10}[point]
    deadline = time.monotonic() + 120
    hit = False
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isdir(shard_dir) and want():
            hit = True
            break
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert hit, f"the build ended before reaching the kill point {point!r}"
    finished, tmps = _finished(shard_dir), _tmps(shard_dir)
    assert len(finished) < N_SHARDS and not (out / "res.h5").exists()
    if point == "tmp":
        assert tmps and not finished  # killed while the first shard was half written
    # every file under a final name is complete: no half-written file was renamed into place
    for n in finished:
        assert _read(os.path.join(shard_dir, n)) == _read(ref / "res.shards" / n), n
    damaged = []
    if point == "one":
        # a finished shard that lost its tail (a disk that lied about fsync) is not taken as finished either
        damaged = [finished[0]]
        p = os.path.join(shard_dir, finished[0])
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)
    r = subprocess.run(_cmd(recipe, out, jobs), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "res.report.json").read_text())
    assert rep["shards"]["skipped"] == len(finished) - len(damaged)
    assert rep["shards"]["built"] == N_SHARDS - len(finished) + len(damaged)
    assert f"{rep['shards']['built']} shard(s) built, {rep['shards']['skipped']} up to date" in r.stdout
    assert not _tmps(shard_dir)
    assert _finished(shard_dir) == _finished(str(ref / "res.shards"))
    for n in _finished(shard_dir):
        assert _read(os.path.join(shard_dir, n)) == _read(ref / "res.shards" / n), n
    assert _index_content(out / "res.h5") == _index_content(ref / "res.h5")
    assert verify(out / "res.h5").ok


def _index_content(path) -> dict:
    """Every attribute and every dataset's bytes in the index (the VDS object headers carry timestamps that
    formats/hdf5.py does not switch off yet, so the index file's own bytes differ in those timestamps and their header checksum)."""
    import hashlib

    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        out["attrs"] = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in f.attrs.items()}
        for name in f:
            a = f[name][()]
            out[name] = hashlib.sha256(repr(a.tolist()).encode() if a.dtype == object else a.tobytes()).hexdigest()
    return out
