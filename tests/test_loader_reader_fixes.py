"""DirectReader robustness: open-file limits, dtype mismatches, use after close, fallback files per process.

Builds come from ``precompile.build`` on small generated image trees (conftest), so every test reads
bytes the project's own writer produced; shards are rewritten with h5py where a test needs a layout
the writer never makes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import precompile
from precompile.errors import FormatError, PrecompileError
from precompile.reader.direct import DirectReader

from conftest import image_recipe, write_recipe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def one_per_shard(tmp_path, image_tree) -> str:
    """10 samples of 16x16x3, one per shard: 10 shard files."""
    r = image_recipe(image_tree, steps=[{"resize": {"size": [16, 16]}}],
                     output={"format": "hdf5", "samples_per_shard": 1})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    return str(tmp_path / "out" / "imgs.h5")


_LIMITED = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    import precompile
    from precompile.errors import FormatError
    from precompile.reader import direct
    from precompile.reader.direct import DirectReader
    direct.USE_REGION = sys.argv[3] == "region"
    ds = precompile.open(sys.argv[1])
    ref = ds.batch(range(len(ds)))["image"]      # the map-style dataset's bytes (h5py)
    ds.close()
    ds = precompile.open(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 4   # room for 3 or so shards, the build has 10
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, low if sys.argv[2] == "fixed" else hard))
    try:
        r = DirectReader(ds)
    except FormatError as e:
        print("FormatError:", e)
        sys.exit(0)
    got = r.read(np.arange(len(ds)))["image"]
    print("read", len(got), "equal", bool(np.array_equal(got, ref)),
          "raised", resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low)
""")


def _run_limited(index: str, mode: str, maps: str = "per-shard") -> str:
    out = subprocess.run([sys.executable, "-c", _LIMITED, index, mode, maps], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or sys.platform == "win32",
                    reason="needs POSIX rlimits and /proc/self/fd to count open files")
def test_open_file_limit_is_raised_or_reported(one_per_shard):
    # one map per shard (the fallback where no region can be reserved):
    # the soft limit can go up to the hard one: the reader raises it and reads every shard
    assert _run_limited(one_per_shard, "raisable") == "read 10 equal True raised True"
    # the hard limit is too low: a FormatError that names the cause, not a bare OSError
    msg = _run_limited(one_per_shard, "fixed")
    if sys.version_info >= (3, 13):  # maps keep no descriptor: 10 shards fit
        assert msg.startswith("read 10 equal True"), msg
    else:
        assert msg.startswith("FormatError:") and "too many open files" in msg.lower() \
            and "open-file limit" in msg and "ulimit -n" in msg, msg
    # one region for all shards closes each descriptor once its file is mapped: no limit to raise
    if sys.platform.startswith("linux"):
        for mode in ("raisable", "fixed"):
            assert _run_limited(one_per_shard, mode, "region") == "read 10 equal True raised False"


def _rewrite_field(path: str, name: str, fn) -> None:
    with h5py.File(path, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = dict(f.attrs)
    os.remove(path)
    with h5py.File(path, "w") as g:
        for k, v in data.items():
            g.create_dataset(k, data=fn(v) if k == name else v)
        for k, v in attrs.items():
            g.attrs[k] = v


def _shard(index: str, s: int) -> str:
    ds = precompile.open(index)
    p = os.path.join(os.path.dirname(index), ds.shards[s]["file"])
    ds.close()
    return p


def test_dtype_mismatch_is_refused_and_byte_order_falls_back(one_per_shard):
    shard = _shard(one_per_shard, 2)
    _rewrite_field(shard, "label", lambda v: v.astype(">i8"))     # same values, big-endian: h5py converts
    ds = precompile.open(one_per_shard)
    r = DirectReader(ds)
    assert "stored as >i8" in r.fallbacks[(2, "label")]
    np.testing.assert_array_equal(r.read(np.arange(len(ds)))["label"], ds.batch(range(len(ds)))["label"])
    r.close()
    ds.close()
    _rewrite_field(shard, "label", lambda v: v.astype(np.int32))  # another type: values would wrap silently
    ds = precompile.open(one_per_shard)
    with pytest.raises(FormatError, match=r"dataset 'label' has dtype <i4, the index says <i8"):
        DirectReader(ds)
    ds.close()


def test_reader_after_close_is_a_clear_error(one_per_shard):
    ds = precompile.open(one_per_shard)
    r = DirectReader(ds)
    np.testing.assert_array_equal(r.read([3, 1])["image"], ds.batch([3, 1])["image"])
    plan = r.plan(np.array([3, 1, 3, 0, 2, 1, 0, 3, 2, 1, 0]))  # planned before close, gathered after
    r.close()
    assert r.closed
    with pytest.raises(PrecompileError, match="reader is closed"):
        r.read([3, 1])
    with pytest.raises(PrecompileError, match="reader is closed"):
        r.gather("image", plan, np.empty((plan.size, 16, 16, 3), np.uint8))
    ds.close()


def test_fallback_shards_open_lazily_in_the_reading_process(one_per_shard):
    shard = _shard(one_per_shard, 4)
    with h5py.File(shard, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = dict(f.attrs)
    os.remove(shard)
    with h5py.File(shard, "w") as g:
        for k, v in data.items():
            g.create_dataset(k, data=v, compression="gzip" if k == "image" else None)
        for k, v in attrs.items():
            g.attrs[k] = v
    ds = precompile.open(one_per_shard)
    r = DirectReader(ds)
    assert "filtered" in r.fallbacks[(4, "image")]
    assert r._h5 == {}                               # nothing held open from construction
    want = ds.batch([4, 0, 4])["image"]
    np.testing.assert_array_equal(r.read([4, 0, 4])["image"], want)
    first = r._h5[4]
    assert first.id.valid
    r._pid = -1                                      # as if this reader had been inherited by a forked child
    np.testing.assert_array_equal(r.read([4])["image"], want[:1])
    assert r._h5[4] is not first and r._pid == os.getpid()
    second = r._h5[4]
    first.close()
    r.close()
    assert not second.id.valid and r._h5 == {}       # close() closes the files this process opened
    ds.close()


def test_in_memory_reader_copies_mapped_and_fallback_shards(one_per_shard):
    shard = _shard(one_per_shard, 4)
    with h5py.File(shard, "r") as f:
        data = {k: f[k][()] for k in f}
        attrs = dict(f.attrs)
    os.remove(shard)
    with h5py.File(shard, "w") as g:   # one shard compressed: served by h5py, then copied like the rest
        for k, v in data.items():
            g.create_dataset(k, data=v, compression="gzip" if k == "image" else None)
        for k, v in attrs.items():
            g.attrs[k] = v
    ds = precompile.open(one_per_shard)
    want = ds.batch(range(len(ds)))
    r = DirectReader(ds, in_memory=True)
    assert "filtered" in r.fallbacks[(4, "image")] and r._maps == {} and r.region is None
    idx = np.array([9, 4, 0, 4, 7, 1])
    for f in ("image", "label"):
        np.testing.assert_array_equal(r.read(idx)[f], want[f][idx])
        np.testing.assert_array_equal(r.read(np.arange(len(ds)))[f], want[f])
    r.close()
    with pytest.raises(PrecompileError, match="reader is closed"):
        r.read([0])
    ds.close()
