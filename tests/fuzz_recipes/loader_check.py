"""The Loader against the map-style dataset and a numpy reference of its device steps.

- every batch equals ``ds`` rows passed through flips and crops done here in numpy with the drawn parameters
  (docs/reference-reader.md: a function of (seed, epoch, rank, batch)); boxes and keypoints through the
  documented maps (reference.py), a dropped box taking its rows and its instance id (ids above it move down);
  padded rows NaN / -1 and counts;
- the conversion: uint8 / 255, then (x - mean) / std, NCHW with ``channels_first``;
- DDP: the ranks' shares are disjoint (``uneven: pad`` repeats to equal shares, ``drop`` trims) and cover the
  epoch; every epoch shows each key once (``copies: epoch``) or every row (``all``);
- resume: a Loader restored from ``state_dict()`` after k batches yields exactly the remaining batches.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import reference as ref
from .oracles import Report

GRID = {"image", "mask", "flow", "flow_valid", "video"}
NOTES = {"boxes", "box_labels", "keypoints"}


def _kw(ld: dict, fields: list[str], rank: int = 0) -> dict:
    """The Loader's arguments; ``PRECOMPILE_FUZZ_DEVICE=cuda`` runs the same oracles on the CUDA feeder (and
    ``in_memory: true`` cases as ``in_memory="gpu"`` or, for odd seeds, ``"pinned"``: the resident feeder)."""
    import os

    device = os.environ.get("PRECOMPILE_FUZZ_DEVICE", "cpu")
    kw: dict[str, Any] = {"batch_size": ld["batch_size"], "shuffle": ld["shuffle"], "seed": ld["seed"], "device": device,
                          "fields": fields, "gpu_steps": ld.get("gpu_steps") or None,
                          "drop_last": ld.get("drop_last", False)}
    if ld.get("world_size"):
        kw.update(rank=rank, world_size=ld["world_size"], uneven=ld.get("uneven", "pad"))
    else:
        kw.update(rank=0, world_size=1)
    for k in ("num_threads", "in_memory", "copies", "prefetch", "block_window", "sort_batches", "map_shards",
              "verify", "include_original"):
        if k in ld:
            kw[k] = ld[k]
    if device == "cuda" and kw.get("in_memory") is True:   # the resident feeder, from device memory or pinned host
        kw["in_memory"] = "pinned" if ld["seed"] % 2 else "gpu"
    kw.update(ld.get("convert") or {})
    if ld.get("convert_fields") is not None:
        kw["convert_fields"] = ld["_convert_fields"]
    if ld.get("_targets"):
        kw["targets"] = "list"
    return kw


def _flip(a: np.ndarray, kind: str, h: bool, v: bool) -> np.ndarray:
    hd, wd = (a.ndim - 3, a.ndim - 2)
    if h:
        a = np.flip(a, wd)
    if v:
        a = np.flip(a, hd)
    a = a.copy()
    if kind == "flow":
        if h:
            a[..., 0] = -a[..., 0]
        if v:
            a[..., 1] = -a[..., 1]
    return a


def _crop(a: np.ndarray, kind: str, p: dict, top: int, left: int, pad_img: float) -> np.ndarray:
    h, w = ref.pair(p["size"])
    H, W = a.shape[-3], a.shape[-2]
    pad = p.get("padding", 0)
    PH, PW = max(H + 2 * pad, h), max(W + 2 * pad, w)
    t, l_ = pad + (PH - H - 2 * pad) // 2, pad + (PW - W - 2 * pad) // 2
    value = np.nan if kind == "flow" else (0 if kind in ("mask", "flow_valid") else pad_img)
    if (PH, PW) != (H, W):
        widths = [(0, 0)] * a.ndim
        widths[-3], widths[-2] = (t, PH - H - t), (l_, PW - W - l_)
        a = np.pad(a, widths, constant_values=value)
    return a[..., top:top + h, left:left + w, :].copy()


def _renumber(mask: np.ndarray, dropped: list[int]) -> np.ndarray:
    """An instance mask after rows ``dropped`` (0-based) left: their ids become 0, later ids move down."""
    out = mask.astype(np.int64).copy()
    m = mask.astype(np.int64)
    for d in sorted(dropped):
        out[m == d + 1] = 0
    for v in np.unique(m):
        if v > 0 and v - 1 not in dropped and v < np.iinfo(mask.dtype).max:
            out[m == v] = v - sum(1 for d in dropped if d < v - 1)
    return out.astype(mask.dtype)


#: the device steps of issue 35: resampling ones (the build step's own kernels are the reference) and value ones
RESAMPLING = {"random_resized_crop", "random_affine"}
VALUES = {"color_jitter", "random_grayscale", "gaussian_blur", "random_erasing"}


def _value_step(name: str, p: dict, one: dict, a: np.ndarray, video: bool) -> np.ndarray:
    """The value steps' references: the build's colour kernel and luma rule, OpenCV's blur, numpy slicing."""
    from precompile.transforms.kernels.colour import color_jitter, to_gray8

    if name == "color_jitter":
        return color_jitter(a, video, one["brightness"], one["contrast"], one["saturation"])
    if name == "random_grayscale":
        if not one["gray"] or a.shape[-1] < 3:
            return a
        out = a.copy()
        g = to_gray8(a[..., :3]) if a.dtype == np.uint8 else np.rint(
            a[..., :1] * np.float32(0.299) + a[..., 1:2] * np.float32(0.587) + a[..., 2:3] * np.float32(0.114))
        out[..., :3] = g.astype(a.dtype)
        return out
    if name == "gaussian_blur":
        import cv2

        frames = a if video else a[None]
        out = [cv2.GaussianBlur(fr.astype(np.float32), (3, 3), sigmaX=one["sigma"], sigmaY=one["sigma"],
                                borderType=cv2.BORDER_REFLECT_101).reshape(fr.shape) for fr in frames]
        o = np.stack(out)
        o = np.clip(np.rint(o), 0, np.iinfo(a.dtype).max).astype(a.dtype) if a.dtype.kind in "ui" else o.astype(a.dtype)
        return o if video else o[0]
    out = a.copy()
    t, l_, h, w = one["top"], one["left"], one["height"], one["width"]
    out[..., t:t + h, l_:l_ + w, :] = p.get("value", 0)
    return out


def reference_sample(s: dict, kinds: dict, steps: list[dict], params: list[dict], i: int, instance: set) -> dict:
    s = {k: (np.asarray(v).copy() if not isinstance(v, str) else v) for k, v in s.items()}
    # fields resampled or recoloured, and by how many levels they may differ: a level per approximate step
    # (docs/reference-reader.md), and a colour jitter after one multiplies what came before by what its factors
    # can stretch a difference (seed 94691: a linear resized crop, then contrast and saturation, 2 levels off)
    approx: dict = {}
    for step, prm in zip(steps, params):
        (name, p), = step.items()
        one = {k: (bool(v[i]) if np.asarray(v).dtype == bool else int(v[i]) if np.asarray(v).dtype.kind in "iu"
                   else float(v[i])) for k, v in prm.items()}
        grids = [f for f in s if kinds.get(f) in GRID]
        if not grids:
            continue
        if name in VALUES:
            for f in grids:
                if kinds[f] in ("image", "video"):
                    s[f] = _value_step(name, p, one, s[f], kinds[f] == "video")
                    if name == "color_jitter":
                        sat = one.get("saturation", 1.0)
                        amp = max(one.get("brightness", 1.0), 1.0) * max(one.get("contrast", 1.0), 1.0) * \
                            (abs(sat) + abs(1.0 - sat))
                        approx[f] = approx.get(f, 0.0) * amp + 1.0
                    elif name == "gaussian_blur":
                        approx[f] = approx.get(f, 0.0) + 1.0
            continue
        hw = s[grids[0]].shape[-3:-1]
        m = ref.step_move(name, p, one, tuple(hw))
        if name in RESAMPLING:
            from precompile.registry import STEPS, load_builtins

            load_builtins()
            cls = STEPS.get(name)
            build = cls(cls.Params.model_validate(p))
            for f in grids:
                k = kinds[f]
                if k == "flow_valid":
                    continue
                s[f] = build.apply(s[f], "mask" if k == "flow_valid" else k, **one)
                # (flow even under nearest: its vectors are scaled, in the device's float order, not the build's:
                # seed 100641, 3 values of a 6x7 resized crop off in the last bits)
                if k == "flow" or (k in ("image", "video") and p.get("interpolation") != "nearest"):
                    approx[f] = approx.get(f, 0.0) + 1.0
            for f in grids:   # validity follows the moved flow (the build derives it)
                if kinds[f] == "flow_valid":
                    flow = next((g for g in grids if kinds[g] == "flow"), None)
                    s[f] = np.isfinite(s[flow]).all(-1, keepdims=True).astype(s[f].dtype) if flow else \
                        build.apply(s[f], "mask", **one)
        for f in grids:
            if name in RESAMPLING:
                break
            if name == "random_flip":
                s[f] = _flip(s[f], kinds[f], one["horizontal"], one["vertical"])
            else:
                s[f] = _crop(s[f], kinds[f], p, one["top"], one["left"], p.get("pad_value", 0))
        if "boxes" in s:
            keep, new, hair = [], [], []
            amb = s.get("__amb__", np.zeros(len(s["boxes"]), bool))
            for r, b in enumerate(s["boxes"].astype(np.float64)):
                br = ref.move_box(b, m)
                if br.kept:
                    keep.append(r)
                    new.append(br.box)
                    # kept by a hair: its visible part is thinner than float noise (an edge of the box on the
                    # window's edge: seed 226182, a box at x 9..13 and a resized crop of x 2..9, 7/12 of a step)
                    hair.append(bool(amb[r]) or bool(br.ambiguous and min(br.box[2] - br.box[0], br.box[3] - br.box[1]) < 1e-4))
            dropped = [r for r in range(len(s["boxes"])) if r not in keep]
            s["__amb__"] = np.asarray(hair, bool)
            s["boxes"] = np.asarray(new, np.float64).reshape(-1, 4)
            for f in [f for f in s if kinds.get(f) in ("box_labels", "keypoints")]:
                s[f] = s[f][keep]
            for f in instance:
                if f in s and dropped:
                    s[f] = _renumber(s[f], dropped)
        for f in [f for f in s if kinds.get(f) == "keypoints"]:
            s[f] = ref.move_keypoints(s[f], m, (m.params or {}).get("pairs", []))
    s["__approx__"] = approx
    return s


def check(case: dict, truth: dict, path: str, R: Report) -> None:
    import precompile
    from precompile.reader import gpu

    ld = case["loader"]
    ds = precompile.open(path)
    try:
        _check(case, ld, ds, path, R, gpu)
    finally:
        ds.close()


def _check(case: dict, ld: dict, ds: Any, path: str, R: Report, gpu: Any) -> None:
    import precompile

    specs = ds.field_specs
    kinds = {f: specs[f]["kind"] for f in ds.fields}
    if any(ds.variable(f) for f in ds.fields if kinds[f] in GRID):
        return   # the Loader reads fixed-shape grids only (a case whose chain lost its fixed size: nothing to load)
    fields = [f for f in ds.fields if not ds.variable(f) or kinds[f] in NOTES]
    texts = [f for f in fields if kinds[f] == "text"]
    fields = [f for f in fields if kinds[f] != "text"]
    coco = case["recipe"]["inputs"].get("coco") or {}
    instance = {"mask"} if coco.get("mask") == "instance" else set()
    # targets="list" where one boxes field is loaded (docs/reference-reader.md: else a ValueError)
    ld["_targets"] = ld.get("targets") == "list" and [kinds[f] for f in fields].count("boxes") == 1
    if ld.get("convert_fields") is not None:   # "none": convert nothing; "first": the first image/video field only
        pics = [f for f in fields if kinds[f] in ("image", "video")]
        ld["_convert_fields"] = [] if ld["convert_fields"] == "none" else pics[:1]
    ranks = range(ld.get("world_size") or 1)
    epoch = ld.get("epoch", 0)
    shares = []
    for rank in ranks:
        try:
            L = precompile.Loader(path, **_kw(ld, fields + texts, rank))
        except Exception as e:
            conv = ld.get("convert") or {}
            refused = isinstance(e, ValueError) and "channels_first" in str(e) and not conv.get("dtype")
            R.check("loader_convert" if conv.get("channels_first") and not conv.get("dtype") else "loader_crash",
                    refused, f"Loader(...) raised {type(e).__name__}: {e}")
            return
        try:
            L.set_epoch(epoch)
            idx = [np.asarray(b) for b in L.batch_indices()]
            shares.append(np.concatenate(idx) if idx else np.zeros(0, np.int64))
            try:
                got = list(L)
            except NotImplementedError as e:   # a torch kernel missing for a stored dtype
                R.check("loader_dtype", False, f"iterating the Loader raised {type(e).__name__}: {str(e)[:300]}")
                return
            except Exception as e:
                R.check("loader_crash", False, f"iterating the Loader raised {type(e).__name__}: {str(e)[:300]}")
                return
            R.check("loader_batches", len(got) == len(idx), f"{len(got)} batches for {len(idx)} index lists")
            for b, (rows, out) in enumerate(zip(idx, got)):
                params = gpu.step_params(L.steps, ld["seed"], epoch, rank, b, len(rows))
                _compare_batch(case, ld, ds, rows, out, params, kinds, fields, instance, R)
                for f in texts:   # text: a list of str per batch (docs/tables.md)
                    want = [ds[int(r)][f] for r in rows]
                    R.check("loader_text", out.get(f) == want, lambda: f"{f}: {out.get(f)} vs {want}")
            if rank == 0 and ld.get("resume_at") is not None:
                _check_resume(ld, fields, path, epoch, got, R)
            if rank == 0:
                _check_collate(ld, ds, fields + texts, kinds, idx, got, R)
        finally:
            L.close()
    _check_shares(case, ld, ds, shares, R)
    if ld.get("mix"):
        _check_mix(case, ld, ds, path, fields, kinds, instance, R, gpu)


def _compare_batch(case, ld, ds, rows, out, params, kinds, fields, instance, R: Report) -> None:
    steps = ld.get("gpu_steps") or []
    conv = ld.get("convert") or {}
    for i, row in enumerate(rows):
        s = {f: ds[int(row)][f] for f in fields}
        want = reference_sample(s, kinds, steps, params, i, instance)
        key = ds.key(int(row))
        for f in fields:
            k = kinds[f]
            if k in NOTES and ld.get("_targets"):   # one dict per image: the rows the reference keeps, no padding
                t = out["targets"][i]
                name = {"boxes": "boxes", "box_labels": "labels", "keypoints": "keypoints"}[k]
                g = t[name].cpu().numpy() if name in t else None
                w = np.asarray(want[f])
                hair = want.get("__amb__")
                if g is not None and hair is not None and len(g) != len(w) and len(hair) == len(w) and \
                        len(g) == int((~hair).sum()):
                    w = w[~hair]
                R.check("loader_targets", g is not None and len(g) == len(w) and f not in out
                        and f + "__count" not in out,
                        lambda: f"targets[{i}][{name!r}]: {None if g is None else len(g)} rows, the reference keeps "
                                f"{len(w)} (padded field in the batch too: {f in out})", key)
                if g is None or len(g) != len(w):
                    continue
                want_dtype = np.int64 if name == "labels" else np.float32
                close = np.abs(g[..., :2].astype(np.float64) - w[..., :2]).max(initial=0) <= 2e-3 \
                    if name == "keypoints" else np.abs(g.astype(np.float64) - w).max(initial=0) <= 2e-3
                R.check("loader_targets", g.dtype == want_dtype and close,
                        lambda: f"targets[{i}][{name!r}] {g.dtype} {g.tolist()} vs reference {np.round(w, 3).tolist()}",
                        key)
                if name == "boxes" and instance:
                    m = out["mask"][i].cpu().numpy()[..., 0] if out["mask"][i].ndim == 3 else out["mask"][i].cpu().numpy()
                    got_m = t.get("masks")
                    ok = got_m is not None and got_m.shape[0] == len(w) and all(
                        np.array_equal(got_m[n].cpu().numpy(), (m == n + 1).astype(np.uint8)) for n in range(len(w)))
                    R.check("loader_targets", ok, lambda: f"targets[{i}]['masks'] are not mask == n + 1 for the "
                                                          f"{len(w)} boxes", key)
                continue
            if k in NOTES:
                c = int(out[f + "__count"][i])
                g = out[f][i].cpu().numpy()
                w = np.asarray(want[f])
                hair = want.get("__amb__")
                if hair is not None and c != len(w) and len(hair) == len(w) and c == int((~hair).sum()):
                    w = w[~hair]   # the rows kept by a hair, dropped here: either is the documented rule
                R.check("loader_reference", c == len(w),
                        lambda: f"{f}: {c} rows, the reference keeps {len(w)} ({np.asarray(s['boxes']).tolist()})", key)
                if c != len(w):
                    continue
                pad = g[c:]
                R.check("loader_padding", (np.isnan(pad).all() if pad.dtype.kind == "f" else (pad == -1).all()),
                        f"{f}: padding rows hold {pad.reshape(-1)[:6].tolist()}", key)
                g = g[:c]
                if k == "keypoints":
                    edge = (np.abs(w[..., 0] - want_hw(want, kinds)[1]) < 1e-6) | \
                           (np.abs(w[..., 1] - want_hw(want, kinds)[0]) < 1e-6)
                    okxy = np.abs(g[..., :2] - w[..., :2]).max(initial=0) <= 2e-3
                    okv = ((g[..., 2] == w[..., 2]) | edge).all()
                    R.check("loader_reference", okxy and okv,
                            lambda: f"keypoints {g.tolist()} vs reference {w.round(3).tolist()}", key)
                else:
                    R.check("loader_reference", np.abs(g.astype(np.float64) - w).max(initial=0) <= 2e-3,
                            lambda: f"{f} {g.tolist()} vs reference {np.round(w, 3).tolist()}", key)
                continue
            g = out[f][i].cpu().numpy() if hasattr(out[f], "cpu") else np.asarray(out[f][i])
            w = want[f]
            if f in conv_fields(conv, fields, kinds, ld.get("_convert_fields")):
                scale = 1 / 255 if w.dtype == np.uint8 else 1.0   # (uint16 and floats are not scaled)
                if conv.get("dtype"):
                    w = ((w.astype(np.float32) * np.float32(scale)) - np.float32(conv.get("mean", 0.0))) / \
                        np.float32(conv.get("std", 1.0))
                if conv.get("channels_first") and w.ndim == 3:
                    w = np.moveaxis(w, -1, 0)
                levels = max(1.0, float(np.floor(want["__approx__"][f] + 1e-9))) if f in want["__approx__"] else 0.0
                # (converted to a float type: a level is 1/255 / std; no dtype, e.g. channels_first alone: the stored
                # values, a level is 1: seeds 98582, 98940, a linear resized crop then NCHW views of uint8)
                # (a level of a uint16 field is 1 / std: seed 120832, a linear affine of gray16 off by one level)
                slack = levels * 1.01 * scale / float(conv.get("std", 1.0)) if conv.get("dtype") else levels
                ok = g.shape == w.shape and np.allclose(g, w, atol=1e-5 + slack, equal_nan=True)
                R.check("loader_convert", ok, lambda: f"{f}: converted {g.shape} differs from (x/255 - mean)/std "
                                                      f"{w.shape}" + (" in NCHW" if conv.get("channels_first") else ""), key)
                continue
            if f in want["__approx__"] and g.shape == w.shape:   # within a level (floats: 1e-3 of the range)
                if g.dtype.kind == "f":
                    ok = np.array_equal(np.isnan(g), np.isnan(w)) and np.allclose(
                        g, w, rtol=1e-3, atol=1e-3 * max(1.0, float(np.nanmax(np.abs(w), initial=0))), equal_nan=True)
                else:
                    levels = max(1, int(np.floor(want["__approx__"][f] + 1e-9)))
                    ok = np.abs(g.astype(np.int64) - w.astype(np.int64)).max(initial=0) <= levels
            else:
                ok = g.shape == w.shape and np.array_equal(g, w, equal_nan=g.dtype.kind == "f")
            oracle = "loader_instance_mask" if f in instance and g.shape == w.shape else "loader_reference"
            R.check(oracle, ok, lambda: f"{f}: batch row {i} {g.shape} differs from the reference {w.shape} "
                                        f"({int((g != w).sum()) if g.shape == w.shape else 'shape'} values)", key)


def want_hw(want: dict, kinds: dict) -> tuple[int, int]:
    for f, k in kinds.items():
        if k in ("image", "mask", "flow") and f in want:
            return tuple(want[f].shape[-3:-1])
    return (0, 0)


def conv_fields(conv: dict, fields: list, kinds: dict, chosen: list | None = None) -> list:
    """The fields the Loader converts: the image/video fields, or ``convert_fields`` (``chosen``) when given."""
    if not conv.get("dtype") and not conv.get("channels_first"):
        return []
    return [f for f in fields if kinds[f] in ("image", "video") and (chosen is None or f in chosen)]


def _check_resume(ld: dict, fields: list, path: str, epoch: int, full: list, R: Report) -> None:
    """A Loader restored from state_dict() after k batches yields the rest of the epoch, batch for batch."""
    import precompile

    k = ld["resume_at"]
    if k >= len(full):
        return
    A = precompile.Loader(path, **_kw(ld, fields))
    try:
        A.set_epoch(epoch)
        it = iter(A)
        for _ in range(k):
            next(it)
        state = A.state_dict()
    finally:
        A.close()
    B = precompile.Loader(path, **_kw(ld, fields))
    try:
        B.load_state_dict(state)
        B.set_epoch(epoch)
        rest = list(B)
    finally:
        B.close()
    same = len(rest) == len(full) - k and all(
        all(np.array_equal(_host(x[f]), _host(y[f]), equal_nan=True) for f in x if not isinstance(x[f], list))
        for x, y in zip(rest, full[k:]))
    R.check("loader_resume", same, f"resumed after {k} of {len(full)} batches: {len(rest)} batches, not the rest")


def _mix_counts(weights: list, sizes: list, stop: Any, cycle: Any) -> list:
    """docs/reference-reader.md's table, computed here: the epoch's N from ``stop``, then floor(N p_i) each and
    one more to the largest remainders (the lower index first on a tie)."""
    import math
    from fractions import Fraction

    w = [Fraction(x) for x in weights]
    p = [x / sum(w) for x in w]
    on = [i for i in range(len(p)) if p[i] > 0]
    if stop == "first_exhausted":
        n = min(math.floor(sizes[i] / p[i]) for i in on if not (cycle and cycle[i]))
    elif stop == "all_exhausted":
        n = max(math.ceil(sizes[i] / p[i]) for i in on)
    else:
        n = int(stop)
    counts = [math.floor(n * q) for q in p]
    for i in sorted(range(len(p)), key=lambda i: (-(n * p[i] - counts[i]), i))[:n - sum(counts)]:
        counts[i] += 1
    return counts


def _check_mix(case, ld, ds, path, fields, kinds, instance, R: Report, gpu) -> None:
    """``precompile.Mix`` of the build with itself: each batch's ``__source``/``__row`` are its
    ``batch_indices``, every row the reference of that stored row through the ``gpu_steps`` drawn for the batch,
    and one epoch (world_size 1, every batch) holds each source's count of the documented table, no row of a source
    twice where that source is not read again (``first_exhausted``, not cycled), every row of one read whole."""
    import precompile

    m = ld["mix"]
    notes = [f for f in fields if kinds[f] in NOTES]
    kw = _kw(ld, fields)
    for k in ("shuffle", "copies", "block_window", "map_shards", "include_original", "targets"):
        kw.pop(k, None)
    kw["shuffle"] = ld["shuffle"] is not False
    if kw.get("in_memory") not in (None, False, True):
        kw["in_memory"] = True
    mixld = {k: v for k, v in ld.items() if k not in ("_targets",)}
    epoch = ld.get("epoch", 0)
    seen: list = []
    for rank in range(ld.get("world_size") or 1):
        kw.update(rank=rank)
        try:
            mix = precompile.Mix([precompile.open(path), precompile.open(path)], weights=m["weights"],
                                 stop=m["stop"], cycle=m.get("cycle"), **kw)
        except ValueError as e:   # (refused where the only source that may end the epoch has weight 0)
            R.check("mix", "none ends the epoch" in str(e), f"Mix(...) raised ValueError: {str(e)[:300]}")
            return
        try:
            mix.set_epoch(epoch)
            idx = mix.batch_indices()
            got = list(mix)
            R.check("mix", len(got) == len(idx), f"{len(got)} Mix batches for {len(idx)} index lists")
            for b, ((src, rows), out) in enumerate(zip(idx, got)):
                R.check("mix", np.array_equal(_host(out["__source"]), src) and np.array_equal(_host(out["__row"]), rows),
                        f"batch {b}: __source/__row differ from batch_indices")
                params = gpu.step_params(mix.steps, ld["seed"], epoch, rank, b, len(rows))
                _compare_batch(case, mixld, ds, rows, out, params, kinds, fields, instance, R)
                seen.extend(zip(src.tolist(), rows.tolist()))
        finally:
            mix.close()
    if (ld.get("world_size") or 1) > 1 or ld.get("drop_last"):
        return
    want = _mix_counts(m["weights"], [len(ds), len(ds)], m["stop"], m.get("cycle"))
    have = [sum(1 for s, _ in seen if s == i) for i in range(2)]
    R.check("mix_counts", have == want, f"an epoch holds {have} samples of each source; the table gives {want}")
    for i in range(2):
        rows = [r for s, r in seen if s == i]
        once = m["stop"] == "first_exhausted" and not (m.get("cycle") and m["cycle"][i])
        if once:
            R.check("mix_counts", len(rows) == len(set(rows)), f"source {i}: a row twice in one epoch")
        if want[i] == len(ds) and once:
            R.check("mix_counts", sorted(rows) == list(range(len(ds))), f"source {i} read whole: rows {sorted(rows)}")


def _check_collate(ld: dict, ds: Any, fields: list, kinds: dict, idx: list, got: list, R: Report) -> None:
    """``precompile.collate(ds)`` over the same rows (a plain DataLoader's batches): each field the rows stacked,
    a ragged field padded with NaN / -1 to the batch's largest count (at least 1) plus ``__count``, text a list;
    and, where the Loader changes nothing (no gpu_steps, no conversion), the Loader's batch itself."""
    import precompile

    col = precompile.collate(ds, targets="list" if ld.get("_targets") else None)
    plain = not ld.get("gpu_steps") and not ld.get("convert")
    for b, (rows, out) in enumerate(zip(idx, got)):
        samples = [ds[int(r)] for r in rows]
        c = col(samples)
        key = ds.key(int(rows[0])) if len(rows) else None
        for f in fields:
            k = kinds[f]
            if k in NOTES and ld.get("_targets"):
                continue
            if k == "text":
                R.check("collate", c.get(f) == [sm[f] for sm in samples], f"{f}: collate gives {c.get(f)}", key)
                continue
            if k in NOTES:
                counts = [len(np.asarray(sm[f])) for sm in samples]
                n = max([1] + counts)
                fill = -1 if k == "box_labels" else np.nan
                want = []
                for sm in samples:
                    a = np.asarray(sm[f])
                    pad = np.full((n - len(a),) + a.shape[1:], fill, dtype=a.dtype)
                    want.append(np.concatenate([a, pad]))
                w = np.stack(want)
                g = _host(c[f])
                R.check("collate", g.shape == w.shape and np.array_equal(g, w, equal_nan=g.dtype.kind == "f")
                        and _host(c[f + "__count"]).tolist() == counts,
                        lambda: f"batch {b} {f}: collate {g.shape} vs the rows padded {w.shape}", key)
                continue
            w = np.stack([np.asarray(sm[f]) for sm in samples])
            g = _host(c[f])
            R.check("collate", g.shape == w.shape and np.array_equal(g, w, equal_nan=g.dtype.kind == "f"),
                    lambda: f"batch {b} {f}: collate {g.shape} {g.dtype} vs the rows stacked {w.shape} {w.dtype}", key)
        if not plain:
            continue
        for f, v in out.items():   # the Loader's batch is the collate's where nothing else runs
            if f == "targets":
                same = len(v) == len(c["targets"]) and all(
                    set(x) == set(y) and all(np.array_equal(_host(x[t]), _host(y[t]), equal_nan=True) for t in x)
                    for x, y in zip(v, c["targets"]))
            elif isinstance(v, list):
                same = v == c.get(f)
            else:
                same = f in c and _host(v).shape == _host(c[f]).shape and np.array_equal(
                    _host(v), _host(c[f]), equal_nan=_host(v).dtype.kind == "f")
            R.check("collate_loader", same, lambda: f"batch {b} {f}: the Loader's differs from the collate's", key)


def _host(v: Any) -> np.ndarray:
    """A batch value on the host (a CUDA tensor copied back; numpy cannot read device memory)."""
    return v.cpu().numpy() if hasattr(v, "cpu") else np.asarray(v)


def _check_shares(case: dict, ld: dict, ds: Any, shares: list, R: Report) -> None:
    W = len(shares)
    rows = np.concatenate(shares) if shares else np.zeros(0)
    n_keys = len(set(ds.keys))
    copies = ld.get("copies", "epoch")
    total = len(ds) if copies == "all" or not case["recipe"].get("copies") else n_keys
    stored = np.asarray(getattr(ds, "copies", np.zeros(0)))
    if ld.get("include_original") is False and copies == "all" and stored.size and stored.max() > 0:
        # every row but copy 0 of the keys that have other copies (docs/reference-reader.md)
        augmented = {ds.key(i) for i in np.flatnonzero(stored != 0).tolist()}
        total = sum(1 for i in range(len(ds)) if stored[i] != 0 or ds.key(i) not in augmented)
    if ld.get("include_original") is False and stored.size and stored.max() > 0:
        augmented = {ds.key(i) for i in np.flatnonzero(stored != 0).tolist()}
        orig = [int(r) for r in set(rows.tolist()) if stored[int(r)] == 0 and ds.key(int(r)) in augmented]
        R.check("loader_epoch", not orig, f"include_original=False read {len(orig)} original row(s), e.g. {orig[:3]}")
    uniq = set(rows.tolist())
    lens = {len(s) for s in shares}
    if W > 1:
        R.check("loader_ddp", len(lens) == 1, f"rank shares differ in size: {[len(s) for s in shares]}")
        if ld.get("uneven", "pad") == "drop":
            want = (total // W) * W
            if ld.get("drop_last"):
                want = None
            R.check("loader_ddp", want is None or len(rows) == want and len(uniq) == want,
                    f"uneven=drop: {len(rows)} rows ({len(uniq)} distinct) over {W} ranks of {total}")
        else:
            R.check("loader_ddp", ld.get("drop_last") or len(uniq) == total,
                    f"uneven=pad: the ranks cover {len(uniq)} of {total} rows")
    elif not ld.get("drop_last"):
        R.check("loader_epoch", len(rows) == total and len(uniq) == total,
                f"one epoch reads {len(rows)} rows ({len(uniq)} distinct), expected {total}")
    if copies != "all" and case["recipe"].get("copies"):
        keys = [ds.key(int(r)) for r in uniq]
        R.check("loader_epoch", len(keys) == len(set(keys)), "an epoch shows some key twice")
