"""Reduced-scale JPEG decoding: which 1/2, 1/4 or 1/8 scale the steps after a decoder allow.

A JPEG can be decoded directly at 1/2, 1/4 or 1/8 of its size from its DCT
coefficients (libjpeg's scaled IDCT, Pillow's ``Image.draft``), several times
faster than a full decode. With ``reduce: auto`` (the image decoder's default)
the recipe works out, before anything is decoded, what the steps that follow
ask of the decoded image, and each JPEG is decoded at the smallest scale that
still satisfies it.

The rule. Only the *first* step that resamples the field matters: everything
after it works on that step's output, whose size does not depend on the
decode scale, so no later step can use detail the first resample threw away.
That first step must be

- ``resize`` (``size``, ``shorter``, ``longer``, ``keep_aspect``) with
  ``interpolation`` ``auto`` or ``area``: it asks for its target (h, w);
- ``random_resized_crop`` (``auto``/``area``) acting on this field alone:
  its smallest possible window, ``scale[0]`` of the area at the extreme
  ``ratio`` (the narrowest and the shortest window), is resized to ``size``,
  so the reduced image must carry that window at ``SAFETY`` x ``size``.
  Every copy shares one decode per input at the scale its smallest crop needs.

and only steps that commute with scaling may come before it (``convert``,
``random_flip``, and steps that do not touch the field). Anything else before
the first resample (a crop in source pixels, colour or noise steps, a step
this module does not know) or no resample at all means full decoding.

A scale 1/k is chosen, largest k first, when the reduced image
(ceil(H/k), ceil(W/k)) -- in displayed orientation, so EXIF orientations 5-8
swap the axes -- is at least ``SAFETY`` times what the step asks for along both
axes, and, for a ``resize`` whose target follows the aspect ratio, gives the
very same target size as the full image (so output shapes never change).

Tolerance (measured, ``benchmarks/bench_quiet_defects.py``, ``benchmarks/bench_decode.py``
and the tests): with ``SAFETY = 2`` the output after the resize is 47-57 dB PSNR from the
full-decode output on photo-like content, at sizes divisible by k or not (before the
geometry fix below, 37-45 dB at sizes not divisible by k); adversarial content stays
above about 42 dB for white noise and 30 dB for 1-pixel lines every 7 pixels.
``reduce: off`` decodes at full size; ``reduce: 2 | 4 | 8`` forces a scale.

Geometry. libjpeg's 1/k decode of a W x H JPEG has ceil(W/k) x ceil(H/k) pixels
covering k*ceil(W/k) x k*ceil(H/k) source pixels (it pads whole blocks past the right
and bottom edges); the source is its part (0, 0, W/k, H/k). Where the first step on
the field is a ``resize`` that can sample from that part (``SourceNeed.fold``: see
:func:`fold_reason`), the decoder leaves libjpeg's pixels as they are and records the
part in the field's meta (``extent``), and the resize samples from it in one resample
(the exact area average). Otherwise the image decoder resamples the part back to the
whole reduced grid, so a reduced image covers exactly the source, as a full decode
does. Either way a field decoded at another scale (a PNG mask, ``reduce: off``)
stays aligned to about 0.02 output pixels after the resize (0.2 before issue 27, at
1001 px and k = 4). Sizes divisible by k need nothing and are left alone.

CMYK JPEGs are decoded whole under ``auto`` (see the image decoder).

The rule (``describe``) and ``SAFETY`` are part of the recipe key, and the
per-file choice is a pure function of the rule and the file's header (its size
and orientation), which the input fingerprint covers, so the shard key changes
whenever the scale choice can.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

SAFETY = 2.0          # the reduced image keeps >= SAFETY x the pixels the first resample asks for
SCALES = (8, 4, 2)    # libjpeg's power-of-two scaled IDCTs, largest reduction first
RULE_VERSION = 2      # bump when the rule or the reduced bytes change: it is part of the recipe key
# (2: a reduced image covers exactly the source at sizes not divisible by k, see image._cover_source)
FOLD_VERSION = 1      # in the key of the recipes whose first resample takes the source's extent (the bytes
#                       of their images at sizes not divisible by k; see ``fold_reason``)

# steps that may run before the first resample without changing what it needs:
# per-pixel format changes and flips commute with scaling, and draw nothing from the size
_TRANSPARENT = frozenset({"convert", "random_flip"})
_AREA = ("auto", "area")


def reduced_size(h: int, w: int, k: int) -> tuple[int, int]:
    """The size libjpeg decodes an h x w image to at scale 1/k (rounded up)."""
    return -(-h // k), -(-w // k)


@dataclass(frozen=True)
class SourceNeed:
    """What the first resampling step after a decoder asks of the decoded image.

    ``step`` is ``"resize"`` or ``"random_resized_crop"``; ``index`` its position in
    ``steps``; ``target`` the step object (read for its sizes, never run).
    """

    step: str
    index: int
    target: Any
    fold: bool = False   # the step takes the source's extent (H/k x W/k) and resamples from it (see FOLD)

    def asks(self, H: int, W: int) -> tuple[float, float, Optional[tuple[int, int]]]:
        """For a displayed H x W source: the (rows, columns) of source pixels the step's output
        needs at least, and the exact target size when it follows the source's aspect ratio."""
        p = self.target.params
        if self.step == "resize":
            h, w = self.target.target_size(H, W)
            aspect = p.shorter is not None or p.longer is not None or p.keep_aspect
            return float(h), float(w), ((h, w) if aspect else None)
        # random_resized_crop: the smallest window that can be drawn, scaled up to the output size
        h_out, w_out = p.size
        area = p.scale[0] * H * W
        win_h = min(H, math.sqrt(area / p.ratio[1]))   # widest ratio gives the shortest window
        win_w = min(W, math.sqrt(area * p.ratio[0]))   # tallest ratio gives the narrowest window
        return h_out * H / win_h, w_out * W / win_w, None

    def scale_for(self, H: int, W: int) -> int:
        """The largest k in 8, 4, 2 (else 1) at which a displayed H x W source still satisfies the step."""
        need_h, need_w, exact = self.asks(H, W)
        for k in SCALES:
            h, w = reduced_size(H, W, k)
            if h < SAFETY * need_h or w < SAFETY * need_w:
                continue
            try:
                if exact is not None and tuple(self.target.target_size(h, w)) != exact:
                    continue  # rounding would change the resize's output size: keep geometry identical
            except ValueError:   # the reduced image's output would pass the largest side where the source's does not
                continue
            return k
        return 1

    def describe(self) -> dict[str, Any]:
        """JSON for the recipe key: the rule's version, its safety factor and the step it follows."""
        out = {"rule": RULE_VERSION, "safety": SAFETY, "step": self.step, "index": self.index,
               "params": self.target.params.model_dump(mode="json")}
        if self.fold:
            out["fold"] = FOLD_VERSION
        return out


def source_need(field: str, recipe: Any) -> tuple[Optional[SourceNeed], str]:
    """The need of ``field`` (an image decoder's output) under ``recipe``'s steps, or None and why."""
    from ..errors import PrecompileError

    from ..sample import link_fields

    specs: dict[str, Any] = {}
    try:  # the specs the steps will see, as make_plan builds them
        for fname, dec in recipe.decoders.items():
            specs.update(dec.output_specs(fname))
        links = link_fields({f: sp.kind for f, sp in specs.items()}, {f: sp.of for f, sp in specs.items() if sp.of})
        specs = {f: sp.with_(of=links[f]) if f in links else sp for f, sp in specs.items()}
    except (ValueError, PrecompileError):
        return None, "the decoders' specs are not valid"
    moved = None   # the first step before the resample that moves the field's pixels (a flip)
    for i, step in enumerate(recipe.steps):
        try:
            targets = step.targets(specs)
            nxt = step.plan(specs)
        except (ValueError, TypeError, PrecompileError):
            return None, f"steps[{i}] {step.name} does not plan"  # make_plan reports it
        if field in targets:
            p = step.params
            if step.name == "resize":
                if p.interpolation not in _AREA:
                    return None, f"steps[{i}] resize uses interpolation {p.interpolation!r} (needs auto or area)"
                fold = fold_reason(recipe, specs, p, moved) is None
                return SourceNeed("resize", i, step, fold), f"steps[{i}] resize"
            if step.name == "random_resized_crop":
                if p.interpolation not in _AREA:
                    return None, (f"steps[{i}] random_resized_crop uses interpolation {p.interpolation!r} "
                                  f"(needs auto or area)")
                if list(targets) != [field]:
                    return None, f"steps[{i}] random_resized_crop draws one window for several fields"
                return SourceNeed("random_resized_crop", i, step), f"steps[{i}] random_resized_crop"
            if step.name not in _TRANSPARENT:
                return None, f"steps[{i}] {step.name} works on source pixels before any resize"
            if step.name != "convert" and moved is None:
                moved = f"steps[{i}] {step.name}"
        specs = nxt
        if field not in specs:
            return None, f"steps[{i}] {step.name} removes the field"
    return None, "no step resizes the field"


def fold_reason(recipe: Any, specs: dict[str, Any], params: Any, moved: Optional[str]) -> Optional[str]:
    """Why the first ``resize`` (``params``) cannot take a reduced decode's source extent, or None when it
    can. It can unless a step before it moves the pixels (a flip would put libjpeg's padding on the other
    side), it is the approximate ``fast`` resize (which resamples the whole grid), annotations are
    scaled onto the decoded grid (COCO inputs: they assume the grid covers the source), or the sample has a
    video field (its steps may run in the build's streamed path, which this hand-over is not checked in)."""
    from ..kinds import ANNOTATIONS, Kind

    if moved is not None:
        return f"{moved} moves the pixels before the resize"
    if getattr(params, "fast", False):
        return "the resize is fast: true"
    if getattr(getattr(getattr(recipe, "model", None), "inputs", None), "coco", None) is not None or \
            any(sp.kind in ANNOTATIONS for sp in specs.values()):
        return "annotations are scaled onto the decoded grid"
    if any(sp.kind is Kind.VIDEO for sp in specs.values()):
        return "the sample has a video field"
    return None


def configure(recipe: Any) -> None:
    """Give every image decoder with ``reduce: auto`` its :class:`SourceNeed` (or None)."""
    for fname, dec in recipe.decoders.items():
        if getattr(dec, "name", None) == "image" and getattr(dec.params, "reduce", "off") == "auto":
            dec.need, dec.need_reason = source_need(fname, recipe)


def explain(recipe: Any) -> dict[str, str]:
    """One line per image field on how its JPEGs will be decoded (for ``precompile plan``)."""
    out = {}
    for fname, dec in recipe.decoders.items():
        if getattr(dec, "name", None) != "image":
            continue
        r = dec.params.reduce
        if r == "off":
            out[fname] = "full size (reduce: off)"
        elif isinstance(r, int):
            out[fname] = f"1/{r} scale for every input (reduce: {r})"
        elif dec.need is not None:
            out[fname] = (f"JPEG at 1/2, 1/4 or 1/8 per file where {dec.need_reason} keeps >= {SAFETY:g}x "
                          f"the pixels it asks for (reduce: auto)")
        else:
            out[fname] = f"full size: {dec.need_reason} (reduce: auto)"
    return out


def key_parts(recipe: Any) -> dict[str, Any]:
    """The decode-scale rules of ``recipe``'s image fields with ``reduce: auto`` or a fixed
    ``2 | 4 | 8``, for the recipe key (the rule's version names how reduced bytes are made)."""
    out: dict[str, Any] = {}
    for fname, dec in recipe.decoders.items():
        if getattr(dec, "name", None) != "image":
            continue
        r = getattr(dec.params, "reduce", "off")
        if r == "auto":
            need = getattr(dec, "need", None)
            out[fname] = need.describe() if need is not None else {"rule": RULE_VERSION, "step": None}
        elif isinstance(r, int):
            out[fname] = {"rule": RULE_VERSION, "fixed": r}
    return out
