"""Video: PyAV decoding (decoded count and pts, not the header), clips by frames and by time, streaming, audio track."""
from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from precompile.decoders.video import VideoDecoder, read_video
from precompile.errors import DecodeError
from precompile.sample import FieldSpec, Sample
from precompile.transforms.kernels import geometry as F
from precompile.transforms.geometry import Resize
from precompile.transforms.temporal import Clips

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "sample_data", "video")


from conftest import realdata_root as realdata  # noqa: E402  (skips when ../shared/realdata is absent)


def _write(path, n, fourcc="MJPG", size=(32, 24)):
    import cv2

    w = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), 10, size)
    for i in range(n):
        fr = np.zeros((size[1], size[0], 3), np.uint8)
        fr[..., 2] = (i * 6) % 256  # red channel (BGR order) encodes the frame number
        fr[..., 1] = 40
        w.write(fr)
    w.release()


def test_decode_frames_in_order_rgb(tmp_path):
    p = str(tmp_path / "ramp.avi")
    _write(p, 30)
    a, meta = read_video(p)
    assert a.shape == (30, 24, 32, 3) and a.dtype == np.uint8
    assert meta["decoded_frames"] == 30 and meta["fps"] == pytest.approx(10)
    red = a[..., 0].mean(axis=(1, 2))
    np.testing.assert_allclose(red, np.arange(30) * 6, atol=3)   # RGB order, frames in order
    assert abs(a[..., 1].mean() - 40) < 3
    g, _ = read_video(p, "gray8")
    assert g.shape == (30, 24, 32, 1)
    k, meta = read_video(p, every=3, max_frames=5)
    assert k.shape[0] == 5 and meta["every"] == 3
    np.testing.assert_allclose(k[..., 0].mean(axis=(1, 2)), np.arange(0, 15, 3) * 6, atol=3)


def test_truncated_file_counts_decoded_frames_not_header(tmp_path):
    import cv2

    p = str(tmp_path / "long.avi")
    _write(p, 60)
    blob = (tmp_path / "long.avi").read_bytes()
    q = str(tmp_path / "cut.avi")
    (tmp_path / "cut.avi").write_bytes(blob[:len(blob) // 2])
    cap = cv2.VideoCapture(q)
    claimed = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    cap.release()
    a, meta = read_video(q)
    assert claimed == 60 and meta["claimed_frames"] == 60
    assert 5 < a.shape[0] < 60 and meta["decoded_frames"] == a.shape[0]
    (tmp_path / "junk.avi").write_bytes(b"\0" * 500)
    with pytest.raises(DecodeError):
        read_video(str(tmp_path / "junk.avi"))
    with pytest.raises(DecodeError):
        read_video(str(tmp_path / "missing.avi"))


def _vid(n, key="v.avi", every=1):
    a = np.zeros((n, 4, 6, 3), np.uint8)
    a[:, 0, 0, 0] = np.arange(n)
    return Sample(key, {"video": a}, {"video": "video"}, {"video": {"fps": 25.0, "every": every}})


def test_clips_indices_stride_every_and_short_policy():
    rng = np.random.default_rng(0)
    c = Clips(Clips.Params(length=3, every=2, stride=4, index_field="frames"))
    out = c.run(_vid(12), rng)
    assert [o.key for o in out] == ["v.avi#clip0", "v.avi#clip1"]   # spans 0-4, 4-8; 8-12 does not fit
    assert [o.fields["frames"].tolist() for o in out] == [[0, 2, 4], [4, 6, 8]]
    assert [o.fields["video"][:, 0, 0, 0].tolist() for o in out] == [[0, 2, 4], [4, 6, 8]]
    assert out[1].meta["clip"] == {"index": 1, "frames": [4, 6, 8], "fps": 25.0, "start": 0.16,
                                   "pts": [0.16, 0.24, 0.32]}
    assert out[0].kinds["frames"] == "index" and out[0].fields["frames"].dtype == np.int32
    # decode-time every=3 maps positions back to source frame numbers
    out = c.run(_vid(12, every=3), rng)
    assert out[0].fields["frames"].tolist() == [0, 6, 12]
    # short videos: dropped, or padded with the last frame / black frames
    assert Clips(Clips.Params(length=8)).run(_vid(5), rng) == []
    (o,) = Clips(Clips.Params(length=8, short="pad", index_field="i")).run(_vid(5), rng)
    assert o.fields["i"].tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
    (o,) = Clips(Clips.Params(length=4, every=2, short="pad", pad="zero", index_field="i")).run(_vid(5), rng)
    assert o.fields["i"].tolist() == [0, 2, 4, -1] and not o.fields["video"][3].any()
    # declared specs
    specs = c.plan({"video": FieldSpec("video", (None, None, None, 3), "uint8")})
    assert specs["video"].shape == (3, None, None, 3) and specs["frames"] == FieldSpec("index", (3,), "int32")
    assert len(Clips(Clips.Params(length=2, max_clips=2)).run(_vid(20), rng)) == 2


def test_resize_applies_to_every_frame_alike():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 255, (5, 24, 32, 3), dtype=np.uint8)
    s = Sample("v", {"video": a}, {"video": "video"})
    (o,) = Resize(Resize.Params(size=[12, 20])).run(s, rng)
    assert o.fields["video"].shape == (5, 12, 20, 3)
    for t in range(5):
        np.testing.assert_array_equal(o.fields["video"][t], F.resize_hwc(a[t], 12, 20))


def test_real_video():
    p = os.path.join(realdata(), "video", "realshort.mp4")
    if not os.path.exists(p):
        pytest.skip("realshort.mp4 absent")
    a, meta = VideoDecoder().read(p)
    assert a.shape == (36, 240, 320, 3) and a.dtype == np.uint8
    assert meta["decoded_frames"] == 36 and meta["fps"] == pytest.approx(30.02, abs=0.05)
    assert a.std() > 10 and np.abs(np.diff(a.astype(np.int16), axis=0)).mean() > 0.5   # real, moving content
    out = Clips(Clips.Params(length=8, every=2, stride=5)).run(Sample("r", {"video": a}, {"video": "video"}, {"video": meta}),
                                                                np.random.default_rng(0))
    assert len(out) == 5 and out[-1].meta["clip"]["frames"] == list(range(20, 36, 2))   # starts 0..20 by 5


def test_recipe_builds(tmp_path):
    import precompile
    from precompile import build

    build(os.path.join(REPO, "recipes", "video.yaml"), out_dir=str(tmp_path))
    ds = precompile.open(str(tmp_path / "video.h5"))
    # squares: 40 frames, span 15, stride 8 -> starts 0, 8, 16, 24; balls 30 -> 0, 8; tiny 6 -> padded
    assert ds.keys == ["balls.mp4#clip0", "balls.mp4#clip1"] + [f"squares.avi#clip{i}" for i in range(4)] \
        + ["tiny.avi#clip0"]
    s = ds[ds.keys.index("squares.avi#clip3")]
    assert s["video"].shape == (8, 32, 32, 3) and s["frames"].tolist() == list(range(24, 40, 2))
    assert ds[len(ds) - 1]["frames"].tolist() == [0, 2, 4, 5, 5, 5, 5, 5]


# ------------------------------------------------------------------------------------------
# PyAV: generated H.264 files whose frames carry their own number, VFR, audio, streaming
# ------------------------------------------------------------------------------------------
def _bars(i, size):
    """A frame showing ``i`` in binary: 8 vertical bars, white for a 1 bit (survives lossy coding)."""
    w, h = size
    img = np.zeros((h, w, 3), np.uint8)
    bw = w // 8
    for b in range(8):
        if (i >> b) & 1:
            img[:, b * bw:(b + 1) * bw] = 255
    img[:, 8 * bw:, 1] = 90
    return img


def _number(frame):
    """The number a ``_bars`` frame shows (any size: reads the middle row of each bar)."""
    h, w = frame.shape[:2]
    bw = w / 8
    row = frame[h // 2]
    return sum(1 << b for b in range(8) if row[int((b + 0.5) * bw)].mean() > 128)


def _write_av(path, n, fps=30, size=(64, 48), pts_ms=None, audio=None, rate=48000, codec="libx264"):
    """An mp4 of ``n`` numbered frames (pts in ms when given: variable frame rate) and optionally a
    mono AAC track holding ``audio`` (float samples at ``rate``)."""
    import av

    c = av.open(str(path), "w")
    s = c.add_stream(codec, rate=fps)
    s.width, s.height = size
    s.pix_fmt = "yuv420p"
    if pts_ms is not None:
        s.codec_context.time_base = Fraction(1, 1000)
    a = None
    if audio is not None:
        a = c.add_stream("aac", rate=rate)
        a.layout = "mono"
    for i in range(n):
        f = av.VideoFrame.from_ndarray(_bars(i, size), format="rgb24")
        if pts_ms is not None:
            f.pts, f.time_base = pts_ms[i], Fraction(1, 1000)
        for p in s.encode(f):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    if a is not None:
        x = np.asarray(audio, np.float32)[None]
        for k in range(0, x.shape[1], 1024):
            fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, k:k + 1024]), format="fltp", layout="mono")
            fr.sample_rate, fr.pts = rate, k
            for p in a.encode(fr):
                c.mux(p)
        for p in a.encode():
            c.mux(p)
    c.close()
    return str(path)


VFR_MS = [0, 33, 66, 100, 200, 300, 310, 320, 330, 500, 533, 566, 600, 633, 666, 700, 900, 933, 966, 1000]


def test_h264_frames_exact_in_order_with_timestamps(tmp_path):
    p = _write_av(tmp_path / "n.mp4", 75, fps=25)
    a, meta = read_video(p)
    assert a.shape == (75, 48, 64, 3) and [_number(f) for f in a] == list(range(75))
    assert meta["decoded_frames"] == 75 and meta["claimed_frames"] == 75 and meta["codec"] == "h264"
    assert meta["pts"] == pytest.approx([i / 25 for i in range(75)], abs=1e-9)
    k, meta = read_video(p, every=4, max_frames=6)
    assert [_number(f) for f in k] == [0, 4, 8, 12, 16, 20] and meta["pts"] == pytest.approx([0, .16, .32, .48, .64, .8])


def test_vfr_timestamps_and_clips_in_seconds(tmp_path):
    p = _write_av(tmp_path / "vfr.mp4", 20, pts_ms=VFR_MS)
    a, meta = read_video(p)
    assert [_number(f) for f in a] == list(range(20))
    assert meta["pts"] == pytest.approx([t / 1000 for t in VFR_MS], abs=1e-9)
    s = Sample("vfr.mp4", {"video": a}, {"video": "video"}, {"video": meta})
    c = Clips(Clips.Params(fps=10, length=5, stride_s=0.5, index_field="i"))
    out = c.run(s, np.random.default_rng(0))
    # targets 0.0 .1 .2 .3 .4 -> the frame on screen at each time; 0.5 .. .9; 1.0 .. 1.4 runs past the end
    assert [o.fields["i"].tolist() for o in out] == [[0, 3, 4, 5, 8], [9, 12, 15, 15, 16]]
    assert [[_number(f) for f in o.fields["video"]] for o in out] == [[0, 3, 4, 5, 8], [9, 12, 15, 15, 16]]
    assert out[1].meta["clip"]["pts"] == pytest.approx([0.5, 0.6, 0.7, 0.7, 0.9])
    assert out[1].meta["clip"]["start"] == pytest.approx(0.5) and out[1].meta["clip"]["fps"] == 10
    assert "pts" not in out[0].meta["video"]   # the whole file's list is not copied into every clip
    # length_s is length * fps frames; a short video pads with the last frame
    (o,) = Clips(Clips.Params(fps=4, length_s=2.0, short="pad", index_field="i")).run(s, np.random.default_rng(0))
    assert o.fields["i"].tolist() == [0, 4, 9, 15, 19, 19, 19, 19] and o.meta["clip"]["pts"][-1] == 1.0
    assert c.plan({"video": FieldSpec("video", (None, None, None, 3), "uint8")})["video"].shape == (5, None, None, 3)


@pytest.mark.parametrize("bad, match", [
    ({"length_s": 1.0}, "needs fps"),
    ({"fps": 10}, "exactly one of length"),
    ({"fps": 10, "length": 4, "stride": 2}, "stride_s"),
    ({"fps": 10, "length_s": 0.01}, "less than one frame"),
    ({}, "length is required"),
])
def test_clips_params_errors(bad, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        Clips.Params(**bad)


def test_real_video_pyav_equals_opencv_and_has_timestamps():
    import cv2

    p = os.path.join(realdata(), "video", "realshort.mp4")
    if not os.path.exists(p):
        pytest.skip("realshort.mp4 absent")
    a, meta = read_video(p)
    cap = cv2.VideoCapture(p)
    ref = []
    while True:
        ok, fr = cap.read()
        if not ok:
            break
        ref.append(cv2.cvtColor(fr, cv2.COLOR_BGR2RGB))
    cap.release()
    assert len(ref) == 36 and np.array_equal(a, np.stack(ref))   # two FFmpeg builds, same frames
    assert meta["pts"] == pytest.approx([i * 1499 / 45000 for i in range(36)], abs=1e-9)   # 30.02 fps, 1/90000 base
    g, _ = read_video(p, "gray8")
    assert np.array_equal(g[..., 0], np.stack([cv2.cvtColor(f, cv2.COLOR_RGB2GRAY) for f in ref]))


def _video_tree(root, audio=True):
    """Three inputs: 75 numbered frames at 25 fps (with an audio track), a VFR file, a 5-frame file."""
    root.mkdir(parents=True, exist_ok=True)
    rate = 16000
    t = np.arange(int(3.2 * rate)) / rate
    _write_av(root / "a.mp4", 75, fps=25, audio=0.3 * np.sin(2 * np.pi * 440 * t) if audio else None, rate=rate)
    _write_av(root / "b.mp4", 20, pts_ms=VFR_MS)
    _write_av(root / "c.mp4", 5, fps=25)
    return root


def _recipe(tmp_path, root, steps, field=None, **over):
    from conftest import write_recipe

    r = {"name": "v", "seed": 3, "inputs": {"root": str(root), "match": "{name}.mp4",
                                             "fields": {"video": field or {"decoder": "video"}}},
         "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 2}}
    r.update(over)
    return write_recipe(tmp_path / f"r{len(list(tmp_path.glob('r*.yaml')))}.yaml", r)


def _dump(h5):
    import precompile

    ds = precompile.open(str(h5))
    return [(ds.key(i), ds.meta(i), {f: (a.dtype.str, a.shape, a.tobytes()) for f, a in ds[i].items()})
            for i in range(len(ds))]


STREAM_CASES = {
    "frames+resize+audio": ([{"clips": {"length": 8, "every": 2, "stride": 5, "short": "pad", "index_field": "i"}},
                             {"resize": {"size": [24, 32]}}],
                            {"decoder": "video", "audio_field": "sound", "audio_rate": 8000, "audio_missing": "silence"}, {}),
    "seconds+letterbox+random-after": ([{"clips": {"fps": 12, "length_s": 0.5, "stride_s": 0.25, "short": "pad",
                                                   "pad": "zero"}},
                                        {"resize": {"size": [20, 20], "keep_aspect": True}},
                                        {"random_flip": {}}, {"color_jitter": {"brightness": 0.3}}],
                                       None, {"copies": 2}),
    "max_clips+shorter+crop, gray": ([{"clips": {"length": 4, "max_clips": 2}}, {"resize": {"shorter": 16}},
                                      {"center_crop": {"size": [16, 16]}}],
                                     {"decoder": "video", "mode": "gray8", "every": 2}, {}),
    "clips only": ([{"clips": {"length": 3, "stride": 7}}], None, {}),
    "black padding + grey letterbox (resize not fused)": (
        [{"clips": {"length": 8, "stride": 30, "short": "pad", "pad": "zero"}},
         {"resize": {"size": [20, 20], "keep_aspect": True, "pad_value": 128}}], None, {}),
}


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_streamed_build_equals_whole_decode_and_any_job_count(tmp_path, monkeypatch, case):
    import precompile
    import precompile.transforms.temporal as temporal

    steps, field, over = STREAM_CASES[case]
    root = _video_tree(tmp_path / "in")
    recipe = _recipe(tmp_path, root, steps, field, **over)
    plan = temporal.stream_plan(precompile.load_recipe(recipe).decoders, precompile.load_recipe(recipe).steps)
    assert plan is not None and (plan.resize is None) == ("not fused" in case or "resize" not in str(steps))
    precompile.build(recipe, out_dir=tmp_path / "s1", n_jobs=1)
    precompile.build(recipe, out_dir=tmp_path / "s2", n_jobs=2)
    precompile.build(recipe, out_dir=tmp_path / "s1again", n_jobs=1, force=True)
    monkeypatch.setattr(temporal, "stream_plan", lambda decoders, steps: None)   # the whole-video path
    precompile.build(recipe, out_dir=tmp_path / "whole", n_jobs=1)
    ref = _dump(tmp_path / "whole" / "v.h5")
    assert len(ref) >= 4
    for other in ("s1", "s2", "s1again"):
        assert _dump(tmp_path / other / "v.h5") == ref, other
    for name in sorted(os.listdir(tmp_path / "s1" / "v.shards")):
        assert (tmp_path / "s1" / "v.shards" / name).read_bytes() == (tmp_path / "s2" / "v.shards" / name).read_bytes()


def test_audio_track_cut_to_each_clip_span(tmp_path):
    import precompile
    from precompile.decoders.video import read_audio_track

    rate = 16000
    x = np.zeros(3 * rate, np.float32)
    for t in (0.5, 1.3, 2.1):   # 10 ms tone bursts, 0.1 s into the clips that start at 0.4, 1.2, 2.0 s
        i = int(t * rate)
        x[i:i + 160] = 0.8 * np.sin(2 * np.pi * 1000 * np.arange(160) / rate) * np.hanning(160)
    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "clk.mp4", 75, fps=25, audio=x, rate=rate)
    field = {"decoder": "video", "audio_field": "sound", "audio_rate": 8000}
    recipe = _recipe(tmp_path, root, [{"clips": {"fps": 10, "length_s": 0.4, "stride_s": 0.4}}], field)
    precompile.build(recipe, out_dir=tmp_path / "out")
    ds = precompile.open(str(tmp_path / "out" / "v.h5"))
    track, meta = read_audio_track(str(root / "clk.mp4"), rate=8000)
    assert meta["sample_rate"] == 8000 and meta["source_rate"] == rate
    assert len(ds) == 7   # starts 0 .. 2.4 s; the last needs 2.4 + 0.3 <= 2.96 (last frame)
    for k in range(len(ds)):
        s, m = ds[k], ds.meta(k)["clip"]
        a = s["sound"]
        assert a.shape == (1, 3200) and a.dtype == np.float32 and m["audio"]["samples"] == 3200
        assert m["start"] == pytest.approx(0.4 * k) and m["audio"]["first_sample"] == round(0.4 * k * 8000)
        np.testing.assert_array_equal(a, track[:, round(0.4 * k * 8000):round(0.4 * k * 8000) + 3200])
        env = np.abs(a[0])
        if k in (1, 3, 5):
            assert abs(int(np.argmax(env)) - (800 + 40)) <= 64, k   # burst centre 0.105 s in, within 8 ms
        else:
            assert env.max() < 0.05, k
    # frame clips take length * every / fps seconds of audio from their first frame's time
    recipe = _recipe(tmp_path, root, [{"clips": {"length": 5, "every": 2, "stride": 20}}], field)
    precompile.build(recipe, out_dir=tmp_path / "out2")
    ds = precompile.open(str(tmp_path / "out2" / "v.h5"))
    assert [ds[k]["sound"].shape for k in range(len(ds))] == [(1, 3200)] * 4
    assert ds.meta(1)["clip"]["start"] == pytest.approx(0.8) and ds.meta(1)["clip"]["frames"] == [20, 22, 24, 26, 28]


def test_real_video_audio_track_and_clip_alignment():
    p = os.path.join(realdata(), "video", "realshort.mp4")
    if not os.path.exists(p):
        pytest.skip("realshort.mp4 absent")
    dec = VideoDecoder(VideoDecoder.Params(audio_field="sound", audio_rate=16000))
    arrays, meta = dec.decode(p, "video")
    x = arrays["sound"]
    assert arrays["video"].shape == (36, 240, 320, 3) and x.shape[0] == 1 and x.dtype == np.float32
    assert meta["audio"]["source_rate"] == 48000 and abs(x.shape[1] / 16000 - 56320 / 48000) < 0.01
    assert np.abs(x).max() > 0.01   # real sound
    s = Sample("r", arrays, {"video": "video", "sound": "audio"}, {"video": meta})
    out = Clips(Clips.Params(length=10, stride=10)).run(s, np.random.default_rng(0))
    assert len(out) == 3
    for k, o in enumerate(out):
        first = round(o.meta["clip"]["start"] * 16000)
        n = round(10 * 16000 / meta["fps"])
        assert o.fields["sound"].shape == (1, n)
        np.testing.assert_array_equal(o.fields["sound"], x[:, first:first + n])


def test_bad_videos_are_per_input_errors_naming_file_and_stage(tmp_path):
    import av
    import cv2

    import precompile

    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "good.mp4", 12)
    (root / "text.mp4").write_text("hello, this is not a video\n")
    (root / "empty.mp4").write_bytes(b"")
    blob = Path(_write_av(tmp_path / "whole.mp4", 60)).read_bytes()
    (root / "truncated.mp4").write_bytes(blob[:len(blob) // 2])   # the index (moov) is at the end: gone
    c = av.open(str(root / "soundonly.mp4"), "w")
    a = c.add_stream("aac", rate=16000)
    a.layout = "mono"
    fr = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
    fr.sample_rate, fr.pts = 16000, 0
    for pk in [*a.encode(fr), *a.encode()]:
        c.mux(pk)
    c.close()
    w = cv2.VideoWriter(str(tmp_path / "zero.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10, (32, 24))
    w.release()
    os.replace(tmp_path / "zero.avi", root / "zero.mp4")   # a video stream with no frames
    recipe = _recipe(tmp_path, root, [{"clips": {"length": 4}}, {"resize": {"size": [16, 16]}}], on_error="skip")
    rep = precompile.build(recipe, out_dir=tmp_path / "out")
    by = {os.path.basename(f["path"]): f for f in rep["failures"]}
    assert set(by) == {"text.mp4", "empty.mp4", "truncated.mp4", "soundonly.mp4", "zero.mp4"}
    assert all(f["stage"] == "decode" and f["field"] == "video" for f in by.values())
    assert "cannot open as a video" in by["text.mp4"]["message"] and str(root / "text.mp4") in by["text.mp4"]["message"]
    assert "cannot open as a video" in by["truncated.mp4"]["message"]
    assert "no video stream (streams: audio)" in by["soundonly.mp4"]["message"]
    assert "no frame could be decoded" in by["zero.mp4"]["message"]
    assert precompile.open(str(tmp_path / "out" / "v.h5")).keys == [f"good.mp4#clip{i}" for i in range(3)]
    # asking for the audio of a file that has none is an error unless silence is asked for
    recipe = _recipe(tmp_path, root, [{"clips": {"length": 4}}], {"decoder": "video", "audio_field": "snd"},
                     inputs={"root": str(root), "match": "good.mp4", "fields": {"video": {"decoder": "video",
                                                                                        "audio_field": "snd"}}})
    with pytest.raises(Exception, match=r"good.mp4.*stage decode.*no audio stream"):
        precompile.build(recipe, out_dir=tmp_path / "out2")


def test_input_failing_mid_stream_is_dropped_whole(tmp_path):
    """Two MPEG-TS files back to back: the frame size changes at frame 20, after 5 clips were cut."""
    import precompile

    root = tmp_path / "in"
    root.mkdir()
    a = Path(_write_av(tmp_path / "p1.ts", 20, size=(64, 48))).read_bytes()
    b = Path(_write_av(tmp_path / "p2.ts", 20, size=(32, 24))).read_bytes()
    (root / "cat.mp4").write_bytes(a + b)
    _write_av(root / "ok.mp4", 8)
    recipe = _recipe(tmp_path, root, [{"clips": {"length": 4}}], on_error="skip")
    rep = precompile.build(recipe, out_dir=tmp_path / "out")
    (f,) = rep["failures"]
    assert f["stage"] == "decode" and f["path"] == str(root / "cat.mp4") and "frame 20 is 32x24" in f["message"]
    assert precompile.open(str(tmp_path / "out" / "v.h5")).keys == ["ok.mp4#clip0", "ok.mp4#clip1"]


@pytest.mark.parametrize("params, clips, converted, held", [
    ({"length": 8}, 37, 300, 8),                              # back to back: one clip at a time (and the
                                                              # tail 296-299, converted before the end shows)
    ({"length": 8, "stride": 4}, 74, 300, 8),                 # overlapping: the clip plus its overlap
    ({"length": 4, "every": 3, "stride": 50}, 6, 24, 4),      # sparse: only the taken frames are converted
    ({"fps": 5, "length": 4}, 12, 50, 4),                     # by time: 30 fps -> 5 fps (+2 of the tail)
    ({"length": 8, "max_clips": 2}, 2, 16, 8),                # stops decoding after the last clip
])
def test_stream_holds_one_clip_and_converts_only_taken_frames(tmp_path, params, clips, converted, held):
    from precompile.transforms.temporal import ClipCutter

    p = _write_av(tmp_path / "long.mp4", 300, fps=30)
    arrays, meta, frames = VideoDecoder().open_stream(p, "video")
    counts = {"yielded": 0, "converted": 0}

    def counted():
        for pos, t, get in frames:
            counts["yielded"] += 1

            def conv(get=get):
                counts["converted"] += 1
                return (get(),)
            yield pos, t, conv

    step = Clips(Clips.Params(**params))
    cutter = ClipCutter(step)
    out = list(step.cut(Sample("long.mp4", arrays, {"video": "video"}, {"video": meta}), ["video"], counted(), cutter))
    assert len(out) == clips and counts["converted"] == converted and cutter.peak_held == held
    assert counts["yielded"] == (16 if "max_clips" in params else 300)
    for o in out:
        assert [_number(f) for f in o.fields["video"]] == [i % 256 for i in o.meta["clip"]["frames"]]


def test_sample_spill_round_trips_past_its_memory_limit(tmp_path):
    from precompile.spill import SampleSpill

    rng = np.random.default_rng(0)
    samples = [Sample(f"k{i}", {"v": rng.integers(0, 255, (4, 8, 8, 3), dtype=np.uint8),
                                "i": np.arange(i, dtype=np.int32), "s": np.float32(i)},
                      {"v": "video", "i": "index", "s": "label"}, {"clip": {"index": i}}, copy=i % 2)
               for i in range(10)]
    sp = SampleSpill(str(tmp_path), limit=3000)
    for s in samples:
        sp.add(s)
    assert sp.in_memory <= 3000 and sp.spilled > 0 and len(sp) == 10
    back = list(sp)
    for a, b in zip(samples, back):
        assert (a.key, a.kinds, a.meta, a.copy) == (b.key, b.kinds, b.meta, b.copy)
        assert a.fields.keys() == b.fields.keys()
        for f in a.fields:
            assert np.asarray(a.fields[f]).dtype == b.fields[f].dtype
            np.testing.assert_array_equal(a.fields[f], b.fields[f])
    sp.close()
    assert os.listdir(tmp_path) == []   # the spill file is unnamed: nothing left behind


def test_isolated_decoder_build_equals_streamed(tmp_path):
    """timeout_s decodes in a helper process that returns whole arrays (no streaming): same output."""
    import precompile

    steps, field, over = STREAM_CASES["frames+resize+audio"]
    root = _video_tree(tmp_path / "in")
    recipe = _recipe(tmp_path, root, steps, field, **over)
    precompile.build(recipe, out_dir=tmp_path / "streamed")
    precompile.build(recipe, out_dir=tmp_path / "isolated", timeout_s=60)
    assert _dump(tmp_path / "isolated" / "v.h5") == _dump(tmp_path / "streamed" / "v.h5")


@pytest.mark.parametrize("case", ["frames+resize+audio", "seconds+letterbox+random-after"])
def test_streamed_build_through_disk_spills_equals_whole_decode(tmp_path, monkeypatch, case):
    """Every buffered sample goes through the temporary file (limit 1 byte): the clips waiting for
    their input to finish, and, before random steps, each step's output over all clips."""
    import precompile
    import precompile.spill as spill
    import precompile.transforms.temporal as temporal

    steps, field, over = STREAM_CASES[case]
    root = _video_tree(tmp_path / "in")
    recipe = _recipe(tmp_path, root, steps, field, **over)
    spilled = []
    add = spill.SampleSpill.add

    def counting_add(self, s):
        add(self, s)
        spilled.append(self.spilled)
    monkeypatch.setattr(spill, "DEFAULT_LIMIT", 1)
    monkeypatch.setattr(spill.SampleSpill, "add", counting_add)
    precompile.build(recipe, out_dir=tmp_path / "spilled", n_jobs=1)
    assert spilled and min(spilled) > 0   # every add went to disk
    monkeypatch.setattr(temporal, "stream_plan", lambda decoders, steps: None)
    precompile.build(recipe, out_dir=tmp_path / "whole", n_jobs=1)
    assert _dump(tmp_path / "spilled" / "v.h5") == _dump(tmp_path / "whole" / "v.h5")
    assert not [p for p in os.listdir(tmp_path / "spilled" / "v.shards") if "spill" in p]


def test_input_failing_in_a_random_step_after_clips_is_dropped_and_its_spills_closed(tmp_path, monkeypatch):
    """Random steps after clips run over all clips of an input (through spill files here); an input
    whose frames are too small for random_crop fails there and is dropped; nothing is left open
    (pytest turns an unclosed spill file into an error)."""
    import gc

    import precompile
    import precompile.spill as spill

    monkeypatch.setattr(spill, "DEFAULT_LIMIT", 1)
    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "big.mp4", 12, size=(128, 112))
    _write_av(root / "small.mp4", 12, size=(64, 48))
    recipe = _recipe(tmp_path, root, [{"clips": {"length": 4}}, {"random_crop": {"size": [100, 100]}}],
                     on_error="skip")
    rep = precompile.build(recipe, out_dir=tmp_path / "out")
    (f,) = rep["failures"]
    assert f["path"] == str(root / "small.mp4") and f["stage"] == "steps[1] random_crop"
    assert precompile.open(str(tmp_path / "out" / "v.h5")).keys == [f"big.mp4#clip{i}" for i in range(3)]
    gc.collect()


@pytest.mark.parametrize("random_after", [False, True])
def test_an_error_while_cutting_streamed_clips_names_the_input_and_the_clips_step(tmp_path, monkeypatch,
                                                                                random_after):
    """A failure in the middle of cutting a streamed video drops that input whole (its clips already
    cut are not stored, their spills are closed) and names the file and ``steps[0] clips``; the
    other input is built, with or without a random step after the clips (the batch path)."""
    import precompile
    import precompile.spill as spill
    from precompile.transforms.temporal import Clips

    monkeypatch.setattr(spill, "DEFAULT_LIMIT", 1)   # every clip goes through a spill file
    cut = Clips.cut

    def failing_cut(self, sample, targets, frames, *a, **kw):
        for k, clip in enumerate(cut(self, sample, targets, frames, *a, **kw)):
            if sample.key == "bad.mp4" and k == 1:
                raise ValueError("the cutter broke")
            yield clip

    monkeypatch.setattr(Clips, "cut", failing_cut)
    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "bad.mp4", 12)
    _write_av(root / "good.mp4", 12)
    steps = [{"clips": {"length": 4}}] + ([{"random_crop": {"size": [32, 32]}}] if random_after else [])
    rep = precompile.build(_recipe(tmp_path, root, steps, on_error="skip"), out_dir=tmp_path / "out")
    (f,) = rep["failures"]
    assert f["path"] == str(root / "bad.mp4") and f["stage"] == "steps[0] clips"
    assert f["message"] == f"{root / 'bad.mp4'}, stage steps[0] clips: clips: ValueError: the cutter broke"
    assert precompile.open(str(tmp_path / "out" / "v.h5")).keys == [f"good.mp4#clip{i}" for i in range(3)]


def test_time_clips_store_their_audio_with_a_fixed_length_the_loader_takes(tmp_path):
    """Clips cut by time with the decoder's audio_rate: the audio field's length (length_s * rate) is
    known at plan time, stored fixed, and a Loader batches it with no fix_length step."""
    torch = pytest.importorskip("torch")
    import precompile
    from precompile.compiler.plan import plan_specs
    from precompile.reader.loader import Loader

    root = _video_tree(tmp_path / "in")
    field = {"decoder": "video", "audio_field": "sound", "audio_rate": 8000, "audio_missing": "silence"}
    recipe = _recipe(tmp_path, root, [{"clips": {"fps": 10, "length_s": 0.4, "stride_s": 0.4, "short": "pad"}},
                                      {"resize": {"size": [24, 32]}}], field)
    specs, _ = plan_specs(precompile.load_recipe(recipe))
    assert specs["sound"].shape == (1, 3200) and specs["video"].shape == (4, 24, 32, 3)
    precompile.build(recipe, out_dir=tmp_path / "out")
    ds = precompile.open(str(tmp_path / "out" / "v.h5"))
    assert ds.field_specs["sound"]["shape"] == [1, 3200] and not ds.variable("sound")
    assert all(ds[i]["sound"].shape == (1, 3200) for i in range(len(ds)))
    n = 0
    for b in Loader(str(tmp_path / "out" / "v.h5"), batch_size=3, shuffle=False, device="cpu",
                    fields=["sound"], num_threads=0, drop_last=False):
        assert tuple(b["sound"].shape[1:]) == (1, 3200) and b["sound"].dtype == torch.float32
        n += b["sound"].shape[0]
    assert n == len(ds)
    # without audio_rate the file decides the rate: the length stays variable, as before
    field = {"decoder": "video", "audio_field": "sound", "audio_missing": "error"}
    recipe = _recipe(tmp_path, root, [{"clips": {"fps": 10, "length_s": 0.4}}], field)
    specs, _ = plan_specs(precompile.load_recipe(recipe))
    assert specs["sound"].shape[-1] is None
    # frame clips: the span depends on each file's fps, so it stays variable too
    field = {"decoder": "video", "audio_field": "sound", "audio_rate": 8000}
    recipe = _recipe(tmp_path, root, [{"clips": {"length": 4}}], field)
    assert plan_specs(precompile.load_recipe(recipe))[0]["sound"].shape[-1] is None


def _on_screen(pts: list, fps: Fraction, length: int, stride: Fraction, short: str = "drop") -> list:
    """docs/reference-steps.md's rule with exact rationals: frame j of clip k is the last frame whose pts is at or
    before t0 + k * stride + j / fps; a clip whose last slot lies past the last frame's pts is not cut."""
    out, k = [], 0
    while True:
        times = [pts[0] + k * stride + Fraction(j) / fps for j in range(length)]
        if times[-1] > pts[-1]:
            return out
        out.append([max(i for i, p in enumerate(pts) if p <= t) for t in times])
        k += 1


@pytest.mark.parametrize("base,offset,fps,length", [(12, 1, 8, 3), (12, 1, 8, 2), (30, 1, 10, 4), (3, 1, 6, 3),
                                                      (24, 5, 8, 4), (25, 3, 5, 3), (12, 7, 4, 3)])
def test_time_clips_take_the_frame_whose_pts_is_exactly_a_slot_time(base, offset, fps, length):
    """Frame timestamps are rationals of a time base (4 * 1/12 = 1/3) that reach the step as floats. The step read
    them as their floats' decimals (0.3333333333333333) against exact slot times (1/12 + 2/8 = 1/3): a slot exactly
    at a frame's pts missed it, so the clip lacked its last frame and a video of exactly one clip was dropped
    without a word (fuzzer seed 123709: 5 frames at 12 fps, the window [0.05, 0.35), clips of 3 at 8 fps). Now
    every clip is the exact rule's, for frames from ``offset`` frames past the origin (a decoder window) at
    ``base`` fps."""
    n = 12
    pts = [Fraction(offset + i, base) for i in range(n)]
    a = np.stack([_bars(i, (16, 12)) for i in range(n)])
    s = Sample("v.mp4", {"video": a}, {"video": "video"},
               {"video": {"fps": float(base), "every": 1, "pts": [float(p) for p in pts]}})
    c = Clips(Clips.Params(fps=fps, length=length, index_field="i"))
    got = [o.fields["i"].tolist() for o in c.run(s, np.random.default_rng(0))]
    want = _on_screen(pts, Fraction(fps), length, Fraction(length, fps))
    assert want and got == want


def _write_turned(path: str, degrees: int, hflip: bool, n: int = 6) -> np.ndarray:
    """An mpeg4 file of ``n`` 32x16 frames (a white 8x8 block at the stored top-left, and the frame index in the
    block's blue) with a display matrix of ``degrees`` counter-clockwise then ``hflip`` (PyAV's
    set_display_rotation). Returns the stored frame 0."""
    import av

    c = av.open(path, "w")
    s = c.add_stream("mpeg4", rate=10)
    s.width, s.height, s.pix_fmt = 32, 16, "yuv420p"
    s.set_display_rotation(degrees, hflip=hflip)
    first = None
    for k in range(n):
        f = np.zeros((16, 32, 3), np.uint8)
        f[:8, :8] = 255
        first = f if first is None else first
        for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return first


@pytest.mark.parametrize("degrees, hflip", [(90, False), (270, False), (180, False), (0, True), (90, True)])
def test_frames_are_turned_as_the_display_matrix_says(tmp_path, degrees, hflip):
    """A phone's portrait video is stored landscape with a display matrix that players apply (PyAV: a
    counter-clockwise turn, then a mirror); the decoder gave the stored frames, on their side. Frames now come as
    a player shows them, whole (read), streamed through clips (a build), and by time, checked against np.rot90
    and a left-right flip of the stored frame; ``rotate: false`` keeps them as stored."""
    import precompile

    p = str(tmp_path / "v.mp4")
    stored = _write_turned(p, degrees, hflip)
    want = np.rot90(stored, degrees // 90)
    if hflip:
        want = want[:, ::-1]
    arr, meta = VideoDecoder().read(p)
    assert arr.shape == (6, *want.shape) and np.array_equal(arr[0], want)
    assert (meta["height"], meta["width"]) == want.shape[:2] and len(meta["display_matrix"]) == 4
    arr, meta = VideoDecoder(VideoDecoder.Params(rotate=False)).read(p)
    assert np.array_equal(arr[0], stored) and "display_matrix" not in meta
    for steps in ([{"clips": {"length": 3}}], [{"clips": {"fps": 10, "length": 3}}]):
        out = tmp_path / f"out{len(steps[0]['clips'])}"
        precompile.build({"name": "v", "inputs": {"root": str(tmp_path), "match": "v.mp4",
                                                  "fields": {"video": {"decoder": "video"}}}, "steps": steps},
                         str(out), progress=False)
        ds = precompile.open(out / "v.h5")
        assert len(ds) == 2 and all(np.array_equal(ds[i]["video"][0], want) for i in range(2))


def test_a_display_matrix_off_the_right_angles_is_refused(tmp_path):
    """A 45 degree display matrix cannot be applied by a turn of the pixel grid: a decode error naming the file,
    which says how to read the frames as stored."""
    p = str(tmp_path / "v.mp4")
    _write_turned(p, 45, False)
    with pytest.raises(DecodeError, match=r"v\.mp4.*turns frames by an angle that is not a multiple of 90 degrees; "
                                          r"set rotate: false"):
        VideoDecoder().read(p)
    arr, _ = VideoDecoder(VideoDecoder.Params(rotate=False)).read(p)
    assert arr.shape == (6, 16, 32, 3)
