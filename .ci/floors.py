#!/usr/bin/env python3
"""Print pinned requirements at the *minimum* versions setup.cfg declares (``pkg>=X`` -> ``pkg==X``).

Used by ``.ci/run``'s floors job: a separate venv gets exactly these versions and runs the tests marked
``floors``, so a declared floor that does not work fails CI. Arguments name extras to include as well
(e.g. ``nifti test``); ``--tests`` prints the floors test files instead: every test module (``FLOORS_MODULES``
in tests/conftest.py is None), each running with whatever of its dependencies the floors venv has (a module
whose optional library is absent skips with the reason). Every floor is installed: torch, dask, fsspec/s3fs
and jsonschema too; moto (test tooling) at whatever version fits them.
"""
from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

SKIP: set[str] = set()   # every declared floor is installed and tested
#: test tooling whose own floor is not a user's: installed at whatever version fits the pinned floors
#: (moto 5.0.0's server extra cannot be resolved together with jsonschema 4.18)
UNPINNED = {"moto"}
ROOT = Path(__file__).resolve().parents[1]


def floors(extras: list[str]) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [r for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    for e in extras:
        reqs += [r for r in cfg["options.extras_require"][e].splitlines() if r.strip()]
    out: dict[str, str] = {}
    for r in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*", r)
        if not m:
            sys.exit(f"floors.py: {r!r} has no plain '>=' floor; give every requirement one")
        name = m.group(1)
        if name.lower() in SKIP:
            continue
        pin = "" if name.lower() in UNPINNED else f"=={m.group(3)}"
        out[name.lower()] = f"{name}{m.group(2) or ''}{pin}"
    return [out[k] for k in sorted(out)]


def floor_tests() -> list[str]:
    """The test files of the floors job: ``FLOORS_MODULES`` in tests/conftest.py (which marks them ``floors``);
    None there means every ``tests/test_*.py``."""
    import ast

    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLOORS_MODULES" for t in node.targets):
            mods = ast.literal_eval(node.value)
            if mods is None:
                return sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))
            return [f"tests/{m}.py" for m in sorted(mods)]
    sys.exit("floors.py: no FLOORS_MODULES in tests/conftest.py")


if __name__ == "__main__":
    if sys.argv[1:] == ["--tests"]:
        print(" ".join(floor_tests()))
    else:
        print("\n".join(floors(sys.argv[1:])))
