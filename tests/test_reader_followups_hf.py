"""to_hf follow-ups (the bridge to Hugging Face ``datasets``: skipped where it is not installed; .ci/run's bridges
line runs it): a build read from a URL as ``precompile.open`` reads it, and the rows written are those of the
build whose digest names the cache entry. Truths: ``precompile.open`` of the local build, sample by sample."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("datasets", reason="Hugging Face datasets is not installed (the hf extra)")

import precompile  # noqa: E402
from precompile import hf  # noqa: E402
from precompile.errors import PrecompileError  # noqa: E402

from conftest import image_recipe, make_image_tree  # noqa: E402

try:   # the moto S3 server fixture (test_remote's); its module skips without s3fs / moto / boto3
    from test_remote import BUCKET, s3, upload_tree  # noqa: F401,E402
except pytest.skip.Exception as e:
    s3, NO_S3 = None, str(e)

SMALL = [{"resize": {"size": [8, 8]}}]


def _recipe(root):
    return image_recipe(root, name="r", steps=SMALL, output={"format": "hdf5", "samples_per_shard": 2})


def _local(index) -> dict[str, dict[str, np.ndarray]]:
    ds = precompile.open(index)
    try:
        return {ds.key(i): {f: np.asarray(v).copy() for f, v in ds[i].items()} for i in range(len(ds))}
    finally:
        ds.close()


def _rows_of(out, fields=("image", "label")) -> dict[str, dict[str, np.ndarray]]:
    rows = out.with_format("numpy", dtype=None)
    return {str(r["__key__"]): {f: hf.array(out, r, f) for f in fields} for r in rows}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].keys() == b[k].keys() and all(
        np.array_equal(np.asarray(a[k][f]).reshape(np.shape(b[k][f])), b[k][f]) for f in a[k]) for k in a)


def test_to_hf_writes_the_rows_of_the_build_its_digest_names(tmp_path, monkeypatch):
    """Before: to_hf took the cache digest from the build it opened, then ``_rows`` opened the path again: a
    rebuild in between wrote the new build's pixels under the old build's digest (and a later to_hf of the old
    build came back with them). Now the rows come from the build the digest was taken of."""
    root = make_image_tree(tmp_path / "in", classes=("x", "y"), per_class=2, size=(12, 10), seed=1)
    index = tmp_path / "out" / "r.h5"
    precompile.build(_recipe(root), out_dir=tmp_path / "out")
    before = _local(index)
    real = hf._rows

    def rebuilt_first(*args, **kwargs):   # a rebuild (new pixels, the same keys) between to_hf and its rows
        make_image_tree(tmp_path / "in", classes=("x", "y"), per_class=2, size=(12, 10), seed=2)
        precompile.build(_recipe(root), out_dir=tmp_path / "out")
        yield from real(*args, **kwargs)

    monkeypatch.setattr(hf, "_rows", rebuilt_first)
    out = hf.to_hf(index, cache_dir=str(tmp_path / "cache"))
    after = _local(index)
    assert after.keys() == before.keys() and not _same(after, before)   # the rebuild changed the pixels
    assert _same(_rows_of(out), before)
    monkeypatch.setattr(hf, "_rows", real)
    assert _same(_rows_of(hf.to_hf(index, cache_dir=str(tmp_path / "cache"))), after)   # the new build: its rows


def test_rows_read_by_path_of_a_build_rebuilt_since_are_an_error(tmp_path):
    """Where ``_rows`` has not the opened build at hand (another process) it opens the path: a build of other
    shard keys than the digest's is an error, never its rows under that digest."""
    root = make_image_tree(tmp_path / "in", classes=("x", "y"), per_class=2, size=(12, 10), seed=1)
    index = tmp_path / "out" / "r.h5"
    precompile.build(_recipe(root), out_dir=tmp_path / "out")
    ds = precompile.open(index)
    digest = hf._digest_of(ds)
    ds.close()
    fields = json.dumps(["image", "label"])
    assert len(list(hf._rows(str(index), fields, False, digest))) == 4
    make_image_tree(tmp_path / "in", classes=("x", "y"), per_class=2, size=(12, 10), seed=2)
    precompile.build(_recipe(root), out_dir=tmp_path / "out")
    with pytest.raises(PrecompileError, match=r"to_hf: .*r\.h5 was rebuilt while its rows were being written"):
        list(hf._rows(str(index), fields, False, digest))


def test_to_hf_reads_a_build_at_a_url_as_precompile_open_does(tmp_path, monkeypatch, request):
    """Before: to_hf("s3://...") made the URL a local path (os.path.abspath: '/cwd/s3:/bucket/...', no such file)
    and took no storage_options. Now a URL is read as precompile.open reads it (storage_options passed on), and
    a build opened with precompile.open (its cache_dir, cache_limit, storage_options) is taken as it is."""
    if s3 is None:
        pytest.skip(NO_S3)
    endpoint, client = request.getfixturevalue("s3")
    root = make_image_tree(tmp_path / "in", classes=("x", "y"), per_class=2, size=(12, 10), seed=1)
    index = tmp_path / "out" / "r.h5"
    precompile.build(_recipe(root), out_dir=tmp_path / "out")
    upload_tree(client, index.parent, "hf1")
    url, so = f"s3://{BUCKET}/hf1/r.h5", {"endpoint_url": endpoint, "anon": True}
    monkeypatch.setenv("PRECOMPILE_CACHE", str(tmp_path / "shards"))
    want = _local(index)
    out = hf.to_hf(url, storage_options=so, cache_dir=str(tmp_path / "cache"))
    assert _same(_rows_of(out), want)
    opened = precompile.open(url, cache_dir=tmp_path / "c2", storage_options=so)
    only = hf.to_hf(opened, fields=["image"], cache_dir=str(tmp_path / "cache2"))
    assert only.column_names == ["__key__", "image"]
    assert _same(_rows_of(only, ("image",)), {k: {"image": v["image"]} for k, v in want.items()})
    assert len(opened) == 4 and opened[0]["image"].shape == (8, 8, 3)   # the caller's build stays open
    with pytest.raises(ValueError, match="storage_options apply to a build given by its URL"):
        hf.to_hf(opened, storage_options=so)
    with pytest.raises(ValueError, match="cache_dir, cache_limit and storage_options apply to a build read from a URL"):
        hf.to_hf(index, storage_options=so)
