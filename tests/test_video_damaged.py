"""Damaged (truncated) videos give the same samples whatever runs the decode (issue 27).

A cut H.264 MP4 used to give 17 frames and ``decode_errors: 0`` at ``-j1`` (the parent process
let FFmpeg use frame threads, which dropped the frames in flight at the damaged packet) and
19 frames with one error at ``-j2`` (one thread per worker). Files of every codec the project
decodes (H.264 in MP4 and MKV, MPEG-4 part 2, MJPEG, VP9), made here with PyAV and cut at several
fractions of their bytes, are built with -j1, -j2 and a dask cluster and compared byte for byte,
and every stored frame is compared with a plain one-thread PyAV decode of the same file.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import precompile
from precompile.decoders.video import read_video, set_decode_threads

sys.path.insert(0, os.path.dirname(__file__))
from conftest import write_recipe  # noqa: E402
from test_video import _bars  # noqa: E402

av = pytest.importorskip("av")

# name -> (encoder, container options, pixel format, codec options)
CODECS = {
    "h264.mp4": ("libx264", {"movflags": "faststart"}, "yuv420p", {}),   # the file: index at the front
    "h264.mkv": ("libx264", {}, "yuv420p", {}),
    "mpeg4.mp4": ("mpeg4", {"movflags": "faststart"}, "yuv420p", {"qscale": "4"}),
    "mjpeg.avi": ("mjpeg", {}, "yuvj420p", {}),
    "vp9.webm": ("libvpx-vp9", {}, "yuv420p", {}),
}
CUTS = (0.35, 0.55, 0.8)


def frame(i: int, size=(128, 96)) -> np.ndarray:
    """Frame ``i``'s number in bars, with noise so that every frame costs bytes."""
    noise = np.random.default_rng(i).integers(-40, 40, (size[1], size[0], 3))
    return np.clip(_bars(i, size).astype(np.int16) + noise, 0, 255).astype(np.uint8)


def write(path: str, name: str, n: int = 40) -> None:
    codec, copts, pix, opts = CODECS[name]
    c = av.open(path, "w", options=copts)
    s = c.add_stream(codec, rate=25, options=opts)
    s.width, s.height, s.pix_fmt = 128, 96, pix
    for i in range(n):
        for p in s.encode(av.VideoFrame.from_ndarray(frame(i), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()


def pyav_frames(path: str, explode: bool = True) -> list[np.ndarray]:
    """Reference: PyAV alone, one codec thread, every packet decoded, rejected ones skipped;
    ``explode``: frames the codec finds damaged are rejected too (FFmpeg's ``err_detect``)."""
    c = av.open(path)
    s = c.streams.video[0]
    s.thread_count = 1
    if explode:
        s.codec_context.options = {"err_detect": "explode"}
    out = []
    try:
        for packet in c.demux(s):
            try:
                out += [f.to_ndarray(format="rgb24") for f in packet.decode()]
            except av.error.InvalidDataError:
                pass
    finally:
        c.close()
    return out


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("damaged")
    whole = tmp_path_factory.mktemp("whole")
    for name in CODECS:
        src = str(whole / name)
        write(src, name)
        with open(src, "rb") as fh:
            data = fh.read()
        stem, ext = name.split(".")
        for f in CUTS:
            (root / f"{stem}_{int(f * 100)}.{ext}").write_bytes(data[:int(len(data) * f)])
    return str(root)


def test_the_cut_files_are_damaged_and_decode_in_part(damaged):
    """The fixture is what the tests need: each file holds some but not all of its 40 frames,
    and at least the cut H.264 MP4s end in a packet the codec rejects."""
    for name in sorted(os.listdir(damaged)):
        n = len(pyav_frames(os.path.join(damaged, name)))
        assert 0 < n < 40, name
    _, meta = read_video(os.path.join(damaged, "h264_55.mp4"))
    assert meta["decode_errors"] == 1


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_decode_equals_one_thread_pyav_for_any_thread_count(damaged, threads):
    try:
        set_decode_threads(threads)
        for name in sorted(os.listdir(damaged)):
            arr, meta = read_video(os.path.join(damaged, name))
            ref = pyav_frames(os.path.join(damaged, name))
            assert len(arr) == meta["decoded_frames"] == len(ref), name
            assert all(np.array_equal(a, r) for a, r in zip(arr, ref)), name
            # plain PyAV (damaged frames returned half-decoded) gives at most the one cut frame more
            assert 0 <= len(pyav_frames(os.path.join(damaged, name), explode=False)) - len(arr) <= 1, name
    finally:
        set_decode_threads(0)


def dump(h5: str) -> list:
    ds = precompile.open(h5)
    return [(ds.key(i), ds.meta(i), {f: (a.dtype.str, a.shape, a.tobytes()) for f, a in ds[i].items()})
            for i in range(len(ds))]


@pytest.mark.parametrize("steps", [[], [{"clips": {"length": 4, "stride": 3}}]], ids=["whole", "streamed clips"])
def test_damaged_videos_build_alike_with_j1_j2_and_dask(tmp_path, damaged, steps):
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "v", "seed": 1, "inputs": {"root": damaged, "match": "{name}.{ext}", "fields": {"video": {"decoder": "video"}}},
        "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 4}})
    precompile.build(recipe, out_dir=str(tmp_path / "j1"), n_jobs=1)
    precompile.build(recipe, out_dir=str(tmp_path / "j2"), n_jobs=2)
    ref = dump(str(tmp_path / "j1" / "v.h5"))
    assert dump(str(tmp_path / "j2" / "v.h5")) == ref
    shards = sorted(os.listdir(tmp_path / "j1" / "v.shards"))
    for name in shards:
        assert (tmp_path / "j1" / "v.shards" / name).read_bytes() == (tmp_path / "j2" / "v.shards" / name).read_bytes()
    if not steps:   # every frame that decodes is kept: the stored video is PyAV's decode
        ds = precompile.open(str(tmp_path / "j1" / "v.h5"))
        assert len(ds) == len(CODECS) * len(CUTS)
        for i in range(len(ds)):
            ref_frames = pyav_frames(os.path.join(damaged, ds.key(i)))   # (the key is the file name)
            v = ds[i]["video"]
            assert len(v) == len(ref_frames), ds.key(i)
            assert np.array_equal(v, np.stack(ref_frames)), ds.key(i)
    pytest.importorskip("dask.distributed", reason="dask.distributed is not installed (extra 'dask')")
    precompile.build(recipe, out_dir=str(tmp_path / "dask"), n_jobs=2, scheduler="local")
    assert dump(str(tmp_path / "dask" / "v.h5")) == ref
    for name in shards:
        assert (tmp_path / "j1" / "v.shards" / name).read_bytes() == (tmp_path / "dask" / "v.shards" / name).read_bytes()
