"""3D steps that permute, flip or shift voxel axes carry the geometry in meta along.

Reference: every voxel's patient position computed from the *input* meta (origin + index x
spacing x direction), moved with numpy's own ``rot90`` / ``flip`` / slicing; the output meta must
predict the moved positions for every output voxel. Issue 27: ``random_rot90`` used to keep
the spacing of the unturned volume.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precompile.registry import STEPS, load_builtins
from precompile.sample import Sample
from precompile.seeding import rng_for
from precompile.transforms.kernels.volume import voxel_map

load_builtins()


def step(name: str, **params):
    cls = STEPS.get(name)
    return cls(cls.Params.model_validate(params))


def oblique_meta(shape, spacing, seed: int) -> dict:
    """DICOM/NIfTI-style geometry (orientation = direction cosines of W, H, D) with an oblique rotation."""
    r = np.random.default_rng(seed)
    q, _ = np.linalg.qr(r.standard_normal((3, 3)))
    w, h, d = q[:, 0], q[:, 1], q[:, 2]
    return {"spacing": [float(s) for s in spacing], "spacing_rcs": [float(spacing[1]), float(spacing[2]), float(spacing[0])],
            "orientation": [[round(float(x), 7) for x in v] for v in (w, h, d)],
            "origin": [round(float(x), 5) for x in r.uniform(-200, 200, 3)],
            "axis_directions": ["S", "P", "L"], "shape": [int(n) for n in shape]}


def positions(meta: dict, shape) -> np.ndarray:
    """(D, H, W, 3) patient position of every voxel, from the meta alone."""
    sp = np.asarray(meta["spacing"], float)
    ori = np.asarray(meta["orientation"], float)
    dirs = np.stack([ori[2], ori[1], ori[0]])          # directions of D, H, W
    idx = np.indices(shape).reshape(3, -1).T.astype(float)
    return (np.asarray(meta["origin"], float) + (idx * sp) @ dirs).reshape(*shape, 3)


def volume_sample(shape, meta) -> Sample:
    vol = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    mask = (vol.astype(np.int64) % 7 == 0).astype(np.uint8)
    return Sample("v", {"ct": vol, "lung": mask}, {"ct": "volume", "lung": "volume_mask"},
                  meta={"ct": meta, "lung": dict(meta)})


def check_moved(out: Sample, before: dict, move) -> None:
    """``move`` is what numpy does to an array; the output meta must place every voxel where
    the same move puts its old position, for the volume and its mask."""
    for f in ("ct", "lung"):
        m = out.meta[f]
        want = move(positions(before, tuple(before["shape"])))
        assert list(want.shape[:3]) == m["shape"] == list(out.fields[f].shape)
        np.testing.assert_allclose(positions(m, out.fields[f].shape), want, atol=2e-3)
        assert m["spacing_rcs"] == [m["spacing"][1], m["spacing"][2], m["spacing"][0]]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 5), d=st.integers(2, 5), k=st.integers(0, 3),
       plane=st.sampled_from([[0, 1], [1, 2], [0, 2], [2, 1], [1, 0]]),
       sp=st.lists(st.sampled_from([0.5, 0.8, 0.9, 1.25, 2.5, 3.0]), min_size=3, max_size=3),
       seed=st.integers(0, 1000))
def test_rot90_carries_spacing_origin_and_direction(n, d, k, plane, sp, seed):
    shape = [d, d, d]
    free = ({0, 1, 2} - set(plane)).pop()
    shape[free] = n                          # the turned plane is square (odd k needs it)
    before = oblique_meta(shape, sp, seed)
    s = step("random_rot90", planes=[plane], k=[k])
    out = s.replay(volume_sample(tuple(shape), before), {"plane": plane, "k": k})
    move = lambda a: np.rot90(a, k, axes=tuple(plane))  # noqa: E731
    np.testing.assert_array_equal(out.fields["ct"], move(volume_sample(tuple(shape), before).fields["ct"]))
    check_moved(out, before, move)
    # the spacing vector is permuted like the axes: numpy's rot90 of a diag(spacing) matrix
    # restricted to the plane swaps the two spacings for odd k
    want = list(sp)
    if k % 2:
        want[plane[0]], want[plane[1]] = want[plane[1]], want[plane[0]]
    assert out.meta["ct"]["spacing"] == want


def test_issue_example_quarter_turn_in_yx_swaps_row_and_column_spacing():
    before = oblique_meta((4, 6, 6), [2.5, 0.9, 0.8], 0)
    out = step("random_rot90").replay(volume_sample((4, 6, 6), before), {"plane": [1, 2], "k": 1})
    assert out.meta["ct"]["spacing"] == [2.5, 0.8, 0.9]
    assert out.meta["ct"]["axis_directions"] == ["S", "R", "P"]   # H runs against old W (L), W along old H (P)


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=3, max_size=3), axes=st.sets(st.integers(0, 2)),
       seed=st.integers(0, 1000))
def test_flip3d_carries_origin_and_direction(shape, axes, seed):
    before = oblique_meta(shape, [2.0, 0.7, 0.6], seed)
    axes = sorted(axes)
    out = step("random_flip3d").replay(volume_sample(tuple(shape), before), {"axes": axes})
    check_moved(out, before, lambda a: np.flip(a, axis=tuple(axes)) if axes else a)
    assert out.meta["ct"]["spacing"] == [2.0, 0.7, 0.6]


def test_random_draws_go_through_the_same_carry():
    """run (random draws) and run_original both record the params and move the meta."""
    before = oblique_meta((5, 5, 5), [3.0, 1.0, 0.5], 3)
    s = step("random_rot90", planes=[[0, 1], [0, 2], [1, 2]], k=[1, 3])
    for c in range(8):
        (out,) = s.run(volume_sample((5, 5, 5), before), rng_for(0, "v", c))
        rec = out.meta["augment"][-1]
        check_moved(out, before, lambda a: np.rot90(a, rec["k"], axes=tuple(rec["plane"])))
    (orig,) = s.run_original(volume_sample((5, 5, 5), before))
    assert orig.meta["ct"] == {**before, "shape": [5, 5, 5]}


@pytest.mark.parametrize("plane", [[0, 1], [1, 2], [0, 2]])
def test_turn_then_resample_gives_the_physical_shape(plane):
    """A volume spanning (60, 15, 22) mm: after a quarter turn the turned axes swap extents, and
    resampling to 1 mm gives that many voxels per axis (the issue's example is plane [0, 1])."""
    extent = [60.0, 15.0, 22.0]
    shape = [12, 12, 12]
    free = ({0, 1, 2} - set(plane)).pop()
    shape[free] = 10                      # the turned plane square, the other axis not
    sp = [e / n for e, n in zip(extent, shape)]
    s = volume_sample(tuple(shape), oblique_meta(shape, sp, 1))
    turned = step("random_rot90", planes=[plane], k=[1]).replay(s, {"plane": plane, "k": 1})
    (res,) = step("resample_volume", spacing=[1.0, 1.0, 1.0]).run(turned, rng_for(0, "v"))
    want = [60, 15, 22]
    want[plane[0]], want[plane[1]] = want[plane[1]], want[plane[0]]
    assert list(res.fields["ct"].shape) == want
    assert list(res.fields["lung"].shape) == want


def test_voxel_map_refuses_what_is_not_an_axis_move():
    with pytest.raises(ValueError, match="not an axis permutation or flip"):
        voxel_map(lambda a: a[::2], (4, 4, 4))


def test_crop_pad_and_patches_move_the_origin():
    before = oblique_meta((6, 7, 8), [2.0, 0.7, 0.6], 5)
    s = volume_sample((6, 7, 8), before)
    (cp,) = step("crop_pad_volume", shape=[4, 9, 8]).run(s, rng_for(0, "v"))
    # rows 1..4 of the slices kept; one column padded in front of H: old = new + (1, -1, 0)
    want = positions(before, (6, 7, 8))
    got = positions(cp.meta["ct"], (4, 9, 8))
    np.testing.assert_allclose(got[:, 1:8], want[1:5], atol=2e-3)
    patches = step("patches3d", size=[3, 3, 4], stride=[3, 4, 4]).run(s, rng_for(0, "v"))
    assert len(patches) == 2 * 2 * 2
    for p in patches:
        c = p.meta["patch"]["corner"]
        np.testing.assert_allclose(positions(p.meta["ct"], (3, 3, 4)),
                                   want[c[0]:c[0] + 3, c[1]:c[1] + 3, c[2]:c[2] + 4], atol=2e-3)
        assert p.meta["lung"]["shape"] == [3, 3, 4]


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(4, 12), min_size=3, max_size=3),
       sp=st.lists(st.sampled_from([0.6, 0.8, 1.25, 2.0, 3.0]), min_size=3, max_size=3),
       target=st.sampled_from([0.7, 1.0, 1.5]), seed=st.integers(0, 100))
def test_resample_moves_origin_to_the_new_first_voxel(shape, sp, target, seed):
    """A volume holding each voxel's own patient coordinates, resampled linearly: inside (away from
    the clamped border) every output voxel holds the position its output meta gives it."""
    before = oblique_meta(shape, sp, seed)
    pos = positions(before, tuple(shape))
    for axis in range(3):
        s = Sample("v", {"ct": pos[..., axis].astype(np.float32)}, {"ct": "volume"}, meta={"ct": before})
        (out,) = step("resample_volume", spacing=[target] * 3).run(s, rng_for(0, "v"))
        m = out.meta["ct"]
        got = positions(m, out.fields["ct"].shape)[..., axis]
        assert m["spacing_rcs"] == [m["spacing"][1], m["spacing"][2], m["spacing"][0]]
        # the interior: output voxels whose centres fall between the first and last input centres
        n_new = np.asarray(out.fields["ct"].shape)
        idx = [np.arange(n) for n in n_new]
        inside = [((i + 0.5) * o / n - 0.5 >= 0) & ((i + 0.5) * o / n - 0.5 <= o - 1) for i, o, n in zip(idx, shape, n_new)]
        sel = np.ix_(*inside)
        np.testing.assert_allclose(out.fields["ct"][sel], got[sel], atol=2e-2)
