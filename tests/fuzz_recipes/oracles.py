"""Checks of a built output against the truth its inputs carry. Each failure is a :class:`Finding` naming its
oracle; tolerances are derived from what the chain did (see :class:`Slack`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import reference as ref
from .truth import K, LUMA, PALETTE


@dataclass
class Finding:
    oracle: str
    message: str
    key: Optional[str] = None

    def __str__(self) -> str:
        return f"[{self.oracle}] {self.key + ': ' if self.key else ''}{self.message}"


class Report:
    """The findings of one case (bounded: the first few per oracle)."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.checks = 0
        self.per_oracle: dict[str, int] = {}

    def check(self, oracle: str, ok: Any, message: Any, key: Optional[str] = None) -> bool:
        self.checks += 1
        self.per_oracle[oracle] = self.per_oracle.get(oracle, 0) + 1
        if not ok:
            if sum(f.oracle == oracle for f in self.findings) < 4:
                self.findings.append(Finding(oracle, message() if callable(message) else str(message), key))
            return False
        return True

    @property
    def oracles(self) -> set[str]:
        return {f.oracle for f in self.findings}


def extent(mask: np.ndarray) -> Optional[np.ndarray]:
    ys, xs = np.nonzero(mask)
    if ys.size == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)


def fmt_box(b: Any) -> str:
    return "[" + ", ".join(f"{float(v):.3f}" for v in b) + "]"


# -- tolerance ----------------------------------------------------------------------------------------------------
@dataclass
class Slack:
    """How far a pixel-truth extent may be from the exact box: ``e`` output px per axis while the truth is tight
    (exact moves keep it, a nearest resample scales it and adds half an output pixel, a blurring one adds
    ``blur``), or, once a warp turned the object, ``loose``: the truth only lies inside the box, ``e`` outside."""
    e: float = 0.0
    loose: bool = False

    def after(self, m: ref.Move, blur: float) -> "Slack":
        if m.resample == "none":
            return Slack(self.e, self.loose)
        s = max(m.scale)
        return Slack(self.e * s + blur, self.loose or m.resample == "affine")


def box_vs_extent(got: np.ndarray, truth: Optional[np.ndarray], sl: Slack) -> Optional[str]:
    """None when the pixel extent ``truth`` agrees with the box ``got`` under ``sl``, else why not."""
    tol = sl.e + 1e-3
    if truth is None:
        return None
    if sl.loose:
        if (truth[:2] >= got[:2] - tol).all() and (truth[2:] <= got[2:] + tol).all():
            return None
        return f"pixels {fmt_box(truth)} outside the box {fmt_box(got)} (slack {tol:.2f})"
    if np.abs(truth - got).max() <= tol:
        return None
    return f"box {fmt_box(got)} vs its pixels {fmt_box(truth)} (tolerance {tol:.2f} px)"


# -- colour classification ----------------------------------------------------------------------------------------
def colour_mask(img: np.ndarray, colour: int, by_luma: bool = False) -> np.ndarray:
    """Pixels confidently of palette colour ``colour``: RGB(A) within 60 of it (a blend with the background or
    any other colour is >= 100 away); grey (8 or 16 bit), or any JPEG (whose chroma is subsampled: judged by
    luma), within 12 of its luma, with all 4 neighbours too (a blend of a brighter colour with black can take
    this luma, but only on a ramp), so never on the image's border, where a ramp along the edge has no neighbour
    across it (seed 211007: a green corner blended with a rotation's black fill, [2, 96, 0], read as red)."""
    if img.shape[-1] >= 3 and not by_luma:
        d = np.linalg.norm(img[..., :3].astype(np.float64) - PALETTE[colour].astype(np.float64), axis=-1)
        return d < 60
    if img.shape[-1] >= 3:
        g = img[..., :3].astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    else:
        g = img[..., 0].astype(np.float64)
    if img.dtype == np.uint16:
        g = g / 257.0
    ok = np.abs(g - LUMA[colour]) < 12
    inner = ok.copy()
    inner[1:, :] &= ok[:-1, :]
    inner[:-1, :] &= ok[1:, :]
    inner[:, 1:] &= ok[:, :-1]
    inner[:, :-1] &= ok[:, 1:]
    inner[[0, -1], :] = False
    inner[:, [0, -1]] = False
    return inner


# -- the 2D annotation reference ------------------------------------------------------------------------------------
@dataclass
class Ann:
    """One annotation of the source, followed through the chain."""
    obj: Any                 # truth.Obj
    label: int
    box: np.ndarray          # current box (float64)
    kp: np.ndarray           # (K, 3) current keypoints
    perm: list               # stored keypoint j is source keypoint perm[j]
    alive: bool = True
    ambiguous: bool = False
    kp_edge: np.ndarray = field(default_factory=lambda: np.zeros(K, bool))   # exactly on the right/bottom edge
    clipped: bool = False    # clipped by some step: its pixels only lie inside the box


def on_edge(kp: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Keypoints within float noise of an edge of the h x w extent (any of the four: a turn or a mirror computed
    in floats may leave 0 as -1e-15 or W as W + 1e-15), where in view or not is the noise's to decide."""
    h, w = hw
    x, y = kp[:, 0], kp[:, 1]
    return (np.abs(x - w) < 1e-6) | (np.abs(y - h) < 1e-6) | (np.abs(x) < 1e-6) | (np.abs(y) < 1e-6)


def follow(anns: list[Ann], moves: list[ref.Move]) -> None:
    for m in moves:
        pairs = (m.params or {}).get("pairs", [])
        for a in anns:
            if not a.alive:
                continue
            b = ref.move_box(a.box, m)
            a.ambiguous |= b.ambiguous
            a.clipped |= b.clipped
            a.alive = b.kept
            a.box = b.box
            a.kp = ref.move_keypoints(a.kp, m, pairs)
            a.kp_edge = on_edge(a.kp, m.hw) | (a.kp_edge & (m.resample == "none") & np.ones(K, bool))
            if m.name == "random_flip" and ref.mirrors(m.M):
                for x, y in pairs:
                    a.perm[x], a.perm[y] = a.perm[y], a.perm[x]


def match_rows(got: np.ndarray, anns: list[Ann], tol: float, labels: Optional[np.ndarray] = None) -> Optional[list[Ann]]:
    """The annotation each stored row is, in order: every unambiguous survivor must be there, an ambiguous one
    (a keep decision within float noise of its threshold at some step) may be, with coordinates that need not
    match (a box kept by a hair can come out anywhere after a later rotation); None when the rows cannot be
    matched."""
    cands = [a for a in anns if a.alive or a.ambiguous]
    out: list[Ann] = []
    j = 0
    for r, row in enumerate(got):
        row = row.astype(np.float64)
        lab = None if labels is None else int(labels[r])
        hit = None
        while j < len(cands):
            a = cands[j]
            j += 1
            if np.abs(row - a.box).max() <= tol:
                hit = a
                break
            if a.ambiguous:
                later = [b for b in cands[j:] if np.abs(row - b.box).max() <= tol]
                if not later and (lab is None or lab == a.label):
                    hit = a          # this row is the ambiguous box, kept by the code
                    break
                continue             # dropped by the code; the row is a later one
            return None              # an unambiguous survivor is missing
        if hit is None:
            return None
        out.append(hit)
    if any(a.alive and not a.ambiguous for a in cands[j:]):
        return None
    return out


def close(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) if np.size(a) else 0.0


def box_tol(v: Any) -> float:
    return 2e-3 + 4e-6 * float(np.abs(np.asarray(v, np.float64)).max(initial=0))
