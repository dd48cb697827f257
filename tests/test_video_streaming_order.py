"""Video steps in any order (issue 20): per-frame steps before ``clips`` stream like those after it.

``resize`` then ``clips`` must store the same bytes as ``clips`` then ``resize``, and as the
whole-video path (no streaming), at -j1 and -j2; random steps before ``clips`` keep one draw per
video (they decode whole); a recipe that holds whole videos says so in ``precompile plan``.
"""
from __future__ import annotations

import os
import sys

import pytest

import precompile
import precompile.transforms.temporal as temporal

sys.path.insert(0, os.path.dirname(__file__))
from test_video import _dump, _recipe, _video_tree  # noqa: E402

pytest.importorskip("av")

CLIPS = {"clips": {"length": 4, "stride": 6, "short": "pad", "index_field": "i"}}
ORDERS = {
    "resize": ([{"resize": {"size": [24, 32]}}, CLIPS], [CLIPS, {"resize": {"size": [24, 32]}}]),
    "shorter+center_crop+convert": (
        [{"resize": {"shorter": 20}}, {"center_crop": {"size": [16, 16]}}, {"convert": {"mode": "gray8"}}, CLIPS],
        [CLIPS, {"resize": {"shorter": 20}}, {"center_crop": {"size": [16, 16]}}, {"convert": {"mode": "gray8"}}]),
    "letterbox, black padding, random after": (
        [{"resize": {"size": [20, 20], "keep_aspect": True, "pad_value": 128}},
         {"clips": {"fps": 12, "length_s": 0.5, "stride_s": 0.4, "short": "pad", "pad": "zero"}},
         {"random_flip": {}}],
        None),
}


def _plan(recipe):
    r = precompile.load_recipe(recipe)
    return temporal.stream_plan(r.decoders, r.steps)


@pytest.mark.parametrize("case", sorted(ORDERS))
def test_per_frame_steps_before_clips_stream_and_equal_the_other_order(tmp_path, monkeypatch, case):
    before, after = ORDERS[case]
    root = _video_tree(tmp_path / "in")
    over = {"copies": 2} if "random" in case else {}
    recipe = _recipe(tmp_path, root, before, **over)
    plan = _plan(recipe)
    assert plan is not None and [s.name for _, s in plan.pre] == [next(iter(s)) for s in before[:plan.at]]
    precompile.build(recipe, out_dir=tmp_path / "s1", n_jobs=1)
    precompile.build(recipe, out_dir=tmp_path / "s2", n_jobs=2)
    got = _dump(tmp_path / "s1" / "v.h5")
    assert len(got) >= 8 and _dump(tmp_path / "s2" / "v.h5") == got
    if after is not None:   # the same steps the other way round: the same bytes
        other = _recipe(tmp_path, root, after, **over)
        precompile.build(other, out_dir=tmp_path / "after", n_jobs=1)
        assert _dump(tmp_path / "after" / "v.h5") == got
    monkeypatch.setattr(temporal, "stream_plan", lambda decoders, steps: None)   # the whole-video path
    precompile.build(recipe, out_dir=tmp_path / "whole", n_jobs=1)
    assert _dump(tmp_path / "whole" / "v.h5") == got


def test_streamed_pre_steps_hold_frames_not_videos(tmp_path, monkeypatch):
    """The frames the cutter holds are already resized: at most a clip's worth of small frames."""
    from test_video import _write_av

    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "long.mp4", 120, size=(320, 240))
    recipe = _recipe(tmp_path, root, [{"resize": {"size": [12, 16]}}, {"clips": {"length": 4}}])
    seen = []
    push = temporal.ClipCutter.push

    def spy(self, pos, t, get):
        out = push(self, pos, t, get)
        seen.extend(a.shape for _, px in self.held.values() for a in px)
        seen.extend(a.shape for c in out for it in c.items for a in it)
        return out
    monkeypatch.setattr(temporal.ClipCutter, "push", spy)
    precompile.build(recipe, out_dir=tmp_path / "out", n_jobs=1)
    # per clip of 4: 1 + 2 + 3 frames held after the pushes before it completes, then its 4 frames
    assert len(seen) == 30 * (6 + 4) and set(seen) == {(12, 16, 3)}
    assert len(precompile.open(str(tmp_path / "out" / "v.h5"))) == 30


@pytest.mark.parametrize("steps, why", [
    ([{"random_flip": {}}, {"clips": {"length": 4}}], "steps[0] random_flip before clips draws once per video "
                                                       "(all its clips share the draw; it cannot move past clips)"),
    ([{"resize": {"size": [8, 8]}}, {"temporal_jitter": {"length": 2}}, {"clips": {"length": 1}}],
     "steps[1] temporal_jitter before clips draws once per video"),
    ([{"resize": {"size": [8, 8]}}], "no clips step"),
    ([{"clips": {"length": 4}}], None),
    ([{"convert": {"mode": "gray8"}}, {"center_crop": {"size": [8, 8]}}, {"clips": {"length": 4}}], None),
])
def test_what_streams_and_why_not(tmp_path, steps, why):
    root = _video_tree(tmp_path / "in", audio=False)
    r = precompile.load_recipe(_recipe(tmp_path, root, steps))
    assert (temporal.stream_plan(r.decoders, r.steps) is None) == (why is not None)
    reason = temporal.whole_video_reason(r.decoders, r.steps)
    assert (reason is None) == (why is None) and (why is None or reason.startswith(why))


def test_random_step_before_clips_keeps_one_draw_per_video(tmp_path):
    """random_flip before clips flips a whole video or none of it: every clip of one copy of a
    video has the same draw (and the flipped clips are the mirrored frames)."""
    import numpy as np

    root = _video_tree(tmp_path / "in", audio=False)
    recipe = _recipe(tmp_path, root, [{"random_flip": {"horizontal": 0.5}}, {"clips": {"length": 4}}], copies=6,
                     keep_original=False)
    precompile.build(recipe, out_dir=tmp_path / "out", n_jobs=1)
    plain = _recipe(tmp_path, root, [{"clips": {"length": 4}}])
    precompile.build(plain, out_dir=tmp_path / "plain", n_jobs=1)
    ds, ref = precompile.open(str(tmp_path / "out" / "v.h5")), precompile.open(str(tmp_path / "plain" / "v.h5"))
    frames = {ref.key(i): ref[i]["video"] for i in range(len(ref))}
    draws: dict = {}
    for i in range(len(ds)):
        flip = ds.meta(i)["augment"][0]["horizontal"]
        draws.setdefault((ds.key(i).split("#")[0], ds.copy(i)), []).append(flip)
        want = frames[ds.key(i)][:, :, ::-1] if flip else frames[ds.key(i)]
        assert np.array_equal(ds[i]["video"], want)
    assert len(draws) == 3 * 6 and all(len(v) >= 1 for v in draws.values())
    assert all(len(set(v)) == 1 for v in draws.values())
    assert {v[0] for v in draws.values()} == {True, False}
    assert any(len(v) > 1 for v in draws.values())


def test_plan_prints_how_videos_are_read_and_the_memory_a_whole_video_needs(tmp_path):
    from click.testing import CliRunner

    from precompile.cli import main

    root = _video_tree(tmp_path / "in", audio=False)
    whole = _recipe(tmp_path, root, [{"resize": {"size": [8, 8]}}])
    res = CliRunner().invoke(main, ["plan", str(whole)])
    assert res.exit_code == 0, res.output
    # the largest declared video: a.mp4, 75 frames of 48x64x3 (the file's header; the decode may differ),
    # held after the resize, which runs on each frame as it is decoded (issue 32.10): 75 x 8 x 8 x 3
    assert "video     video: no clips step: each video is held whole after resize (run on each frame as it is " \
           "decoded), up to 75 x 8 x 8 x 3 = 14,400 bytes per video (largest header of 3 input(s))" in res.output
    held = _recipe(tmp_path, root, [{"random_flip": {}}, {"resize": {"size": [8, 8]}}])
    res = CliRunner().invoke(main, ["plan", str(held)])
    assert res.exit_code == 0, res.output
    assert "video     video: no clips step: each video is held whole, up to 75 x 48 x 64 x 3 = 691,200 " \
           "bytes per video (largest header of 3 input(s))" in res.output
    streamed = _recipe(tmp_path, root, [{"resize": {"size": [8, 8]}}, {"clips": {"length": 4}}])
    res = CliRunner().invoke(main, ["plan", str(streamed)])
    assert res.exit_code == 0, res.output
    assert "video     video: streamed frame by frame (resize -> clips), one clip at a time in memory" in res.output
    # Matroska declares no frame count: the memory is unknown, and plan says so
    from test_video import _write_av

    mkv = tmp_path / "mkv"
    mkv.mkdir()
    _write_av(mkv / "a.mkv", 10)
    r = _recipe(tmp_path, mkv, [{"resize": {"size": [8, 8]}}], inputs={
        "root": str(mkv), "match": "{name}.mkv", "fields": {"video": {"decoder": "video"}}})
    res = CliRunner().invoke(main, ["plan", str(r)])
    assert res.exit_code == 0, res.output
    assert "video     video: no clips step: each video is held whole after resize (run on each frame as it is " \
           "decoded), memory unknown (no container header of 1 probed input(s) declares a frame count)" in res.output


def test_a_failing_step_before_clips_names_the_input_and_step_as_without_streaming(tmp_path, monkeypatch):
    """center_crop larger than the frames fails on the first frame streamed; the failure (message,
    stage, file) is the whole-video path's, and the input is dropped whole."""
    from test_video import _write_av

    root = tmp_path / "in"
    root.mkdir()
    _write_av(root / "big.mp4", 12, size=(128, 96))
    _write_av(root / "small.mp4", 12)
    steps = [{"center_crop": {"size": [80, 80]}}, {"clips": {"length": 4}}]
    recipe = _recipe(tmp_path, root, steps, on_error="skip")
    assert _plan(recipe) is not None
    reports = [precompile.build(recipe, out_dir=tmp_path / "s", n_jobs=1)]
    monkeypatch.setattr(temporal, "stream_plan", lambda decoders, steps: None)
    reports.append(precompile.build(recipe, out_dir=tmp_path / "w", n_jobs=1))
    fails = [[(f["path"], f["stage"], f["field"], f["message"]) for f in r["failures"]] for r in reports]
    assert fails[0] == fails[1]
    ((path, stage, field, message),) = fails[0]
    assert path == str(root / "small.mp4") and stage == "steps[0] center_crop" and field == "video"
    assert "input 48x64 is smaller than the crop 80x80 (set pad: true to pad)" in message
    assert _dump(tmp_path / "s" / "v.h5") == _dump(tmp_path / "w" / "v.h5")
    assert precompile.open(str(tmp_path / "s" / "v.h5")).keys == [f"big.mp4#clip{i}" for i in range(3)]
