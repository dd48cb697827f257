"""Cases drawn from one integer seed: a description of the inputs, a recipe, and Loader options.

A case is plain JSON (``{"seed", "family", "inputs", "recipe", "loader", "j2"}``) so a failing one is kept
verbatim in ``regressions.json`` and replays whatever this drawer later becomes. ``$IN`` in the recipe is the
input folder the runner writes the inputs to.

:data:`COVERAGE` says how every step, kind, decoder option, output format and Loader device step is drawn;
``tests/test_recipe_fuzzer.py`` fails when the registries or the docs list one it does not name, and when the
fixed seeds never draw one it names.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np

from .reference import pair, resize_target
from .truth import FLIP_PAIRS, MAX_OBJECTS, rng_of

# family -> weight in the fixed-seed run
FAMILIES = {"coco": 34, "folder": 10, "flow": 8, "table": 12, "video": 12, "audio": 10, "volume": 8, "dicom": 6}


def draw_case(seed: int) -> dict:
    r = rng_of(seed, "family")
    names = list(FAMILIES)
    w = np.array([FAMILIES[n] for n in names], float)
    family = str(r.choice(names, p=w / w.sum()))
    return DRAWERS[family](seed)


def _choice(r: np.random.Generator, items: list, p: Optional[list] = None) -> Any:
    i = int(r.choice(len(items), p=None if p is None else np.asarray(p, float) / np.sum(p)))
    return copy.deepcopy(items[i])


# -- 2D chains ----------------------------------------------------------------------------------------------------
def out_hw(name: str, p: dict, hw: tuple[int, int]) -> tuple[int, int]:
    if p.get("fields") == []:
        return hw
    if name == "resize":
        return resize_target(p, *hw)[1]
    if name in ("center_crop", "random_crop", "random_resized_crop"):
        return tuple(pair(p["size"]))
    return hw


def _range(r: np.random.Generator, lo: float, hi: float, digits: int = 2) -> list[float]:
    """Two sorted draws from [lo, hi), rounded to ``digits``, never equal and never past ``hi`` (both rounded to
    ``hi``: seed 113832 drew a random_resized_crop scale of [1.0, 1.01], which the step refuses)."""
    a, b = sorted(float(round(x, digits)) for x in r.uniform(lo, hi, 2))
    if b > a:
        return [a, b]
    step = 10 ** -digits
    return [a, round(a + step, digits)] if a + step <= hi else [round(a - step, digits), a]


def _size_filters(r: np.random.Generator, p: dict) -> None:
    """albumentations' box size filters (``min_area``, ``min_width``, ``min_height``, output pixels) on a step that
    takes ``min_visibility``, about one time in three. Drawn from a stream jumped off ``r``'s without advancing it,
    so every other draw of a seed is what it was before the filters existed."""
    side = np.random.Generator(r.bit_generator.jumped())
    if side.random() >= 0.35:
        return
    for k, values in (("min_area", [9.0, 30.0, 80.0, 12.5]), ("min_width", [2.0, 4.0, 7.0, 3.5]),
                      ("min_height", [2.0, 4.0, 7.0, 3.5])):
        if side.random() < 0.5:
            p[k] = float(_choice(side, values))


def draw_2d_step(r: np.random.Generator, sizes: list[tuple[int, int]], keypoints: bool, colour_ok: bool,
                 first: bool, video: bool = False, image_field: str = "image") -> Optional[dict]:
    """One 2D step valid for every current (h, w) in ``sizes`` (None when no step fits)."""
    mh, mw = min(s[0] for s in sizes), min(s[1] for s in sizes)
    names = ["resize", "center_crop", "random_crop", "random_resized_crop", "random_flip", "random_affine",
             "convert", "color_jitter", "gaussian_noise"]
    weights = [26, 10, 14, 12, 14, 10, 5, 5, 4]
    name = _choice(r, names, weights)
    mv = float(_choice(r, [0.0, 0.0, 0.3, 0.5, 0.9]))
    p: dict[str, Any]
    if name == "resize":
        form = _choice(r, ["size", "shorter", "longer", "keep"], [5, 2, 2, 2])
        if form == "size":
            p = {"size": [int(r.integers(10, 56)), int(r.integers(10, 56))]}
            if r.random() < 0.2:
                p = {"size": int(r.integers(12, 48))}
        elif form == "shorter":
            p = {"shorter": int(r.integers(10, 48))}
        elif form == "longer":
            p = {"longer": int(r.integers(14, 56))}
        else:
            p = {"size": [int(r.integers(12, 48)), int(r.integers(12, 48))], "keep_aspect": True,
                 "pad_value": int(_choice(r, [0, 0, 17]))}
        if r.random() < 0.35:
            p["interpolation"] = _choice(r, ["auto", "area", "linear", "cubic", "nearest"])
        if r.random() < 0.15:
            p["fast"] = True
    elif name == "center_crop":
        pad = r.random() < 0.25
        hi_h, hi_w = (int(mh * 1.3) if pad else mh), (int(mw * 1.3) if pad else mw)
        h = int(r.integers(min(6, hi_h), hi_h + 1))
        w = int(r.integers(min(6, hi_w), hi_w + 1))
        if (h > mh or w > mw) and not pad:
            return None
        p = {"size": [h, w]} if h != w or r.random() < 0.5 else {"size": h}
        if pad:
            p["pad"] = True
            if r.random() < 0.5:
                p["pad_value"] = int(_choice(r, [0, 9]))
        if mv:
            p["min_visibility"] = mv
        _size_filters(r, p)
    elif name == "random_crop":
        padding = int(_choice(r, [0, 0, 0, 2, 4]))
        pad = r.random() < 0.2
        lim_h, lim_w = mh + 2 * padding, mw + 2 * padding
        hi_h, hi_w = (int(lim_h * 1.3) if pad else lim_h), (int(lim_w * 1.3) if pad else lim_w)
        h = int(r.integers(min(6, hi_h), hi_h + 1))
        w = int(r.integers(min(6, hi_w), hi_w + 1))
        p = {"size": [h, w]}
        if padding:
            p["padding"] = padding
        if pad:
            p["pad"] = True
        if r.random() < 0.2:
            p["pad_value"] = 5
        if mv:
            p["min_visibility"] = mv
        _size_filters(r, p)
    elif name == "random_resized_crop":
        p = {"size": [int(r.integers(10, 48)), int(r.integers(10, 48))]}
        if r.random() < 0.7:
            p["scale"] = _range(r, 0.2, 1.0)
        if r.random() < 0.4:
            p["ratio"] = _range(r, 0.5, 2.0)
        if r.random() < 0.3:
            p["interpolation"] = _choice(r, ["auto", "area", "linear", "cubic", "nearest"])
        if mv:
            p["min_visibility"] = mv
        _size_filters(r, p)
    elif name == "random_flip":
        p = {"horizontal": float(_choice(r, [0.0, 0.5, 0.5, 1.0])), "vertical": float(_choice(r, [0.0, 0.0, 0.5, 1.0]))}
        if keypoints or r.random() < 0.3:
            p["flip_pairs"] = FLIP_PAIRS if r.random() < 0.8 else []
    elif name == "random_affine":
        p = {"degrees": _choice(r, [0, 10, 45, [85, 95], 180, [-30, 5]])}
        if r.random() < 0.5:
            p["scale"] = _choice(r, [[0.8, 1.25], [1.0, 1.0], 0.9, [1.1, 1.4]])
        if r.random() < 0.5:
            p["translate"] = float(_choice(r, [0.0, 0.1, 0.25]))
        if r.random() < 0.2:
            p["fill"] = 7
        if r.random() < 0.3:
            p["interpolation"] = _choice(r, ["linear", "cubic", "nearest"])
        if mv:
            p["min_visibility"] = mv
        _size_filters(r, p)
    elif name == "convert":
        p = {"mode": _choice(r, ["rgb8", "gray8", "gray16", "rgba8"])}
    elif name == "color_jitter":
        p = {}
        for k in ("brightness", "contrast", "saturation"):
            if r.random() < 0.6:
                p[k] = _choice(r, [0.2, 0.4, [0.8, 1.1]])
        if not p:
            p = {"brightness": 0.3}
    else:
        p = {"std": _choice(r, [1.0, 3.0, [0.5, 4.0]])}
    if name in ("convert", "color_jitter", "gaussian_noise") and not video and r.random() < 0.4:
        p["fields"] = [image_field]
    if name in ("random_flip", "center_crop") and r.random() < 0.03:
        p["fields"] = []
    return {name: p}


def draw_2d_chain(r: np.random.Generator, sizes: list[tuple[int, int]], n: int, keypoints: bool,
                  lead_resize: Optional[dict] = None, video: bool = False,
                  image_field: str = "image") -> tuple[list[dict], list[tuple[int, int]]]:
    steps = []
    if lead_resize is not None:
        steps.append(lead_resize)
        sizes = [out_hw("resize", lead_resize["resize"], s) for s in sizes]
    for _ in range(n):
        for _try in range(8):
            s = draw_2d_step(r, sizes, keypoints, True, not steps, video, image_field)
            if s is None:
                continue
            (name, p), = s.items()
            new = [out_hw(name, p, hw) for hw in sizes]
            if min(min(h, w) for h, w in new) < 5 or max(max(h, w) for h, w in new) > 160:
                continue
            steps.append(s)
            sizes = new
            break
    return steps, sizes


def fixed_size(steps: list[dict]) -> bool:
    """Whether every sample leaves the chain at one size (a Loader reads fixed-shape fields only)."""
    fixed = False
    for s in steps:
        (name, p), = s.items()
        if p.get("fields") == []:
            continue
        if name in ("center_crop", "random_crop", "random_resized_crop") or (name == "resize" and "size" in p):
            fixed = True
        elif name == "resize":
            fixed = False
    return fixed


def draw_loader(r: np.random.Generator, hw: tuple[int, int], keypoints: bool, n_rows: int) -> dict:
    ld: dict[str, Any] = {"batch_size": int(r.integers(1, 5)), "shuffle": _choice(r, [True, False, "block", "shard"]),
                          "seed": int(r.integers(0, 100)), "epoch": int(r.integers(0, 3))}
    if r.random() < 0.35:
        ld["world_size"] = int(r.integers(2, 4))
        ld["uneven"] = _choice(r, ["pad", "drop"])
    if r.random() < 0.2:
        ld["drop_last"] = True
    if r.random() < 0.4:
        ld["resume_at"] = int(r.integers(0, 3))
    if r.random() < 0.25:
        ld["in_memory"] = True
    if r.random() < 0.3:
        ld["num_threads"] = int(_choice(r, [0, 1, 2]))
    if r.random() < 0.25:
        ld["convert"] = {"dtype": "float32", "mean": 0.25, "std": 0.5, "channels_first": bool(r.random() < 0.5)}
    elif r.random() < 0.08:
        ld["convert"] = {"channels_first": True}   # without a dtype: the batch must still be NCHW
    if r.random() < 0.2:
        ld["copies"] = "all"
    steps = []
    h, w = hw
    for _ in range(int(_choice(r, [0, 1, 1, 2, 2, 3]))):
        if r.random() < 0.5:
            p = {"horizontal": float(_choice(r, [0.5, 1.0, 0.0])), "vertical": float(_choice(r, [0.0, 0.5, 1.0]))}
            if keypoints:
                p["flip_pairs"] = FLIP_PAIRS if r.random() < 0.8 else []
            steps.append({"random_flip": p})
        else:
            padding = int(_choice(r, [0, 0, 2]))
            pad = r.random() < 0.2
            ch = int(r.integers(max(4, h // 2), h + 2 * padding + (4 if pad else 0) + 1))
            cw = int(r.integers(max(4, w // 2), w + 2 * padding + (4 if pad else 0) + 1))
            if not pad:
                ch, cw = min(ch, h + 2 * padding), min(cw, w + 2 * padding)
            p = {"size": [ch, cw]}
            if padding:
                p["padding"] = padding
            if pad:
                p["pad"] = True
            if r.random() < 0.3:
                p["min_visibility"] = float(_choice(r, [0.3, 0.5, 0.9]))
            _size_filters(r, p)
            if r.random() < 0.2:
                p["pad_value"] = 3
            steps.append({"random_crop": p})
            h, w = ch, cw
    # the random device steps of issue 35, from their own stream (the draws above, and the case's after, stay)
    r2 = np.random.default_rng([ld["seed"], int(hw[0]), int(hw[1]), n_rows, 35])
    if r2.random() < 0.6:
        steps += draw_device_augment(r2, (h, w))
    # the chain the Loader fuses on CUDA (reader/fused.py: resized crop -> flip -> jitter -> float conversion),
    # in a quarter of the cases instead of the steps drawn above, from a stream of its own (the other draws stay)
    r3 = np.random.default_rng([ld["seed"], int(hw[0]), int(hw[1]), n_rows, 36])
    if r3.random() < 0.25:
        steps = draw_fused_chain(r3, hw, keypoints)
        ld["convert"] = {"dtype": "float32", "mean": 0.25, "std": 0.5,
                         "channels_first": bool(r3.random() < 0.5)}
    ld["gpu_steps"] = steps
    # the Loader's options that change no value (prefetch, block_window, sort_batches, map_shards, verify) or only
    # which rows an epoch reads (include_original) or which fields convert (convert_fields: resolved against the
    # case's fields in loader_check), from a stream of their own (the draws above, and the case's after, stay)
    r4 = np.random.default_rng([ld["seed"], int(hw[0]), int(hw[1]), n_rows, 37])
    if r4.random() < 0.2:
        ld["prefetch"] = int(_choice(r4, [1, 3, 5]))
    if r4.random() < 0.3:
        ld["block_window"] = int(_choice(r4, [1, 2, 3]))
    if r4.random() < 0.25:
        ld["sort_batches"] = False
    if r4.random() < 0.25:
        ld["map_shards"] = "lazy"
    if r4.random() < 0.1:
        ld["verify"] = True
    if r4.random() < 0.25:
        ld["include_original"] = False
    if ld.get("convert") and r4.random() < 0.3:
        ld["convert_fields"] = _choice(r4, ["none", "first"])
    if r4.random() < 0.25:
        ld["targets"] = "list"   # (loader_check passes it where the case loads a boxes field)
    # a precompile.Mix of the build with itself (two opened copies) beside the Loader, from a stream of its own
    r5 = np.random.default_rng([ld["seed"], int(hw[0]), int(hw[1]), n_rows, 38])
    if r5.random() < 0.3:
        m: dict[str, Any] = {"weights": [float(_choice(r5, [0.5, 1.0, 2.0, 3.0])) for _ in range(2)],
                             "stop": _choice(r5, ["first_exhausted", "first_exhausted", "all_exhausted", "n"])}
        if m["stop"] == "n":
            m["stop"] = int(r5.integers(1, 2 * n_rows + 2))
        elif m["stop"] == "first_exhausted" and r5.random() < 0.3:
            m["cycle"] = [True, False] if r5.random() < 0.5 else [False, True]
        if r5.random() < 0.3:
            m["weights"][int(r5.integers(0, 2))] = 0.0 if r5.random() < 0.5 else m["weights"][0]
        ld["mix"] = m
    return ld


def draw_fused_chain(r: np.random.Generator, hw: tuple[int, int], keypoints: bool) -> list[dict]:
    """random_resized_crop, then (mostly) a horizontal flip and colour jitter: the steps the fused kernels take."""
    h, w = hw
    size = [int(r.integers(2, max(3, h + 5))), int(r.integers(2, max(3, w + 5)))]
    out = [{"random_resized_crop": {"size": size, "scale": _range(r, 0.05, 1.0), "ratio": _range(r, 0.5, 2.0),
                                    "interpolation": _choice(r, ["auto", "area", "linear"])}}]
    if r.random() < 0.8:
        p: dict[str, Any] = {"horizontal": float(_choice(r, [0.5, 1.0])), "vertical": float(_choice(r, [0.0, 0.5]))}
        if keypoints:
            p["flip_pairs"] = FLIP_PAIRS
        out.append({"random_flip": p})
    if r.random() < 0.8:
        j = {k: float(_choice(r, [0.0, 0.2, 0.6])) for k in ("brightness", "contrast", "saturation")}
        out.append({"color_jitter": j})
    return out


def draw_device_augment(r: np.random.Generator, hw: tuple[int, int]) -> list[dict]:
    """One or two of the device-only random steps: resized crop, affine, colour jitter, grayscale, blur, erasing."""
    out = []
    h, w = hw
    for _ in range(int(_choice(r, [1, 1, 2]))):
        name = _choice(r, ["random_resized_crop", "random_affine", "color_jitter", "random_grayscale",
                           "gaussian_blur", "random_erasing"])
        if name == "random_resized_crop":
            size = [int(r.integers(4, max(5, h + 3))), int(r.integers(4, max(5, w + 3)))]
            p = {"size": size, "scale": [0.3, 1.0], "interpolation": _choice(r, ["auto", "nearest", "linear"])}
            h, w = size
        elif name == "random_affine":
            p = {"degrees": float(_choice(r, [0.0, 15.0, 90.0])), "scale": [0.8, 1.2], "translate": 0.1,
                 "interpolation": _choice(r, ["linear", "nearest"])}
        elif name == "color_jitter":
            p = {"brightness": 0.3, "contrast": 0.3, "saturation": 0.3}
        elif name == "random_grayscale":
            p = {"p": 0.5}
        elif name == "gaussian_blur":
            if min(h, w) < 2:
                continue
            p = {"kernel_size": 3, "sigma": [0.5, 1.5]}
        else:
            p = {"p": 0.7, "value": 5}
        if name in ("random_resized_crop", "random_affine") and r.random() < 0.3:
            p["min_visibility"] = 0.3
        out.append({name: p})
    return out


def _image_decoder(r: np.random.Generator, big: bool, allow_forced: bool) -> dict:
    d: dict[str, Any] = {"decoder": "image"}
    if r.random() < 0.5:
        d["mode"] = _choice(r, ["rgb8", "gray8", "rgba8", "gray16"], [5, 2, 1, 1])
    if r.random() < 0.25:
        d["exif_transpose"] = False
    red = _choice(r, ["auto", "default", "off", False, 2, 4, 8] if (big and allow_forced) else ["auto", "default", "off"],
                  [3, 3, 1, 1, 1, 1, 1] if (big and allow_forced) else [3, 3, 1])
    if red != "default":
        d["reduce"] = red
    return d


def _images(r: np.random.Generator, n: int, big: bool, subdirs: bool, exif: bool) -> list[dict]:
    out = []
    for i in range(n):
        if big:
            H, W = int(r.integers(100, 241)), int(r.integers(100, 241))
        else:
            H, W = int(r.integers(20, 73)), int(r.integers(20, 73))
        if r.random() < 0.15:
            W = H                              # square: an EXIF turn keeps the size
        fmt = _choice(r, ["jpg", "png"], [3, 2])
        name = f"{'sub/' if subdirs and i % 2 else ''}im{i:02d}.{fmt}"
        o = int(_choice(r, [1, 2, 3, 4, 5, 6, 7, 8], [12, 1, 1, 1, 1, 2, 1, 1])) if exif else 1
        out.append({"name": name, "H": H, "W": W, "fmt": fmt, "orientation": o,
                    "quality": int(_choice(r, [85, 95, 100])), "subsampling": int(_choice(r, [0, 0, 2])),
                    "palette": bool(fmt == "png" and r.random() < 0.1),
                    "n_obj": 0 if r.random() < 0.12 else int(r.integers(1, MAX_OBJECTS + 1)),
                    "crowd": bool(r.random() < 0.3), "edge_kp": bool(r.random() < 0.15),
                    "segs": [_choice(r, ["poly", "rle", "rle_list", "none"], [12, 2, 2, 1]) for _ in range(MAX_OBJECTS)],
                    "seed": int(r.integers(0, 1 << 30))})
    return out


def _output(r: np.random.Generator, mode: str, bmp_ok: bool) -> dict:
    fmt = _choice(r, ["hdf5", "png", "bmp"], [6, 3, 2 if bmp_ok else 0])
    out: dict[str, Any] = {"format": fmt, "samples_per_shard": int(r.integers(1, 4))}
    if fmt == "hdf5" and r.random() < 0.3:
        out["chunk_samples"] = int(r.integers(1, 3))
    return out


def _copies(r: np.random.Generator, steps: list[dict], recipe: dict) -> None:
    from .reference import RANDOM_STEPS

    if any(next(iter(s)) in RANDOM_STEPS for s in steps) and r.random() < 0.35:
        recipe["copies"] = int(r.integers(1, 3))
        if r.random() < 0.3:
            recipe["keep_original"] = False


def draw_coco(seed: int) -> dict:
    r = rng_of(seed, "coco")
    big = r.random() < 0.25
    images = _images(r, int(r.integers(1, 5)), big, r.random() < 0.3, exif=r.random() < 0.35)
    coco: dict[str, Any] = {"file": "$IN/ann.json"}
    mask = _choice(r, ["none", "semantic", "instance"], [2, 1, 3])
    if mask != "none" or r.random() < 0.5:
        coco["mask"] = mask
    kps = r.random() < 0.6
    if kps:
        coco["keypoints"] = True
    crowd = _choice(r, ["drop", "keep", "ignore", None])
    if crowd:
        coco["crowd"] = crowd
    image_field = "image" if r.random() < 0.85 else "photo"
    if image_field != "image":
        coco["image"] = image_field
    dec = _image_decoder(r, big, True)
    forced = isinstance(dec.get("reduce"), int) and not isinstance(dec.get("reduce"), bool)
    lead = None
    if forced and r.random() < 0.7:
        lead = {"resize": {"size": [int(r.integers(12, 40)), int(r.integers(12, 40))]}}
    reducible = big and dec.get("reduce", "auto") not in ("off", False)
    truth = r.random() < (0.3 if reducible else 0.8) and (not forced or lead is not None)
    fields: dict[str, Any] = {image_field: dec}
    if truth:
        ids: dict[str, Any] = {"decoder": "mask", "path": "{stem}.ids.png"}
        opt = _choice(r, ["none", "classes", "remap", "max_label", "dtype"])
        if opt == "classes":
            ids["classes"] = [0, 1, 2, 3, 4, 5, 200]
        elif opt == "remap":
            ids["classes"], ids["remap"] = [0, 1, 2, 3, 4, 5, 200], True
        elif opt == "max_label":
            ids["max_label"] = 200
        elif opt == "dtype":
            ids["dtype"] = "uint16"
        if dec.get("exif_transpose") is False:
            ids["exif_transpose"] = False
        fields["ids"] = ids
        if kps:
            fields["marks"] = {"decoder": "mask", "path": "{stem}.marks.png", **({"exif_transpose": False}
                                                                                if dec.get("exif_transpose") is False else {})}
    sizes = []
    for im in images:
        H, W = im["H"], im["W"]
        if im["orientation"] >= 5 and dec.get("exif_transpose", True):
            H, W = W, H
        k = dec.get("reduce") if forced else 1
        sizes.append((-(-H // k), -(-W // k)))
    steps, final = draw_2d_chain(r, sizes, int(_choice(r, [0, 1, 2, 2, 3, 4])), kps, lead, image_field=image_field)
    recipe: dict[str, Any] = {"name": "fz", "seed": int(r.integers(0, 1000)),
                              "inputs": {"root": "$IN", "coco": coco, "fields": fields}, "steps": steps}
    _copies(r, steps, recipe)
    mode = dec.get("mode", "rgb8")
    bmp_ok = mode in ("rgb8", "gray8") and mask != "instance" and not (truth and fields["ids"].get("dtype") == "uint16") \
        and not any("convert" in s and s["convert"]["mode"] in ("gray16", "rgba8") for s in steps)
    recipe["output"] = _output(r, mode, bmp_ok)
    turned = any(im["orientation"] >= 5 and im["H"] != im["W"] for im in images) and dec.get("exif_transpose", True)
    if turned or r.random() < 0.2:
        recipe["on_error"] = "skip"
    if r.random() < 0.12 and len(images) > 1:
        recipe["split"] = {"by": "hash", "fractions": {"a": 0.5, "b": 0.5}, "seed": int(r.integers(0, 50))}
    loader = None
    if recipe["output"]["format"] == "hdf5" and "split" not in recipe and fixed_size(steps) and r.random() < 0.6 \
            and len(set(final)) == 1:
        loader = draw_loader(r, final[0], kps, len(images))
    inputs = {"images": images, "image_ids": _choice(r, ["int", "str"], [4, 1]), "truth": truth,
              "short_rle": bool(r.random() < 0.1), "bad": "nan_keypoint" if kps and r.random() < 0.04 else None}
    return {"seed": seed, "family": "coco", "inputs": inputs, "recipe": recipe, "loader": loader,
            "j2": bool(r.random() < 0.08)}


def draw_folder(seed: int) -> dict:
    r = rng_of(seed, "folder")
    big = r.random() < 0.2
    images = _images(r, int(r.integers(2, 6)), big, False, exif=r.random() < 0.3)
    labels = ["cat", "dog", "\u00e9l\u00e8ve"]
    for i, im in enumerate(images):
        im["label"] = labels[int(r.integers(0, len(labels)))]
        im["name"] = f"{im['label']}/n{i:02d}.{im['fmt']}"
    dec = _image_decoder(r, big, False)
    fields: dict[str, Any] = {"image": dec, "ids": {"decoder": "mask", "path": "ids/{label}/{name}.png"}}
    if dec.get("exif_transpose") is False:
        fields["ids"]["exif_transpose"] = False
    lab: dict[str, Any] = {"capture": "label"}
    if r.random() < 0.4:
        lab["classes"] = sorted(labels, reverse=True)
    if r.random() < 0.3:
        lab["field"] = "cls"
    inputs_r = {"root": "$IN", "match": "img/{label}/{name}.{ext}", "where": {"ext": "jpg|png"}, "fields": fields,
                "label": lab}
    sizes = [((im["W"], im["H"]) if im["orientation"] >= 5 and dec.get("exif_transpose", True) else (im["H"], im["W"]))
             for im in images]
    steps, final = draw_2d_chain(r, sizes, int(_choice(r, [0, 1, 2, 3])), False)
    recipe: dict[str, Any] = {"name": "fz", "seed": int(r.integers(0, 1000)), "inputs": inputs_r, "steps": steps}
    _copies(r, steps, recipe)
    mode = dec.get("mode", "rgb8")
    recipe["output"] = _output(r, mode, mode in ("rgb8", "gray8") and not any(
        "convert" in s and s["convert"]["mode"] in ("gray16", "rgba8") for s in steps))
    if r.random() < 0.25:
        recipe["split"] = {"by": "hash", "fractions": {"train": 0.7, "val": 0.3},
                           **({"group": "label"} if r.random() < 0.5 else {})}
    loader = None
    if recipe["output"]["format"] == "hdf5" and "split" not in recipe and fixed_size(steps) and len(set(final)) == 1 \
            and r.random() < 0.5:
        loader = draw_loader(r, final[0], False, len(images))
    return {"seed": seed, "family": "folder", "inputs": {"images": images, "truth": True}, "recipe": recipe,
            "loader": loader, "j2": bool(r.random() < 0.08)}


def draw_flow(seed: int) -> dict:
    r = rng_of(seed, "flow")
    images = _images(r, int(r.integers(1, 4)), False, False, exif=False)
    for i, im in enumerate(images):
        im["name"] = f"p{i:02d}"
        im["fmt"] = "png"
        im["crowd"] = False
        im["n_obj"] = max(1, im["n_obj"])
    valid = r.random() < 0.6
    fields: dict[str, Any] = {
        "img1": {"decoder": "image"}, "img2": {"decoder": "image", "path": "{name}_img2.png"},
        "ids1": {"decoder": "mask", "path": "{name}_ids1.png"}, "ids2": {"decoder": "mask", "path": "{name}_ids2.png"},
        "flow": {"decoder": "flo", "path": "{name}_flow.flo", **({"valid_mask": True} if valid else {})},
        "occ": {"decoder": "flow_mask", "path": "{name}_ids1.png", **({"invert": True} if r.random() < 0.4 else {})}}
    sizes = [(im["H"], im["W"]) for im in images]
    steps, final = draw_2d_chain(r, sizes, int(_choice(r, [0, 1, 2, 3])), False)
    steps = [s for s in steps if "fields" not in next(iter(s.values())) or next(iter(s)) == "random_flip"]
    recipe: dict[str, Any] = {"name": "fz", "seed": int(r.integers(0, 1000)),
                              "inputs": {"root": "$IN", "match": "{name}_img1.png", "fields": fields}, "steps": steps}
    _copies(r, steps, recipe)
    recipe["output"] = {"format": _choice(r, ["hdf5", "png"], [3, 1]), "samples_per_shard": int(r.integers(1, 3))}
    loader = None
    if recipe["output"]["format"] == "hdf5" and fixed_size(steps) and len(set(final)) == 1 and r.random() < 0.5:
        loader = draw_loader(r, final[0], False, len(images))
    return {"seed": seed, "family": "flow", "inputs": {"images": images}, "recipe": recipe, "loader": loader,
            "j2": bool(r.random() < 0.05)}


def _table(seed: int) -> dict:
    from .famtable import draw_table

    return draw_table(seed)


def _video(seed: int) -> dict:
    from .famav import draw_video

    return draw_video(seed)


def _audio(seed: int) -> dict:
    from .famav import draw_audio

    return draw_audio(seed)


def _volume(seed: int) -> dict:
    from .famvolume import draw_volume

    return draw_volume(seed)


def _dicom(seed: int) -> dict:
    from .famvolume import draw_dicom

    return draw_dicom(seed)


DRAWERS: dict[str, Any] = {"coco": draw_coco, "folder": draw_folder, "flow": draw_flow, "table": _table,
                           "video": _video, "audio": _audio, "volume": _volume, "dicom": _dicom}


# -- coverage: how every step, kind, decoder option, output format and Loader device step is drawn -------------------
COVERAGE: dict[str, dict[str, Any]] = {
    "steps": {
        "resize": "2D chains (coco, folder, flow; size/shorter/longer/keep_aspect, interpolation, fast), video pre-clips",
        "center_crop": "2D chains (pad, pad_value, min_visibility, min_area/min_width/min_height), video pre-clips "
                       "per-frame",
        "convert": "2D chains (rgb8/gray8/gray16/rgba8, fields: [image]), video",
        "random_crop": "2D chains (padding, pad, pad_value, min_visibility, min_area/min_width/min_height), video "
                       "after clips",
        "random_resized_crop": "2D chains (scale, ratio, interpolation, min_visibility, min_area/min_width/min_height)",
        "random_flip": "2D chains (horizontal, vertical, flip_pairs, fields: [])",
        "random_affine": "2D chains (degrees, scale, translate, fill, interpolation, min_visibility, "
                         "min_area/min_width/min_height)",
        "color_jitter": "2D chains and video (brightness, contrast, saturation)",
        "gaussian_noise": "2D chains, video (fields: [video]), audio, volumes (fields: [volume])",
        "clips": "video (length/every/stride or fps/length/length_s/stride_s, short, pad, max_clips, index_field)",
        "temporal_jitter": "video after clips (length, strides, jitter)",
        "windows": "audio (length, hop, short, tail, pad_value)",
        "fix_length": "audio (length, align, pad_value)",
        "random_gain": "audio (db, clip)",
        "time_shift": "audio (max_shift or max_fraction, mode)",
        "resample_volume": "NIfTI/DICOM 3D chains (shape, order, spacing_from)",
        "crop_pad_volume": "3D chains (shape, pad_value)",
        "patches3d": "3D chains (size, stride, pad, pad_value, mask, min_fraction, max_patches, corner_field)",
        "random_flip3d": "3D chains (prob, axes)",
        "random_rot90": "3D chains (planes, k; odd k only on square planes)",
        "elastic": "3D chains (magnitude, grid)",
        "hu_window": "3D chains (window or level + width, dtype)",
        "standardise": "3D chains (mean + std, or per_sample with mask)",
        "lung_mask": "3D chains (out, threshold, components, min_fraction, closing, fill_holes)",
        "apply_mask": "3D chains (mask: the label field or lung_mask's output, fill)",
    },
    "kinds": {
        "image": "every 2D family", "mask": "ids/marks truth masks, COCO masks, flow_mask",
        "flow": "flow pairs (.flo)", "flow_valid": "flo valid_mask: true", "video": "video family",
        "volume": "NIfTI and DICOM", "volume_mask": "nifti_labels, lung_mask", "audio": "audio files, video audio_field",
        "label": "folder label capture, table label column", "index": "clips index_field, patches3d corner_field",
        "boxes": "COCO", "box_labels": "COCO", "keypoints": "COCO keypoints: true",
        "text": "table text columns", "target": "table target columns (one column, or a vector with map)",
    },
    "decoders": {
        "image": {"mode": "rgb8/gray8/rgba8/gray16", "exif_transpose": "true/false (EXIF orientations 1-8 drawn)",
                  "reduce": "auto/off/false/2/4/8 (big images)"},
        "mask": {"classes": "ids truth [0..5, 200]", "max_label": "200", "remap": "with classes", "dtype": "uint16",
                 "exif_transpose": "with the image's"},
        "flow_mask": {"invert": "flow family occlusion mask"},
        "flo": {"valid_mask": "flow family"},
        "video": {"mode": "rgb8/gray8", "every": "2-3", "max_frames": "2-9", "audio_field": "sound",
                  "audio_rate": "8000/16000", "audio_mono": "false", "audio_quality": "VHQ/HQ/MQ",
                  "audio_missing": "silence for videos without audio", "start_s": "window", "end_s": "window",
                  "rotate": "false, for mp4 files drawn with a display rotation (90/180/270)"},
        "audio": {"mono": "false", "channels": "with mono: false", "sample_rate": "resampling",
                  "dtype": "int16", "quality": "VHQ..QQ"},
        "dicom": {"dtype": "int16", "rescale": "false", "force": "files without meta", "uneven": "(single file)",
                  "slice_spacing": "(single file)", "tilt": "(single file)", "monochrome1": "invert"},
        "dicom_series": {"dtype": "int16", "rescale": "false", "force": "a slice without file meta",
                         "uneven": "resample/keep (a missing slice)", "slice_spacing": "1.0/2.0",
                         "tilt": "keep (15 degree tilt)", "monochrome1": "invert (12-bit MONOCHROME1)",
                         "series_uid": "two series in a folder", "multiple": "largest", "recursive": "sub-folders"},
        "nifti": {"orient": "native/LPS/RAS (axes permuted and flipped)", "index": "all/0/1 (4D)", "dtype": "int16",
                  "rescale": "false (scl_slope/inter set)"},
        "nifti_labels": {"orient": "with the volume's", "index": "with the volume's", "dtype": "uint8..int64"},
    },
    "formats": {"hdf5": "every family", "png": "2D families, tables", "bmp": "2D rgb8/gray8",
                "wav": "audio (subtype auto/PCM_16/FLOAT)"},
    "device_steps": {"random_flip": "Loader gpu_steps (horizontal, vertical, flip_pairs)",
                     "random_crop": "Loader gpu_steps (size, padding, pad, pad_value, min_visibility, "
                                    "min_area/min_width/min_height; chained)",
                     "random_resized_crop": "Loader gpu_steps (size, scale, interpolation, min_visibility)",
                     "random_affine": "Loader gpu_steps (degrees, scale, translate, interpolation, min_visibility)",
                     "color_jitter": "Loader gpu_steps (brightness, contrast, saturation)",
                     "random_grayscale": "Loader gpu_steps (p)", "gaussian_blur": "Loader gpu_steps (3x3, sigma)",
                     "random_erasing": "Loader gpu_steps (p, value)"},
}


def used(case: dict) -> dict[str, set]:
    """What a drawn case exercises: steps, kinds, decoder options, output format, Loader device steps."""
    rec = case["recipe"]
    inp = rec["inputs"]
    out: dict[str, set] = {"steps": set(), "kinds": set(), "decoders": set(), "formats": set(), "device_steps": set()}
    for s in rec.get("steps", []):
        out["steps"].update(s)
    out["formats"].add(rec.get("output", {}).get("format", "hdf5"))
    for f, d in (inp.get("fields") or {}).items():
        for k in d:
            if k not in ("decoder", "path"):
                out["decoders"].add(f"{d['decoder']}.{k}")
    dec_kinds = {"image": "image", "mask": "mask", "flow_mask": "mask", "flo": "flow", "video": "video",
                 "audio": "audio", "dicom": "volume", "dicom_series": "volume", "nifti": "volume",
                 "nifti_labels": "volume_mask"}
    for f, d in (inp.get("fields") or {}).items():
        out["kinds"].add(dec_kinds[d["decoder"]])
        if d["decoder"] == "flo" and d.get("valid_mask"):
            out["kinds"].add("flow_valid")
        if d["decoder"] == "video" and d.get("audio_field"):
            out["kinds"].add("audio")
    if "coco" in inp:
        out["kinds"].update({"image", "boxes", "box_labels"})
        c = inp["coco"]
        if c.get("keypoints"):
            out["kinds"].add("keypoints")
        if c.get("mask", "none") != "none":
            out["kinds"].add("mask")
    if "label" in inp:
        out["kinds"].add("label")
    for c in (inp.get("columns") or {}).values():
        out["kinds"].add(c["kind"])
    for s in rec.get("steps", []):
        (n, p), = s.items()
        if (n == "clips" and (p or {}).get("index_field")) or (n == "patches3d" and (p or {}).get("corner_field")):
            out["kinds"].add("index")
        if n == "lung_mask":
            out["kinds"].add("volume_mask")
    for s in (case.get("loader") or {}).get("gpu_steps", []):
        out["device_steps"].update(s)
    return out
