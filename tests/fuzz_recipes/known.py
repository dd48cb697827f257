"""Defects being fixed elsewhere (issue 32): each id has a narrow predicate on the case and the oracles its
failures show in. A finding is excused only when a defect's predicate matches the case *and* the finding's
oracle is one of that defect's; anything else is a new finding. Remove an entry when its fix merges: the
cases it excused must then pass."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .oracles import Finding


@dataclass(frozen=True)
class Known:
    title: str
    oracles: frozenset
    applies: Callable[[dict], bool]
    #: why no kept case shows it every time (the entry still excuses it where it shows), or None
    flaky: str | None = None


def _steps(case: dict) -> list[tuple[str, dict]]:
    return [(n, p or {}) for s in case["recipe"].get("steps", []) for n, p in s.items()]


def _gpu(case: dict) -> list[tuple[str, dict]]:
    ld = case.get("loader") or {}
    return [(n, p or {}) for s in ld.get("gpu_steps", []) for n, p in s.items()]


def _coco(case: dict) -> dict:
    return case["recipe"]["inputs"].get("coco") or {}


def _image_dec(case: dict) -> dict:
    f = _coco(case).get("image", "image")
    return case["recipe"]["inputs"]["fields"].get(f, {})


def _drops_boxes(case: dict) -> bool:
    return any(n in ("center_crop", "random_crop", "random_resized_crop", "random_affine") and p.get("fields") != []
               for n, p in _steps(case)) or any(n == "random_crop" for n, _ in _gpu(case))


def _may_reduce(case: dict) -> bool:
    """A JPEG of a COCO case may be decoded at 1/k with a size not divisible by k."""
    r = _image_dec(case).get("reduce", "auto")
    if r is False or r == "off":
        return False
    ks = [r] if isinstance(r, int) else [2, 4, 8]
    imgs = [im for im in case["inputs"].get("images", []) if im["fmt"] == "jpg"]   # libjpeg's scaled decode
    if not isinstance(r, int) and not any(n in ("resize", "random_resized_crop") for n, _ in _steps(case)):
        return False
    return any(im["H"] % k or im["W"] % k for im in imgs for k in ks)


def _exif_turned(case: dict) -> bool:
    return _image_dec(case).get("exif_transpose", True) and any(
        im["orientation"] != 1 and (im["orientation"] < 5 or im["H"] == im["W"]) for im in case["inputs"]["images"])


def _edge_keypoint_mirrored(case: dict) -> bool:
    if not (_coco(case).get("keypoints") and any(im.get("edge_kp") for im in case["inputs"]["images"])):
        return False
    flips = [p for n, p in _steps(case) + _gpu(case) if n == "random_flip" and p.get("fields") != []
             and (p.get("horizontal", 0.5) > 0 or p.get("vertical", 0) > 0)]
    mirrored_exif = _image_dec(case).get("exif_transpose", True) and any(
        im.get("edge_kp") and im["orientation"] in (2, 3, 6, 7) for im in case["inputs"]["images"])
    return bool(flips) or mirrored_exif


def _clips(case: dict):
    return next((p for n, p in _steps(case) if n == "clips"), None)


def _has_uint16(case: dict) -> bool:
    fields = case["recipe"]["inputs"].get("fields", {})
    return _coco(case).get("mask") == "instance" or any(
        d.get("mode") == "gray16" or d.get("dtype") == "uint16" for d in fields.values()) or any(
        n == "convert" and p.get("mode") == "gray16" for n, p in _steps(case))


_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
_ANNOT = {"box_reference", "keypoint_reference", "pixel_truth", "keypoint_marker", "colour_truth", "instance_mask",
          "semantic_mask", "mask_background", "crowd_ignore", "keypoint_visibility", "keypoint_visible_on_marker",
          "coco_reference"}

KNOWN: dict[str, Known] = {
    "32.1": Known("instance-mask ids not renumbered when a step drops a box",
                  frozenset({"instance_mask", "loader_instance_mask"}),
                  lambda c: c["family"] == "coco" and _coco(c).get("mask") == "instance" and _drops_boxes(c)),
    "32.2": Known("Loader gpu_steps bound to the stored grid (a step after random_crop)",
                  frozenset({"loader_reference", "loader_crash", "loader_pixel_truth"}),
                  lambda c: any(n == "random_crop" for n, _ in _gpu(c)[:-1])),
    "32.6": Known("COCO coordinates off on a reduced decode at sizes not divisible by k",
                  frozenset({"box_reference", "keypoint_reference", "pixel_truth", "keypoint_marker", "colour_truth",
                             "instance_mask"}),
                  lambda c: c["family"] == "coco" and _may_reduce(c)),
    "32.7-exif": Known("COCO boxes not turned with a square or mirrored EXIF-oriented image",
                       frozenset(_ANNOT), lambda c: c["family"] == "coco" and _exif_turned(c)),
    "32.7-kp0": Known("a keypoint at x = 0 lands on x = W after a mirror and turns invisible",
                      frozenset({"keypoint_visible_on_marker", "loader_keypoint_visible"}), _edge_keypoint_mirrored),
    "32.7-pad": Known("ds.batch(pad=True) pads box_labels with 0, a real class",
                      frozenset({"batch_pad_labels"}), lambda c: c["family"] == "coco"),
    "32.7-cf": Known("Loader channels_first=True without dtype is ignored",
                     frozenset({"loader_convert"}),
                     lambda c: bool((c.get("loader") or {}).get("convert", {}).get("channels_first"))
                     and not (c.get("loader") or {}).get("convert", {}).get("dtype")),
    "32.3": Known("TSV tables read with CSV quoting",
                  frozenset({"table_rows", "table_cells", "inputs_accounted", "build_error", "split_rows", "labels",
                             "split_groups", "table_image", "loader_text"}),
                  lambda c: c["family"] == "table" and c["inputs"]["format"] in ("tsv", "tab")
                  and any(str(v).startswith('"') for row in c["inputs"]["rows"] for v in row.values())),
    "32.4": Known("CSV over 1 MiB with quoted cells spanning lines misparsed",
                  frozenset({"table_rows", "table_cells", "inputs_accounted", "build_error", "input_failure",
                             "split_rows"}),
                  lambda c: c["family"] == "table" and c["inputs"]["format"] == "csv" and c["inputs"].get("big")),
    "32.5": Known("JSON Lines strings that look like dates become timestamps",
                  frozenset({"table_cells", "labels", "table_rows", "inputs_accounted", "build_error", "split_rows"}),
                  lambda c: c["family"] == "table" and c["inputs"]["format"] == "jsonl"
                  and "when" in c["recipe"]["inputs"].get("columns", {})),
    "32.8": Known("a mixed-type JSON Lines column gives pyarrow's raw error",
                  frozenset({"error_message"}),
                  lambda c: c["family"] == "table" and c["inputs"]["format"] == "jsonl" and c["inputs"].get("mixed")),
    "32.rle": Known("COCO RLE counts that sum short of h*w leave uninitialised mask bytes",
                    frozenset({"mask_background", "crowd_ignore", "semantic_mask", "instance_mask", "coco_reference",
                               "j1_vs_j2"}),
                    lambda c: c["family"] == "coco" and c["inputs"].get("short_rle")
                    and _coco(c).get("mask", "none") != "none" and _coco(c).get("crowd", "drop") != "drop",
                    flaky="the bytes past a short RLE are whatever malloc returns: zeros in every build on the test "
                          "machine (pycocotools' decode after freeing non-zero buffers shows them every time)"),
    "32.nonfinite": Known("non-finite COCO keypoints stored",
                          frozenset({"finite", "keypoint_reference", "keypoint_visibility", "keypoint_marker",
                                     "keypoint_visible_on_marker", "loader_reference"}),
                          lambda c: c["family"] == "coco" and c["inputs"].get("bad") == "nan_keypoint"),
}


# -- new findings of this fuzzer (not yet fixed): the same narrow predicates, reported as "new finding" --------------
NEW: dict[str, Known] = {
    "N1": Known("new finding: a COCO recipe with a sibling planar field (a mask or depth PNG via a path template) "
                "fails every input the image decoder reduces ('planar fields differ in size ... which one do the "
                "boxes annotate?'), though reduce: auto is the default and docs/coco.md shows such fields",
                frozenset({"input_failure", "build_error", "inputs_accounted"}),
                lambda c: c["family"] == "coco" and len(c["recipe"]["inputs"]["fields"]) > 1
                and (isinstance(_image_dec(c).get("reduce", "auto"), int) and _image_dec(c).get("reduce") is not False
                     or _image_dec(c).get("reduce", "auto") == "auto"
                     and any(im["fmt"] == "jpg" for im in c["inputs"]["images"])
                     and any(n in ("resize", "random_resized_crop") for n, _ in _steps(c)))),
    "N2": Known("new finding: the Loader's device random_flip raises NotImplementedError ('flip_cpu' not "
                "implemented for 'UInt16') on a uint16 field: every COCO instance mask, a gray16 image, a uint16 mask",
                frozenset({"loader_dtype"}),
                lambda c: any(n == "random_flip" for n, _ in _gpu(c)) and _has_uint16(c)),
    "N4": Known("new finding: temporal_jitter after clips cut by time (fps) with a fixed audio_rate cuts the clip's "
                "audio to the kept frames' span but leaves its planned fixed length: the write stage fails the input "
                "('shape (1, 640) differs from the declared (1, 1280)')",
                frozenset({"build_error", "input_failure", "inputs_accounted"}),
                lambda c: c["family"] == "video" and (_clips(c) or {}).get("fps") is not None
                and c["recipe"]["inputs"]["fields"]["video"].get("audio_rate") is not None
                and any(n == "temporal_jitter" for n, _ in _steps(c))),
    "N6": Known("new finding: a streamed video cut by frame clips with short: pad and pad: last pads with the last "
                "frame it read, not the video's last frame, when a seek skipped the rest (12 frames, decoder every 3, "
                "clips length 4 every 2: streamed [0, 6, 6, 6], decoded whole [0, 6, 9, 9])",
                frozenset({"frame_truth", "index_field", "stream_vs_whole"}),
                lambda c: c["family"] == "video" and (_clips(c) or {}).get("short") == "pad"
                and (_clips(c) or {}).get("pad", "last") == "last" and (_clips(c) or {}).get("fps") is None),
    "N7": Known("new finding: a streamed video cut by clips ignores the decoder's max_frames where it seeks or cuts "
                "by time: it cuts clips from frames past it (time clips: max_frames 8 at 25 fps gives a clip of frame "
                "10; frame clips of length 1 every 4 frames, max_frames 7: a clip of frame 8); decoded whole: none",
                frozenset({"clip_count", "frame_truth", "index_field", "stream_vs_whole", "audio_truth"}),
                lambda c: c["family"] == "video" and _clips(c) is not None
                and c["recipe"]["inputs"]["fields"]["video"].get("max_frames") is not None),
}
KNOWN.update(NEW)


def excuse(case: dict, findings: list[Finding], with_new: bool = True) -> tuple[list[Finding], list[str]]:
    """(the findings no known defect excuses, the ids of those that excused some); ``with_new=False``: only the
    issue's defects excuse (a kept case of a new finding must still show it)."""
    live = {k: v for k, v in KNOWN.items() if _safe(v, case) and (with_new or k not in NEW)}
    new, used = [], set()
    for f in findings:
        hit = [k for k, v in live.items() if f.oracle in v.oracles]
        if hit:
            used.update(hit)
        else:
            new.append(f)
    return new, sorted(used)


def _safe(k: Known, case: dict) -> bool:
    try:
        return bool(k.applies(case))
    except (KeyError, TypeError, IndexError):
        return False
