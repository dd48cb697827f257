"""Keyframe seeks for sparse clips (issue 20): the streamed read jumps to the keyframe before the
next frame a clip needs instead of decoding the frames between, and gives the same clips, byte
for byte, as decoding through and as cutting the whole decoded video.

Files: the real H.264 file (two keyframes), the project's sample videos (MPEG-4 part 2, MJPEG),
H.264 made here with short GOPs and B-frames (constant and variable frame rate), files whose
container claims more frames than they hold (cut AVI and MP4), and the damaged files of
tests/test_video_damaged.py.
"""
from __future__ import annotations

import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.decoders import video as vmod
from precompile.decoders.video import PacketIndex, VideoDecoder, read_video, set_seeking
from precompile.sample import Sample
from precompile.transforms.temporal import Clips

sys.path.insert(0, os.path.dirname(__file__))
from conftest import realdata_root  # noqa: E402
from test_video import VFR_MS, _bars, _dump, _number, _recipe, _write  # noqa: E402

av = pytest.importorskip("av")
SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "video"


def write_gop(path, n, gop=12, bframes=2, fps=30, pts_ms=None, size=(64, 48), faststart=False):
    """H.264 with a keyframe every ``gop`` frames and B-frames; frame i shows i (``_bars``)."""
    c = av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {})
    s = c.add_stream("libx264", rate=fps, options={"g": str(gop), "keyint_min": str(gop), "bf": str(bframes),
                                                   "sc_threshold": "0"})
    s.width, s.height, s.pix_fmt = *size, "yuv420p"
    if pts_ms is not None:
        s.codec_context.time_base = Fraction(1, 1000)
    for i in range(n):
        f = av.VideoFrame.from_ndarray(_bars(i, size), format="rgb24")
        if pts_ms is not None:
            f.pts, f.time_base = pts_ms[i], Fraction(1, 1000)
        for p in s.encode(f):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return str(path)


def streamed(path, clips, dec=None, seek=True):
    """(clips as (key, clip meta, bytes), seeks made) from the streamed read, seeking or not."""
    set_seeking(seek)
    try:
        arrays, meta, src = VideoDecoder(VideoDecoder.Params(**(dec or {}))).open_stream(path, "video")
        step = Clips(Clips.Params(**clips))
        frames = ((pos, t, (lambda get=get: (get(),))) for pos, t, get in src)
        sample = Sample("k", arrays, {"video": "video"}, {"video": meta})
        try:
            out = [(o.key, o.meta["clip"], o.fields["video"].tobytes()) for o in
                   step.cut(sample, ["video"], frames, seek=src.want)]
        finally:
            src.close()
    finally:
        set_seeking(True)
    return out, src.seeker.seeks if src.seeker is not None else 0


def whole(path, clips, dec=None):
    """The same clips cut from the whole decoded video (no streaming at all)."""
    d = VideoDecoder(VideoDecoder.Params(**(dec or {})))
    arrays, meta = d.decode(path, "video")
    out = Clips(Clips.Params(**clips)).run(Sample("k", arrays, {"video": "video"}, {"video": meta}),
                                           np.random.default_rng(0))
    return [(o.key, o.meta["clip"], o.fields["video"].tobytes()) for o in out]


def check(path, clips, dec=None, min_seeks=1):
    got, seeks = streamed(path, clips, dec)
    through, none = streamed(path, clips, dec, seek=False)
    assert none == 0 and seeks >= min_seeks, (path, clips, seeks)
    assert got == through, (path, clips)
    assert got == whole(path, clips, dec), (path, clips)
    assert got, (path, clips)
    return got


SPARSE = [
    {"length": 4, "stride": 40},
    {"length": 3, "every": 5, "stride": 60},
    {"length": 2, "stride": 50, "max_clips": 2},
    {"length": 6, "stride": 25, "short": "pad"},
    {"fps": 2, "length": 2, "stride_s": 1.7},
]


@pytest.mark.parametrize("clips", SPARSE, ids=str)
def test_seek_equals_decode_through_h264_with_bframes(tmp_path, clips):
    p = write_gop(tmp_path / "g.mp4", 150)
    got = check(p, clips)
    for _, meta, _ in got:   # the frames are the ones their indices name
        if clips.get("fps") is None:
            assert meta["frames"][0] % (clips["stride"]) == 0


def test_seek_frame_numbers_are_exact(tmp_path):
    p = write_gop(tmp_path / "g.mp4", 200, gop=10, bframes=3)
    set_seeking(True)
    arrays, meta, src = VideoDecoder().open_stream(p, "video")
    step = Clips(Clips.Params(length=3, stride=47))
    frames = ((pos, t, (lambda get=get: (get(),))) for pos, t, get in src)
    out = list(step.cut(Sample("k", arrays, {"video": "video"}, {"video": meta}), ["video"], frames, seek=src.want))
    src.close()
    assert src.seeker.seeks == 4   # to keyframes 40, 90, 140, 180 for the clips at 47, 94, 141, 188
    assert [o.meta["clip"]["frames"] for o in out] == [[s, s + 1, s + 2] for s in range(0, 190, 47)]
    for o in out:
        assert [_number(f) for f in o.fields["video"]] == o.meta["clip"]["frames"]
        assert o.meta["clip"]["pts"] == pytest.approx([i / 30 for i in o.meta["clip"]["frames"]])


def test_seek_vfr_time_clips(tmp_path):
    ms = [int(1000 * i / 30) if i < 60 else 2000 + 50 * (i - 60) for i in range(120)]   # 30 fps, then 20 fps
    p = write_gop(tmp_path / "vfr.mp4", 120, gop=8, pts_ms=ms)
    check(p, {"fps": 4, "length": 2, "stride_s": 1.3})
    check(p, {"length": 2, "stride": 30})
    q = write_gop(tmp_path / "vfr2.mp4", 20, gop=4, pts_ms=VFR_MS)
    check(q, {"fps": 10, "length": 1, "stride_s": 0.45})


def test_seek_with_decoder_every_and_gray(tmp_path):
    p = write_gop(tmp_path / "g.mp4", 150, gop=9)
    check(p, {"length": 2, "stride": 20}, {"every": 2, "mode": "gray8"})
    check(p, {"fps": 3, "length": 2, "stride_s": 1.5}, {"every": 3})


def test_seek_real_and_sample_files():
    real = os.path.join(realdata_root(), "video", "realshort.mp4")
    if not os.path.exists(real):
        pytest.skip("realshort.mp4 absent")
    assert PacketIndex(real).keys == [0, 30]
    check(real, {"length": 4, "stride": 32})
    check(real, {"length": 2, "every": 2, "stride": 31, "short": "pad"})
    check(real, {"fps": 5, "length": 1, "stride_s": 1.05})
    check(str(SAMPLE / "balls.mp4"), {"length": 2, "stride": 12})          # MPEG-4 part 2, keyframes 0, 12, 24
    check(str(SAMPLE / "squares.avi"), {"length": 3, "stride": 10}, {"every": 2})   # MJPEG: every frame a key


def test_seek_on_files_whose_container_claims_more_frames(tmp_path):
    """A cut AVI claims 60 frames and holds about half; a cut MP4 (index at the front) claims 150."""
    _write(str(tmp_path / "long.avi"), 60)
    blob = (tmp_path / "long.avi").read_bytes()
    (tmp_path / "cut.avi").write_bytes(blob[:len(blob) // 2])
    _, meta = read_video(str(tmp_path / "cut.avi"))
    assert meta["claimed_frames"] == 60 and meta["decoded_frames"] < 40
    check(str(tmp_path / "cut.avi"), {"length": 2, "stride": 9})
    check(str(tmp_path / "cut.avi"), {"length": 2, "stride": 9, "short": "pad"})
    full = write_gop(tmp_path / "full.mp4", 150, gop=10, faststart=True)
    data = Path(full).read_bytes()
    for frac in (0.6, 0.85):   # (the index at the front is much of this small file)
        cut = tmp_path / f"cut{int(frac * 10)}.mp4"
        cut.write_bytes(data[:int(len(data) * frac)])
        _, meta = read_video(str(cut))
        assert meta["claimed_frames"] == 150 and meta["decoded_frames"] < 150
        got = check(str(cut), {"length": 2, "stride": 23})
        assert got[-1][1]["frames"][0] >= 23   # clips past the first seek


def test_seek_on_damaged_files_equals_decode_through(tmp_path):
    """The damaged files of test_video_damaged (every codec, cut at 35, 55, 80 %)."""
    import test_video_damaged as dmg

    files = []
    for name in dmg.CODECS:
        dmg.write(str(tmp_path / name), name)
        data = (tmp_path / name).read_bytes()
        for f in dmg.CUTS:
            files.append(tmp_path / f"cut{int(f * 100)}_{name}")
            files[-1].write_bytes(data[:int(len(data) * f)])
    seeks = 0
    for p in map(str, files):
        name = os.path.basename(p)
        for clips in ({"length": 2, "stride": 7}, {"length": 1, "stride": 13, "short": "pad"}):
            got, n = streamed(p, clips)
            through, _ = streamed(p, clips, seek=False)
            assert got == through == whole(p, clips), (name, clips)
            seeks += n
    assert seeks > 0   # (MJPEG: every frame is a keyframe)


def test_packet_index_refuses_what_it_cannot_number(tmp_path):
    p = write_gop(tmp_path / "g.mp4", 30, gop=10)
    idx = PacketIndex(p)
    assert idx.ok and idx.keys == [0, 10, 20] and len(idx.pts) == 30
    (tmp_path / "junk.mp4").write_bytes(b"\0" * 100)
    with pytest.raises(precompile.errors.DecodeError):
        PacketIndex(str(tmp_path / "junk.mp4"))


def test_frames_after_a_seek_that_disagree_with_the_index_restart_decoding_through(tmp_path, monkeypatch):
    """A seek that lands elsewhere than the index says (simulated: on the keyframe after the one
    asked for) is caught on the first frame after it; the read starts over, decoding through, and
    the clips are those of decoding through."""
    p = write_gop(tmp_path / "g.mp4", 120, gop=10)
    real_seek = vmod.Seeker.seek

    def late(self, container, stream, key):
        real_seek(self, container, stream, key)
        container.seek(self.index.pts[key + 10], stream=stream, backward=True, any_frame=False)

    monkeypatch.setattr(vmod.Seeker, "seek", late)
    restarts = []
    iter_all = vmod._iter_all

    def counting(*a, **k):
        restarts.append(k.get("seeker", a[5] if len(a) > 5 else None) is None)
        return iter_all(*a, **k)
    monkeypatch.setattr(vmod, "_iter_all", counting)
    clips = {"length": 3, "stride": 35}
    got, seeks = streamed(p, clips)
    assert seeks == 1 and restarts == [False, True]
    assert got == whole(p, clips)


def test_sparse_build_seeks_and_equals_decode_through_at_j1_and_j2(tmp_path, monkeypatch):
    root = tmp_path / "in"
    root.mkdir()
    write_gop(root / "a.mp4", 160, gop=15)
    write_gop(root / "b.mp4", 90, gop=7, pts_ms=[int(i * 40) for i in range(90)])
    recipe = _recipe(tmp_path, root, [{"resize": {"size": [24, 32]}},
                                      {"clips": {"length": 4, "stride": 33, "index_field": "i"}}])
    seeks = []
    seek = vmod.Seeker.seek

    def counted(self, *a):
        seeks.append(a[-1])
        return seek(self, *a)
    monkeypatch.setattr(vmod.Seeker, "seek", counted)
    precompile.build(recipe, out_dir=tmp_path / "j1", n_jobs=1)
    assert seeks   # the -j1 build ran in this process and sought
    precompile.build(recipe, out_dir=tmp_path / "j2", n_jobs=2)
    set_seeking(False)
    try:
        precompile.build(recipe, out_dir=tmp_path / "through", n_jobs=1)
    finally:
        set_seeking(True)
    ref = _dump(tmp_path / "through" / "v.h5")
    assert len(ref) == 5 + 3
    assert _dump(tmp_path / "j1" / "v.h5") == ref == _dump(tmp_path / "j2" / "v.h5")


@pytest.fixture(scope="module")
def gop_file(tmp_path_factory):
    return write_gop(tmp_path_factory.mktemp("gop") / "g.mp4", 130, gop=11, bframes=2)


def test_seek_equals_whole_for_any_frame_clips(gop_file):
    """Property: any frame-clip parameters give the whole-video path's clips, seeking or not."""
    from hypothesis import given, settings, strategies as st

    seeks = []

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(length=st.integers(1, 6), every=st.integers(1, 4), stride=st.integers(1, 70),
           max_clips=st.one_of(st.none(), st.integers(1, 4)), short=st.sampled_from(["drop", "pad"]),
           dec_every=st.integers(1, 2))
    def prop(length, every, stride, max_clips, short, dec_every):
        clips = {"length": length, "every": every, "stride": stride, "max_clips": max_clips, "short": short}
        got, n = streamed(gop_file, clips, {"every": dec_every})
        seeks.append(n)
        assert got == whole(gop_file, clips, {"every": dec_every})

    prop()
    assert sum(1 for n in seeks if n) >= 5   # sparse draws did seek


def test_seek_equals_whole_for_any_time_clips(tmp_path):
    """Property: any time-clip parameters on a variable-frame-rate file give the whole-video clips."""
    from hypothesis import given, settings, strategies as st

    ms = [int(1000 * i / 30) if i < 50 else 1700 + 70 * (i - 50) for i in range(110)]
    p = write_gop(tmp_path / "vfr.mp4", 110, gop=9, pts_ms=ms)
    seeks = []

    @settings(max_examples=20, deadline=None, derandomize=True)
    @given(fps=st.sampled_from([1, 2.5, 4, 12, 29.97]), length=st.integers(1, 4),
           stride_s=st.one_of(st.none(), st.floats(0.1, 2.5)), max_clips=st.one_of(st.none(), st.integers(1, 3)),
           short=st.sampled_from(["drop", "pad"]))
    def prop(fps, length, stride_s, max_clips, short):
        clips = {"fps": fps, "length": length, "stride_s": stride_s, "max_clips": max_clips, "short": short}
        got, n = streamed(p, clips)
        seeks.append(n)
        assert got == whole(p, clips)

    prop()
    assert sum(1 for n in seeks if n) >= 3


# -- a seek never changes what a clip is cut from (fuzzer findings N6, N7) --------------------------------------------
def _numbers(got, size=(64, 48)):
    """The numbers the frames of streamed()/whole() clips show."""
    w, h = size
    return [[_number(f) for f in np.frombuffer(b, np.uint8).reshape(-1, h, w, 3)] for _, _, b in got]


def test_padding_a_short_video_repeats_its_last_frame_not_the_last_one_read(tmp_path):
    """12 frames, decoder every 3 (frames 0, 3, 6, 9), clips of 4 taking every 2nd kept frame: the video is
    shorter than one clip, padded with its last frame, 9. The seek to the keyframe at 10 after frame 6 (for the
    clip's next frame, 12, past the end) skipped 9, and the clip was padded with 6."""
    p = write_gop(tmp_path / "g.mp4", 12, gop=10, bframes=0)
    clips, dec = {"length": 4, "every": 2, "stride": 2, "short": "pad"}, {"every": 3}
    got = check(p, clips, dec, min_seeks=0)
    assert _numbers(got) == [[0, 6, 9, 9]] and got[0][1]["frames"] == [0, 6, 9, 9]
    assert _numbers(whole(p, clips, dec)) == [[0, 6, 9, 9]]
    # pad: zero is unchanged (black frames, index -1)
    assert streamed(p, {**clips, "pad": "zero"}, dec)[0][0][1]["frames"] == [0, 6, -1, -1]


def test_max_frames_bounds_clips_cut_by_frames_after_a_seek(tmp_path):
    """max_frames: 7 keeps frames 0..6; clips of 1 frame every 4: frames 0 and 4. The seek to keyframe 8 (the
    next clip's frame) gave a third clip of frame 8."""
    p = write_gop(tmp_path / "g.mp4", 16, gop=4, bframes=0)
    got = check(p, {"length": 1, "stride": 4}, {"max_frames": 7})
    assert _numbers(got) == [[0], [4]]


def test_max_frames_bounds_clips_cut_by_time_after_a_seek(tmp_path):
    """25 fps, max_frames: 8 (0.00 .. 0.28 s); a 1-frame clip every 0.2 s at 5 fps: frames 0 and 5. The seek to
    keyframe 10 (on screen at 0.4 s) gave a third clip of frame 10."""
    p = write_gop(tmp_path / "g.mp4", 21, gop=5, bframes=0, fps=25)
    got = check(p, {"fps": 5, "length": 1}, {"max_frames": 8})
    assert _numbers(got) == [[0], [5]]
    assert [m["frames"] for _, m, _ in got] == [[0], [5]]


def test_seek_equals_whole_with_max_frames_and_short_videos(tmp_path):
    """Property: decoder every / max_frames and clips that may be longer than the video (padded), cut by frames
    or by time, give the whole-video path's clips."""
    from hypothesis import given, settings, strategies as st

    p = write_gop(tmp_path / "g.mp4", 16, gop=4, bframes=0, fps=25)
    seeks = []

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(length=st.integers(1, 6), every=st.integers(1, 5), stride=st.integers(1, 12),
           fps=st.one_of(st.none(), st.sampled_from([2.5, 5, 7, 12.5])), short=st.sampled_from(["drop", "pad"]),
           pad=st.sampled_from(["last", "zero"]), dec_every=st.integers(1, 3),
           max_frames=st.one_of(st.none(), st.integers(1, 14)))
    def prop(length, every, stride, fps, short, pad, dec_every, max_frames):
        if fps is None:
            clips = {"length": length, "every": every, "stride": stride, "short": short, "pad": pad}
        else:
            clips = {"fps": fps, "length": length, "stride_s": stride / 25, "short": short, "pad": pad}
        dec = {"every": dec_every, "max_frames": max_frames}
        got, n = streamed(p, clips, dec)
        seeks.append(n)
        assert got == whole(p, clips, dec)

    prop()
    assert sum(1 for n in seeks if n) >= 5
