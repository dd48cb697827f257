"""The Loader's random device steps with annotations, attacked from outside (issue 35): a real build whose pixels
carry their own annotations, read with ``gpu_steps``, each batch checked against truths the code does not compute.

The build (``_pixel_truth_test``, tests/pixel_truth_decoder.py): 48x64 images with up to 12 solid rectangles on a
black background, object ``L`` painted in ``COLOURS[L]`` with id ``L + 1`` in a uint16 instance mask tied to the
boxes, class ``1 + L % 3`` in a semantic mask (not tied), label ``L`` (so a kept row names its source object),
keypoints at the centres of its top-left, top-right and middle pixels (visibility 2, 2, 1), and a flow field whose
vectors are a known linear function of the pixel, ``(0.1 x + 1, 0.05 y - 2)``. Sample 0 has no objects.

What each batch is held to, per sample ``j`` with the map ``m`` that ``Loader.batch_maps`` reports (batch pixels
back to stored pixels, plain numpy here):

- every kept keypoint, mapped back by ``m``, lands on its source keypoint (the flip pairs swapped where ``m``
  mirrors); its visibility is the source's while it is on the output image (edges included), else 0;
- a single geometric step's box is the source box's corners sent forward (``m`` inverted), enclosed and clipped;
  the boxes kept are exactly those the documented filters keep (visible fraction, area, width, height computed
  here from the mapped box);
- the instance mask, resampled nearest: each output pixel whose centre is not on a source pixel edge holds the
  id (renumbered to its row) of the source pixel under its centre, 0 for an object whose box was dropped; the
  semantic mask agrees with it; with nearest images, the object's pixels are exactly its colour;
- the flow: ``J F(p)``, ``p`` the centre mapped back, ``J`` the forward map's linear part, where the resampling
  taps stay inside the window (a linear field is resampled exactly by linear taps; area taps and nearest move it by
  a bounded amount);
- counts and padding.

Then the joins (threads, prefetch, in_memory, resume, ranks, targets="list", conversion) must give the same bytes,
and the fused chain (Triton's interpreter on the CPU) must equal the eager chain on hostile windows.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import precompile
from precompile import Loader
from precompile import build as run_build
from precompile.reader.ragged import count_name
from precompile.transforms.kernels import maps as M

from pixel_truth_decoder import K  # noqa: F401  (registers the decoder; a build's workers import that module)

H, W = 48, 64
COLOURS = np.array([((60 + 41 * i) % 256, (250 - 23 * i) % 256, (90 + 13 * i) % 256) for i in range(12)], np.uint8)
PAIRS = [[0, 1]]


def _flow_truth(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The stored flow at pixel index coordinates (x, y): a linear field (pixel (r, c) holds it at x=c, y=r)."""
    return np.stack([x * 0.1 + 1, y * 0.05 - 2], -1)


def make_inputs(root: str, n: int = 10) -> None:
    rng = np.random.default_rng(5)
    os.makedirs(os.path.join(root, "a"), exist_ok=True)
    ch, cw = H // 3, W // 4
    for k in range(n):
        image = np.zeros((H, W, 3), np.uint8)
        inst = np.zeros((H, W, 1), np.uint16)
        sem = np.zeros((H, W, 1), np.uint8)
        boxes, kps = [], []
        for cy in range(3):
            for cx in range(4):
                if k == 0 or rng.random() < 0.3:
                    continue
                h, w = int(rng.integers(4, ch - 1)), int(rng.integers(4, cw - 1))
                y1, x1 = cy * ch + int(rng.integers(0, ch - h + 1)), cx * cw + int(rng.integers(0, cw - w + 1))
                i = len(boxes)
                image[y1:y1 + h, x1:x1 + w], inst[y1:y1 + h, x1:x1 + w] = COLOURS[i], i + 1
                sem[y1:y1 + h, x1:x1 + w] = 1 + i % 3
                boxes.append([x1, y1, x1 + w, y1 + h])
                kps.append([[x1 + 0.5, y1 + 0.5, 2], [x1 + w - 0.5, y1 + 0.5, 2], [x1 + w // 2 + 0.5, y1 + h // 2 + 0.5, 1]])
        ys, xs = np.mgrid[0:H, 0:W].astype(np.float32)
        np.savez(os.path.join(root, "a", f"s{k}.npz"), image=image, instances=inst, semantic=sem,
                 flow=_flow_truth(xs, ys).astype(np.float32), boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
                 box_labels=np.arange(len(boxes), dtype=np.int64), keypoints=np.asarray(kps, np.float32).reshape(-1, 3, 3))


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pixel_truth")
    make_inputs(str(tmp / "in"))
    r = {"name": "pt", "seed": 1, "inputs": {"root": str(tmp / "in"), "match": "{label}/{name}.npz",
                                             "fields": {"image": {"decoder": "_pixel_truth_test"}}},
         "steps": [{"resize": {"size": [H, W], "interpolation": "nearest"}}],   # a fixed shape for the Loader
         "output": {"format": "hdf5", "samples_per_shard": 4}}
    path = run_build(r, out_dir=str(tmp / "out"))["output"]
    ds = precompile.open(path)
    src = [ds[i] for i in range(len(ds))]
    for s in src:   # the build kept the painted truth as it was made
        for L, (x1, y1, x2, y2) in enumerate(s["boxes"].astype(int)):
            assert (s["image"][y1:y2, x1:x2] == COLOURS[L]).all() and (s["instances"][y1:y2, x1:x2] == L + 1).all()
    return path, src


def _fwd(m: np.ndarray, pts: np.ndarray) -> np.ndarray:
    return pts @ m[:, :2].T + m[:, 2]


def _moved_box(box: np.ndarray, inv: np.ndarray, hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The source box's corners sent forward, enclosed (unclipped) and clipped to the output image."""
    x1, y1, x2, y2 = (float(v) for v in box)
    c = _fwd(inv, np.array([[x1, y1], [x2, y1], [x1, y2], [x2, y2]]))
    moved = np.array([c[:, 0].min(), c[:, 1].min(), c[:, 0].max(), c[:, 1].max()])
    h, w = hw
    return moved, moved.clip([0, 0, 0, 0], [w, h, w, h])


def _kept(src: dict, inv: np.ndarray, hw: tuple[int, int], f: dict) -> list[int]:
    """The source rows the documented filters keep (docs/annotations.md): nothing visible is dropped; then the
    visible fraction, the clipped area, width and height against min_visibility, min_area, min_width,
    min_height (inclusive, 1e-9 slack)."""
    out = []
    for L, box in enumerate(src["boxes"]):
        moved, cl = _moved_box(box, inv, hw)
        cw, chh = cl[2] - cl[0], cl[3] - cl[1]
        c32 = cl.astype(np.float32)   # nothing visible: decided on the box as stored (a hair of float64 width is none)
        if c32[2] <= c32[0] or c32[3] <= c32[1]:
            continue
        area = (moved[2] - moved[0]) * (moved[3] - moved[1])
        if (cw * chh / area + 1e-9 < f.get("min_visibility", 0) or cw * chh + 1e-9 < f.get("min_area", 0)
                or cw + 1e-9 < f.get("min_width", 0) or chh + 1e-9 < f.get("min_height", 0)):
            continue
        out.append(L)
    return out


def check_batch(loader, epoch: int, b: int, batch: dict, src: list, *, single: dict | None = None,
                exact: bool = False, flow_tol: float = 0.0, mask_reach: float = 0.0) -> list[str]:
    """Every truth of the module docstring for one batch; returns the failures (empty: all hold).
    ``single``: the options of the one geometric step (its box formula and filters checked); ``exact``: nearest
    resampling (object pixels exactly their colour); ``flow_tol``: the resampling's bound on a linear flow;
    ``mask_reach``: a chain's nearest steps each round to a pixel: a mask pixel may hold the id found within
    ``mask_reach`` times half a source pixel plus half an output pixel of its centre (0: exactly the one under it)."""
    rows, maps = loader.batch_maps(b, epoch)
    errs: list[str] = []
    assert len(rows) == batch["image"].shape[0]
    for j, i in enumerate(rows):
        s, m = src[int(i)], maps[j]
        inv = M.invert(m)
        msg = f"epoch {epoch} batch {b} sample {j} (row {i})"
        n = int(batch[count_name("boxes")][j])
        for f in ("box_labels", "keypoints"):
            if int(batch[count_name(f)][j]) != n:
                errs.append(f"{msg}: {f}__count {int(batch[count_name(f)][j])} != boxes__count {n}")
        if not (np.isnan(batch["boxes"][j, n:].numpy()).all() and (batch["box_labels"][j, n:] == -1).all()):
            errs.append(f"{msg}: rows past the count are not padding")
        boxes = batch["boxes"][j, :n].numpy()
        labels = batch["box_labels"][j, :n].numpy()
        kps = batch["keypoints"][j, :n].numpy()
        img, inst = batch["image"][j].numpy(), batch["instances"][j].numpy()[..., 0].astype(np.int64)
        sem, flow = batch["semantic"][j].numpy()[..., 0], batch["flow"][j].numpy()
        h, w = inst.shape
        if len(set(labels.tolist())) != n:
            errs.append(f"{msg}: labels {labels} name an object twice")
        if single is not None:
            want = _kept(s, inv, (h, w), single)
            if labels.tolist() != want:
                errs.append(f"{msg}: kept objects {labels.tolist()}, the filters keep {want}")
        mirrored = np.linalg.det(m[:, :2]) < 0
        for r, L in enumerate(labels):
            skp = s["keypoints"][L].copy()
            if mirrored:
                for a, c in PAIRS:
                    skp[[a, c]] = skp[[c, a]]
            back = _fwd(m, kps[r, :, :2].astype(np.float64))
            if not np.allclose(back, skp[:, :2], atol=1e-3):
                errs.append(f"{msg}: keypoints of object {L} map back to {back.tolist()}, not {skp[:, :2].tolist()}")
            if single is not None:
                for (x, y, v), sv in zip(kps[r], skp[:, 2]):
                    want_v = sv if (0 <= x <= w and 0 <= y <= h) else 0
                    if v != want_v:
                        errs.append(f"{msg}: keypoint ({x}, {y}) of object {L} has visibility {v}, not {want_v}")
                moved, cl = _moved_box(s["boxes"][L], inv, (h, w))
                if not np.allclose(boxes[r], cl, atol=1e-3):
                    errs.append(f"{msg}: box of object {L} is {boxes[r].tolist()}, the moved box {cl.tolist()}")
            ys, xs = np.nonzero(inst == r + 1)
            if len(xs) and (xs.min() < boxes[r, 0] - 1 or xs.max() + 1 > boxes[r, 2] + 1
                            or ys.min() < boxes[r, 1] - 1 or ys.max() + 1 > boxes[r, 3] + 1):
                errs.append(f"{msg}: mask of row {r} reaches past its box {boxes[r].tolist()}")
            if len(xs) and not (sem[ys, xs] == 1 + L % 3).all():
                errs.append(f"{msg}: the semantic mask disagrees with the instance mask of object {L}")
            if exact and len(xs) and not (img[ys, xs] == COLOURS[L]).all():
                errs.append(f"{msg}: pixels of object {L}'s mask are not its colour")
        if not set(np.unique(inst).tolist()) <= set(range(n + 1)):
            errs.append(f"{msg}: mask ids {sorted(set(np.unique(inst).tolist()))} for {n} boxes")
        # every pixel through the map
        yy, xx = np.mgrid[0:h, 0:w]
        p = _fwd(m, np.stack([xx.ravel() + 0.5, yy.ravel() + 0.5], 1).astype(np.float64))
        sx, sy = np.floor(p[:, 0]).astype(int), np.floor(p[:, 1]).astype(int)
        on = (sx >= 0) & (sx < W) & (sy >= 0) & (sy < H)
        clear = on & (np.abs(p - np.round(p)) > 1e-6).all(1)   # a centre on a pixel edge may take either side
        row_of = np.zeros(len(s["boxes"]) + 1, np.int64)
        row_of[labels + 1] = np.arange(1, n + 1)   # renumbered; a dropped object's pixels are background

        def ids_at(pts: np.ndarray) -> np.ndarray:
            ix, iy = np.floor(pts[:, 0]).astype(int), np.floor(pts[:, 1]).astype(int)
            inside = (ix >= 0) & (ix < W) & (iy >= 0) & (iy < H)
            out = np.zeros(len(pts), np.int64)
            out[inside] = s["instances"][iy[inside], ix[inside], 0]
            return row_of[out]

        got_id = inst.ravel()
        ok = got_id == ids_at(p)
        if mask_reach:   # a chain rounds to the nearest pixel once per step: the id of a source pixel within reach
            d = mask_reach * (0.5 + 0.5 * np.abs(m[:, :2]).sum(1))
            for dx in np.linspace(-d[0], d[0], 9):   # every source pixel within reach (steps under half a pixel)
                for dy in np.linspace(-d[1], d[1], 9):
                    ok |= got_id == ids_at(p + [dx, dy])
        # where the flow is NaN a step padded or left the pixel uncovered (a chain's middle step too): mask 0 there
        covered = np.isfinite(flow.reshape(-1, 2)).all(1)
        bad = int((~ok & clear & covered).sum()) + int((got_id[~covered] != 0).sum())
        if bad:
            errs.append(f"{msg}: {bad} of {int(clear.sum())} instance-mask pixels differ from the source under their "
                        f"centres")
        q = p - 0.5
        corners = _fwd(m, np.array([[0, 0], [w, 0], [0, h], [w, h]], np.float64)) - 0.5
        lo, hi = np.maximum(corners.min(0), 0), np.minimum(corners.max(0), [W - 1, H - 1])
        reach = 1 + np.abs(m[:, :2]).sum(1)    # a tap reaches about one source pixel per output pixel
        inner = (q >= lo + reach).all(1) & (q <= hi - reach).all(1)
        want_f = _flow_truth(q[:, 0], q[:, 1]) @ inv[:, :2].T
        if single is None:   # a chain's middle step leaves holes (NaN) inside the composed window: the rest holds
            inner &= np.isfinite(flow.reshape(-1, 2)).all(1)
        d = np.abs(flow.reshape(-1, 2)[inner] - want_f[inner])
        tol = 2e-3 * (1 + np.abs(want_f[inner])) + flow_tol * max(1.0, float(np.abs(inv[:, :2]).sum()))
        if inner.any() and not (d <= tol).all():
            errs.append(f"{msg}: flow off its vectors by {float(np.nanmax(d))}")
    return errs


def _run(path, src, steps, epochs=(0, 1), **check) -> list[str]:
    loader = Loader(path, batch_size=4, shuffle=True, seed=3, device="cpu", gpu_steps=steps, num_threads=0)
    errs: list[str] = []
    for e in epochs:
        loader.set_epoch(e)
        for b, batch in enumerate(loader):
            errs += check_batch(loader, e, b, batch, src, **check)
    return errs


#: (step, nearest images, the flow's resampling bound in source-pixel units of the field (0.1 per pixel))
SINGLE = {
    "flip": ({"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}}, True, 0.0),
    "crop-padding": ({"random_crop": {"size": [30, 40], "padding": 5, "min_visibility": 0.5, "min_area": 12,
                                      "min_width": 3, "min_height": 2}}, True, 0.0),
    "crop-pad-larger": ({"random_crop": {"size": [60, 70], "pad": True}}, True, 0.0),
    "rrc-nearest": ({"random_resized_crop": {"size": [24, 40], "scale": [0.1, 1], "interpolation": "nearest",
                                             "min_visibility": 0.6, "min_area": 30}}, True, 0.01),
    "rrc-nearest-up": ({"random_resized_crop": {"size": [96, 80], "scale": [0.1, 1], "interpolation": "nearest"}},
                       True, 0.0),
    "rrc-auto": ({"random_resized_crop": {"size": [24, 40], "scale": [0.1, 1], "min_width": 4, "min_height": 3}},
                 False, 0.01),
    "affine-nearest": ({"random_affine": {"degrees": 40, "scale": [0.6, 1.4], "translate": 0.25,
                                          "interpolation": "nearest", "min_visibility": 0.5, "min_width": 3}},
                       True, 0.06),
    "affine-linear": ({"random_affine": {"degrees": 30, "scale": [0.7, 1.3], "translate": 0.2,
                                         "min_area": 25}}, False, 0.0),
    "affine-extreme": ({"random_affine": {"degrees": 180, "scale": [0.05, 3.0], "translate": 1.0,
                                          "interpolation": "nearest", "min_visibility": 0.2}}, True, 0.1),
    "rrc-thin-windows": ({"random_resized_crop": {"size": [100, 3], "scale": [0.9, 1.0], "ratio": [0.01, 0.02]}},
                         False, 0.1),
    "rrc-tiny-windows": ({"random_resized_crop": {"size": [7, 3], "scale": [0.01, 0.02], "ratio": [0.1, 10],
                                                  "interpolation": "nearest"}}, True, 0.1),
    "crop-1x1": ({"random_crop": {"size": [1, 1]}}, True, 0.0),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_each_geometric_step_moves_every_annotation_onto_its_pixels(truth, name):
    path, src = truth
    step, exact, flow_tol = SINGLE[name]
    errs = _run(path, src, [step], single=next(iter(step.values())), exact=exact, flow_tol=flow_tol)
    assert not errs, "\n".join(errs[:10])


CHAINS = {
    "rrc-flip-affine-crop": [
        {"random_resized_crop": {"size": [40, 40], "scale": [0.3, 1], "interpolation": "nearest",
                                 "min_visibility": 0.3}},
        {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}},
        {"random_affine": {"degrees": 15, "translate": 0.1, "interpolation": "nearest"}},
        {"random_crop": {"size": [32, 36], "padding": 2}}],
    "values-between-moves": [
        {"color_jitter": {"brightness": 0.5, "contrast": 0.5, "saturation": 0.5, "hue": 0.5}},
        {"random_resized_crop": {"size": [30, 30], "scale": [0.2, 1], "interpolation": "nearest",
                                 "min_visibility": 0.3}},
        {"random_erasing": {"p": 1.0}}, {"gaussian_blur": {"kernel_size": 3}}, {"random_grayscale": {"p": 0.5}},
        {"random_flip": {"horizontal": 0.5, "flip_pairs": PAIRS}}],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_chains_keep_annotations_masks_and_flow_on_the_reported_map(truth, name):
    """A chain: keypoints map back exactly through batch_maps, masks follow the composed map but for the repeated
    nearest rounding of each step (an id from within a pixel of the centre), flow by the nearest bound; a keypoint that left
    the image in one step stays at visibility 0 (so visibility is not checked against the last grid only)."""
    path, src = truth
    errs = _run(path, src, CHAINS[name], mask_reach=2, flow_tol=0.1)
    assert not errs, "\n".join(errs[:10])


def test_value_steps_keep_annotations_masks_and_flat_regions(truth):
    """Colour steps move nothing: boxes, keypoints, masks and flow are the stored ones, and each object's pixels,
    one colour in the source, are still one colour after jitter (hue included) and grayscale."""
    path, src = truth
    steps = [{"color_jitter": {"brightness": 0.6, "contrast": 0.6, "saturation": 0.6, "hue": 0.5}},
             {"random_grayscale": {"p": 0.5}}]
    kw = dict(batch_size=4, shuffle=True, seed=3, device="cpu", num_threads=0)
    plain = list(Loader(path, **kw))
    jittered = Loader(path, gpu_steps=steps, **kw)
    changed = 0
    for b, (got, want) in enumerate(zip(jittered, plain)):
        for f in want:
            if f != "image":
                torch.testing.assert_close(got[f], want[f], rtol=0, atol=0, equal_nan=True, msg=f"batch {b} {f}")
        for j in range(len(got["image"])):
            img, inst = got["image"][j].numpy(), got["instances"][j].numpy()[..., 0]
            for r in range(int(got[count_name("boxes")][j])):
                colours = np.unique(img[inst == r + 1].reshape(-1, 3), axis=0)
                assert len(colours) == 1, f"batch {b} sample {j} object {r}: {len(colours)} colours"
            changed += int(not np.array_equal(img, want["image"][j].numpy()))
        assert not check_batch(jittered, 0, b, got, src)
    assert changed > 0


# -- joins: the same bytes whatever the threads, prefetch, memory, resume point --------------------------------------
JOIN_STEPS = [{"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.3}},
              {"random_resized_crop": {"size": [30, 36], "scale": [0.2, 1], "min_visibility": 0.4}},
              {"random_flip": {"horizontal": 0.5, "vertical": 0.3, "flip_pairs": PAIRS}},
              {"random_affine": {"degrees": 20, "translate": 0.1, "min_visibility": 0.3}},
              {"random_grayscale": {"p": 0.3}}, {"gaussian_blur": {"kernel_size": [3, 5]}},
              {"random_erasing": {"p": 0.5}}]


def _batches(path, epochs=(0, 1), **kw) -> list[dict]:
    kw = {"batch_size": 3, "seed": 7, "device": "cpu", "gpu_steps": JOIN_STEPS, "shuffle": True, **kw}
    loader = Loader(path, **kw)
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [dict(b) for b in loader]
    return out


def _assert_same(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want), what
    for b, (x, y) in enumerate(zip(got, want)):
        assert x.keys() == y.keys(), what
        for k in x:
            if isinstance(x[k], torch.Tensor):
                torch.testing.assert_close(x[k], y[k], rtol=0, atol=0, equal_nan=True, msg=f"{what}: batch {b} {k}")


def test_joins_give_the_same_batches_and_resume_mid_epoch(truth):
    path, src = truth
    base = _batches(path, num_threads=0)
    for kw in (dict(num_threads=2), dict(num_threads=2, prefetch=1), dict(num_threads=1, prefetch=4),
               dict(in_memory=True, num_threads=2)):
        _assert_same(_batches(path, **kw), base, str(kw))
    loader = Loader(path, batch_size=3, seed=7, device="cpu", gpu_steps=JOIN_STEPS, num_threads=2)
    loader.set_epoch(1)
    it = iter(loader)
    first = [dict(next(it)), dict(next(it))]
    state = loader.state_dict()
    del it
    again = Loader(path, batch_size=3, seed=7, device="cpu", gpu_steps=JOIN_STEPS, num_threads=1, in_memory=True)
    again.load_state_dict(state)
    again.set_epoch(1)   # the usual loop: keeps the restored position
    nb = len(loader)
    _assert_same(first + [dict(b) for b in again], base[nb:], "resumed")
    assert not all(torch.equal(a["image"], b["image"]) for a, b in zip(base[:nb], base[nb:]))   # epochs draw anew


@pytest.mark.parametrize("shuffle", [False, True])
def test_rank_shares_keep_the_truth_and_draw_apart(truth, shuffle):
    """world_size 3: each rank's batches (in_memory holding only its share when shuffle is off) keep every truth,
    the shares are disjoint (uneven='drop': 3 rows each of 10), and the ranks draw their own parameters."""
    path, src = truth
    steps = [{"random_resized_crop": {"size": [30, 30], "scale": [0.3, 1], "interpolation": "nearest",
                                      "min_visibility": 0.3}},
             {"random_flip": {"horizontal": 0.5, "flip_pairs": PAIRS}}]
    seen, maps = [], []
    for rank in range(3):
        for in_memory in (False, True):
            loader = Loader(path, batch_size=2, seed=4, device="cpu", gpu_steps=steps, shuffle=shuffle, rank=rank,
                            world_size=3, in_memory=in_memory, num_threads=1, uneven="drop")
            errs = []
            for b, batch in enumerate(loader):
                errs += check_batch(loader, 0, b, batch, src, exact=True, flow_tol=0.01)
            assert not errs, "\n".join(errs[:10])
        seen += [int(i) for rows in loader.batch_indices(0) for i in rows]
        maps.append(loader.batch_maps(0, 0)[1])
    assert len(seen) == len(set(seen)) == 9 and set(seen) <= set(range(10))   # 10 rows, 3 each, one dropped
    assert not np.allclose(maps[0], maps[1]) and not np.allclose(maps[1], maps[2])


@pytest.mark.parametrize("extra", [{}, {"dtype": "float32", "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.3, 0.25],
                                        "channels_first": True}])
def test_targets_list_equals_the_padded_batch_cut_to_its_counts(truth, extra):
    path, src = truth
    padded = _batches(path, num_threads=0, **extra)
    listed = _batches(path, num_threads=2, targets="list", **extra)
    assert len(padded) == len(listed)
    for b, (p, t) in enumerate(zip(padded, listed)):
        assert not {"boxes", "box_labels", "keypoints", count_name("boxes")} & set(t)
        torch.testing.assert_close(t["image"], p["image"], rtol=0, atol=0)
        assert t["image"].stride() == p["image"].stride()
        torch.testing.assert_close(t["instances"], p["instances"], rtol=0, atol=0)
        assert len(t["targets"]) == len(p["image"])
        for j, d in enumerate(t["targets"]):
            n = int(p[count_name("boxes")][j])
            assert set(d) == {"boxes", "labels", "keypoints", "masks"}
            torch.testing.assert_close(d["boxes"], p["boxes"][j, :n], rtol=0, atol=0)
            torch.testing.assert_close(d["labels"], p["box_labels"][j, :n], rtol=0, atol=0)
            torch.testing.assert_close(d["keypoints"], p["keypoints"][j, :n], rtol=0, atol=0)
            ids = p["instances"][j, ..., 0].long()
            want = torch.stack([(ids == r + 1) for r in range(n)]).to(torch.uint8) if n else \
                torch.zeros((0, *ids.shape), dtype=torch.uint8)
            torch.testing.assert_close(d["masks"], want, rtol=0, atol=0)


def test_the_device_steps_table_names_every_option_each_step_takes():
    """docs/reference-reader.md's device-step table: its options column lists exactly the options each step's
    parser accepts (``fields`` aside: every step takes it). The box filters of random_resized_crop and
    random_affine work on the device (test_each_geometric_step_moves_every_annotation_onto_its_pixels holds them to
    the documented rule), so a table without them tells users they do not exist."""
    import re
    from pathlib import Path

    from precompile.reader import augment

    text = (Path(__file__).resolve().parents[1] / "docs" / "reference-reader.md").read_text()
    section = text.split("### Device steps (`gpu_steps`)", 1)[1]
    table = next(b for b in section.split("\n\n") if b.startswith("| step |"))
    listed = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        listed[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cells[1])))
    for name, cls in augment.STEP_NAMES.items():
        params = getattr(cls, "Params", None) or cls.STEP.Params
        assert listed.get(name) == set(params.model_fields) - {"fields"}, name


def test_a_mix_keeps_the_truth_through_its_reported_maps(truth, tmp_path):
    """precompile.Mix with the same device chain over two copies of the build: each sample, from whichever build,
    keeps every truth through the map ``mix.batch_maps`` reports (in_memory and a rank share too)."""
    import shutil

    path, src = truth
    other = tmp_path / "copy"
    shutil.copytree(os.path.dirname(path), other)

    class Maps:   # the Mix's (sources, rows, maps) as check_batch reads a Loader's (rows, maps)
        def __init__(self, mix):
            self.mix = mix

        def batch_maps(self, b, epoch):
            _, rows, maps = self.mix.batch_maps(b, epoch)
            return rows, maps

    for kw in ({"in_memory": True, "num_threads": 2}, {"rank": 1, "world_size": 2}):
        mix = precompile.Mix([path, str(other / os.path.basename(path))], batch_size=3, seed=2, device="cpu",
                             gpu_steps=CHAINS["rrc-flip-affine-crop"], **kw)
        errs: list[str] = []
        sources = set()
        for e in (1,):
            mix.set_epoch(e)
            for b, batch in enumerate(mix):
                errs += check_batch(Maps(mix), e, b, batch, src, mask_reach=2, flow_tol=0.1)
                sources |= set(batch["__source"].tolist())
        assert not errs, f"{kw}: " + "\n".join(errs[:10])
        assert sources == {0, 1}


def test_a_misspelt_device_step_option_or_name_gets_a_did_you_mean(truth):
    """A recipe's misspelt step option says ``unknown key; did you mean 'scale'?``; the same step as a device
    step said only pydantic's ``Extra inputs are not permitted``. Now both name the close options (and a
    misspelt step name the close device steps), and a key with nothing close lists the options there are."""
    path, _ = truth
    cases = [({"random_resized_crop": {"size": 10, "scael": [0.1, 1]}},
              "random_resized_crop: scael: unknown option; did you mean 'scale'?"),
             ({"random_resized_crop": {"size": 10, "min_visibilty": 0.4}},
              "random_resized_crop: min_visibilty: unknown option; did you mean 'min_visibility'"),
             ({"color_jitter": {"brightnes": 0.2}}, "color_jitter: brightnes: unknown option; did you mean "
                                                    "'brightness'?"),
             ({"random_flip": {"zzz": 1}}, "random_flip: zzz: unknown option (options: fields, horizontal, "
                                           "vertical, flip_pairs)"),
             ({"random_resized_cop": {"size": 10}}, "gpu_steps[0]: 'random_resized_cop' is unknown; did you mean "
                                                    "'random_resized_crop'")]
    cases.append(({"random_flip": {1: 0.5}}, "gpu_steps[0].random_flip: option names are strings, got 1"))
    for step, message in cases:
        with pytest.raises(ValueError) as e:
            Loader(path, batch_size=2, device="cpu", gpu_steps=[step])
        assert str(e.value).startswith(message), str(e.value)


def test_numbers_that_are_not_whole_are_refused_not_truncated(truth):
    """``world_size=2.5`` read a share of 2 ranks, ``seed=1.5`` drew seed 1's batches and steps, ``batch_size=2.5``
    gave batches of 2, ``set_epoch(1.5)`` epoch 1: int() truncated them without a word. A whole number written
    as a float (4.0, from a config file) or a numpy integer still works, and gives the int's batches."""
    path, _ = truth
    kw = dict(batch_size=4, device="cpu", num_threads=0, gpu_steps=[{"random_erasing": {"p": 1.0}}])
    for bad, name in (({"world_size": 2.5, "rank": 0}, "world_size"), ({"rank": 0.5, "world_size": 2}, "rank"),
                      ({"seed": 1.5}, "seed"), ({"batch_size": 2.5}, "batch_size"), ({"prefetch": 1.5}, "prefetch"),
                      ({"num_threads": 1.5}, "num_threads"), ({"seed": "3"}, "seed"), ({"batch_size": True}, "batch_size")):
        with pytest.raises(ValueError, match=f"^{name} must be a whole number, got "):
            Loader(path, **{**kw, **bad})
    loader = Loader(path, **kw)
    with pytest.raises(ValueError, match=r"^epoch must be a whole number, got 1\.5"):
        loader.set_epoch(1.5)
    want = [b["image"] for b in Loader(path, **{**kw, "seed": 3})]
    got = [b["image"] for b in Loader(path, **{**kw, "seed": 3.0, "batch_size": np.int64(4), "prefetch": 2.0})]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def bad_box_build(tmp_path_factory):
    """Four 20x30 samples whose sample s2's box 1 has x2 < x1 in the stored bytes. A build now refuses such a
    box (formats.base.check_annotations: test_a_build_refuses_bad_stored_annotations); builds made before that
    check, with no step, stored it: the shard's bytes are changed here after a build of good boxes."""
    import glob

    import h5py

    tmp = tmp_path_factory.mktemp("bad_box")
    os.makedirs(tmp / "in" / "a")
    for k in range(4):
        boxes = np.array([[0, 0, 6, 6], [20, 10, 28, 18]], np.float32)
        np.savez(tmp / "in" / "a" / f"s{k}.npz", image=np.zeros((20, 30, 3), np.uint8),
                 instances=np.zeros((20, 30, 1), np.uint16), semantic=np.zeros((20, 30, 1), np.uint8),
                 flow=np.zeros((20, 30, 2), np.float32), boxes=boxes, box_labels=np.arange(2),
                 keypoints=np.zeros((2, 3, 3), np.float32))
    r = {"name": "bad", "seed": 1, "inputs": {"root": str(tmp / "in"), "match": "{label}/{name}.npz",
                                              "fields": {"image": {"decoder": "_pixel_truth_fixed_test"}}},
         "steps": [], "output": {"format": "hdf5", "samples_per_shard": 4}}
    out = run_build(r, out_dir=str(tmp / "out"))["output"]
    row = precompile.open(out).keys.index("a/s2.npz")
    shard, = glob.glob(str(tmp / "out" / "bad.shards" / "*.h5"))
    with h5py.File(shard, "r+") as h:
        start = int(h["boxes/offsets"][row]) + 4          # box 1 of the sample: (x1, y1, x2, y2) after box 0
        h["boxes/data"][start:start + 4] = np.array([28, 10, 20, 18], np.float32)
    return out


@pytest.mark.parametrize("step", [{"random_crop": {"size": [10, 10]}}, {"random_flip": {"flip_pairs": []}}])
def test_a_bad_stored_box_is_an_error_naming_the_build_sample_step_and_row(bad_box_build, step):
    """A device step meeting a stored box with x2 < x1 said only ``box 5 [28.0, 10.0, 20.0, 18.0] has x2 < x1 or
    y2 < y1``: 5 counted the rows of the whole batch, and neither the build, the sample, the step nor the field
    was named. Now: the build, the dataset row and key, the batch, the step, the field and the box's row in its
    own sample."""
    from precompile.errors import FormatError

    ds = precompile.open(bad_box_build)
    row = ds.keys.index("a/s2.npz")
    name = next(iter(step))
    for threads in (0, 2):
        loader = Loader(bad_box_build, batch_size=4, shuffle=False, device="cpu", gpu_steps=[step],
                        num_threads=threads)
        with pytest.raises(FormatError) as e:
            list(loader)
        assert str(e.value).startswith(
            f"{bad_box_build}: row {row} ('a/s2.npz'), sample 2 of batch 0 of epoch 0: {name}: field 'boxes': "
            f"box 1 [28.0, 10.0, 20.0, 18.0] has x2 < x1 or y2 < y1"), str(e.value)


def test_clips_uint16_and_float_images_move_with_the_uint8_image(truth, tmp_path):
    """The same rows built again as a uint16 image (x 257), a float32 image (/ 255) and a 3-frame clip (frame t:
    the painted pixels darkened by 40 t) beside the same annotations: under nearest geometric steps every field
    is the uint8 build's image moved the same way (the clip frame by frame), and the annotations are the same
    bytes; under linear ones, within a level of it."""
    path, _ = truth
    r = {"name": "deep", "seed": 1, "inputs": {"root": str(tmp_path / "in"), "match": "{label}/{name}.npz",
                                               "fields": {"image": {"decoder": "_pixel_truth_deep_test"}}},
         "steps": [{"resize": {"size": [H, W], "interpolation": "nearest"}}],
         "output": {"format": "hdf5", "samples_per_shard": 4}}
    make_inputs(str(tmp_path / "in"))
    deep = run_build(r, out_dir=str(tmp_path / "out"))["output"]
    notes = ("boxes", "box_labels", "keypoints", "instances")
    for steps, levels in (([{"random_resized_crop": {"size": [24, 40], "scale": [0.2, 1], "interpolation": "nearest",
                                                     "min_visibility": 0.4}},
                            {"random_flip": {"horizontal": 0.5, "vertical": 0.5, "flip_pairs": PAIRS}},
                            {"random_affine": {"degrees": 30, "translate": 0.2, "interpolation": "nearest",
                                               "min_visibility": 0.4}}], 0),
                          ([{"random_resized_crop": {"size": [24, 40], "scale": [0.2, 1]}},
                            {"random_affine": {"degrees": 30, "translate": 0.2}}], 1)):
        kw = dict(batch_size=4, seed=2, shuffle=False, device="cpu", gpu_steps=steps, num_threads=0)
        got = list(Loader(deep, **kw))
        want = list(Loader(path, fields=["image", *notes], **kw))
        assert len(got) == len(want)
        for b, (g, w) in enumerate(zip(got, want)):
            for f in notes:
                torch.testing.assert_close(g[f], w[f], rtol=0, atol=0, equal_nan=True, msg=f"batch {b} {f}")
            u8 = w["image"].numpy().astype(np.float64)
            assert g["image"].dtype == torch.uint16 and g["imagef"].dtype == torch.float32
            assert np.abs(g["image"].numpy().astype(np.float64) / 257 - u8).max() <= levels, f"batch {b} uint16"
            assert np.abs(g["imagef"].numpy().astype(np.float64) * 255 - u8).max() <= levels + 1e-3, f"batch {b} f32"
            if levels == 0:
                for t in range(3):
                    frame = np.where((u8 != 0).any(-1, keepdims=True), np.clip(u8 - 40 * t, 1, 255), 0)
                    np.testing.assert_array_equal(g["clip"][:, t].numpy(), frame, err_msg=f"batch {b} frame {t}")


def test_gpu_steps_that_are_not_a_list_say_so(truth):
    """``gpu_steps="random_flip"`` said ``gpu_steps[0]: ... got 'r'`` (its first letter), and a mapping given for
    the list ``gpu_steps[0]: ... got 'random_flip'``: both now say a list of steps is wanted."""
    path, _ = truth
    for steps, what in (("random_flip", "a str"), ({"random_flip": {}}, "a dict")):
        with pytest.raises(ValueError, match=rf"^gpu_steps must be a list of steps, one mapping each "
                                             rf"\(\[\{{'random_flip': \{{\.\.\.\}}\}}, \.\.\.\]\), got {what}"):
            Loader(path, batch_size=2, device="cpu", gpu_steps=steps)
