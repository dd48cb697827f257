"""Shared fixtures: small generated image trees, recipe writing, real-data location."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
REALDATA = Path(os.environ.get("PRECOMPILE_REALDATA", REPO.parent / "shared" / "realdata"))

# The tests build tiny inputs, which a -j N build would otherwise build in its own process (the small-build
# rule, docs/reference-build.md#the-stages): every test that asks for workers gets them, subprocesses
# included; tests/test_small_build.py unsets it to test the rule itself. Set PRECOMPILE_SMALL_BUILD to run
# the suite with the rule on (e.g. 32,524288,0.3).
os.environ.setdefault("PRECOMPILE_SMALL_BUILD", "0")

# Property tests draw fresh examples on every local run (that is how they find things: the floors job of one CI
# run drew an 8x4855 input no earlier run had); under CI (CI=true, or PRECOMPILE_CI=1, which .ci/run exports) the
# draws are fixed, so a submission lands or fails on its code, not on the luck of one draw.
# PRECOMPILE_HYPOTHESIS_RANDOM=1 keeps them random under CI too.
if (os.environ.get("CI") or os.environ.get("PRECOMPILE_CI")) and not os.environ.get("PRECOMPILE_HYPOTHESIS_RANDOM"):
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True)
    _hypothesis_settings.load_profile("ci")


def realdata_root() -> str:
    """The real third-party data folder; skips the test when ../shared/realdata is absent."""
    if not REALDATA.is_dir():
        pytest.skip(f"real data not available here: {REALDATA} (../shared/realdata is absent)")
    return str(REALDATA)


def realdata(*parts: str) -> Path:
    """Path of a real third-party file; skips the test when ../shared/realdata is absent."""
    p = REALDATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"real data not available here: {p} (../shared/realdata is absent)")
    return p


def realdata_files(*patterns: str, max_bytes: int | None = None) -> list[Path]:
    """Real files matching the glob ``patterns`` (``**`` recursive) under the real-data folder, sorted;
    [] when the folder is absent (module-level seeds; a test that needs them calls realdata_root())."""
    import glob

    out: list[Path] = []
    for pat in patterns:
        for p in sorted(glob.glob(str(REALDATA / pat), recursive=True)):
            if os.path.isfile(p) and (max_bytes is None or os.path.getsize(p) <= max_bytes):
                out.append(Path(p))
    return out


def make_image_tree(root: Path, classes=("cat", "dog"), per_class: int = 5, size=(40, 56), seed: int = 0) -> Path:
    """Write smooth random RGB JPEG/PNG images into root/<class>/<i>.<ext>."""
    import cv2
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            small = rng.integers(0, 256, (6, 8, 3)).astype(np.float32)
            img = cv2.resize(small, (size[1], size[0]), interpolation=cv2.INTER_CUBIC)
            arr = np.clip(img, 0, 255).astype(np.uint8)
            ext = "png" if i % 2 else "jpg"
            Image.fromarray(arr).save(root / c / f"{i:03d}.{ext}")
    return root


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def image_recipe(root: Path, **over) -> dict:
    r = {
        "name": "imgs",
        "seed": 7,
        "inputs": {"root": str(root), "match": "{label}/{name}.{ext}", "where": {"ext": "jpg|png"},
                   "fields": {"image": {"decoder": "image", "mode": "rgb8"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"shorter": 36}}, {"center_crop": {"size": [32, 32]}}],
        "output": {"format": "hdf5", "samples_per_shard": 4},
    }
    for k, v in over.items():
        r[k] = v
    return r


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    return make_image_tree(tmp_path / "data")


@pytest.fixture
def image_recipe_file(tmp_path: Path, image_tree: Path) -> Path:
    return write_recipe(tmp_path / "recipe.yaml", image_recipe(image_tree))


# The tests that .ci/run also runs against the minimum declared dependency versions (`-m floors`):
# None means every test module (each runs with what the floors venv has; a missing optional library skips).
FLOORS_MODULES = None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and (FLOORS_MODULES is None or item.module.__name__ in FLOORS_MODULES):
            item.add_marker(pytest.mark.floors)


def index_shards(index_path) -> dict[str, Path]:
    """{'shard-00003': path} of the shards the index at ``index_path`` names (names without their content key:
    a shard file is ``shard-00003-<key16>.h5``, or a folder of that name for the file-folder formats)."""
    import json

    from precompile.formats import snapshot

    index_path = Path(index_path)
    attrs = snapshot.read_index_attrs(str(index_path))
    assert attrs is not None, f"{index_path}: no readable index"
    files = [s["file"] for s in json.loads(attrs["shards"])]
    return {Path(f).name[:len("shard-00000")]: index_path.parent / f for f in files}


def shard_file(index_path, index: int) -> Path:
    """The shard of number ``index`` that the index at ``index_path`` names."""
    return index_shards(index_path)[f"shard-{index:05d}"]
