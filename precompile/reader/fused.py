"""Triton kernels for the Loader's most common device chain (issue 35): ``random_resized_crop`` (linear, area
or auto taps), then optionally ``random_flip``, then optionally ``color_jitter``, then the conversion to
float32 (or float16, bfloat16), on a uint8 RGB image batch (N, H, W, 3).

The eager steps (:mod:`~precompile.reader.augment`, :mod:`~precompile.reader.gpu`) stay the reference; this
module computes the same pixels from the same draws (:func:`~precompile.reader.gpu.step_params`, so the same
batches) in fewer passes over memory (the kernels: :mod:`~precompile.reader.fused_kernels`):

- the taps (``taps_kernel``, one launch per axis): :func:`~precompile.reader.augment.device_taps`' values, bit
  for bit, from the same windows (the torch form is some forty small kernels);
- pass 1 (``rrc_kernel``), per output pixel: every tap of both axes (summed in the eager order: across each row first,
  then down, ``w0 * x0``, then each further tap added with one rounding, as eager ``addcmul`` does), rounded
  half to even and clamped to uint8 (as the eager step stores it), read through the flip (the flip moves
  pixels only). Without contrast the same program applies the jitter and the conversion and writes the
  float32 result; with contrast it writes the uint8 image and one float64 partial sum per program of the
  brightness-adjusted gray (for the contrast mean);
- pass 2 (``jitter_kernel``, with contrast only): the sample's mean from its partial sums, then brightness,
  contrast, saturation and hue by the eager float32 rules in the eager order, rounded half to even and clamped
  to uint8, then ``x * a + b`` (the conversion's scale, mean and std) in float32, cast to the conversion's
  dtype (rounded to nearest even), in the eager layout (NHWC storage; ``channels_first`` is the conversion's
  NCHW view of it).

Bound: a float32 result may round differently from the eager chain's in the last bit (another summation order
for the contrast mean, the device's own division and reciprocal); an intermediate that lands on the other side
of a uint8 rounding boundary then moves by one level. So each float is within ``1/255/std + 1e-6`` of the
eager chain's (one uint8 level), and such values are rare (``tests/test_fused.py`` checks the bound, and that
at most 1% differ; on the CPU, through Triton's interpreter, every value has been equal). The kernels are
compiled without contracting products into adds (``enable_fp_fusion=False``: the eager ops round each
product), the resize's multiply-adds being explicit ``fma`` as eager ``addcmul`` computes them.

:class:`FusedChain` is what the :class:`~precompile.reader.feed.Finisher` asks: :meth:`FusedChain.of` says
whether a bound step list and the conversions form a supported chain (one uint8 image field, no other grid
moved, a float32, float16 or bfloat16 conversion; boxes and keypoints move by the eager code),
:meth:`FusedChain.usable` whether one batch can take it (a CUDA tensor, or a CPU tensor under
``TRITON_INTERPRET=1``; Triton importable; ``PRECOMPILE_FUSED`` not ``0``), and :meth:`FusedChain.run` computes
it. Everything else takes the eager steps. Only the Loader imports this module; torch and triton are imported
when first needed (triton is optional).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Sequence

import numpy as np

#: output pixels per program
BLOCK = 256
#: output columns (or rows) per program of the taps kernel
TAPS_BLOCK = 128


def enabled() -> bool:
    """False when ``PRECOMPILE_FUSED=0``: the eager steps (the reference) run instead."""
    return os.environ.get("PRECOMPILE_FUSED", "1").strip() != "0"


def interpreting() -> bool:
    """``TRITON_INTERPRET=1`` now: a CPU batch may take the kernels when they are the interpreter's (tests;
    the variable must also have been set when triton was first imported, :func:`interpreted`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def kernels() -> Any:
    """The kernels (the module :mod:`~precompile.reader.fused_kernels`), or None when triton does not import.
    Imported on first use: triton is never imported before."""
    try:
        from . import fused_kernels
    except Exception:   # any import failure (missing, a broken install): the eager steps run
        return None
    return fused_kernels


def interpreted() -> bool:
    """The kernels are Triton's interpreter's (triton was first imported with ``TRITON_INTERPRET=1``): they
    run on CPU tensors."""
    k = kernels()
    return k is not None and type(k.rrc_kernel).__name__ == "InterpretedFunction"


class FusedChain:
    """A supported chain bound to one field: the resized crop, the flip (or None), the jitter (or None) and
    the field's conversion."""

    def __init__(self, field: str, rrc: Any, flip: Any, jitter: Any, convert: Any):
        self.field, self.rrc, self.flip, self.jitter, self.convert = field, rrc, flip, jitter, convert
        #: boxes or keypoints move with the image (the eager steps' own code moves them: gpu.run_steps with
        #: pixels=False, after the kernels)
        self.notes = False

    @classmethod
    def of(cls, steps: Sequence[Any], convert: dict[str, Any]) -> FusedChain | None:
        """The chain when the bound ``steps`` are ``random_resized_crop`` (linear, area or auto), then
        optionally ``random_flip``, then optionally ``color_jitter``, every one covering the same single image
        field and no other grid (no mask, flow, clip or second image; boxes and keypoints may move with it),
        converted to float32, float16 or bfloat16; else None."""
        from . import augment, gpu
        from ..kinds import ANNOTATIONS, Kind

        steps = list(steps)
        if not steps or type(steps[0]) is not augment.RandomResizedCrop:
            return None
        rest = steps[1:]
        flip = rest.pop(0) if rest and type(rest[0]) is gpu.RandomFlip else None
        jitter = rest.pop(0) if rest and type(rest[0]) is augment.ColorJitter else None
        if rest:
            return None
        rrc = steps[0]
        if rrc.params.interpolation not in ("auto", "area", "linear"):
            return None
        bound = [getattr(s, "bound", None) for s in steps]
        if any(b is None for b in bound):
            return None
        grids = [{f: k for f, k in b.items() if k not in ANNOTATIONS} for b in bound]   # boxes move as before
        if len(grids[0]) != 1:
            return None
        (field, kind), = grids[0].items()
        if kind is not Kind.IMAGE or any(g != {field: Kind.IMAGE} for g in grids):
            return None
        conv = convert.get(field)
        import torch

        if conv is None or conv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return None
        chain = cls(field, rrc, flip, jitter, conv)
        chain.notes = any(len(b) > 1 for b in bound)
        return chain

    def usable(self, batch: dict[str, Any]) -> bool:
        """This batch can take the fused kernels: ``PRECOMPILE_FUSED`` is not 0, triton imports, the field is
        a uint8 (N, H, W, 3) tensor of the bound grid on CUDA (or on the CPU under Triton's interpreter)."""
        import torch

        x = batch.get(self.field)
        if not enabled() or x is None or x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
            return False
        if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
            return False
        if tuple(x.shape[1:3]) != tuple(self.rrc.hw) or x.stride(-1) != 1 or x.shape[0] > 65535:   # grid's y
            return False
        return interpreted() if x.device.type == "cpu" else kernels() is not None

    def factors(self, params: Sequence[dict], n: int) -> np.ndarray:
        """(n, 8) float32 per sample: horizontal flip, vertical flip, brightness, contrast, 1 - contrast,
        saturation, 1 - saturation, hue (``1 - x`` in float64 then float32, as the eager step computes it)."""
        fac = np.zeros((n, 8), np.float32)
        fac[:, 2] = fac[:, 3] = fac[:, 5] = 1.0
        if self.flip is not None:
            p = params[1]
            fac[:, 0], fac[:, 1] = p["horizontal"], p["vertical"]
        if self.jitter is not None:
            p = params[-1]
            fac[:, 2] = np.asarray(p["brightness"], np.float32)
            fac[:, 3] = np.asarray(p["contrast"], np.float32)
            fac[:, 4] = (1 - np.asarray(p["contrast"])).astype(np.float32)
            fac[:, 5] = np.asarray(p["saturation"], np.float32)
            fac[:, 6] = (1 - np.asarray(p["saturation"])).astype(np.float32)
            fac[:, 7] = np.asarray(p["hue"], np.float32)
        return fac

    def run(self, x: Any, params: Sequence[dict]) -> Any:
        """The converted batch (the conversion's dtype and layout: NHWC storage, an NCHW view when
        ``channels_first``) from uint8 ``x`` (N, H, W, 3) and the steps' draws ``params`` (one dict per step,
        :func:`~precompile.reader.gpu.step_params`)."""
        import torch

        cpu = x.device.type == "cpu"
        with contextlib.nullcontext() if cpu else torch.cuda.device(x.device):   # Triton launches on the current one
            return self._run(x, params, cpu)

    def _run(self, x: Any, params: Sequence[dict], cpu: bool) -> Any:
        import torch

        from . import gpu

        k = kernels()
        n = x.shape[0]
        oh, ow = self.rrc.params.size
        out = torch.empty((n, oh, ow, 3), dtype=self.convert.dtype, device=x.device)
        if n == 0:
            return _view(out, self.convert)
        p = params[0]
        modes = self.rrc._modes(p["height"], p["width"], self.rrc.params.interpolation)
        windows, kx, ky, _ = self.rrc.tap_windows(p["top"], p["left"], p["height"], p["width"], modes)
        t = gpu.to_device(windows, x.device)
        ix, wx = taps(t[:4], ow, kx)
        iy, wy = taps(t[4:], oh, ky)
        fac_np = self.factors(params, n)
        fac = gpu.to_device(fac_np, x.device)
        a, b = self.convert._coeffs(x.device, 3)
        contrast = bool((fac_np[:, 3] != 1).any())
        saturation = bool((fac_np[:, 5] != 1).any())
        hue = bool((fac_np[:, 7] != 0).any())
        nb = -(-(oh * ow) // BLOCK)
        grid = (nb, n)
        opts = {"enable_fp_fusion": False}
        bf16 = self.convert.dtype == torch.bfloat16
        if contrast:
            mid = torch.empty((n, oh, ow, 3), dtype=torch.uint8, device=x.device)
            part = torch.empty((n, nb), dtype=torch.float64, device=x.device)
        else:
            mid = part = out   # not written
        sn, sh, sw, _ = x.stride()
        k.rrc_kernel[grid](x, sn, sh, sw, ix, wx, iy, wy, fac, out, mid, part, a, b, n, oh, ow, nb,
                           ix.shape[0], iy.shape[0], KXB=_bucket(ix.shape[0]), KYB=_bucket(iy.shape[0]),
                           BLOCK=BLOCK, TWO_PASS=contrast, SATURATION=saturation, HUE=hue, RECIP=not cpu,
                           EMULATE=cpu, BF16=bf16, **opts)
        if contrast:
            k.jitter_kernel[grid](mid, fac, out, part, a, b, oh, ow, nb, BLOCK=BLOCK,
                                  NB=max(16, k.triton.next_power_of_2(nb)), SATURATION=saturation, HUE=hue,
                                  RECIP=not cpu, BF16=bf16, **opts)
        return _view(out, self.convert)


def taps(windows: Any, size: int, k: int) -> tuple[Any, Any]:
    """:func:`~precompile.reader.augment.device_taps` for one axis (the same values, bit for bit), in one
    kernel launch: ``windows`` (4, n) float64 on the device (start, length, rule, ``cv_scale(length, size)`` per
    sample, as :meth:`~precompile.reader.augment.RandomResizedCrop.tap_windows` gives them), ``k`` taps ->
    source indices (k, n, size) int64 and float32 weights."""
    import torch

    n = windows.shape[1]
    idx = torch.empty((k, n, size), dtype=torch.int64, device=windows.device)
    w = torch.empty((k, n, size), dtype=torch.float32, device=windows.device)
    if n:
        kernels().taps_kernel[(-(-size // TAPS_BLOCK), n)](windows, idx, w, n, size, k, KB=_bucket(k),
                                                            BLOCK=TAPS_BLOCK, enable_fp_fusion=False)
    return idx, w


def _bucket(k: int) -> int:
    """The loop length compiled for ``k`` taps: the next power of two (few kernel variants whatever the
    windows; the slots past ``k`` add nothing)."""
    return 1 << max(0, int(k) - 1).bit_length()


def _view(out: Any, convert: Any) -> Any:
    """The conversion's layout of a float32 NHWC result: an NCHW view when ``channels_first``."""
    return out.permute(0, 3, 1, 2) if convert.channels_first else out
