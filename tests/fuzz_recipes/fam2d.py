"""2D families: COCO files, folders with a label capture, flow pairs. Inputs, and the oracles on each sample."""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from . import reference as ref
from .oracles import (Ann, Report, Slack, box_tol, box_vs_extent, colour_mask, extent, fmt_box, follow, match_rows,
                      on_edge)
from .truth import (CATEGORY_LABEL, CROWD_ID, K, MAX_OBJECTS, coco_annotations,
                    exif_transpose, flow_pair, make_scene, rng_of, save_image, write_coco, write_flo)


# -- inputs -----------------------------------------------------------------------------------------------------------
def _scene(im: dict):
    return make_scene(im["seed"], im["H"], im["W"], im["n_obj"], im["crowd"], im["edge_kp"], im["segs"])


def write(case: dict, root: str) -> dict:
    fam = case["family"]
    inp = case["inputs"]
    truth: dict[str, Any] = {}
    if fam == "coco":
        images, per = [], []
        first = 1
        shared: dict[str, Any] = {"path": os.path.join(root, "ann.json")}
        for n, im in enumerate(inp["images"]):
            sc = _scene(im)
            o = im["orientation"]
            path = os.path.join(root, im["name"])
            save_image(sc.image, path, im["fmt"], o, im["quality"], im["subsampling"], im["palette"])
            stem = im["name"].rsplit(".", 1)[0]
            if inp.get("truth"):
                save_image(sc.ids, os.path.join(root, stem + ".ids.png"), "png", o)
                save_image(sc.marks, os.path.join(root, stem + ".marks.png"), "png", o)
            iid: Any = 100 + n if inp["image_ids"] == "int" else f"img-{n}"
            anns = coco_annotations(sc, iid, first, inp.get("short_rle", False), inp.get("bad"))
            first += len(anns) + 3
            images.append({"id": iid, "file_name": im["name"], "height": im["H"], "width": im["W"]})
            per.append(anns)
            truth[im["name"]] = {"scene": sc, "im": im, "anns": anns, "image_id": iid, "shared": shared}
        order = list(rng_of(case["seed"], "order").permutation(len(images)))
        write_coco(os.path.join(root, "ann.json"), [images[i] for i in order], per, rng_of(case["seed"], "anns"))
    elif fam == "folder":
        for im in inp["images"]:
            sc = _scene(im)
            name = im["name"]
            save_image(sc.image, os.path.join(root, "img", name), im["fmt"], im["orientation"], im["quality"],
                       im["subsampling"], im["palette"])
            save_image(sc.ids, os.path.join(root, "ids", name.rsplit(".", 1)[0] + ".png"), "png", im["orientation"])
            truth["img/" + name] = {"scene": sc, "im": im}
    elif fam == "flow":
        for im in inp["images"]:
            sc = _scene(im)
            img2, ids2, flow, moves = flow_pair(sc, im["seed"])
            n = im["name"]
            save_image(sc.image, os.path.join(root, n + "_img1.png"), "png")
            save_image(img2, os.path.join(root, n + "_img2.png"), "png")
            save_image(sc.ids, os.path.join(root, n + "_ids1.png"), "png")
            save_image(ids2, os.path.join(root, n + "_ids2.png"), "png")
            write_flo(os.path.join(root, n + "_flow.flo"), flow)
            truth[n + "_img1.png"] = {"scene": sc, "im": im, "flow": flow, "moves": moves}
    return truth


# -- helpers ------------------------------------------------------------------------------------------------------------
def _targets(p: dict, field: str) -> bool:
    f = p.get("fields")
    return f is None or field in f


def _blur(name: str, p: dict, scale: float = 1.0) -> float:
    """How far, in output px, a resample of an image moves the edge of a flat colour region as classified:
    nearest 0.5; area/linear half a pixel plus half the ramp a growing resize spreads one input pixel over;
    cubic or the approximate area one more half pixel (ringing)."""
    interp = p.get("interpolation", "auto" if name != "random_affine" else "linear")
    if interp == "nearest":
        return 0.5
    ramp = 0.5 + 0.5 * max(1.0, scale)
    if interp == "cubic" or p.get("fast"):
        return ramp + 0.5
    return ramp


def reduce_expected(case: dict, field: str, dec: dict, Hd: int, Wd: int, fmt: str) -> Optional[set]:
    """The decode scales docs/reference-decoders.md allows for this input (None: do not judge)."""
    r = dec.get("reduce", "auto")
    if r is False or r == "off":
        return {1}
    if isinstance(r, int):
        return {r}
    if fmt != "jpg":
        return {1}
    for s in case["recipe"]["steps"]:
        (name, p), = s.items()
        if not _targets(p or {}, field) or (p or {}).get("fields") == []:
            continue
        if name == "resize":
            if p.get("interpolation", "auto") not in ("auto", "area"):
                return {1}
            (h, w), _, _ = ref.resize_target(p, Hd, Wd)
            aspect = p.get("shorter") is not None or p.get("longer") is not None or p.get("keep_aspect")
            for k in (8, 4, 2):
                rh, rw = ref.reduced(Hd, Wd, k)
                if Hd < k or Wd < k or rh < 2 * h or rw < 2 * w:
                    continue
                if aspect and ref.resize_target(p, rh, rw)[0] != (h, w):
                    continue
                return {k}
            return {1}
        if name == "random_resized_crop":
            return None if p.get("interpolation", "auto") in ("auto", "area") else {1}
        if name not in ("convert", "random_flip"):
            return {1}
    return {1}


# -- the 2D sample oracle -------------------------------------------------------------------------------------------------
class Chain:
    """The reference chain of one sample: its moves and the slack of each kind of truth."""

    def __init__(self, case: dict, field: str, H: int, W: int, orientation: int, k: int, meta: dict):
        self.E, (Hd, Wd) = ref.exif_map(orientation, H, W)
        self.Hd, self.Wd = Hd, Wd
        hk, wk = ref.reduced(Hd, Wd, k)
        self.D = ref.shift_scale(wk / Wd, hk / Hd, 0, 0)
        self.moves: list[ref.Move] = []
        self.blurs: list[float] = []
        self.colour_ok = True
        dec = case["recipe"]["inputs"]["fields"].get(field, {})
        self.grey = dec.get("mode", "rgb8") in ("gray8", "gray16")   # colour lost once: judge by luma
        grid = (hk, wk)
        for name, p, rec in ref.geometric_records(case["recipe"]["steps"], meta.get("augment", [])):
            if name in ("color_jitter", "gaussian_noise") and _targets(p, field) and p.get("fields") != []:
                self.colour_ok = False
            if name == "convert" and _targets(p, field) and p.get("mode") in ("gray8", "gray16"):
                self.grey = True
            m = ref.step_move(name, p, rec, grid)
            if m is not None:
                self.moves.append(m)
                self.blurs.append(_blur(name, p, max(m.scale)))
                grid = m.hw
        self.hw = grid
        self.first = (hk, wk)

    def ids_slack(self, rect: bool = True) -> Slack:
        """Nearest resampling keeps a rectangle's extent to half an output pixel; any other shape's extreme
        pixels may be skipped by a downscale (a triangle's tip), so then its pixels only lie inside the box."""
        sl = Slack()
        decoded = min(self.D[0, 0], self.D[1, 1])   # the truth fields are at full size: a reduced image's first
        for m in self.moves:                         # resample is a larger shrink for them (189 -> 27, not 24 -> 27)
            sl = sl.after(m, 0.5 if m.resample == "scale" else 1.0)
            if not rect and m.resample == "scale" and min(m.scale) * decoded < 1:
                sl = Slack(sl.e, True)
            decoded = 1.0
        return sl

    def colour_slack(self, source_err: float, rect: bool = True) -> Slack:
        """As ids_slack, and a blurring resample of any scale may wash out a non-rectangular object's thin tips."""
        sl = Slack(source_err)
        for m, b in zip(self.moves, self.blurs):
            sl = sl.after(m, b)
            if not rect and m.resample == "scale" and (min(m.scale) < 1 or b > 0.5):
                sl = Slack(sl.e, True)
        return sl

    def kp_slack(self) -> float:
        e = 0.0
        for m in self.moves:
            if m.resample == "scale":
                e = e * max(m.scale) + 0.5
            elif m.resample == "affine":
                e = e * max(m.scale) + 1.0
        return e

    @property
    def exact(self) -> bool:
        return all(m.resample == "none" for m in self.moves)


def _source_colour_err(im: dict, k: int) -> float:
    e = 0.0 if im["fmt"] == "png" else (1.0 if im["subsampling"] == 0 else 2.0)
    if im["fmt"] == "jpg" and im["quality"] < 90:
        e += 1.0
    return e / k + (1.0 if k > 1 else 0.0)


def check_sample_2d(case: dict, truth: dict, key: str, s: dict, meta: dict, R: Report, copy: int) -> None:
    fam = case["family"]
    rec = case["recipe"]
    info = truth.get(key)
    if not R.check("key", info is not None, f"stored key {key!r} is no input's", key):
        return
    sc, im = info["scene"], info["im"]
    field = (rec["inputs"].get("coco") or {}).get("image", "image") if fam == "coco" else ("img1" if fam == "flow" else "image")
    dec = rec["inputs"]["fields"][field]
    orient = im.get("orientation", 1) if dec.get("exif_transpose", True) else 1
    k = int((meta.get(field) or {}).get("reduce", 1))
    allowed = reduce_expected(case, field, dec, *ref.exif_map(orient, im["H"], im["W"])[1], im["fmt"])
    R.check("reduce_rule", allowed is None or k in allowed,
            f"decoded at 1/{k}, the docs' rule allows {sorted(allowed or [])}", key)
    try:
        ch = Chain(case, field, im["H"], im["W"], orient, k, meta)
    except LookupError as e:
        R.check("augment_record", False, str(e), key)
        return
    img = s[field]
    R.check("shape", tuple(img.shape[:2]) == tuple(ch.hw),
            f"{field} is {img.shape[:2]}, the documented steps give {ch.hw}", key)
    if tuple(img.shape[:2]) != tuple(ch.hw):
        return
    if fam == "coco":
        _check_coco(case, info, key, s, ch, R, field, im, k)
    elif fam == "folder":
        _check_folder(case, info, key, s, ch, R, field, im, k)
    else:
        _check_flow(case, info, key, s, ch, R)


def _ids_value(rec: dict, v: int) -> int:
    ids = rec["inputs"]["fields"].get("ids", {})
    if ids.get("remap"):
        return ids["classes"].index(v)
    return v


def _colour_check(R: Report, key: str, img: np.ndarray, ch: Chain, items: list, im: dict, k: int, what: str,
                  extra: float = 0.0) -> None:
    """``items``: (colour, expected box, name, loose, rect) of objects that must show as their colour's pixels
    (``extra``: the slack of the expected boxes themselves when they are pixel extents)."""
    if not ch.colour_ok:
        return
    # a rotation leaves no rectangle a rectangle: its box is the turned corners' enclosing box, whose sides say
    # nothing of how thin the object is, and a thin turned object judged by luma may keep no pixel of its colour
    # (the ids truth, resampled nearest, still places it: seed 92753, gray8, random_affine of up to 180 degrees)
    turned = any(m.resample == "affine" for m in ch.moves)
    for colour, box, name, clipped, rect in items:
        rect = rect and not turned
        sl = ch.colour_slack(_source_colour_err(im, k), rect)
        grey = img.shape[-1] == 1 or im["fmt"] == "jpg" or ch.grey
        # judged by luma one pixel in from the edge: a non-rectangular object's thin tips may hold no interior
        # a reduced decode is a resample too: a non-rectangular object's thin tips may wash out
        sl = Slack(sl.e + extra + (1.0 if grey else 0.0), sl.loose or (not rect and (grey or k > 1)))
        w, h = box[2] - box[0], box[3] - box[1]
        if min(w, h) < 3 + 2 * sl.e:
            continue
        got = extent(colour_mask(img, colour, grey))
        if got is None and not rect:
            continue   # a clipped box, or an interior by luma, may hold none of a non-rectangular object's pixels
        msg = box_vs_extent(box, got, Slack(sl.e, sl.loose or clipped)) if got is not None else "no pixel of its colour"
        R.check("colour_truth", msg is None, lambda: f"{what} {name}: {msg}", key)


def _check_coco(case, info, key, s, ch: Chain, R: Report, field, im, k) -> None:
    rec = case["recipe"]
    coco = rec["inputs"]["coco"]
    crowd = coco.get("crowd", "drop")
    sc = info["scene"]
    order = list(sc.objects) + ([sc.crowd] if sc.crowd is not None else [])

    def follow_all(D: np.ndarray) -> list[Ann]:
        out = []
        for o in order:
            if o.crowd and crowd != "keep":
                continue
            kp = o.keypoints if o.keypoints is not None else np.zeros((K, 3), np.float32)
            if case["inputs"].get("bad") == "nan_keypoint" and sc.objects and o is sc.objects[0] and o.keypoints is not None:
                kp = kp.copy()
                kp[1, 0] = np.nan
            a = Ann(o, CATEGORY_LABEL[o.category], np.asarray(o.box, np.float64), kp.astype(np.float64), list(range(K)))
            pre = ref.Move("exif", ref.compose(D, ch.E), ch.first, "none", 0.0)
            a.box = ref.move_box(a.box, pre).box
            a.kp = ref.move_keypoints(a.kp, pre, [])
            a.kp_edge = on_edge(a.kp, pre.hw)   # an EXIF turn may bring a keypoint onto an edge (seed 93104)
            out.append(a)
        follow(out, ch.moves)
        return out

    anns = follow_all(ch.D)
    boxes = np.asarray(s["boxes"], np.float64).reshape(-1, 4)
    labels = np.asarray(s["box_labels"]).reshape(-1)
    R.check("finite", np.isfinite(boxes).all(), lambda: f"non-finite boxes stored: {boxes.tolist()}", key)
    R.check("counts", len(labels) == len(boxes), f"{len(boxes)} boxes, {len(labels)} labels", key)
    if "keypoints" in s:
        kps = np.asarray(s["keypoints"], np.float64)
        R.check("counts", kps.shape == (len(boxes), K, 3), f"keypoints {kps.shape} for {len(boxes)} boxes", key)
        R.check("finite", np.isfinite(kps).all(), lambda: "non-finite keypoints stored", key)
    tol = max([box_tol(a.box) for a in anns] + [2e-3])
    rows = match_rows(boxes, anns, tol, labels)
    if rows is None and k > 1 and im["fmt"] != "jpg":
        # docs/coco.md: a non-JPEG under a forced reduce: k is area-resized and its coordinates divided by k (the
        # true scale ceil(W/k) / W differs by less than a reduced pixel): either scale is the documented one
        alt = follow_all(ref.shift_scale(1 / k, 1 / k, 0, 0))
        rows = match_rows(boxes, alt, tol, labels)
        if rows is not None:
            anns = alt
    if not R.check("box_reference", rows is not None, lambda: (
            f"stored boxes {[fmt_box(b) for b in boxes]}, the documented chain keeps "
            f"{[fmt_box(a.box) + ('?' if a.ambiguous else '') for a in anns if a.alive or a.ambiguous]} "
            f"(decoded at 1/{k}, steps {[m.name for m in ch.moves]})"), key):
        return
    for r, a in enumerate(rows):
        R.check("labels", int(labels[r]) == a.label, f"row {r}: label {labels[r]}, expected {a.label}", key)
    for a in rows:
        a.clipped |= a.ambiguous   # kept by a hair: its box need not reach its pixels
    if "keypoints" in s:
        _check_keypoints(R, key, s, rows, ch, kps)
    if "ids" in s:
        _check_ids_boxes(R, key, s, rows, anns, ch, rec)
    if "mask" in s:
        _check_mask(R, key, s, rows, ch, rec, coco, info, k)
        if k == 1 and not ch.moves and not case["recipe"].get("steps"):
            _check_coco_reference(R, key, s, case, info, ch)
    _colour_check(R, key, s[field], ch, [(a.obj.colour, boxes[r], f"row {r}", a.clipped, is_rect(a.obj)) for r, a in enumerate(rows)], im, k,
                  "box")


def _flip_pairs(rec: dict) -> list:
    for s in rec["steps"]:
        (n, p), = s.items()
        if n == "random_flip":
            return (p or {}).get("flip_pairs") or []
    return []


def _check_keypoints(R: Report, key: str, s: dict, rows: list[Ann], ch: Chain, kps: np.ndarray) -> None:
    h, w = ch.hw
    e = ch.kp_slack()
    marks = s.get("marks")
    for r, a in enumerate(rows):
        got = kps[r]
        for j in range(K):
            x, y, v = got[j]
            ex, ey, ev = a.kp[j]
            t = box_tol(a.kp[j, :2])
            if a.ambiguous:
                continue   # a box kept by a hair: the reference does not know where its rows went
            R.check("keypoint_reference", abs(x - ex) <= t and abs(y - ey) <= t,
                    lambda: f"row {r} keypoint {j} at ({x:.3f}, {y:.3f}), documented ({ex:.3f}, {ey:.3f})", key)
            if not a.kp_edge[j]:
                R.check("keypoint_visibility", (v == 0) == (ev == 0),
                        lambda: f"row {r} keypoint {j} at ({x:.3f}, {y:.3f}) has visibility {v}, documented {ev}", key)
            if marks is None or a.obj.keypoints is None:
                continue
            src = a.perm[j]
            if a.obj.keypoints[src, 2] == 0:
                continue
            if not (0 <= ex <= w and 0 <= ey <= h):
                continue   # out of the stored extent: its marker is cut (seed 140044: a left-edge keypoint at x = -1
                #            after a crop, its marker's kept part from x = 0)
            ys, xs = np.nonzero(marks[..., 0] == _marks_value(a.obj.index, src))
            if xs.size == 0:
                continue
            d = np.maximum(np.maximum(xs - x, x - (xs + 1)), np.maximum(ys - y, y - (ys + 1))).clip(0).min()
            R.check("keypoint_marker", d <= e + 1e-3,
                    lambda: f"row {r} keypoint {j} at ({x:.3f}, {y:.3f}) is {d:.3f} px from its marker "
                            f"{list(zip(xs.tolist(), ys.tolist()))[:3]} (tolerance {e:.2f})", key)
            if ch.exact:
                R.check("keypoint_visible_on_marker", v > 0,
                        lambda: f"row {r} keypoint {j} at ({x:.3f}, {y:.3f}) on its marker pixel "
                                f"{list(zip(xs.tolist(), ys.tolist()))[:2]} in a {w}x{h} image has visibility 0", key)


def is_rect(o: Any) -> bool:
    x1, y1, x2, y2 = o.box
    return int(o.raster.sum()) == (x2 - x1) * (y2 - y1)


def _marks_value(index: int, j: int) -> int:
    return 3 * (index - 1) + j + 1


def _check_ids_boxes(R: Report, key, s, rows: list[Ann], anns: list[Ann], ch: Chain, rec: dict) -> None:
    ids = s["ids"][..., 0]
    present = set(np.unique(ids).tolist())
    allowed = {_ids_value(rec, v) for v in [0, *range(1, MAX_OBJECTS + 1), CROWD_ID]}
    R.check("mask_values", present <= allowed, f"ids values {sorted(present - allowed)} were never painted", key)
    for r, a in enumerate(rows):
        v = _ids_value(rec, a.obj.index)
        got = extent(ids == v)
        b = np.asarray(s["boxes"][r], np.float64)
        sl = ch.ids_slack(is_rect(a.obj))
        if got is None:
            thin = min(b[2] - b[0], b[3] - b[1]) < 1 + 2 * sl.e
            R.check("pixel_truth", thin or sl.loose or (a.clipped and not is_rect(a.obj)),
                    lambda: f"row {r} box {fmt_box(b)} kept, but its object's pixels are gone", key)
            continue
        msg = box_vs_extent(b, got, Slack(sl.e, sl.loose or a.clipped))
        R.check("pixel_truth", msg is None, lambda: f"row {r}: {msg}", key)
    if ch.exact and all(m.min_visibility == m.min_area == m.min_width == m.min_height == 0 for m in ch.moves):
        kept = {id(a) for a in rows}
        for a in anns:
            if id(a) in kept or a.obj.crowd:
                continue
            n = int((ids == _ids_value(rec, a.obj.index)).sum())
            R.check("pixel_truth", n == 0, lambda: f"object {a.obj.index} shows {n} pixels but its box was dropped",
                    key)


def _coco_api(info: dict) -> Any:
    """pycocotools' COCO API over the written annotation file (parsed once per case)."""
    api = info["shared"].get("coco")
    if api is None:
        import contextlib
        import io as _io

        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(_io.StringIO()):
            api = info["shared"]["coco"] = COCO(info["shared"]["path"])
    return api


def _check_coco_reference(R: Report, key, s, case: dict, info: dict, ch: Chain) -> None:
    """With no step, the stored mask is pycocotools' annToMask of each kept annotation (file order), drawn by
    decreasing pixel count, crowd regions per the crowd policy (docs/coco.md), turned by the EXIF orientation."""
    import warnings

    coco = case["recipe"]["inputs"]["coco"]
    mode, crowd = coco.get("mask", "none"), coco.get("crowd", "drop")
    api = _coco_api(info)
    iid = info["image_id"]
    anns = [a for a in api.dataset["annotations"] if a["image_id"] == iid]
    m = s["mask"][..., 0].astype(np.int64)
    top = int(np.iinfo(s["mask"].dtype).max)
    want = np.zeros((info["im"]["H"], info["im"]["W"]), np.int64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"__array__ implementation doesn't accept a copy keyword", DeprecationWarning)
        if crowd == "ignore":
            for a in anns:
                if a["iscrowd"] and "segmentation" in a:
                    want[api.annToMask(a) > 0] = top
        kept = [a for a in anns if not a["iscrowd"] or crowd == "keep"]
        drawn = [(i, api.annToMask(a)) for i, a in enumerate(kept) if a.get("segmentation")]
    drawn.sort(key=lambda im: -int(np.count_nonzero(im[1])))
    for i, mk in drawn:
        want[mk > 0] = (CATEGORY_LABEL[kept[i]["category_id"]] + 1) if mode == "semantic" else i + 1
    want = exif_transpose(want.astype(np.uint16), ch_orientation(case, info)).astype(np.int64)
    if want.shape != m.shape:
        R.check("coco_reference", False, f"mask {m.shape} vs annToMask's {want.shape}", key)
        return
    bad = m != want
    R.check("coco_reference", not bad.any(), lambda: f"{int(bad.sum())} mask pixels differ from pycocotools' annToMask "
            f"(e.g. at {np.argwhere(bad)[:2].tolist()}: {m[bad][:2].tolist()} vs {want[bad][:2].tolist()})", key)


def ch_orientation(case: dict, info: dict) -> int:
    dec = case["recipe"]["inputs"]["fields"][(case["recipe"]["inputs"]["coco"] or {}).get("image", "image")]
    return info["im"]["orientation"] if dec.get("exif_transpose", True) else 1


def _check_mask(R: Report, key, s, rows: list[Ann], ch: Chain, rec: dict, coco: dict, info: dict, k: int) -> None:
    mode = coco.get("mask", "none")
    crowd = coco.get("crowd", "drop")
    m = s["mask"][..., 0].astype(np.int64)
    top = int(np.iinfo(s["mask"].dtype).max)
    n = len(rows)
    ids = s["ids"][..., 0] if "ids" in s else None
    sc = info["scene"]
    if mode == "instance":
        vals = set(np.unique(m).tolist()) - {0, top}
        R.check("instance_mask", vals <= set(range(1, n + 1)),
                lambda: f"mask holds ids {sorted(vals - set(range(1, n + 1)))} but there are {n} boxes", key)
        for r, a in enumerate(rows):
            mine = m == r + 1
            if a.obj.seg == "none" and not a.obj.crowd:
                R.check("instance_mask", not mine.any(), f"row {r} has no segmentation but mask == {r + 1} is drawn", key)
                continue
            if ids is None:
                continue
            t = ids == _ids_value(rec, a.obj.index)
            if k == 1:
                R.check("instance_mask", np.array_equal(mine, t),
                        lambda: f"mask == {r + 1} ({int(mine.sum())} px at {extent(mine)}) is not row {r}'s object "
                                f"({int(t.sum())} px at {extent(t)})", key)
            else:
                sl = Slack(ch.ids_slack().e + 1.0, ch.ids_slack().loose)
                got, want = extent(mine), extent(t)
                # a thin object (across, no more than the extents may differ by: 2 px, more after an upscale) may
                # vanish from one nearest-neighbour sampling and not the other: the mask samples the reduced grid,
                # the ids field the full-size one
                thin = lambda e: e is not None and (e[2:] - e[:2]).min() <= max(2.0, 2 * sl.e)   # noqa: E731
                ok = (got is None) == (want is None) or (got is None and thin(want)) or (want is None and thin(got))
                if got is not None and want is not None:
                    tol = 2 * sl.e + 1e-3
                    ok = np.abs(got - want).max() <= tol
                    if not ok and (thin(got) or thin(want)):
                        # a thin object sampled on two grids keeps other stretches of its length in each (seed
                        # 226033: 1/8 then resized nearest, a 2 px tall object kept x 7..10 in one, 3..9 in the
                        # other): one extent must lie within the other's
                        def inside(a, b):
                            return bool((a[:2] >= b[:2] - tol).all() and (a[2:] <= b[2:] + tol).all())
                        ok = inside(got, want) or inside(want, got)
                R.check("instance_mask", ok, lambda: f"mask == {r + 1} at {got} vs row {r}'s object at {want}", key)
    elif mode == "semantic" and ids is not None and k == 1:
        want = np.zeros_like(m)
        for o in sc.objects:
            if o.seg == "none":
                continue
            want[ids == _ids_value(rec, o.index)] = CATEGORY_LABEL[o.category] + 1
        if sc.crowd is not None and crowd != "drop":
            want[ids == _ids_value(rec, CROWD_ID)] = top if crowd == "ignore" else CATEGORY_LABEL[sc.crowd.category] + 1
        bad = m != want
        R.check("semantic_mask", not bad.any(),
                lambda: f"{int(bad.sum())} pixels differ from the painted classes, e.g. at "
                        f"{np.argwhere(bad)[:3].tolist()}: {m[bad][:3].tolist()} vs {want[bad][:3].tolist()}", key)
    if ids is not None and k == 1:
        bg = (ids == 0) & (m != 0)
        R.check("mask_background", not bg.any(),
                lambda: f"{int(bg.sum())} background pixels hold {np.unique(m[bg])[:5].tolist()}", key)
        if sc.crowd is not None and crowd == "ignore":
            t = ids == _ids_value(rec, CROWD_ID)
            R.check("crowd_ignore", np.array_equal(m == top, t), f"crowd pixels ({int(t.sum())}) are not the "
                    f"mask's {top} pixels ({int((m == top).sum())})", key)


def _check_folder(case, info, key, s, ch: Chain, R: Report, field, im, k) -> None:
    rec = case["recipe"]
    lab = rec["inputs"]["label"]
    lf = lab.get("field", "label")
    names = lab.get("classes") or sorted({x["label"] for x in case["inputs"]["images"]})
    R.check("label", int(s[lf]) == names.index(im["label"]), f"label {s[lf]} for class {im['label']!r} ({names})", key)
    ids = s["ids"][..., 0]
    sc = info["scene"]
    items = []
    for o in sc.objects:
        a = Ann(o, 0, np.asarray(o.box, np.float64), np.zeros((K, 3)), list(range(K)))
        pre = ref.Move("exif", ref.compose(ch.D, ch.E), ch.first, "none", 0.0)
        a.box = ref.move_box(a.box, pre).box
        follow([a], ch.moves)
        t = extent(ids == o.index)
        sl = ch.ids_slack(is_rect(o))
        if a.alive and not a.ambiguous and t is not None:
            msg = box_vs_extent(a.box, t, Slack(sl.e, sl.loose or a.clipped))
            R.check("pixel_truth", msg is None, lambda: f"object {o.index}: {msg}", key)
            items.append((o.colour, a.box, f"object {o.index}", a.clipped, is_rect(o)))
    _colour_check(R, key, s[field], ch, items, im, k, "object")


def _check_flow(case, info, key, s, ch: Chain, R: Report) -> None:
    flow = s["flow"]
    if "flow_valid" in s:
        R.check("flow_valid", np.array_equal(s["flow_valid"][..., 0] == 1, np.isfinite(flow).all(-1)),
                "flow_valid != isfinite(flow)", key)
    ids1, ids2 = s["ids1"][..., 0], s["ids2"][..., 0]
    occ = s["occ"][..., 0]
    inv = case["recipe"]["inputs"]["fields"]["occ"].get("invert", False)
    if not inv:
        R.check("flow_mask", np.array_equal(occ == 1, ids1 > 0), "flow_mask != (ids1 > 0)", key)
    else:
        R.check("flow_mask", not ((occ == 1) & (ids1 > 0)).any(), "inverted flow_mask set on an object pixel", key)
    h, w = ids1.shape
    e = ch.ids_slack().e
    for o in info["scene"].objects:
        if tuple(info["moves"][o.index]) == (99, 99):
            continue   # covered by another moved object, or partly out of the image: no single shift to judge
        a, b = ids1 == o.index, ids2 == o.index
        ea, eb = extent(a), extent(b)
        if ea is None or eb is None or a.sum() < 16 or abs(int(a.sum()) - int(b.sum())) > 0.2 * a.sum():
            continue
        if min(ea[0], eb[0], ea[1], eb[1]) <= 0 or max(ea[2], eb[2]) >= w or max(ea[3], eb[3]) >= h:
            continue
        inner = a.copy()   # the vectors inside the object (a resample blends its edge with the background's)
        inner[1:, :] &= a[:-1, :]
        inner[:-1, :] &= a[1:, :]
        inner[:, 1:] &= a[:, :-1]
        inner[:, :-1] &= a[:, 1:]
        f = flow[inner]
        f = f[np.isfinite(f).all(-1)]
        if len(f) < 3:
            continue
        ya, xa = np.nonzero(a)
        yb, xb = np.nonzero(b)
        shift = np.array([xb.mean() - xa.mean(), yb.mean() - ya.mean()])
        mean = np.median(f, axis=0)
        R.check("flow_truth", np.abs(shift - mean).max() <= 1.0 + 2 * e,
                lambda: f"object {o.index} moved {shift.round(2).tolist()} between the frames, its flow says "
                        f"{mean.round(2).tolist()} (tolerance {1 + 2 * e:.2f})", key)
    # (a non-rectangular object is judged as one: judged by luma one pixel in from its edge, a thin one may keep no
    # pixel of its colour: seed 125155, a 10-pixel RLE object cropped, gray16)
    _colour_check(R, key, s["img1"], ch, [(o.colour, b, f"object {o.index}", True, is_rect(o))
                                         for o in info["scene"].objects
                                         for b in [extent(ids1 == o.index)] if b is not None], info["im"], 1, "ids1",
                  ch.ids_slack().e)


# -- the family interface the runner calls ---------------------------------------------------------------------------
check_sample = check_sample_2d


def input_keys(case: dict, truth: dict) -> list[str]:
    return list(truth)


MIRRORS = (2, 4, 5, 7)


def _refusal(case: dict, im: dict, msg: str) -> bool:
    """docs/coco.md's refusals of one image: a short RLE (counts summing short of h x w), a non-finite keypoint,
    labelled keypoints on an image its EXIF orientation mirrors (which keypoints swap sides is not known)."""
    coco = case["recipe"]["inputs"]["coco"] or {}
    dec = case["recipe"]["inputs"]["fields"][coco.get("image", "image")]
    if case["inputs"].get("short_rle") and "RLE counts sum to" in msg:
        return True
    if case["inputs"].get("bad") == "nan_keypoint" and "keypoints are not finite" in msg:
        return True
    return bool(coco.get("keypoints")) and dec.get("exif_transpose", True) and im["orientation"] in MIRRORS \
        and f"EXIF orientation {im['orientation']} mirrors the image" in msg


def expected_failure(case: dict, f: dict, truth: dict) -> bool:
    """docs/coco.md: an image whose EXIF turn swaps its size fails as that input, naming the orientation; so does
    an image with an annotation the file refuses (:func:`_refusal`)."""
    info = truth.get(f.get("key"))
    if case["family"] != "coco" or info is None:
        return False
    im = info["im"]
    dec = case["recipe"]["inputs"]["fields"][(case["recipe"]["inputs"]["coco"] or {}).get("image", "image")]
    turned = im["orientation"] >= 5 and im["H"] != im["W"] and dec.get("exif_transpose", True)
    msg = f.get("message", "")
    return turned and "EXIF orientation" in msg or _refusal(case, im, msg)


def expected_error(case: dict, e: Any, truth: dict) -> Optional[str]:
    """A COCO file with a non-finite keypoint may be refused at plan time (naming the annotation); a build whose
    every input is an expected failure has nothing to write."""
    if e is None:
        return None
    if "every input failed" in str(e) and all(
            expected_failure(case, {"key": k, "message": "EXIF orientation"}, truth) for k in truth):
        return "every input is an EXIF-turned image of another size than the JSON says"
    if case["family"] == "coco" and case["inputs"].get("bad") == "nan_keypoint" and "keypoint" in str(e):
        return "a non-finite keypoint refused"
    if case["family"] == "coco" and any(_refusal(case, info["im"], str(e)) for info in truth.values()):
        return "an annotation the file refuses (on_error: fail stops the plan or the build)"
    return None
