"""Builds and checks shared by the Loader tests (a helper module, not a test file).

- ``built`` / ``ds``: a build made by ``precompile.build`` from generated PNG and JPEG files
  (120 samples of 8x8 RGB, 5 samples per chunk, 32 per shard), module-scoped; shards are
  rewritten with h5py (:func:`_rewrite_shard`) where a test needs an unusual layout.
- ``small_build``: 10 samples of 32x32 RGB in shards of 4, from the conftest image tree.
- :func:`_assert_same_as_dataset`: a pass of the Loader gives the map-style dataset's bytes.
"""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from PIL import Image

import precompile
from precompile import build
from precompile.reader.loader import Loader
from precompile.recipe import parse_recipe

from conftest import image_recipe, write_recipe

N, CHUNK, PER_SHARD = 120, 5, 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_inputs(root: str) -> None:
    rng = np.random.default_rng(7)
    for c in ("cat", "dog", "eel"):
        os.makedirs(os.path.join(root, c), exist_ok=True)
    for i in range(N):
        c = ("cat", "dog", "eel")[i % 3]
        img = Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8))
        if i % 2:
            img.save(os.path.join(root, c, f"{i:04d}.png"))
        else:
            img.save(os.path.join(root, c, f"{i:04d}.jpg"), quality=90)


def _build(tmp: str, name: str = "t") -> str:
    _make_inputs(os.path.join(tmp, "in"))
    recipe = parse_recipe({
        "name": name, "seed": 0,
        "inputs": {"root": "in", "match": "{label}/{name}.{ext}", "where": {"ext": "png|jpg"},
                   "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [8, 8]}}],
        "output": {"format": "hdf5", "samples_per_shard": PER_SHARD, "chunk_samples": CHUNK},
    }, base_dir=tmp)
    build(recipe, out_dir=os.path.join(tmp, "out"))
    return os.path.join(tmp, "out", f"{name}.h5")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("loader")))


@pytest.fixture()
def ds(built):
    d = precompile.open(built)
    yield d
    d.close()


@pytest.fixture
def small_build(tmp_path, image_tree) -> str:
    precompile.build(write_recipe(tmp_path / "r.yaml", image_recipe(image_tree)), out_dir=tmp_path / "out")
    return str(tmp_path / "out" / "imgs.h5")


def _rewrite_shard(path: str, *, compression: str | None = None, scramble: bool = False) -> None:
    """Rewrite a shard with the same datasets: gzip chunks, or chunks written in reverse, unaligned, with junk between."""
    with h5py.File(path, "r") as f:
        data = {k: f[k][()] for k in f}
        dtypes = {k: f[k].dtype for k in f}
        chunks = {k: f[k].chunks for k in f}
        attrs = dict(f.attrs)
    os.remove(path)
    with h5py.File(path, "w") as g:
        for k, v in data.items():
            if k.startswith("__"):
                g.create_dataset(k, data=v, dtype=dtypes[k])
                continue
            d = g.create_dataset(k, shape=v.shape, dtype=v.dtype, chunks=chunks[k], compression=compression)
            c = chunks[k][0]
            starts = list(range(0, len(v), c))
            for j, s in enumerate(reversed(starts) if scramble else starts):
                d[s:s + c] = v[s:s + c]
                if scramble:  # a small allocation between chunks: addresses are not evenly spaced
                    g.create_dataset(f"junk_{k}_{j}", data=np.arange(j * 13 + 3, dtype=np.uint8))
        for k, v in attrs.items():
            g.attrs[k] = v
    _drop_chunk_tables(os.path.dirname(path)[:-len(".shards")] + ".h5")


def _drop_chunk_tables(index: str) -> None:
    """Make ``index`` an index without chunk tables (as written before they existed): the Loader then
    resolves every shard through h5py (a rewritten shard no longer matches the tables)."""
    from precompile.formats import names as fmt

    with h5py.File(index, "r+") as f:
        if fmt.CHUNKS in f:
            del f[fmt.CHUNKS]
        entries = fmt.loads(f.attrs[fmt.A_SHARDS])
        f.attrs[fmt.A_SHARDS] = fmt.dumps([{k: v for k, v in e.items() if k != fmt.E_CHUNKS} for e in entries])


def _chunk_addresses(path: str, name: str) -> list[int]:
    with h5py.File(path, "r") as f:
        out: list[tuple[int, int]] = []
        f[name].id.chunk_iter(lambda ci: out.append((ci.chunk_offset[0], ci.byte_offset)))
    return [a for _, a in sorted(out)]


def _assert_same_as_dataset(loader: Loader, ds, epoch: int | None = None) -> int:
    if epoch is not None:
        loader.set_epoch(epoch)
    idx = loader.batch_indices()
    got = list(loader)
    assert len(got) == len(idx) == len(loader)
    for b, i in zip(got, idx):
        ref = ds.batch(i)
        for f in loader.fields:
            np.testing.assert_array_equal(b[f].numpy(), ref[f])
    return len(got)
