"""Progress advances per input wherever shard tasks run, its rate leaves out up-to-date shards, and
``--scheduler local`` uses the machine's cores and says where its dashboard is."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import precompile
from conftest import image_recipe, write_recipe
from precompile.compiler import progress as progress_mod

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def recorded(monkeypatch):
    """Every Progress.add call (shard, n) and every finished bar."""
    calls, bars = [], []
    real_add, real_close = progress_mod.Progress.add, progress_mod.Progress.close

    def add(self, shard, n=1):
        calls.append((shard, n))
        real_add(self, shard, n)

    def close(self):
        real_close(self)
        bars.append(self.bar)

    monkeypatch.setattr(progress_mod.Progress, "add", add)
    monkeypatch.setattr(progress_mod.Progress, "close", close)
    return calls, bars


@pytest.mark.parametrize("jobs", [1, 2])
def test_progress_per_input_and_rate_of_built_inputs_only(tmp_path, image_tree, recorded, jobs):
    calls, bars = recorded
    rf = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree))  # 10 inputs, shards of 4, 4, 2
    precompile.build(rf, out_dir=tmp_path / "out", n_jobs=jobs, progress=True)
    per_input = [c for c in calls if c[1] == 1]
    # one event per input from the shard tasks (in-process, or through the loky queue), plus a top-up call
    # per shard when its result arrives (a no-op once every input was counted)
    assert sorted(s for s, _ in per_input) == [0] * 4 + [1] * 4 + [2] * 2, calls
    bar = bars[-1]
    assert bar.n == bar.total == 10 and bar.format_dict["initial"] == 0
    calls.clear()
    rep = precompile.build(rf, out_dir=tmp_path / "out", n_jobs=jobs, progress=True)  # all up to date
    assert rep["up_to_date"] and calls == [] and len(bars) == 1  # a no-op build shows no bar at all
    last = sorted(p for p in image_tree.rglob("*") if p.is_file())[-1]  # an input of the last shard (2 inputs)
    os.utime(last, ns=(last.stat().st_atime_ns, last.stat().st_mtime_ns + 10**9))
    precompile.build(rf, out_dir=tmp_path / "out", n_jobs=jobs, progress=True)
    bar = bars[-1]
    # the 8 inputs of the up-to-date shards start the bar; the rate counts only the 2 inputs built
    assert sorted(c[0] for c in calls if c[1] == 1) == [2, 2] and bar.format_dict["initial"] == 8 and bar.n == 10
    line = bar.format_meter(**bar.format_dict)
    assert "762600" not in line and re.search(r"10/10 ", line), line


def test_local_dask_uses_all_cores_and_reports_dashboard(tmp_path, image_recipe_file):
    pytest.importorskip("dask.distributed", reason="dask.distributed is not installed (extra 'dask')")
    rep = precompile.build(image_recipe_file, out_dir=tmp_path / "d", scheduler="local")
    n = os.cpu_count() or 1
    assert rep["jobs"] == n and rep["shards"]["built"] == 3
    note = [e for e in rep["events"] if e.startswith("dask: local cluster")]
    assert note and f"of {n} worker(s)" in note[0]
    assert "dashboard at http://127.0.0.1:" in note[0] or "pip install bokeh" in note[0]
    out = subprocess.run([sys.executable, "-m", "precompile.cli", "build", str(image_recipe_file), "-o",
                          str(tmp_path / "cli"), "--scheduler", "local", "--progress"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"dask: local cluster of {n} worker(s)" in out.stderr
    assert "10/10" in out.stderr
