"""The fused device chain (precompile/reader/fused.py): random_resized_crop -> random_flip -> color_jitter ->
float32 conversion of a uint8 RGB batch in one or two Triton kernels, against the eager steps (the reference,
themselves tested against the build's numpy/OpenCV steps in tests/test_device_augment.py).

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set per test): tiny batches.
The bound the fused result keeps against the eager chain (the module's docstring says why): every float
within ``1/255/std + 1e-6`` (one uint8 level before the conversion), and at most 1% of the values differ at
all. The draws are given by hand where a case must be covered (an area window that shrinks, one that grows, a
linear one, flips on and off in one batch, jitter factors of 1 and at the ends of their ranges, hue 0 and not)
and drawn by the steps' own stream elsewhere. The CUDA test (skipped without a GPU) compares fused and eager
on the device on a real-size batch. Only a missing triton skips this module.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fused_cases import DEV, MEAN, STD, bind, interpret  # noqa: F401  (skips this module without triton)
from precompile.reader import augment, fused, gpu  # noqa: E402
from precompile.reader.loader import Loader  # noqa: E402

from loader_cases import small_build  # noqa: E402,F401

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the fused-vs-eager "
                          "check on the device runs on a GPU node")


def test_the_kernels_run_where_this_process_needs_them():
    """The CPU runs the interpreter's kernels (else the CPU tests below would not test the kernels: triton
    was imported before this module without TRITON_INTERPRET=1); a GPU machine, compiled ones."""
    assert fused.interpreted() == (DEV == "cpu")


def _convert(channels_first: bool = False, mean=MEAN, std=STD, dtype=torch.float32) -> dict[str, gpu.Convert]:
    return {"image": gpu.Convert(dtype, mean, std, channels_first, 1 / 255)}


def _eager(steps: list, conv: dict, x: torch.Tensor, params: list) -> torch.Tensor:
    return conv["image"](gpu.run_steps({"image": x.clone()}, steps, params)["image"])


def _within_bound(got: torch.Tensor, want: torch.Tensor, std=STD, what: str = "") -> None:
    """The stated bound: each float within one uint8 level (1/255/std) + 1e-6 of the eager chain's, and at
    most 1% of the values differing at all. On the CPU (the interpreter, its fused multiply-adds computed in
    float64) every value equals the eager chain's on these inputs (measured), so there the test asks for that:
    a rule broken only at a rounding tie (half up instead of half to even, say) fails."""
    assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype, what
    if DEV == "cpu":
        diff = int((got != want).sum())
        assert diff == 0, f"{what}: {diff} of {got.numel()} values differ from the eager chain's on the CPU"
    eps = 0.0 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps   # float16, bfloat16: their rounding
    got, want = (t.float().permute(0, 2, 3, 1) if t.shape[-1] != 3 else t.float() for t in (got, want))
    d = (got - want).abs()
    level = torch.tensor([1 / 255 / s + 1e-6 for s in np.broadcast_to(std, (3,))]) + eps * want.abs()
    assert bool((d <= level).all()), f"{what}: {float(d.max())} from the eager chain (bound {level.max()})"
    assert int((d > 0).sum()) <= 0.01 * d.numel(), f"{what}: {int((d > 0).sum())} of {d.numel()} values differ"


def _image(n: int, H: int, W: int, seed: int = 0) -> torch.Tensor:
    """Noise, with a flat sample and a gray one (hue and saturation's equal-channel branch) when n >= 3."""
    x = np.random.default_rng(seed).integers(0, 256, (n, H, W, 3)).astype(np.uint8)
    if n >= 3:
        x[1] = 77
        x[2, ..., 1] = x[2, ..., 2] = x[2, ..., 0]
    return torch.from_numpy(x)


def _windows(*wins: tuple[int, int, int, int]) -> dict[str, np.ndarray]:
    a = np.array(wins, np.int64)
    return {"top": a[:, 0], "left": a[:, 1], "height": a[:, 2], "width": a[:, 3]}


#: (interpolation, windows (top, left, height, width) on a 20x24 grid resized to 8x8): each tap rule
WINDOW_CASES = [
    ("area", [(1, 2, 18, 21), (3, 4, 5, 6), (0, 0, 20, 5)]),     # shrinks (area); grows (area-up); one axis grows
    ("linear", [(2, 3, 17, 19), (5, 6, 4, 7), (0, 0, 20, 24)]),
    ("auto", [(0, 1, 19, 22), (7, 9, 3, 5), (4, 2, 9, 16)]),    # area, linear, area in one batch
]
def _factors(brightness, contrast, saturation, hue) -> dict[str, list[float]]:
    return {"brightness": brightness, "contrast": contrast, "saturation": saturation, "hue": hue}


#: per-sample jitter factors (3 samples): 1 and the ends of the ranges, hue off and on
JITTER_CASES = [
    None,
    _factors([1.0, 0.0, 2.5], [0.0, 1.0, 3.0], [3.0, 0.0, 1.0], [0.0, 0.0, 0.0]),
    _factors([1.3, 1.0, 0.6], [1.0, 1.0, 1.0], [0.5, 1.0, 2.0], [0.0, 0.0, 0.0]),
    _factors([0.8, 1.2, 1.0], [1.4, 0.7, 1.0], [1.0, 1.6, 0.3], [0.5, -0.37, 0.0]),
    _factors([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [-0.5, 0.11, 0.0]),
]


@pytest.mark.parametrize("jitter", JITTER_CASES, ids=["no-jitter", "extremes", "no-contrast", "hue", "hue-only"])
@pytest.mark.parametrize("interp,wins", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_fused_chain_is_the_eager_chain_on_given_draws(interpret, interp, wins, jitter):
    """Hand-made draws covering each tap rule, flips on and off per sample, jitter factors of 1 and at the
    ends of their ranges: the fused result keeps the bound against the eager steps."""
    steps = [{"random_resized_crop": {"size": [8, 8], "interpolation": interp}},
             {"random_flip": {"horizontal": 0.5, "vertical": 0.5}}]
    if jitter is not None:
        steps.append({"color_jitter": {"brightness": [0, 3], "contrast": [0, 3], "saturation": [0, 3],
                                       "hue": 0.5}})
    steps = bind(steps, (20, 24))
    params = [_windows(*wins), {"horizontal": np.array([True, False, True]), "vertical": np.array([False, True, True])}]
    if jitter is not None:
        params.append({k: np.array(v, np.float64) for k, v in jitter.items()})
    for channels_first in (False, True):
        conv = _convert(channels_first)
        chain = fused.FusedChain.of(steps, conv)
        x = _image(3, 20, 24).to(DEV)
        assert chain is not None and chain.usable({"image": x})
        _within_bound(chain.run(x, params).cpu(), _eager(steps, conv, x, params).cpu(), what=f"{interp} {jitter}")


def test_the_rules_the_cases_cover():
    """The hand-made windows take the rules they are named for (so the test above covers each)."""
    codes = {}
    for interp, wins in WINDOW_CASES:
        steps = bind([{"random_resized_crop": {"size": [8, 8], "interpolation": interp}}], (20, 24))
        p = _windows(*wins)
        modes = steps[0]._modes(p["height"], p["width"], interp)
        grows = (p["height"] < 8) | (p["width"] < 8)
        codes[interp] = np.where(modes == "area", np.where(grows, augment.AREA_UP, augment.AREA_DOWN),
                                 augment.LINEAR).tolist()
    assert codes == {"area": [augment.AREA_DOWN, augment.AREA_UP, augment.AREA_UP],
                     "linear": [augment.LINEAR] * 3,
                     "auto": [augment.AREA_DOWN, augment.LINEAR, augment.AREA_DOWN]}


@pytest.mark.parametrize("chain", [
    [{"random_resized_crop": {"size": [8, 8], "scale": [0.02, 1.0]}}],
    [{"random_resized_crop": {"size": [9, 7], "scale": [0.02, 1.0], "interpolation": "area"}},
     {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4}}],
    [{"random_resized_crop": {"size": [8, 8], "scale": [0.02, 1.0], "interpolation": "linear"}},
     {"random_flip": {}}, {"color_jitter": {"brightness": [0, 3], "contrast": [0, 3], "saturation": [0, 3],
                                            "hue": 0.5}}],
])
def test_fused_chain_is_the_eager_chain_on_drawn_batches(interpret, chain):
    """The steps' own draws (several batches, 4 samples of 20x24): the bound holds, with the per-channel mean
    and std, with none, and converted to float32, float16 and bfloat16 (rounded to nearest even, as
    ``Tensor.to``)."""
    steps = bind(chain, (20, 24))
    x = _image(4, 20, 24, seed=3).to(DEV)
    for b, (mean, std, dtype) in enumerate([(MEAN, STD, torch.float32), (None, None, torch.float16),
                                            (0.5, 0.25, torch.bfloat16)]):
        conv = _convert(False, mean, std, dtype)
        params = gpu.step_params(steps, 11, 0, 0, b, 4)
        got = fused.FusedChain.of(steps, conv).run(x, params)
        _within_bound(got.cpu(), _eager(steps, conv, x, params).cpu(), 1.0 if std is None else std,
                      what=f"{chain} {mean}")


def test_the_taps_kernel_is_device_taps(interpret):
    """The fused path's taps (one kernel launch per axis) are augment.device_taps' (the eager path's, equal to
    the host's OpenCV tables: tests/test_device_augment.py), bit for bit, every slot: linear, area growing, area
    shrinking (partial taps on both sides, whole scales, 5x), a batch of all rules, down to 1 pixel."""
    rng = np.random.default_rng(7)
    for out in (1, 9):
        lengths = np.concatenate([rng.integers(1, 5 * out + 2, 6), [out, 2 * out, out + 1, max(out - 1, 1), 1,
                                                                     5 * out]])
        starts = rng.integers(0, 50, len(lengths))
        mixed = np.where(lengths >= out, rng.integers(0, 3, len(lengths)), rng.integers(0, 2, len(lengths)))
        for code in (augment.LINEAR, augment.AREA_UP, augment.AREA_DOWN, None):   # None: a batch of all rules
            sel = lengths >= out if code == augment.AREA_DOWN else np.ones(len(lengths), bool)
            L, s0 = lengths[sel], starts[sel]
            codes = np.full(len(L), code) if code is not None else mixed
            k = augment.tap_count(codes, L, out)
            t = torch.tensor(np.stack([s0, L, codes, augment.cv_scale(L, out)]).astype(np.float64), device=DEV)
            want = augment.device_taps(*t, out, k, set(codes.tolist()))
            for g, w, what in zip(fused.taps(t, out, k), want, ("indices", "weights")):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{what}: rule {code}, {L.tolist()} -> {out}"


def test_only_supported_chains_are_fused():
    """FusedChain.of takes resized crop (linear/area/auto) [-> flip] [-> jitter] on one image field converted
    to float32, float16 or bfloat16; anything else is None (the eager steps)."""
    rrc = {"random_resized_crop": {"size": [8, 8]}}
    jit = {"color_jitter": {"brightness": 0.2}}
    hw = (20, 24)
    ok = [[rrc], [rrc, {"random_flip": {}}], [rrc, jit], [rrc, {"random_flip": {"vertical": 0.5}}, jit]]
    for chain in ok:
        assert fused.FusedChain.of(bind(chain, hw), _convert()) is not None, chain
    refused = {
        "nearest": [{"random_resized_crop": {"size": [8, 8], "interpolation": "nearest"}}],
        "jitter first": [jit, rrc],
        "flip after jitter": [rrc, jit, {"random_flip": {}}],
        "another step": [rrc, {"random_grayscale": {"p": 0.5}}],
        "no resized crop": [{"random_flip": {}}, jit],
        "crop": [{"random_crop": {"size": 8}}, jit],
    }
    for why, chain in refused.items():
        assert fused.FusedChain.of(bind(chain, hw), _convert()) is None, why
    steps = bind([rrc, jit], hw)
    assert fused.FusedChain.of(steps, {}) is None   # no conversion
    assert fused.FusedChain.of(steps, {"image": gpu.Convert(torch.float64)}) is None
    assert fused.FusedChain.of(steps, {"image": gpu.Convert(None, channels_first=True)}) is None
    masked = bind([rrc, {"random_flip": {}}], hw, {"image": ("image", (*hw, 3)), "mask": ("mask", (*hw, 1))})
    assert fused.FusedChain.of(masked, _convert()) is None   # a mask moves with the image: eager


def test_boxes_and_keypoints_move_as_the_eager_steps_move_them(interpret, monkeypatch):
    """Boxes (with their labels) and keypoints bound with the image: the Finisher fuses the pixels and moves the
    annotations by the steps' own code, so they are the eager chain's exactly (boxes dropped by min_visibility
    included) and the image within the bound; a mask bound with them keeps the whole chain eager."""
    from precompile.reader.feed import Finisher, HostPool
    from precompile.reader.ragged import count_name, pad_rows

    rng = np.random.default_rng(4)
    n, H, W = 3, 20, 24
    specs = {"image": {"kind": "image"}, "boxes": {"kind": "boxes"},
             "box_labels": {"kind": "box_labels", "of": "boxes"}, "keypoints": {"kind": "keypoints", "of": "boxes"}}
    shapes = {"image": (H, W, 3), "boxes": (None, 4), "box_labels": (None,), "keypoints": (None, 2, 3)}
    chain = [{"random_resized_crop": {"size": [8, 8], "scale": [0.2, 1.0], "min_visibility": 0.3}},
             {"random_flip": {"horizontal": 0.5, "flip_pairs": [[0, 1]]}},
             {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}}]

    def batch() -> dict[str, torch.Tensor]:
        out = {"image": _image(n, H, W, seed=9).to(DEV)}
        counts = [4, 0, 6]
        xy = [rng.uniform(0, [W - 6, H - 6], (c, 2)) for c in counts]
        boxes = [np.concatenate([p, p + rng.uniform(2, 6, (len(p), 2))], 1).astype(np.float32) for p in xy]
        rows = {"boxes": boxes, "box_labels": [np.arange(c, dtype=np.int64) for c in counts],
                "keypoints": [np.concatenate([rng.uniform(0, [W, H], (c, 2, 2)), np.full((c, 2, 1), 2.0)], 2)
                              .astype(np.float32) for c in counts]}
        for f, r in rows.items():
            a, c = pad_rows(r, r[0].shape[1:], r[0].dtype)
            out[f], out[count_name(f)] = torch.from_numpy(a), torch.from_numpy(c)
        return out

    x = batch()
    results = []
    for on in ("1", "0"):
        monkeypatch.setenv("PRECOMPILE_FUSED", on)
        steps = augment.parse_steps(chain)
        gpu.bind_steps(steps, specs, shapes)
        fin = Finisher(steps, _convert(), 5, 0, HostPool())
        assert fin.fused is not None and fin.fused.notes
        results.append(fin.finish({k: v.clone() for k, v in x.items()}, 2, 7))
        assert fin.fused_batches == (on == "1")
    got, want = results
    _within_bound(got["image"].cpu(), want["image"].cpu(), what="with boxes")
    assert int(want[count_name("boxes")].sum()) < 10   # min_visibility dropped some: their rows went too
    for f in ("boxes", "box_labels", "keypoints"):
        for k in (f, count_name(f)):
            assert torch.equal(got[k].cpu().nan_to_num(-9), want[k].cpu().nan_to_num(-9)), k
    specs["mask"], shapes["mask"] = {"kind": "mask", "of": "boxes"}, (H, W, 1)
    steps = augment.parse_steps(chain)
    gpu.bind_steps(steps, specs, shapes)
    assert fused.FusedChain.of(steps, _convert()) is None


def test_a_batch_takes_the_fused_path_only_where_it_can(interpret, monkeypatch):
    """usable(): a uint8 (N, H, W, 3) batch of the bound grid, on CUDA or under the interpreter;
    PRECOMPILE_FUSED=0 and a CPU batch without the interpreter take the eager steps."""
    chain = fused.FusedChain.of(bind([{"random_resized_crop": {"size": [8, 8]}}], (20, 24)), _convert())
    x = _image(2, 20, 24).to(DEV)
    assert chain.usable({"image": x})
    assert not chain.usable({"image": x.to(torch.float32)})
    assert not chain.usable({"image": _image(2, 20, 23).to(DEV)})
    assert not chain.usable({"image": x[..., :1]})
    monkeypatch.setenv("PRECOMPILE_FUSED", "0")
    assert not chain.usable({"image": x})
    monkeypatch.setenv("PRECOMPILE_FUSED", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not chain.usable({"image": x.cpu()})


def test_kernels_that_fail_leave_the_eager_steps_with_a_warning(interpret, monkeypatch):
    """A launch that raises (a GPU Triton cannot compile for, say): a RuntimeWarning naming the error, the
    eager result for that batch, and the eager steps from then on."""
    from precompile.reader.feed import Finisher, HostPool

    steps = bind([{"random_resized_crop": {"size": [8, 8]}}, {"random_flip": {}}], (20, 24))
    fin = Finisher(steps, _convert(), 5, 0, HostPool())

    def broken(self, x, params):
        raise RuntimeError("no kernel image for this GPU " + "x" * 500)

    monkeypatch.setattr(fused.FusedChain, "run", broken)
    x = _image(3, 20, 24).to(DEV)
    with pytest.warns(RuntimeWarning, match=r"fused device kernels failed \(RuntimeError: no kernel image") as rec:
        got = fin.finish({"image": x.clone()}, 0, 1)["image"]
    assert len(str(rec[0].message)) < 400   # the error's text cut
    params = gpu.step_params(steps, 5, 0, 0, 1, 3)
    assert torch.equal(got, _eager(steps, _convert(), x, params))
    assert fin.fused is None and fin.fused_batches == 0
    fin.finish({"image": x.clone()}, 0, 2)   # eager, no second warning (warnings are errors here)


LOADER_STEPS = [{"random_resized_crop": {"size": [16, 15], "scale": [0.2, 1.0]}}, {"random_flip": {}},
                {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}}]


def _batches(path: str, **kw) -> tuple[list[torch.Tensor], Loader]:
    loader = Loader(path, batch_size=5, shuffle=True, seed=3, device=DEV, num_threads=0, dtype="float32",
                    mean=MEAN, std=STD, **kw)
    return [b["image"].cpu() for b in loader], loader


def test_the_loader_uses_the_fused_path_with_the_same_draws(small_build, interpret, monkeypatch):
    """A Loader with the supported chain fuses every batch (the Finisher counts them) and gives the eager
    batches within the bound (the same draws: the same stream); PRECOMPILE_FUSED=0 forces the eager steps;
    an unsupported chain (a grayscale step added) stays eager."""
    got, loader = _batches(small_build, gpu_steps=LOADER_STEPS, channels_first=True)
    assert len(got) == 2 and got[0].shape == (5, 3, 16, 15)
    assert loader.finisher.fused is not None and loader.finisher.fused_batches == 2
    monkeypatch.setenv("PRECOMPILE_FUSED", "0")
    want, eager = _batches(small_build, gpu_steps=LOADER_STEPS, channels_first=True)
    assert eager.finisher.fused_batches == 0
    for g, w in zip(got, want):
        _within_bound(g, w, what="loader")
    monkeypatch.delenv("PRECOMPILE_FUSED")
    _, other = _batches(small_build, gpu_steps=LOADER_STEPS + [{"random_grayscale": {"p": 0.5}}])
    assert other.finisher.fused is None and other.finisher.fused_batches == 0


@CUDA
def test_fused_chain_is_the_eager_chain_on_cuda(monkeypatch):
    """On the device, a real-size batch (64 of 256x320 -> 224x224, the ImageNet recipe's steps): fused and
    eager within the bound, on drawn batches with and without hue."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PRECOMPILE_FUSED", raising=False)
    x = _image(64, 256, 320, seed=5).cuda()
    for hue in (0.0, 0.1):
        steps = bind([{"random_resized_crop": {"size": [224, 224]}}, {"random_flip": {}},
                       {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": hue}}],
                      (256, 320))
        for channels_first in (False, True):
            conv = _convert(channels_first)
            chain = fused.FusedChain.of(steps, conv)
            assert chain.usable({"image": x})
            for b in range(3):
                params = gpu.step_params(steps, 7, 0, 0, b, 64)
                got = chain.run(x, params)
                _within_bound(got.cpu(), _eager(steps, conv, x, params).cpu(), what=f"cuda hue={hue} batch {b}")


COMPILE = r'''
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from precompile.reader import fused_kernels as fk

POINTERS = dict(x="*u8", ix="*i64", wx="*fp32", iy="*i64", wy="*fp32", fac="*fp32", out="*fp32", mid="*u8",
                part="*fp64", a_ptr="*fp32", b_ptr="*fp32")


def build(fn, consts):
    sig = {a: "constexpr" if a in consts else POINTERS.get(a, "i64" if a == "sn" else "i32") for a in fn.arg_names}
    return compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options={"enable_fp_fusion": False}).asm["ptx"]


for two, kb, bf16 in ((True, (4, 4), False), (False, (2, 1), True)):
    POINTERS["out"] = "*bf16" if bf16 else "*fp32"
    build(fk.rrc_kernel, dict(KXB=kb[0], KYB=kb[1], BLOCK=256, TWO_PASS=two, SATURATION=True, HUE=True, RECIP=True,
                              EMULATE=False, BF16=bf16))
POINTERS["out"] = "*fp16"
ptx = build(fk.jitter_kernel, dict(BLOCK=256, NB=256, SATURATION=True, HUE=True, RECIP=True, BF16=False))
POINTERS.update(t="*fp64", idx="*i64", w="*fp32")
print("fma in the taps kernel:", build(fk.taps_kernel, dict(KB=4, BLOCK=128)).count("fma.rn"))
print("fma in the jitter kernel:", ptx.count("fma.rn"))
'''


def test_the_kernels_compile_for_a_gpu_without_one(tmp_path):
    """Triton's compiler (the interpreter runs what the compiler may refuse) builds both kernels, with every
    branch (two passes or one, saturation, hue, several tap counts), for sm_90 (H100/H200) on this machine, GPU
    or not (triton ships ptxas); and contracts no product into an add (``enable_fp_fusion=False``: the jitter
    and taps kernels have no fma, as the eager ops round each product). A fresh process: this one's triton is the
    interpreter's on the CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(fused.__file__))), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "fma in the jitter kernel: 0" in r.stdout and "fma in the taps kernel: 0" in r.stdout, r.stdout
