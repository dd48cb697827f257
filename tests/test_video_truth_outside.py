"""An outside check of the video decoder and clip cutting against a truth the code did not compute.

The truth is PyAV itself, decoding every frame of the same file in the plainest way
(``for f in container.decode(video=0)``, ``f.to_ndarray(format="rgb24")``, ``f.pts * f.time_base``), and
files written here whose frames show their own index (8 bars, one per bit: :func:`bars`), so a clip's
frames can be named by the numbers in their pixels. The expected clips are computed here from that truth
and the documented rules (frame clips: positions ``k * stride + j * every``; time clips: the last frame
whose time is not after ``t0 + k * stride_s + j / fps``), never from precompile's own output.

Files: H.264 with B-frames and short / open GOPs, MPEG-4 part 2 with B-frames in AVI and MP4, MJPEG
(yuvj420p), VP9, 10-bit and 4:4:4 H.264, odd sizes, mp4 files trimmed by an edit list (the first frames are
before the presentation start: players hide them), streams copied from mid-GOP, variable frame rates, repeated
and missing pts, H.264 with B-frames in AVI (pts in decode order), microsecond and 2**31 - 1 time bases, audio
that starts before or after the video, and lossless FFV1 frames of known grey levels in 8/10/16-bit, 4:1:1,
4:1:0 and odd-sized formats (against the levels and OpenCV's own decode, where PyAV's rgb24 is off).

``PRECOMPILE_VIDEO_EXPLORE=N`` draws N more random files and recipes (default 4).
"""
from __future__ import annotations

import bisect
import os
import random
from fractions import Fraction

import numpy as np
import pytest

from precompile.decoders.video import VideoDecoder, read_video, set_seeking
from precompile.errors import DecodeError
from precompile.sample import Sample
from precompile.transforms.temporal import Clips

av = pytest.importorskip("av")


# -- files whose frames carry their index ------------------------------------------------------------
def bars(i: int, size: tuple[int, int]) -> np.ndarray:
    """Frame ``i``: 8 vertical bars, white for a 1 bit of ``i`` (survives lossy coding), the rest dark green."""
    w, h = size
    img = np.zeros((h, w, 3), np.uint8)
    bw = w // 8
    for b in range(8):
        if (i >> b) & 1:
            img[:, b * bw:(b + 1) * bw] = 255
    img[:, 8 * bw:, 1] = 90
    return img


def number(frame: np.ndarray) -> int:
    """The index a :func:`bars` frame shows."""
    h, w = frame.shape[:2]
    bw = w / 8
    row = frame[h // 2]
    return sum(1 << b for b in range(8) if row[int((b + 0.5) * bw)].mean() > 128)


def write(path, n, codec="libx264", fps=30, size=(64, 48), pts=None, tb=None, opts=None, pix="yuv420p",
          cont_opts=None):
    """``n`` numbered frames; ``pts`` (in ``tb``) for a variable frame rate."""
    c = av.open(str(path), "w", options=cont_opts or {})
    s = c.add_stream(codec, rate=fps, options=opts or {})
    s.width, s.height, s.pix_fmt = *size, pix
    if tb is not None:
        s.codec_context.time_base = tb
    for i in range(n):
        f = av.VideoFrame.from_ndarray(bars(i, size), format="rgb24")
        if pts is not None:
            f.pts, f.time_base = pts[i], tb
        for p in s.encode(f):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return str(path)


def trim_with_edit_list(src, dst, hidden):
    """``src`` stream-copied to ``dst`` (mp4/mov) with every timestamp moved ``hidden`` frames earlier: the
    muxer writes an edit list that starts the presentation at the old frame ``hidden`` (the frames before
    it are decoded, as the later ones need them, but players do not show them)."""
    i, o = av.open(src), av.open(dst, "w")
    s = i.streams.video[0]
    out = o.add_stream_from_template(s)
    d = int(round(hidden / (s.average_rate * s.time_base)))
    for pk in i.demux(s):
        if pk.size == 0:
            continue
        pk.pts -= d
        pk.dts -= d
        pk.stream = out
        o.mux(pk)
    o.close()
    i.close()
    return dst


def plain(path):
    """PyAV's frames, the plainest way: [(number shown, time in seconds from the stream's start, rgb)]."""
    c = av.open(str(path))
    s = c.streams.video[0]
    s0 = s.start_time or 0
    out = [(number(a), Fraction(f.pts - s0) * f.time_base, a)
           for f in c.decode(video=0) for a in [f.to_ndarray(format="rgb24")]]
    c.close()
    return out


# -- the expected clips, from the truth and the documented rules --------------------------------------
def expected(ref, clips, every=1, max_frames=None, start_s=None, end_s=None):
    """The numbers each clip shows (None: a black padding frame)."""
    fr = ref
    if start_s is not None or end_s is not None:
        lo = Fraction(repr(float(start_s or 0.0)))
        fr = [r for r in fr if r[1] >= lo and (end_s is None or r[1] < Fraction(repr(float(end_s))))]
    fr = fr[::every][:max_frames]
    n, c = len(fr), Clips.Params(**clips)
    out = []
    if c.fps is None:
        span = (c.length - 1) * c.every + 1
        stride = c.stride or span
        while (c.max_clips is None or len(out) < c.max_clips) and len(out) * stride + span <= n:
            out.append([fr[len(out) * stride + j * c.every][0] for j in range(c.length)])
        if not out and c.short == "pad" and n:
            out.append([fr[i][0] if i < n else (fr[-1][0] if c.pad == "last" else None)
                        for i in (j * c.every for j in range(c.length))])
        return out
    L = c.length if c.length is not None else round(c.length_s * c.fps)
    fps = Fraction(repr(float(c.fps)))
    stride = Fraction(repr(float(c.stride_s))) if c.stride_s else Fraction(L) / fps
    times = [r[1] for r in fr]

    def slots(k):
        return [times[0] + k * stride + Fraction(j) / fps for j in range(L)]

    while (c.max_clips is None or len(out) < c.max_clips) and slots(len(out))[-1] <= times[-1]:
        out.append([fr[bisect.bisect_right(times, s) - 1][0] for s in slots(len(out))])
    if not out and c.short == "pad":
        out.append([fr[bisect.bisect_right(times, s) - 1][0] if s <= times[-1] else
                    (fr[-1][0] if c.pad == "last" else None) for s in slots(0)])
    return out


def streamed(path, clips, dec=None, seek=True):
    """The clips the engine's streamed read cuts (``open_stream`` -> ``Clips.cut`` with the source's
    keyframe seeks), as the numbers their frames show, and the seeks made."""
    set_seeking(seek)
    try:
        arrays, meta, src = VideoDecoder(VideoDecoder.Params(**(dec or {}))).open_stream(str(path), "video")
        frames = ((pos, t, (lambda get=get: (get(),))) for pos, t, get in src)
        sample = Sample("k", arrays, {"video": "video"}, {"video": meta})
        try:
            out = list(Clips(Clips.Params(**clips)).cut(sample, ["video"], frames, seek=src.want))
        finally:
            src.close()
    finally:
        set_seeking(True)
    nums = [[number(f) if i >= 0 else None for f, i in zip(o.fields["video"], o.meta["clip"]["frames"])]
            for o in out]
    return nums, (src.seeker.seeks if src.seeker is not None else 0)


def check_clips(path, clips, dec=None, ref=None):
    ref = plain(path) if ref is None else ref
    d = dec or {}
    want = expected(ref, clips, d.get("every", 1), d.get("max_frames"), d.get("start_s"), d.get("end_s"))
    got, seeks = streamed(path, clips, dec)
    through, _ = streamed(path, clips, dec, seek=False)
    assert got == want, (path, clips, dec, seeks)
    assert through == want, (path, clips, dec)
    return seeks


# -- files ----------------------------------------------------------------------------------------------
FILES = {
    "h264-bframes.mp4": dict(opts={"bf": "3", "g": "8", "keyint_min": "8", "sc_threshold": "0"}),
    "h264-bframes.mkv": dict(opts={"bf": "2", "g": "5", "sc_threshold": "0"}),
    "h264-opengop.mp4": dict(opts={"bf": "3", "x264-params": "open-gop=1:keyint=8:min-keyint=8:scenecut=0"}),
    "h264-one-key.mp4": dict(opts={"bf": "2", "g": "1000"}),
    "h264-all-key.mkv": dict(opts={"g": "1"}),
    "mpeg4-bframes.avi": dict(codec="mpeg4", opts={"bf": "2", "g": "6"}),
    "mpeg4-bframes.mp4": dict(codec="mpeg4", opts={"bf": "2", "g": "6"}),
    "mjpeg-yuvj420p.avi": dict(codec="mjpeg", pix="yuvj420p"),
    "vp9.webm": dict(codec="libvpx-vp9", opts={"g": "5"}),
    "h264-10bit.mkv": dict(pix="yuv420p10le", opts={"bf": "2", "g": "7"}),
    "h264-444-odd.mkv": dict(pix="yuv444p", size=(37, 23), opts={"bf": "1", "g": "9"}),
    "mjpeg-odd.mkv": dict(codec="mjpeg", pix="yuvj444p", size=(35, 17)),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("truth")
    out = {}
    for name, kw in FILES.items():
        codec = kw.get("codec", "libx264")
        if codec not in av.codecs_available:
            continue   # (this FFmpeg build lacks the encoder; the other files still run)
        out[name] = write(root / name, 40, **kw)
    if "h264-bframes.mp4" in out:
        out["h264-edit-list.mp4"] = trim_with_edit_list(out["h264-bframes.mp4"], str(root / "h264-edit-list.mp4"), 3)
        out["h264-edit-list.mov"] = trim_with_edit_list(out["h264-bframes.mp4"], str(root / "h264-edit-list.mov"), 5)
    return out


def _file(files, name):
    if name not in files:
        pytest.skip(f"this PyAV build cannot write {name} (no encoder)")
    return files[name]


ALL = [*FILES, "h264-edit-list.mp4", "h264-edit-list.mov"]


@pytest.mark.parametrize("name", ALL)
def test_whole_decode_is_pyavs_frames_and_times(files, name):
    """Every frame, in order, byte for byte PyAV's rgb24 (OpenCV's frames for 10 bits), at PyAV's pts; gray8 is
    OpenCV's RGB->gray of them."""
    import cv2

    p = _file(files, name)
    ref = plain(p)
    a, meta = read_video(p)
    assert len(a) == len(ref) == meta["decoded_frames"]
    if "10bit" in name:   # PyAV's rgb24 darkens 10-bit frames (test_rgb_frames_keep_their_levels_...): OpenCV's
        cap = cv2.VideoCapture(p)
        ref = [(r[0], r[1], cap.read()[1][..., ::-1]) for r in ref]
    assert all(np.array_equal(x, r[2]) for x, r in zip(a, ref))
    assert [number(x) for x in a] == [r[0] for r in ref]
    assert [Fraction(t).limit_denominator(10 ** 6) for t in meta["pts"]] == [r[1] for r in ref]
    g, _ = read_video(p, mode="gray8", every=3)
    assert np.array_equal(g[..., 0], np.stack([cv2.cvtColor(r[2], cv2.COLOR_RGB2GRAY) for r in ref[::3]]))


def test_edit_list_hides_the_frames_before_the_presentation_start(files):
    """The trimmed file holds frames 0..39 but its edit list starts at frame 3 (5 in the .mov): precompile keeps
    what PyAV (and a player) shows, from time 0, whole or streamed with seeks (the packet index leaves out the
    packets the demuxer marks discarded, which decode to no frame: with them the index was off by the hidden
    frames and the read never sought)."""
    for name, hidden in (("h264-edit-list.mp4", 3), ("h264-edit-list.mov", 5)):
        p = _file(files, name)
        ref = plain(p)
        assert [r[0] for r in ref] == list(range(hidden, 40)) and ref[0][1] == 0
        a, meta = read_video(p)
        assert [number(x) for x in a] == list(range(hidden, 40)) and meta["pts"][0] == 0.0
        assert check_clips(p, {"length": 2, "stride": 17}, ref=ref) >= 1   # seeks past the hidden frames' packets
        check_clips(p, {"fps": 5, "length": 2, "stride_s": 0.5}, ref=ref)


CLIPS = [
    {"length": 3, "stride": 17},
    {"length": 2, "every": 3, "stride": 13, "max_clips": 2},
    {"length": 45, "short": "pad"},
    {"length": 45, "short": "pad", "pad": "zero", "every": 2},
    {"fps": 7, "length": 2, "stride_s": 0.4},
    {"fps": 30, "length": 3, "stride_s": 1 / 3},
    {"fps": 10, "length_s": 5, "short": "pad"},
]
DECS = [{}, {"every": 2}, {"max_frames": 21}, {"start_s": 1 / 6, "end_s": 1.0}]


@pytest.mark.parametrize("name", ["h264-bframes.mp4", "h264-opengop.mp4", "mpeg4-bframes.avi", "vp9.webm",
                                  "h264-edit-list.mov", "h264-10bit.mkv", "h264-444-odd.mkv"])
def test_streamed_clips_are_pyavs_frames(files, name):
    """Clips by frames and by time, with the decoder's every / max_frames / window: the frames PyAV shows at
    the documented places, streamed with keyframe seeks and decoded through."""
    p = _file(files, name)
    ref = plain(p)
    for dec in DECS:
        for clips in CLIPS:
            check_clips(p, clips, dec, ref)


def test_sparse_clips_seek_and_still_take_pyavs_frames(tmp_path):
    """A long file with many keyframes and B-frames, clips far apart: the read seeks, and every clip's frames
    are the ones PyAV shows at those positions and times."""
    p = write(tmp_path / "long.mp4", 240, size=(32, 16), opts={"bf": "3", "g": "10", "keyint_min": "10",
                                                                 "sc_threshold": "0"})
    ref = plain(p)
    assert check_clips(p, {"length": 3, "stride": 50}, ref=ref) >= 3
    assert check_clips(p, {"length": 2, "every": 4, "stride": 70}, {"every": 2}, ref=ref) >= 1
    assert check_clips(p, {"fps": 6, "length": 2, "stride_s": 1.9}, ref=ref) >= 2


VFR_MS = [0, 33, 34, 100, 350, 351, 400, 1000, 1001, 1033, 1100, 1500, 1966, 2000, 2001, 2500]


@pytest.mark.parametrize("ext", [".mp4", ".mkv"])
def test_variable_frame_rate_clips_by_time_take_the_frame_on_screen(tmp_path, ext):
    p = write(tmp_path / f"vfr{ext}", len(VFR_MS), pts=VFR_MS, tb=Fraction(1, 1000), opts={"bf": "2", "g": "4"})
    ref = plain(p)
    assert [r[1] for r in ref] == [Fraction(t, 1000) for t in VFR_MS]
    for clips in ({"fps": 10, "length": 4, "stride_s": 0.5}, {"fps": 3, "length_s": 1.0, "stride_s": 1.0},
                  {"fps": 1, "length": 3, "short": "pad"}):
        check_clips(p, clips, ref=ref)
    check_clips(p, {"fps": 20, "length": 2}, {"start_s": 1.0, "end_s": 2.0}, ref=ref)


US = [0, 500000, 999999, 1500000, 2000000, 2499999, 2500000]


@pytest.mark.parametrize("ext", [".mp4", ".mov"])
def test_time_window_bounds_are_exact_in_a_microsecond_time_base(tmp_path, ext):
    """start_s / end_s keep the frames with start_s <= t < end_s exactly: a frame 1 us before start_s is out, one
    1 us before end_s is in (a 1e-6 s tolerance swapped both)."""
    p = write(tmp_path / f"us{ext}", len(US), codec="mjpeg", pix="yuvj420p", pts=US, tb=Fraction(1, 10 ** 6),
              cont_opts={"video_track_timescale": "1000000"})
    ref = plain(p)
    assert [r[1] for r in ref] == [Fraction(t, 10 ** 6) for t in US]
    for start, end, want in ((1.0, None, [3, 4, 5, 6]), (None, 1.0, [0, 1, 2]), (1.0, 2.5, [3, 4, 5]),
                             (0.999999, 2.499999, [2, 3, 4])):
        a, meta = read_video(p, start_s=start, end_s=end)
        assert [number(x) for x in a] == want, (start, end)
        assert [r[0] for r in ref if (start is None or r[1] >= Fraction(repr(start)))
                and (end is None or r[1] < Fraction(repr(end)))] == want
        check_clips(p, {"length": 1}, {"start_s": start, "end_s": end}, ref=ref)
    with pytest.raises(DecodeError, match=r"us\.\w+: no frame between start_s 0\.9999995 and end_s 0\.9999999"):
        read_video(p, start_s=0.9999995, end_s=0.9999999)


# -- audio ---------------------------------------------------------------------------------------------
RATE = 8000


def write_av(path, n, v_ms, a_ms, fps=25, bf="2"):
    """Numbered frames from ``v_ms`` ms and a mono 16-bit PCM track from ``a_ms`` ms whose sample k holds
    k (mod 30000): a sample's value says when it plays."""
    c = av.open(str(path), "w")
    s = c.add_stream("libx264", rate=fps, options={"bf": bf, "g": "10"})
    s.width, s.height, s.pix_fmt = 32, 16, "yuv420p"
    s.codec_context.time_base = Fraction(1, 1000)
    a = c.add_stream("pcm_s16le", rate=RATE)
    a.layout = "mono"
    total = int(RATE * (n / fps + 0.5))
    samples = (np.arange(total) % 30000).astype(np.int16)
    done = 0

    def audio_until(t):
        nonlocal done
        while done < total and a_ms / 1000 + done / RATE <= t:
            fr = av.AudioFrame.from_ndarray(samples[None, done:done + 800], format="s16", layout="mono")
            fr.sample_rate, fr.pts, fr.time_base = RATE, done + a_ms * RATE // 1000, Fraction(1, RATE)
            for p in a.encode(fr):
                c.mux(p)
            done += 800

    for i in range(n):
        f = av.VideoFrame.from_ndarray(bars(i, (32, 16)), format="rgb24")
        f.pts, f.time_base = v_ms + i * 1000 // fps, Fraction(1, 1000)
        for p in s.encode(f):
            c.mux(p)
        audio_until(v_ms / 1000 + i / fps)
    audio_until(1e9)
    for st in (s, a):
        for p in st.encode():
            c.mux(p)
    c.close()
    return str(path)


@pytest.mark.parametrize("v_ms,a_ms", [(0, 500), (300, 0), (1000, 200)])
@pytest.mark.parametrize("ext", [".mkv", ".mp4"])
def test_clip_audio_is_the_sound_playing_with_its_first_frame(tmp_path, ext, v_ms, a_ms):
    """Audio that starts after / before the video: each clip's first sample is the one PyAV times at the clip's
    first frame (frame clips) or at the clip's start (time clips)."""
    p = write_av(tmp_path / f"av{ext}", 40, v_ms, a_ms)
    c = av.open(p)
    shown = {number(f.to_ndarray(format="rgb24")): Fraction(f.pts) * f.time_base for f in c.decode(video=0)}
    c.close()
    c = av.open(p)
    a0 = next(Fraction(f.pts) * f.time_base for f in c.decode(audio=0))
    v0 = c.streams.video[0].start_time * c.streams.video[0].time_base
    c.close()
    for clips in ({"length": 3, "stride": 13}, {"fps": 5, "length": 2, "stride_s": 0.7}):
        arrays, meta, src = VideoDecoder(VideoDecoder.Params(audio_field="a")).open_stream(p, "video")
        frames = ((pos, t, (lambda get=get: (get(),))) for pos, t, get in src)
        sample = Sample("k", arrays, {"video": "video", "a": "audio"}, {"video": meta})
        out = list(Clips(Clips.Params(**clips)).cut(sample, ["video"], frames, seek=src.want))
        src.close()
        assert out
        for o in out:
            start = Fraction(o.meta["clip"]["start"]).limit_denominator(10 ** 6)   # from the video stream's start
            t = shown[number(o.fields["video"][0])] if "stride" in clips else v0 + start
            k = (t - a0) * RATE   # the track's sample playing at t
            x = np.rint(o.fields["a"][0] * 32768).astype(np.int64)
            if k >= 0:
                assert abs(int(x[0]) - k) <= 0.5, (clips, o.meta["clip"])
            else:   # the clip starts before the track: zeros, then the track from sample 0
                lead = int(round(-k))
                assert not x[:lead].any() and (lead + 1 >= len(x) or (x[lead], x[lead + 1]) == (0, 1)), clips


# -- a build -------------------------------------------------------------------------------------------
def test_build_streamed_clips_are_pyavs_frames(tmp_path):
    """The engine's build (streamed, seeking) stores clips whose frames are PyAV's at the documented positions."""
    import precompile
    from conftest import write_recipe

    root = tmp_path / "in"
    root.mkdir()
    files = {"a": write(root / "a.mp4", 120, size=(32, 16), opts={"bf": "2", "g": "8", "sc_threshold": "0"}),
             "b": trim_with_edit_list(write(tmp_path / "b0.mp4", 90, size=(32, 16), opts={"bf": "3", "g": "12"}),
                                      str(root / "b.mp4"), 4)}
    clips = {"length": 2, "every": 2, "stride": 37, "index_field": "i"}
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "t", "seed": 1, "inputs": {"root": str(root), "match": "{name}.mp4",
                                          "fields": {"video": {"decoder": "video"}}},
        "steps": [{"clips": clips}], "output": {"format": "hdf5", "samples_per_shard": 3}})
    precompile.build(recipe, out_dir=tmp_path / "out")
    ds = precompile.open(str(tmp_path / "out" / "t.h5"))
    got: dict[str, list] = {}
    for i in range(len(ds)):
        name, _, _ = ds.key(i).partition("#")
        got.setdefault(name, []).append([number(f) for f in ds[i]["video"]])
    want = {k: expected(plain(p), {kk: v for kk, v in clips.items() if kk != "index_field"}) for k, p in files.items()}
    assert got == {f"{k}.mp4": v for k, v in want.items()}


# -- drawn cases ---------------------------------------------------------------------------------------
def test_drawn_files_and_recipes(tmp_path):
    """Random codecs, containers, GOPs, B-frames, frame rates (some variable), decoder options and clips; the
    streamed clips (seeking and not) against PyAV's frames. PRECOMPILE_VIDEO_EXPLORE=N draws N cases."""
    n = int(os.environ.get("PRECOMPILE_VIDEO_EXPLORE", "4"))
    rng = random.Random(int(os.environ.get("PRECOMPILE_VIDEO_SEED", "7")))
    for case in range(n):
        frames = rng.randint(5, 60)
        codec = rng.choice(["libx264", "libx264", "mpeg4", "mjpeg", "libvpx-vp9", "mpeg2video"])
        if codec not in av.codecs_available:
            continue
        ext = {"libx264": [".mp4", ".mkv", ".mov", ".ts"], "mpeg4": [".mp4", ".mkv", ".avi", ".ts"],
               "mjpeg": [".avi", ".mkv", ".mov"], "libvpx-vp9": [".webm", ".mkv"],
               "mpeg2video": [".mpg", ".vob", ".ts", ".mkv"]}[codec]
        ext = rng.choice(ext)
        opts = {"g": str(rng.randint(1, 12))}
        if codec in ("libx264", "mpeg4", "mpeg2video"):
            opts["bf"] = str(rng.randint(0, 3))
        pts = tb = None
        if rng.random() < 0.4 and codec != "mpeg2video":   # (MPEG-2: fixed frame rates only)
            tb, t, pts = Fraction(1, 1000), 0, []
            for _ in range(frames):
                pts.append(t)
                t += rng.choice([33, 34, 1, 100, 250, 17])
        fps = rng.choice([30, 25] if codec == "mpeg2video" else [30, 25, 12])
        p = write(tmp_path / f"d{case}{ext}", frames, codec=codec, fps=fps, opts=opts, pts=pts, tb=tb,
                  pix="yuvj420p" if codec == "mjpeg" else "yuv420p", size=rng.choice([(32, 16), (48, 32)]))
        if rng.random() < 0.5:
            clips = {"length": rng.randint(1, 6), "every": rng.randint(1, 3), "stride": rng.randint(1, 30)}
        else:
            clips = {"fps": rng.choice([2, 5, 7, 10, 29.97, 30]), "length": rng.randint(1, 5),
                     "stride_s": rng.choice([0.1, 0.25, 1 / 3, 0.5, 1.3])}
        if rng.random() < 0.3:
            clips.update(short="pad", pad=rng.choice(["last", "zero"]))
        if rng.random() < 0.2:
            clips["max_clips"] = rng.randint(1, 3)
        dec: dict = {}
        r = rng.random()
        if r < 0.3:
            dec["every"] = rng.randint(2, 3)
        elif r < 0.5:
            dec["max_frames"] = rng.randint(1, 20)
        ref = plain(p)
        check_clips(p, clips, dec, ref)


def test_faulty_pts_are_placed_one_whole_frame_later(tmp_path):
    """H.264 with B-frames in AVI: the container has no presentation times, so the frames' pts come out in decode
    order (PyAV: 1, 3, 2, 4, 6, 5, ...); a frame whose pts does not increase is placed one nominal frame after the
    one before, exactly. Added up in floats, 0.24 + 0.04 was 0.27999999999999997, so the next frame's pts 0.28 was
    taken as increasing: two frames 1e-17 s apart, the first never on screen, and a time clip at the file's own
    rate skipped a frame and showed the next twice."""
    p = write(tmp_path / "bf.avi", 40, fps=25, opts={"bf": "2", "g": "3", "sc_threshold": "0"})
    c = av.open(p)
    raw = [f.pts for f in c.decode(video=0)]
    c.close()
    assert raw != sorted(raw)   # the file's pts are out of order, as the test needs
    a, meta = read_video(p)
    assert [number(x) for x in a] == list(range(40))
    gaps = np.diff(meta["pts"])
    assert gaps.min() >= 1 / 25 - 1e-9, meta["pts"]
    got, _ = streamed(p, {"fps": 25, "length": 38})
    # (frame 1's pts is frame 2's: frame 0 stays on screen one slot longer; from there on each frame shows once)
    assert got[0][:2] == [0, 0] and got[0][2:] == list(range(1, 37)), got


def test_time_clips_in_a_time_base_finer_than_a_nanosecond(tmp_path):
    """An mp4 with timescale 2**31 - 1: frame 15 of a 30 fps file is at 1073741824 / 2147483647 s, 2.3e-10 s after
    0.5, so a clip slot at exactly 0.5 s shows frame 14. Recovering the frame's time from its float as the nearest
    fraction with a denominator up to 1e9 gave 1/2 (the time base's denominator is larger), which put frame 15 on
    screen at 0.5."""
    p = write(tmp_path / "fine.mp4", 50, size=(32, 16), opts={"bf": "2", "g": "7", "sc_threshold": "0"},
              cont_opts={"video_track_timescale": str(2 ** 31 - 1)})
    ref = plain(p)
    assert ref[15][1] == Fraction(2 ** 30, 2 ** 31 - 1) and ref[15][1] > Fraction(1, 2)
    check_clips(p, {"fps": 30, "length": 3, "stride_s": 0.5}, ref=ref)
    check_clips(p, {"fps": 10, "length": 2}, ref=ref)
    check_clips(p, {"length": 1}, {"start_s": 0.5, "end_s": 1.0}, ref=ref)


def test_raw_stream_without_timestamps_is_timed_at_its_rate(tmp_path):
    """A raw H.264 stream (B-frames, no container): PyAV's frames have no pts; they are placed 1/fps apart from 0, as
    a player shows them, and time clips take the frame on screen at each slot, streamed or not."""
    p = str(tmp_path / "raw.h264")
    c = av.open(p, "w", format="h264")
    s = c.add_stream("libx264", rate=25, options={"bf": "2", "g": "6", "sc_threshold": "0"})
    s.width, s.height, s.pix_fmt = 32, 16, "yuv420p"
    for i in range(40):
        for pk in s.encode(av.VideoFrame.from_ndarray(bars(i, (32, 16)), format="rgb24")):
            c.mux(pk)
    for pk in s.encode():
        c.mux(pk)
    c.close()
    c = av.open(p)
    frames = [(number(f.to_ndarray(format="rgb24")), f.pts) for f in c.decode(video=0)]
    rate = c.streams.video[0].average_rate
    c.close()
    assert [n for n, _ in frames] == list(range(40)) and {t for _, t in frames} == {None} and rate == 25
    a, meta = read_video(p)
    assert [number(x) for x in a] == list(range(40))
    assert [Fraction(t).limit_denominator(1000) for t in meta["pts"]] == [Fraction(i, 25) for i in range(40)]
    ref = [(i, Fraction(i, 25), None) for i in range(40)]
    check_clips(p, {"fps": 10, "length": 3, "stride_s": 0.7}, ref=ref)
    check_clips(p, {"length": 2, "stride": 15}, {"every": 2}, ref=ref)


def test_repeated_pts_follow_the_documented_rule_streamed_or_whole(tmp_path):
    """Microsecond times stored in Matroska's milliseconds: frames 5 and 6 share pts 2500. PyAV gives both at 2.5 s;
    precompile places the second one nominal frame later (the decoder's rule for a pts that does not increase), and a
    streamed read cuts what the whole decode cuts."""
    p = write(tmp_path / "dup.mkv", len(US), codec="mjpeg", pix="yuvj420p", pts=US, tb=Fraction(1, 10 ** 6))
    ref = plain(p)
    assert [r[1] for r in ref][-2:] == [Fraction(5, 2)] * 2
    a, meta = read_video(p)
    assert [number(x) for x in a] == list(range(len(US)))
    fps = Fraction(meta["fps"]).limit_denominator(1000)
    assert Fraction(meta["pts"][-1]).limit_denominator(10 ** 6) == Fraction(5, 2) + 1 / fps
    placed = [(r[0], Fraction(t).limit_denominator(10 ** 6), None) for r, t in zip(ref, meta["pts"])]
    for clips in ({"fps": 4, "length": 4, "stride_s": 0.5}, {"fps": 2, "length": 6, "short": "pad"}):
        check_clips(p, clips, ref=placed)


GRAYS = [0, 16, 40, 128, 200, 235, 255]


@pytest.mark.parametrize("codec,pix,size", [
    ("ffv1", "yuv420p10le", (32, 16)), ("ffv1", "yuv422p10le", (32, 16)), ("ffv1", "yuv420p16le", (32, 16)),
    ("ffv1", "yuv420p", (32, 16)), ("libx264", "yuv420p10le", (32, 16)), ("ffv1", "yuv411p", (32, 16)),
    ("ffv1", "yuv410p", (32, 16)), ("ffv1", "yuv444p", (32, 16)), ("mjpeg", "yuvj422p", (32, 16)),
    ("png", "rgba", (32, 16)), ("ffv1", "gray", (32, 16)), ("ffv1", "yuv420p", (35, 17)), ("ffv1", "yuv420p", (36, 17)),
    ("mjpeg", "yuvj420p", (33, 21)), ("ffv1", "yuv422p", (35, 17)), ("ffv1", "yuv444p", (35, 17))])
def test_rgb_frames_keep_their_levels_and_equal_opencv(tmp_path, codec, pix, size):
    """Flat grey frames of known levels, stored losslessly (FFV1) at 10 and 16 bits: the decoded RGB holds those
    levels (+-1 for the 10-bit rounding), and every frame equals OpenCV's own decode of the file byte for byte.
    swscale's rgb24 path darkened frames of more than 8 bits by about 1% (255 -> 253, 128 -> 126) and differed
    from OpenCV by up to 22 levels on colour edges, 4:1:1 (DV) and 4:1:0 frames by up to 21, and 4:2:0 / 4:2:2
    frames of an odd height by up to 25 (each further from the source than OpenCV's)."""
    cv2 = pytest.importorskip("cv2")
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    colour = np.stack([(x * 9) % 256, (y * 17) % 256, ((x + y) * 5 + 100) % 256], -1).astype(np.uint8)
    p = str(tmp_path / ("deep" + {"mjpeg": ".avi", "png": ".mov"}.get(codec, ".mkv")))
    c = av.open(p, "w")
    s = c.add_stream(codec, rate=10)
    s.width, s.height, s.pix_fmt = w, h, pix
    for img in [np.full((h, w, 3), v, np.uint8) for v in GRAYS] + [colour]:
        for pk in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(pk)
    for pk in s.encode():
        c.mux(pk)
    c.close()
    a, _ = read_video(p)
    if codec == "ffv1":
        got = [int(np.median(f)) for f in a[:len(GRAYS)]]
        assert np.abs(np.subtract(got, GRAYS)).max() <= 1, got
    import re

    ours = ".".join(str(v) for v in av.library_versions["libswscale"][:2])
    theirs = re.search(r"swscale:\s+YES \((\d+\.\d+)", cv2.getBuildInformation())
    if theirs is None or theirs.group(1) != ours:   # (the floors job's OpenCV 4.8 bundles an older FFmpeg)
        pytest.skip(f"OpenCV {cv2.__version__} bundles swscale {theirs.group(1) if theirs else '?'}, PyAV {ours}: "
                    f"their conversions differ in the last bits, so byte equality is not the rule there")
    cap = cv2.VideoCapture(p)
    seen = []
    while True:
        ok, fr = cap.read()
        if not ok:
            break
        seen.append(fr[..., ::-1])
    assert len(seen) == len(a) and all(np.array_equal(f, g) for f, g in zip(a, seen))


@pytest.mark.parametrize("ext", [".mkv", ".mp4"])
def test_stream_cut_mid_gop_seeks_and_takes_pyavs_frames(tmp_path, ext):
    """A stream copied from its 4th packet (mid-GOP, no keyframe first): PyAV shows frames from the first keyframe on
    (8). The packet index leaves out the packets before it, so sparse clips seek (the index was off by them and the
    first frame's check turned seeking off) and still take PyAV's frames."""
    src = write(tmp_path / f"src{ext}", 120, size=(32, 16), opts={"bf": "2", "g": "8", "sc_threshold": "0"})
    i, o = av.open(src), av.open(str(tmp_path / f"cut{ext}"), "w")
    out = o.add_stream_from_template(i.streams.video[0])
    for k, pk in enumerate(i.demux(i.streams.video[0])):
        if pk.size and k >= 3:
            pk.stream = out
            o.mux(pk)
    o.close()
    i.close()
    p = str(tmp_path / f"cut{ext}")
    ref = plain(p)
    assert ref[0][0] == 8
    assert check_clips(p, {"length": 3, "stride": 31}, ref=ref) >= 2
    assert check_clips(p, {"fps": 5, "length": 2, "stride_s": 1.1}, ref=ref) >= 2


@pytest.mark.parametrize("stride", [27, 29])
def test_a_seek_that_finds_no_frame_does_not_lose_the_clip(tmp_path, monkeypatch, stride):
    """MPEG-TS: a seek to one of the last keyframes lands past the frames left (its seek is not exact), so no frame
    was decoded after it, nothing disagreed with the packet index, and the clip that needed those frames was
    silently missing (30 frames, clips at 0 and ``stride``: one clip came out). A read whose frames stop short of
    the packet index after a seek now starts over decoding through, as on a frame that disagrees. (Transport
    streams are no longer sought in at all; the test lets them seek, the one way found to make a seek find
    nothing.)"""
    from precompile.decoders import video as vmod

    monkeypatch.setattr(vmod, "_NO_SEEK_FORMATS", frozenset())
    p = write(tmp_path / "end.ts", 30, size=(32, 16), opts={"bf": "2", "g": "5", "sc_threshold": "0"})
    ref = plain(p)
    assert len(ref) == 30
    assert check_clips(p, {"length": 1, "stride": stride}, ref=ref) >= 1
    check_clips(p, {"length": 1, "stride": stride}, {"every": 1, "max_frames": 30}, ref=ref)
    check_clips(p, {"fps": 30, "length": 1, "stride_s": stride / 30}, ref=ref)


@pytest.mark.parametrize("ext", [".mpg", ".vob", ".ts"])
def test_mpeg_system_streams_take_pyavs_frames_without_seeking(tmp_path, ext):
    """MPEG program streams (.mpg, .vob) and transport streams (.ts): after a seek the frames' pts are not the ones a
    whole decode gives them (MPEG-2 in a program stream: the frame showing 122 came with frame 123's pts), so the
    check of each frame against the packet index passed on the wrong frame and a clip took frames 137-139 for
    138-140; in a transport stream most seeks land past their keyframe and the read started over. These formats
    are read through, never seeking."""
    p = write(tmp_path / f"ps{ext}", 200, codec="mpeg2video", size=(32, 16), opts={"bf": "0", "g": "10"})
    ref = plain(p)
    assert [r[0] for r in ref] == list(range(200))
    for clips in ({"length": 3, "stride": 23}, {"length": 2, "stride": 40}, {"fps": 2, "length": 1, "stride_s": 1.5}):
        assert check_clips(p, clips, ref=ref) == 0
