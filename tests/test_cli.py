"""The command line: output, exit codes, one clean error line (no traceback)."""
from __future__ import annotations

import os
import subprocess
import sys

from click.testing import CliRunner

from precompile.cli import main

from conftest import REPO, image_recipe, write_recipe


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precompile", *args], capture_output=True, text=True)


def test_validate_plan_build_inspect(tmp_path, image_recipe_file):
    r = CliRunner().invoke(main, ["validate", str(image_recipe_file)])
    assert r.exit_code == 0 and "ok" in r.output
    r = CliRunner().invoke(main, ["plan", str(image_recipe_file)])
    assert r.exit_code == 0
    assert "samples   10" in r.output and "shards    3" in r.output
    assert "image        image (32, 32, 3) uint8" in r.output and "label        label () int64" in r.output
    assert "(30.1 KiB of sample data)" in r.output  # 10 * (3072 + 8) bytes
    est = float(r.output.split("size")[1].split()[0])   # KiB on disk, as plan estimates it
    r = CliRunner().invoke(main, ["build", str(image_recipe_file), "-o", str(tmp_path / "out"), "-j", "2",
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "10 samples" in r.output and "3 shard(s) built" in r.output and "decode" in r.output
    written = sum(os.path.getsize(p) for p in (tmp_path / "out" / "imgs.shards").glob("*.h5")) / 1024
    assert abs(est - written) <= 0.05 * written, (est, written)
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "out" / "imgs.h5")])
    assert r.exit_code == 0
    for text in ("samples      10 in 3 shard(s)", "(32, 32, 3)", "uint8", "chunks of", "0=cat, 1=dog",
                 "recipe hash", "precompile 0.1.0"):
        assert text in r.output, text


def test_recipe_error_is_one_line_with_exit_code_2(tmp_path, image_tree):
    p = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree, steps=[{"resize": {"size": [1, 2, 3]}}]))
    out = run("validate", str(p))
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {p}: steps[0].resize.size: expected an integer or 2 integers [height, width], got 3 values"
    assert "Traceback" not in out.stderr


def test_build_failure_exit_code_3_no_traceback(tmp_path, image_tree):
    (image_tree / "cat" / "000.jpg").write_bytes(b"\xff\xd8\xff broken")
    p = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree))
    out = run("build", str(p), "-o", str(tmp_path / "out"), "--no-progress")
    assert out.returncode == 3
    assert "cat/000.jpg" in out.stderr and "stage decode" in out.stderr and "Traceback" not in out.stderr


def test_inspect_missing_file_exit_code_5(tmp_path):
    out = run("inspect", str(tmp_path / "nothing.h5"))
    assert out.returncode == 5 and "no such file" in out.stderr


def test_missing_recipe_file(tmp_path):
    out = run("plan", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "cannot read recipe" in out.stderr


def test_a_command_leaves_its_objects_out_of_the_exit_collections():
    """The process of a CLI command freezes what is alive at its exit (gc.freeze, an exit handler), so the
    interpreter's shutdown does not run full collections over every imported object (0.1-0.2 s of CPU after
    the last line; benchmarks/bench_serial.py). A handler registered before the command runs after it."""
    code = ("import atexit, gc, os, sys\n"
            "atexit.register(lambda: os.write(1, b'frozen %d\\n' % gc.get_freeze_count()))\n"
            "from precompile.cli import main\n"
            "main(sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-c", code, "validate", str(REPO / "recipes" / "images.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ": ok (1 field(s), 2 step(s), output hdf5;" in out.stdout
    assert int(out.stdout.split("frozen ")[-1]) > 10_000, out.stdout   # the imports' objects (~100k)


def test_a_build_leaves_the_imports_objects_out_of_its_collections(tmp_path):
    """``build`` imports the build path with the collector paused and freezes what the imports made while the
    build runs (collections over them were 0.05-0.1 s of a small build's CPU; benchmarks/bench_serial.py); when
    the command returns in-process (CliRunner) they are unfrozen and the collector is as it was."""
    code = ("import gc, sys\n"
            "import precompile.compiler as c\n"
            "from click.testing import CliRunner\n"
            "from precompile.cli import main\n"
            "seen, real = [], c.build\n"
            "def spy(*a, **k):\n"
            "    seen.append((gc.get_freeze_count() > 10_000, gc.isenabled()))\n"
            "    return real(*a, **k)\n"
            "c.build = spy\n"
            "for enabled in (True, False):\n"
            "    (gc.enable if enabled else gc.disable)()\n"
            "    r = CliRunner().invoke(main, ['build', sys.argv[1], '-o', sys.argv[2], '--no-progress'])\n"
            "    print(r.exit_code, seen[-1], gc.get_freeze_count(), gc.isenabled(), '36 samples' in r.output)\n")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "recipes" / "images.yaml"), str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["0 (True, True) 0 True True", "0 (True, False) 0 False True"], out.stdout


def test_sample_recipe_builds_from_the_repo(tmp_path):
    out = run("build", str(REPO / "recipes" / "images.yaml"), "-o", str(tmp_path), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "36 samples" in out.stdout
    import precompile

    ds = precompile.open(tmp_path / "images.h5")
    assert ds.label_names == ["beach", "forest", "night"] and ds[0]["image"].shape == (64, 64, 3)


def test_bad_job_count_and_unwritable_output_are_one_line_errors(tmp_path, image_recipe_file):
    out = run("build", str(image_recipe_file), "-j", "0", "--no-progress")
    assert out.returncode == 2 and "positive number of jobs" in out.stderr and "Traceback" not in out.stderr
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = run("build", str(image_recipe_file), "-o", str(blocker / "sub"), "--no-progress")
    assert out.returncode == 6 and "Traceback" not in out.stderr  # OutputError: the output folder's fault
    assert out.stderr.startswith("error: cannot create the output folder ") and str(blocker) in out.stderr


def test_unreachable_dask_scheduler_is_a_clean_error(tmp_path, image_recipe_file):
    import pytest

    pytest.importorskip("dask.distributed", reason="dask.distributed is not installed (extra 'dask')")
    out = run("build", str(image_recipe_file), "-o", str(tmp_path / "o"), "--scheduler", "tcp://127.0.0.1:9",
              "--no-progress")
    assert out.returncode == 3 and "cannot reach the dask scheduler" in out.stderr and "Traceback" not in out.stderr


def test_negative_seed_and_clashing_where_group_are_recipe_errors(tmp_path, image_tree):
    p = write_recipe(tmp_path / "r.yaml", image_recipe(image_tree, seed=-1))
    out = run("validate", str(p))
    assert out.returncode == 2 and ": seed: " in out.stderr
    r = image_recipe(image_tree)
    r["inputs"]["where"] = {"ext": "(?P<name>jpg)"}
    out = run("validate", str(write_recipe(tmp_path / "r2.yaml", r)))
    assert out.returncode == 2 and "inputs.where" in out.stderr and "Traceback" not in out.stderr
