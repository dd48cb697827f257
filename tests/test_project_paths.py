"""One real-data rule for every test, and no absolute machine paths anywhere in the project.

Tests find the real third-party files only through ``conftest.py``'s helpers (``realdata``,
``realdata_root``, ``realdata_files``): ``$PRECOMPILE_REALDATA`` or ``../shared/realdata``, else the
test skips with the reason. No file of the package, the tests, the benchmarks, the recipes, the
sample data script or the docs names a path of one machine (a home, the root's or a work folder).
"""
from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

CHECKED = ["precompile", "tests", "benchmarks", "recipes", "sample_data", "docs"]
TEXT = {".py", ".yaml", ".yml", ".md", ".cfg", ".toml", ".txt", ".json"}
# an absolute path into a machine's folders (built from parts so that this file does not match itself)
MACHINE_PATH = re.compile("(?<![\\w.~])/(" + "|".join(["wo" + "rk", "ho" + "me", "ro" + "ot", "Us" + "ers"]) + ")/")


def _files() -> list[Path]:
    out = [p for d in CHECKED for p in sorted((REPO / d).rglob("*")) if p.is_file() and p.suffix in TEXT
           and "__pycache__" not in p.parts]
    return out + [p for p in sorted(REPO.glob("*")) if p.is_file() and p.suffix in TEXT]


def test_no_absolute_machine_paths_in_the_project():
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in _files()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if MACHINE_PATH.search(line)]
    assert not hits, "\n".join(hits)


def test_the_rule_catches_a_machine_path():
    assert MACHINE_PATH.search('REAL = "/' + 'work/shared/realdata"')
    assert MACHINE_PATH.search("open('/" + "home/me/x.png')")
    assert not MACHINE_PATH.search("root: ../sample_data/dicom") and not MACHINE_PATH.search("s3://bucket/work/x")


def test_only_conftest_reads_the_real_data_location():
    """The environment variable and the shared folder are named in conftest.py only; every other test
    goes through its helpers (which skip with the reason when the data is absent)."""
    name = "PRECOMPILE_" + "REALDATA"
    users = [p.name for p in sorted((REPO / "tests").glob("*.py"))
             if p.name not in ("conftest.py", Path(__file__).name) and (name in p.read_text() or '"shared", "real' + 'data"' in p.read_text())]
    assert users == []
