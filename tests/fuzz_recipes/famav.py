"""Videos whose frames show their own index (a flat colour) and whose audio samples hold their own time (a ramp),
and audio files whose samples hold their own index (a ramp). References: PyAV's own decode of the file (frame
order and pts), the docs' clip and window rules (reference.py), and the ramps."""
from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np

from . import reference as ref
from .oracles import Report
from .truth import audio_ramp, frame_index, pyav_frames, rng_of, write_video, write_wav_int16

CONTAINERS = {"mpeg4": ["mp4", "avi"], "libx264": ["mp4", "mkv"], "ffv1": ["mkv"], "mjpeg": ["avi"]}


# -- drawing ------------------------------------------------------------------------------------------------------
def draw_video(seed: int) -> dict:
    from .draw import _choice, draw_2d_step, out_hw

    r = rng_of(seed, "video")
    gray = r.random() < 0.25
    vids = []
    audio_any = r.random() < 0.4
    for i in range(int(r.integers(1, 3))):
        codec = _choice(r, list(CONTAINERS), [3, 3, 2, 1])
        ext = _choice(r, CONTAINERS[codec])
        if audio_any and ext == "mp4":
            ext = "mkv" if codec != "mpeg4" else "avi"
        n = int(r.integers(4, 18 if gray else 25))
        H, W = 2 * int(r.integers(8, 25)), 2 * int(r.integers(8, 25))
        vids.append({"name": f"v{i}.{ext}", "n": n, "H": H, "W": W, "fps": _choice(r, [10, 12, 25]), "codec": codec,
                     "audio": ({"rate": int(_choice(r, [8000, 11025, 16000])), "channels": int(_choice(r, [1, 2]))}
                               if audio_any and (i == 0 or r.random() < 0.7) else None), "gray": gray})
    dec: dict[str, Any] = {"decoder": "video"}
    if r.random() < 0.3:
        dec["mode"] = "gray8" if gray else "rgb8"
    if r.random() < 0.25:
        dec["every"] = int(r.integers(2, 4))
    if r.random() < 0.2:
        dec["max_frames"] = int(r.integers(2, 10))
    window = not audio_any and r.random() < 0.15
    if window:   # every video is at least 4 frames at 10 fps or more: [0, 0.1] holds frames
        dec["start_s"] = float(_choice(r, [0.0, 0.05, 0.1]))
        if r.random() < 0.6:
            dec["end_s"] = round(dec["start_s"] + float(_choice(r, [0.15, 0.3, 0.6])), 3)
    if audio_any:
        dec["audio_field"] = "sound"
        if r.random() < 0.6 or any(v["audio"] is None for v in vids):
            dec["audio_rate"] = int(_choice(r, [8000, 16000]))
        if r.random() < 0.3:
            dec["audio_mono"] = False
        if r.random() < 0.3:
            dec["audio_quality"] = _choice(r, ["VHQ", "HQ", "MQ"])
        if any(v["audio"] is None for v in vids):
            dec["audio_missing"] = "silence"
        if not dec.get("audio_mono", True) and len({(v["audio"] or {}).get("channels") for v in vids}) > 1:
            dec["audio_mono"] = True
    # a display matrix (a phone's turned video) on some mp4 files, from a stream of its own (the draws above and
    # after stay): the decoder turns the frames as players show them unless rotate: false
    rr = np.random.default_rng([seed, 41])
    for v in vids:
        if v["name"].endswith(".mp4") and rr.random() < 0.5:
            v["rotation"] = int(_choice(rr, [90, 180, 270]))
    if any(v.get("rotation") for v in vids) and rr.random() < 0.4:
        dec["rotate"] = False
    steps: list[dict] = []
    sizes = [(v["W"], v["H"]) if _turned(v, dec) else (v["H"], v["W"]) for v in vids]   # as the decoder gives them
    if r.random() < 0.5:   # per-frame steps before clips: the streamed path
        for _ in range(int(r.integers(1, 3))):
            name = _choice(r, ["resize", "center_crop", "convert"])
            if name == "resize":
                s = {"resize": {"size": [int(r.integers(8, 24)), int(r.integers(8, 24))]} if r.random() < 0.7
                     else {"shorter": int(r.integers(8, 20))}}
            elif name == "center_crop":
                mh, mw = min(h for h, _ in sizes), min(w for _, w in sizes)
                s = {"center_crop": {"size": [int(r.integers(6, mh + 1)), int(r.integers(6, mw + 1))]}}
            else:
                s = {"convert": {"mode": _choice(r, ["rgb8", "rgba8"] + (["gray8"] if gray else []))}}
            steps.append(s)
            (n_, p_), = s.items()
            sizes = [out_hw(n_, p_, hw) for hw in sizes]
    clips = r.random() < 0.75
    if clips:
        c: dict[str, Any] = {}
        if r.random() < 0.3:
            c["fps"] = float(_choice(r, [5, 8, 12.5]))
            if r.random() < 0.5:
                c["length"] = int(r.integers(1, 6))
            else:
                c["length_s"] = float(_choice(r, [0.25, 0.5, 0.4]))
            if r.random() < 0.5:
                c["stride_s"] = float(_choice(r, [0.2, 0.5, 0.3]))
        else:
            c["length"] = int(r.integers(1, 6))
            if r.random() < 0.4:
                c["every"] = int(r.integers(2, 4))
            if r.random() < 0.5:
                c["stride"] = int(r.integers(1, 6))
        if r.random() < 0.3:
            c["short"] = "pad"
            if r.random() < 0.5:
                c["pad"] = "zero"
        if r.random() < 0.3:
            c["max_clips"] = int(r.integers(1, 4))
        if r.random() < 0.6:
            c["index_field"] = "frames"
        steps.append({"clips": c})
    for _ in range(int(_choice(r, [0, 1, 1, 2]))):
        if clips and r.random() < 0.3:
            steps.append({"temporal_jitter": {"length": int(r.integers(1, 4)),
                                              **({"strides": [1, 2]} if r.random() < 0.5 else {}),
                                              **({"jitter": 1} if r.random() < 0.5 else {})}})
            continue
        s = draw_2d_step(r, sizes, False, True, False, video=True)
        if s is None:
            continue
        (n_, p_), = s.items()
        if n_ == "color_jitter":
            s = {"color_jitter": {"brightness": 0.02, "contrast": [0.99, 1.01]}}   # a frame's colour keeps its index
        elif n_ == "gaussian_noise":
            s = {"gaussian_noise": {"std": 1.0, "fields": ["video"]}}
        elif n_ == "convert":
            s = {"convert": {"mode": _choice(r, ["rgb8", "rgba8"] + (["gray8"] if gray else []))}}
        elif n_ == "random_affine":
            p_["degrees"], p_.pop("scale", None), p_.pop("translate", None)
            p_["degrees"] = 15
        for k in ("pad_value", "fill"):   # padding stays black: a frame shows its index in every other pixel
            p_.pop(k, None)
        new = [out_hw(*next(iter(s.items())), hw) for hw in sizes]
        if min(min(h, w) for h, w in new) < 4:
            continue
        steps.append(s)
        sizes = new
    recipe = {"name": "fz", "seed": int(r.integers(0, 100)),
              "inputs": {"root": "$IN", "match": "{name}.{ext}", "where": {"ext": "mp4|mkv|avi"},
                         "fields": {"video": dec}},
              "steps": steps, "output": {"format": "hdf5", "samples_per_shard": int(r.integers(1, 5))}}
    if any(next(iter(s)) in ref.RANDOM_STEPS for s in steps) and r.random() < 0.3:
        recipe["copies"] = int(r.integers(1, 3))
    return {"seed": seed, "family": "video", "inputs": {"videos": vids}, "recipe": recipe, "loader": None,
            "j2": bool(r.random() < 0.1), "whole": bool(clips and r.random() < 0.15)}


def draw_audio(seed: int) -> dict:
    from .draw import _choice

    r = rng_of(seed, "audio")
    rate = int(_choice(r, [8000, 16000, 22050]))
    ch = int(_choice(r, [1, 2]))
    files = [{"name": f"a{i}.{fmt}", "fmt": fmt, "n": int(r.integers(200, 3000)), "channels": ch, "rate": rate}
             for i, fmt in enumerate(_choice(r, ["wav16", "wavf", "flac"]) for _ in range(int(r.integers(1, 4))))]
    for f in files:
        f["name"] = f["name"].replace("wav16", "wav").replace("wavf", "wav")
        f["name"] = f["name"].rsplit(".", 1)[0] + "_" + f["fmt"] + "." + f["name"].rsplit(".", 1)[1]
    dec: dict[str, Any] = {"decoder": "audio"}
    if r.random() < 0.4:
        dec["mono"] = False
        if r.random() < 0.5:
            dec["channels"] = ch
    if r.random() < 0.3:
        dec["sample_rate"] = int(_choice(r, [8000, 12000, 16000]))
    if r.random() < 0.25:
        dec["dtype"] = "int16"
    if r.random() < 0.2:
        dec["quality"] = _choice(r, ["VHQ", "HQ", "MQ", "LQ", "QQ"])
    steps: list[dict] = []
    if r.random() < 0.5:
        w = {"length": int(r.integers(50, 800)), "hop": int(r.integers(30, 600))}
        if r.random() < 0.3:
            w["short"] = "pad"
        if r.random() < 0.3:
            w["tail"] = "pad"
        if r.random() < 0.3:
            w["pad_value"] = 0.125
        steps.append({"windows": w})
    if r.random() < 0.4:
        f_ = {"length": int(r.integers(100, 3000))}
        if r.random() < 0.6:
            f_["align"] = _choice(r, ["start", "center", "end"])
        if r.random() < 0.3:
            f_["pad_value"] = -0.25
        steps.append({"fix_length": f_})
    if r.random() < 0.35:
        t = {"mode": _choice(r, ["roll", "zero"])}
        if r.random() < 0.5:
            t["max_shift"] = int(r.integers(1, 50))
        else:
            t["max_fraction"] = float(_choice(r, [0.05, 0.2]))
        steps.append({"time_shift": t})
    if r.random() < 0.35:
        steps.append({"random_gain": {"db": _choice(r, [3.0, [-6.0, 2.0]]), **({"clip": True} if r.random() < 0.4 else {})}})
    if r.random() < 0.15:
        steps.append({"gaussian_noise": {"std": 0.001}})
    out: dict[str, Any] = {"format": _choice(r, ["hdf5", "wav"], [1, 1]), "samples_per_shard": int(r.integers(1, 5))}
    if out["format"] == "wav" and r.random() < 0.5:   # int16 audio is written as PCM_16 (FLOAT is refused)
        out["options"] = {"subtype": _choice(r, ["auto", "PCM_16"] + (["FLOAT"] if dec.get("dtype") != "int16" else []))}
    recipe = {"name": "fz", "seed": int(r.integers(0, 100)),
              "inputs": {"root": "$IN", "match": "{name}.{ext}", "where": {"ext": "wav|flac"}, "fields": {"audio": dec}},
              "steps": steps, "output": out}
    if any(next(iter(s)) in ref.RANDOM_STEPS for s in steps) and r.random() < 0.3:
        recipe["copies"] = int(r.integers(1, 3))
    return {"seed": seed, "family": "audio", "inputs": {"files": files}, "recipe": recipe, "loader": None,
            "j2": bool(r.random() < 0.05)}


def _turned(v: dict, dec: dict) -> bool:
    """Whether the decoder gives video ``v``'s frames a quarter turn from how they are stored."""
    return v.get("rotation", 0) in (90, 270) and dec.get("rotate", True)


# -- writing ------------------------------------------------------------------------------------------------------
def write(case: dict, root: str) -> dict:
    truth: dict[str, Any] = {}
    if case["family"] == "video":
        for v in case["inputs"]["videos"]:
            path = os.path.join(root, v["name"])
            write_video(path, v["n"], v["H"], v["W"], v["fps"], v["codec"], v["audio"], v["gray"],
                        v.get("rotation", 0))
            idx, pts = pyav_frames(path, v["gray"])
            if v["gray"]:
                idx = [(i - 20) / 12 if i >= 0 else -1 for i in idx]
                idx = [int(round(i)) for i in idx]
            assert idx == list(range(v["n"])), f"{path}: PyAV shows frames {idx}, not 0..{v['n'] - 1}"
            truth[v["name"]] = {"v": v, "pts": pts}
    else:
        import soundfile as sf

        for f in case["inputs"]["files"]:
            path = os.path.join(root, f["name"])
            data, slope = audio_ramp(f["n"], f["channels"])
            if f["fmt"] == "wav16":
                write_wav_int16(path, data, f["rate"])
                stored = np.round(data.astype(np.float64) * 32768) / 32768
            elif f["fmt"] == "wavf":
                sf.write(path, data.T, f["rate"], subtype="FLOAT")
                stored = data.astype(np.float64)
            else:
                sf.write(path, data.T, f["rate"], subtype="PCM_16", format="FLAC")
                stored = np.round(data.astype(np.float64) * 32768) / 32768
            truth[f["name"]] = {"f": f, "stored": stored, "slope": slope}
    return truth


def input_keys(case: dict, truth: dict) -> list[str]:
    return list(truth)


def dropped_keys(case: dict, truth: dict) -> set:
    """Inputs a step may legitimately leave without a sample (a video shorter than one clip, audio shorter than
    one window)."""
    out = set()
    for k in truth:
        if case["family"] == "video" and not _expected_clips(case, truth[k]) and _clips_params(case) is not None:
            out.add(k)
        if case["family"] == "audio":
            w = _step(case, "windows")
            if w is not None and not _audio_windows(case, truth[k]):
                out.add(k)
    return out


def _step(case: dict, name: str) -> Optional[dict]:
    for s in case["recipe"].get("steps", []):
        (n, p), = s.items()
        if n == name:
            return p or {}
    return None


def _clips_params(case: dict) -> Optional[dict]:
    return _step(case, "clips")


# -- video oracles --------------------------------------------------------------------------------------------------
def _kept(case: dict, info: dict) -> tuple[list[int], list[float]]:
    """The frames the video decoder keeps (absolute indices, pts): the [start_s, end_s) window, every k-th,
    at most max_frames (docs/reference-decoders.md)."""
    dec = case["recipe"]["inputs"]["fields"]["video"]
    pts = info["pts"]
    lo, hi = dec.get("start_s"), dec.get("end_s")
    idx = [i for i, t in enumerate(pts) if (lo is None or t >= lo - 1e-6) and (hi is None or t < hi - 1e-6)]
    idx = idx[::dec.get("every", 1)]
    if dec.get("max_frames"):
        idx = idx[:dec["max_frames"]]
    return idx, [pts[i] for i in idx]


def _expected_clips(case: dict, info: dict) -> list[list[int]]:
    """Per clip, the absolute frame index of each slot (-1: black), from the docs' rules."""
    c = _clips_params(case)
    idx, pts = _kept(case, info)
    if c is None:
        return [idx]
    if c.get("fps"):
        L = c["length"] if c.get("length") is not None else int(round(c["length_s"] * c["fps"]))
        from fractions import Fraction

        fps = Fraction(c["fps"]).limit_denominator(10 ** 6)
        stride = Fraction(c["stride_s"]).limit_denominator(10 ** 6) if c.get("stride_s") else Fraction(L) / fps
        if not pts:
            return []
        t0 = Fraction(pts[0]).limit_denominator(10 ** 9)
        tp = [Fraction(t).limit_denominator(10 ** 9) for t in pts]
        last = tp[-1]
        clips = []
        k = 0
        while c.get("max_clips") is None or k < c["max_clips"]:
            start = t0 + k * stride
            times = [start + Fraction(j) / fps for j in range(L)]
            if times[-1] > last:
                break
            clips.append([idx[max(i for i, t in enumerate(tp) if t <= tt)] for tt in times])
            k += 1
        if not clips and c.get("short") == "pad":
            times = [t0 + Fraction(j) / fps for j in range(L)]
            clips = [[idx[max(i for i, t in enumerate(tp) if t <= tt)] if tt <= last else
                      (idx[-1] if c.get("pad", "last") == "last" else -1) for tt in times]]
        return clips
    pos = ref.frame_clips(len(idx), c["length"], c.get("every", 1), c.get("stride"), c.get("short", "drop"),
                          c.get("pad", "last"), c.get("max_clips"))
    return [[idx[p] if p >= 0 else -1 for p in clip] for clip in pos]


def _decode_frames(v: np.ndarray, gray_video: bool) -> list[int]:
    out = []
    for fr in v:
        if gray_video:
            g = fr[..., 0].reshape(-1).astype(np.float64)
            g = g[(g > 12) & (g < 240)]
            out.append(-1 if g.size == 0 else int(round((float(np.median(g)) - 20) / 12)))
        else:
            out.append(frame_index(fr) if fr.shape[-1] >= 3 else -2)
    return out


def check_sample(case: dict, truth: dict, key: str, s: dict, meta: dict, R: Report, copy: int) -> None:
    if case["family"] == "audio":
        return _check_audio(case, truth, key, s, meta, R)
    base, _, clip = key.partition("#clip")
    info = truth.get(base)
    if not R.check("key", info is not None, f"stored key {key!r} is no input's", key):
        return
    v = s["video"]
    got = _decode_frames(v, info["v"]["gray"])
    clips = _expected_clips(case, info)
    c = _clips_params(case)
    if c is None:
        want = clips[0]
    else:
        k = int(clip) if clip else -1
        if not R.check("clip_count", 0 <= k < len(clips), f"clip {k} stored, the docs' rule cuts {len(clips)}", key):
            return
        want = clips[k]
        m = meta.get("clip", {})
        R.check("clip_meta", m.get("index") == k, f"meta clip index {m.get('index')} for key {key}", key)
        if "frames" in s:
            fi = s["frames"].tolist()
            dec = case["recipe"]["inputs"]["fields"]["video"]
            if dec.get("start_s") is None and not _step(case, "temporal_jitter"):
                R.check("index_field", fi == want, f"index field {fi}, the clip's source frames {want}", key)
            R.check("index_field", fi == m.get("frames"), f"index field {fi} != meta clip frames {m.get('frames')}", key)
    jits = [(p or {}) for st in case["recipe"].get("steps", []) for n, p in st.items() if n == "temporal_jitter"]
    if jits and c is not None:
        recs = [a for a in meta.get("augment", []) if a.get("step") == "temporal_jitter"]
        if not R.check("augment_record", len(recs) == len(jits), f"temporal_jitter records {recs}", key):
            return
        for jit, rec in zip(jits, recs):
            ind = rec["indices"]
            R.check("temporal_jitter", len(ind) == jit["length"] and ind == sorted(ind)
                    and all(0 <= i < len(want) for i in ind), f"indices {ind} for a clip of {len(want)}", key)
            want = [want[i] for i in ind if 0 <= i < len(want)]
        if "frames" in s and case["recipe"]["inputs"]["fields"]["video"].get("start_s") is None:
            R.check("index_field", s["frames"].tolist() == want,
                    f"index field after temporal_jitter {s['frames'].tolist()} vs frames {want}", key)
    if got and got[0] != -2:
        R.check("frame_truth", got == want, f"stored frames show {got}, the docs' rule takes {want}", key)
    # every frame of one sample moved alike: the white object sits at one place in all of them
    def white(fr: np.ndarray) -> np.ndarray:   # the object: bright in every channel (frames: B = 128, grey <= 224)
        return fr[..., :3].min(-1) > (200 if fr.shape[-1] >= 3 and not info["v"]["gray"] else 238)

    obj = [np.argwhere(white(fr)).mean(0) if white(fr).sum() >= 6 else None for fr in v]
    shown = np.array([o for o in obj if o is not None])
    spread = float(np.abs(shown - shown.mean(0)).max()) if len(shown) > 1 else 0.0
    # a window blown up (its record: one per sample, every frame alike) blows up the centre's noise with it: seed
    # 192262, a 4x4 window to 12x34 nearest, 0.27 source px of edge-blending noise read as 2.29 output px
    up = 1.0
    for r in meta.get("augment", []):
        if r.get("step") == "random_resized_crop" and r.get("height") and r.get("width"):
            up = max(up, v.shape[-3] / r["height"], v.shape[-2] / r["width"])
    R.check("frames_alike", spread <= 1.5 * up,
            f"the object's centre moves {spread:.2f} px between frames of one sample (tolerance {1.5 * up:.2f})", key)
    # the display matrix: the object, written in the stored frame's top-left part, is where the turn puts it (only
    # after steps that keep relative places: docs/reference-decoders.md, video, rotate)
    dec = case["recipe"]["inputs"]["fields"]["video"]
    kept = {"clips", "temporal_jitter", "convert", "color_jitter", "gaussian_noise", "resize"}
    names = {n for st in case["recipe"].get("steps", []) for n in st}
    if len(shown) and names <= kept and not any("keep_aspect" in (st.get("resize") or {}) for st in
                                                 case["recipe"].get("steps", [])):
        H, W = v.shape[-3], v.shape[-2]
        cy, cx = shown.mean(0)[0] / H, shown.mean(0)[1] / W
        a = 1 / 8 + 1 / 10   # the object's centre in the stored frame: (H/8 + H/10) / H of the way down, as far across
        k = info["v"].get("rotation", 0) // 90 if dec.get("rotate", True) else 0
        want_yx = [(a, a), (1 - a, a), (1 - a, 1 - a), (a, 1 - a)][k]
        R.check("display_matrix", abs(cy - want_yx[0]) < 0.15 and abs(cx - want_yx[1]) < 0.15,
                f"the object's centre is at ({cy:.2f}, {cx:.2f}) of the frame; a turn of {90 * k} degrees puts it at "
                f"({want_yx[0]:.2f}, {want_yx[1]:.2f})", key)
    if "sound" in s:
        _check_video_audio(case, info, key, s, meta, want, R)


def _check_video_audio(case, info, key, s, meta, want, R: Report) -> None:
    a = np.asarray(s["sound"], np.float64)
    v = info["v"]
    dec = case["recipe"]["inputs"]["fields"]["video"]
    if v["audio"] is None:
        R.check("audio_truth", np.abs(a).max(initial=0) == 0, "a video without audio gave a non-silent track", key)
        return
    rate = dec.get("audio_rate", v["audio"]["rate"])
    total = int(round(v["n"] / v["fps"] * v["audio"]["rate"]))
    slope_t = v["audio"]["rate"] / total          # ramp value per second
    off = -0.5 + (0.05 * (v["audio"]["channels"] - 1) / 2 if dec.get("audio_mono", True) else 0.0)
    m = meta.get("clip", {}).get("audio") if _clips_params(case) is not None else None
    first = m["first_sample"] if m else 0
    c = _clips_params(case)
    if c is not None and not c.get("fps") and m:
        fps = v["fps"]
        n = int(round(len(want) * c.get("every", 1) * dec.get("every", 1) * rate / fps)) if not _step(case, "temporal_jitter") else None
        if n is not None:
            R.check("audio_truth", a.shape[-1] == n, f"clip audio has {a.shape[-1]} samples, the clip spans {n}", key)
    # the audio of a clip starts at its first frame: sample 0 plays at that frame's pts
    if m and want and want[0] >= 0 and not _step(case, "temporal_jitter"):
        t0 = info["pts"][want[0]] if not c.get("fps") else meta["clip"]["start"]
        R.check("audio_truth", abs(first / rate - t0) <= 1.0 / rate + 1e-6,
                f"the clip's audio starts at {first / rate:.5f} s, its first frame at {t0:.5f} s", key)
    ch0 = a[0]
    lo, hi = 24, ch0.size - 24
    tsrc = v["n"] / v["fps"]
    j = np.arange(ch0.size)
    t = (first + j) / rate
    inside = (j >= lo) & (j < hi) & (t > 0.01) & (t < tsrc - 0.01)
    if inside.sum() < 3:
        return
    exp = off + slope_t * t
    err = np.abs(ch0[inside] - exp[inside]).max()
    R.check("audio_truth", err < 4e-3, f"audio ramp off by {err:.4f} (the track's sample at time t holds t)", key)


# -- audio oracles -----------------------------------------------------------------------------------------------
def _audio_windows(case: dict, info: dict) -> list[int]:
    w = _step(case, "windows")
    n = _decoded_len(case, info)
    return ref.window_starts(n, w["length"], w["hop"], w.get("short", "drop"), w.get("tail", "drop"))


def _decoded_len(case: dict, info: dict) -> int:
    """Samples after resampling: the duration kept, n * rate / source rate, rounded (the meta's ``frames``
    is checked against it)."""
    dec = case["recipe"]["inputs"]["fields"]["audio"]
    f = info["f"]
    sr = dec.get("sample_rate")
    return f["n"] if not sr or sr == f["rate"] else int(math.floor(f["n"] * sr / f["rate"] + 0.5))


def _decoded(case: dict, info: dict) -> tuple[np.ndarray, float, np.ndarray]:
    """The decoded audio as the docs define it: (C, N) float64, the tolerance, and a per-sample weight of trust
    (0 near the ends of a resampled track)."""
    dec = case["recipe"]["inputs"]["fields"]["audio"]
    f = info["f"]
    x = info["stored"]
    if dec.get("mono", True):
        x = x.mean(axis=0, keepdims=True)
    tol = 1e-6 if f["fmt"] == "wavf" else 1.5 / 32768
    trust = np.ones(x.shape[-1])
    sr = dec.get("sample_rate")
    if sr and sr != f["rate"]:
        n = _decoded_len(case, info)
        pos = np.arange(n) * f["rate"] / sr
        ramp = np.stack([np.interp(pos, np.arange(x.shape[-1]), row) for row in x])
        x = ramp
        # soxr's band-limited filter rings at the file's hard ends for some output samples: 64 input samples of
        # margin, or 64 output samples' worth when shrinking (seeds 113277, 113665: a float ramp 22050 -> 8000
        # Hz was 2.6e-3 off at 67 input samples (24 output samples) from its end, 1e-4 past 176)
        edge = 64 * max(1.0, f["rate"] / sr)
        trust = ((pos > edge) & (pos < f["n"] - edge)).astype(float)
        # the ramp's value per output sample, as slack for where soxr puts sample 0 (within half a sample)
        # plus the source's own quantisation (a 16-bit FLAC or WAV: seed 98214 was 2.61e-3 against 2.60e-3)
        tol = 1e-3 + 1.0 * info["slope"] * f["rate"] / sr + (0.0 if f["fmt"] == "wavf" else 1.5 / 32768)
    if dec.get("dtype") == "int16":
        x = np.round(np.clip(x, -1, 1) * 32767) / 32767 if False else x
        tol = max(tol, 2.5 / 32768)
    return x, tol, trust


def _check_audio(case, truth, key, s, meta, R: Report) -> None:
    base, _, w = key.partition("#w")
    info = truth.get(base)
    if not R.check("key", info is not None, f"stored key {key!r} is no input's", key):
        return
    dec = case["recipe"]["inputs"]["fields"]["audio"]
    a = np.asarray(s["audio"], np.float64)
    n_dec = (meta.get("audio") or {}).get("frames")
    R.check("audio_length", n_dec == _decoded_len(case, info),
            f"decoded {n_dec} samples, {info['f']['n']} at {info['f']['rate']} Hz give {_decoded_len(case, info)}", key)
    i16 = dec.get("dtype") == "int16"

    def pad_of(v: float) -> float:   # a pad value is in the array's units: an int16 field pads with int(v)
        return float(int(v)) / 32768 if i16 else float(v)
    if dec.get("dtype") == "int16":
        R.check("audio_dtype", s["audio"].dtype == np.int16, f"dtype {s['audio'].dtype}", key)
        a = a / 32768.0
    x, tol, trust = _decoded(case, info)
    recs = list(meta.get("augment", []))
    cur = x
    cur_trust = trust
    for st in case["recipe"].get("steps", []):
        (name, p), = st.items()
        p = p or {}
        if name == "windows":
            starts = _audio_windows(case, info)
            k = int(w) if w else -1
            if not R.check("windows", 0 <= k < len(starts), f"window {k} stored, the docs' rule cuts {len(starts)}", key):
                return
            R.check("windows", meta.get("window", {}).get("start") == starts[k],
                    f"meta window start {meta.get('window')} vs {starts[k]}", key)
            L = p["length"]
            seg = np.full((cur.shape[0], L), pad_of(p.get("pad_value", 0)))
            part = cur[:, starts[k]:starts[k] + L]
            seg[:, :part.shape[1]] = part
            t = np.zeros(L)
            t[:part.shape[1]] = cur_trust[starts[k]:starts[k] + L]
            t[part.shape[1]:] = 1.0
            cur, cur_trust = seg, t
        elif name == "fix_length":
            L, al = p["length"], p.get("align", "start")
            N = cur.shape[1]
            out = np.full((cur.shape[0], L), pad_of(p.get("pad_value", 0)))
            t = np.ones(L)
            if N >= L:
                o = 0 if al == "start" else (N - L if al == "end" else (N - L) // 2)
                out[:] = cur[:, o:o + L]
                t[:] = cur_trust[o:o + L]
            else:
                o = 0 if al == "start" else (L - N if al == "end" else (L - N) // 2)
                out[:, o:o + N] = cur
                t[o:o + N] = cur_trust
            cur, cur_trust = out, t
        elif name in ("time_shift", "random_gain", "gaussian_noise"):
            rec = next((r for r in recs if r.get("step") == name), None)
            if not R.check("augment_record", rec is not None, f"no record of {name}: {recs}", key):
                return
            recs.remove(rec)
            if name == "time_shift":
                sh = int(rec["shift"])
                if p.get("mode", "roll") == "roll":
                    cur, cur_trust = np.roll(cur, sh, axis=1), np.roll(cur_trust, sh)
                else:
                    out = np.zeros_like(cur)
                    t = np.ones_like(cur_trust)
                    if sh >= 0:
                        out[:, sh:] = cur[:, :cur.shape[1] - sh]
                        t[sh:] = cur_trust[:len(t) - sh]
                    else:
                        out[:, :sh] = cur[:, -sh:]
                        t[:sh] = cur_trust[-sh:]
                    cur, cur_trust = out, t
            elif name == "random_gain":
                cur = cur * 10 ** (float(rec["gain_db"]) / 20)
                if p.get("clip"):
                    cur = np.clip(cur, -1, 1)
                tol *= 10 ** (abs(float(rec["gain_db"])) / 20)
            else:
                tol += 6 * float(rec.get("std", 0.001))
    out = case["recipe"]["output"]
    if out["format"] == "wav" and (out.get("options") or {}).get("subtype") == "PCM_16":
        tol += 1.0 / 32768   # stored as 16-bit PCM: clip(round(x * 32768), -32768, 32767) (docs/reference-formats.md)
        cur = np.clip(cur, -1.0, 32767 / 32768)
    if not R.check("audio_shape", a.shape == cur.shape, f"audio {a.shape}, the docs' steps give {cur.shape}", key):
        return
    if dec.get("dtype") == "int16":
        cur = np.clip(cur, -1, 32767 / 32768)
    ok = cur_trust > 0.5
    err = np.abs(a - cur)[:, ok].max(initial=0)
    R.check("audio_truth", err <= tol, f"samples off by {err:.2e} (tolerance {tol:.1e}); each holds its index", key)


def check_dataset(case: dict, truth: dict, ds: Any, R: Report, split: str) -> None:
    """A wav build: each stored WAV file, read with Python's wave module (or by hand for float), holds what
    ``ds[i]`` returns."""
    if case["family"] != "audio" or case["recipe"]["output"]["format"] != "wav" or len(ds) == 0:
        return
    import glob

    from .truth import read_wav

    folder = os.path.dirname(ds.path)
    files = sorted(glob.glob(os.path.join(folder, "fz.shards", "*", "*.wav")))
    R.check("wav_files", len(files) == len(ds), f"{len(files)} WAV files for {len(ds)} samples")
    if not files:
        return
    data, rate, bits = read_wav(files[0])
    i = int(os.path.basename(files[0]).split(".")[0])
    want = np.asarray(ds[i]["audio"], np.float64)
    if ds[i]["audio"].dtype == np.int16:
        want = want / 32768
    tol = 1.0 / 32768 if bits == 16 else 1e-7
    R.check("wav_files", data.shape == want.shape and np.abs(data - want).max(initial=0) <= tol,
            f"{files[0]}: {data.shape} {bits}-bit vs ds[{i}] {want.shape}")
