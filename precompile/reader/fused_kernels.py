"""The Triton kernels of :mod:`~precompile.reader.fused` (imported by it when first needed: this module
imports triton, which is optional; ``TRITON_INTERPRET`` is read when it is imported). See that module for
what they compute and the bound against the eager steps."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_u8(v):
    """float32 -> the uint8 value as float32: clamped to [0, 255], rounded half to even (adding and
    removing 2**23 rounds to an integer by the default rounding, which is to nearest even)."""
    v = tl.minimum(tl.maximum(v, 0.0), 255.0)
    return (v + 8388608.0) - 8388608.0

@triton.jit
def _fma(a, b, c, EMULATE: tl.constexpr):
    """``a * b + c`` with one rounding, as eager torch's ``addcmul`` (value 1) computes it on CUDA
    (``std::fma``) and on the CPU (a contracted multiply-add). ``EMULATE`` (Triton's interpreter, whose
    ``fma`` rounds twice): in float64, where the product is exact, then rounded to float32."""
    if EMULATE:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _gray(r, g, b):
    """The build's float32 luma, in its order: (r * 0.299 + g * 0.587) + b * 0.114."""
    return (r * 0.299 + g * 0.587) + b * 0.114

@triton.jit
def _div(a, b, RECIP: tl.constexpr):
    """``a / b`` as eager torch divides a tensor by a number: CUDA multiplies by the float32 reciprocal,
    the CPU divides."""
    if RECIP:
        return a * tl.math.div_rn(1.0, b)
    else:
        return tl.math.div_rn(a, b)

@triton.jit
def _hue(r, g, b, shift, RECIP: tl.constexpr):
    """torchvision's hue shift as :class:`~precompile.reader.augment.ColorJitter` applies it: clamped to
    [0, 255], to HSV (:func:`~precompile.reader.augment.rgb_to_hsv`), the hue moved by ``shift`` modulo 1,
    back (:func:`~precompile.reader.augment.hsv_to_rgb`), times 255; the same float32 ops in order."""
    r = _div(tl.minimum(tl.maximum(r, 0.0), 255.0), 255.0, RECIP)
    g = _div(tl.minimum(tl.maximum(g, 0.0), 255.0), 255.0, RECIP)
    b = _div(tl.minimum(tl.maximum(b, 0.0), 255.0), 255.0, RECIP)
    maxc = tl.maximum(tl.maximum(r, g), b)
    minc = tl.minimum(tl.minimum(r, g), b)
    eqc = maxc == minc
    cr = maxc - minc
    s = tl.math.div_rn(cr, tl.where(eqc, 1.0, maxc))
    dv = tl.where(eqc, 1.0, cr)
    rc = tl.math.div_rn(maxc - r, dv)
    gc = tl.math.div_rn(maxc - g, dv)
    bc = tl.math.div_rn(maxc - b, dv)
    hr = bc - gc
    hg = (2.0 + rc) - bc
    hb = (4.0 + gc) - rc
    hs = tl.where(maxc == r, hr, tl.where(maxc == g, hg, hb))
    t = _div(hs, 6.0, RECIP) + 1.0
    h = t - tl.floor(t)                      # fmod(t, 1): t >= 0
    t = h + shift
    h = t - tl.floor(t)                      # remainder(t, 1)
    v = maxc
    i6 = tl.floor(h * 6.0)
    f = h * 6.0 - i6
    i = i6.to(tl.int32) % 6
    p = tl.minimum(tl.maximum(v * (1.0 - s), 0.0), 1.0)
    q = tl.minimum(tl.maximum(v * (1.0 - s * f), 0.0), 1.0)
    u = tl.minimum(tl.maximum(v * (1.0 - s * (1.0 - f)), 0.0), 1.0)
    # (v,u,p) (q,v,p) (p,v,u) (p,q,v) (u,p,v) (v,p,q) for i = 0..5
    ro = tl.where(i == 0, v, tl.where(i == 1, q, tl.where(i == 2, p, tl.where(i == 3, p, tl.where(i == 4, u, v)))))
    go = tl.where(i == 0, u, tl.where(i == 1, v, tl.where(i == 2, v, tl.where(i == 3, q, tl.where(i == 4, p, p)))))
    bo = tl.where(i == 0, p, tl.where(i == 1, p, tl.where(i == 2, u, tl.where(i == 3, v, tl.where(i == 4, v, q)))))
    return ro * 255.0, go * 255.0, bo * 255.0

@triton.jit
def _finish(r, g, b, fac, s, out, n_out, mask, m, a_ptr, b_ptr,
            CONTRAST: tl.constexpr, SATURATION: tl.constexpr, HUE: tl.constexpr, RECIP: tl.constexpr):
    """uint8 values (as float32) -> the jitter (brightness, contrast with the mean ``m``, saturation, hue)
    -> uint8 -> ``x * a + b``, stored at ``out`` (n_out: 3 * the pixel's index)."""
    bright = tl.load(fac + s * 8 + 2)
    r = r * bright
    g = g * bright
    b = b * bright
    if CONTRAST:
        c = tl.load(fac + s * 8 + 3)
        mo = m * tl.load(fac + s * 8 + 4)
        r = r * c + mo
        g = g * c + mo
        b = b * c + mo
    if SATURATION:
        sat = tl.load(fac + s * 8 + 5)
        go = _gray(r, g, b) * tl.load(fac + s * 8 + 6)
        r = r * sat + go
        g = g * sat + go
        b = b * sat + go
    if HUE:
        shift = tl.load(fac + s * 8 + 7)
        hr, hg, hb = _hue(r, g, b, shift, RECIP)
        on = shift != 0.0
        r = tl.where(on, hr, r)
        g = tl.where(on, hg, g)
        b = tl.where(on, hb, b)
    r = _round_u8(r)
    g = _round_u8(g)
    b = _round_u8(b)
    tl.store(out + n_out, r * tl.load(a_ptr) + tl.load(b_ptr), mask=mask)
    tl.store(out + n_out + 1, g * tl.load(a_ptr + 1) + tl.load(b_ptr + 1), mask=mask)
    tl.store(out + n_out + 2, b * tl.load(a_ptr + 2) + tl.load(b_ptr + 2), mask=mask)

@triton.jit
def rrc_kernel(x, sn, sh, sw, ix, wx, iy, wy, fac, out, mid, part, a_ptr, b_ptr, n, oh, ow, nb,
                KX: tl.constexpr, KY: tl.constexpr, BLOCK: tl.constexpr, TWO_PASS: tl.constexpr,
                CONTRAST: tl.constexpr, SATURATION: tl.constexpr, HUE: tl.constexpr, RECIP: tl.constexpr,
                EMULATE: tl.constexpr):
    """Pass 1 for block ``program_id(0)`` of sample ``program_id(1)``: resize (+ flip); then either the
    whole rest (``TWO_PASS`` false) or the uint8 image and the block's gray sum."""
    pb = tl.program_id(0)
    s = tl.program_id(1)
    p = pb * BLOCK + tl.arange(0, BLOCK)
    mask = p < oh * ow
    oy = p // ow
    ox = p % ow
    fh = tl.load(fac + s * 8)
    fv = tl.load(fac + s * 8 + 1)
    sx = tl.where(fh != 0.0, ow - 1 - ox, ox)
    sy = tl.where(fv != 0.0, oh - 1 - oy, oy)
    base = x + s.to(tl.int64) * sn
    r = tl.zeros([BLOCK], dtype=tl.float32)
    g = tl.zeros([BLOCK], dtype=tl.float32)
    b = tl.zeros([BLOCK], dtype=tl.float32)
    for ky in tl.static_range(KY):
        yo = (ky * n + s) * oh + sy
        row = tl.load(iy + yo, mask=mask, other=0)
        wyv = tl.load(wy + yo, mask=mask, other=0.0)
        cr = tl.zeros([BLOCK], dtype=tl.float32)
        cg = tl.zeros([BLOCK], dtype=tl.float32)
        cb = tl.zeros([BLOCK], dtype=tl.float32)
        for kx in tl.static_range(KX):
            xo = (kx * n + s) * ow + sx
            col = tl.load(ix + xo, mask=mask, other=0)
            wxv = tl.load(wx + xo, mask=mask, other=0.0)
            src = base + row * sh + col * sw
            vr = tl.load(src, mask=mask, other=0).to(tl.float32)
            vg = tl.load(src + 1, mask=mask, other=0).to(tl.float32)
            vb = tl.load(src + 2, mask=mask, other=0).to(tl.float32)
            if kx == 0:
                cr = vr * wxv
                cg = vg * wxv
                cb = vb * wxv
            else:
                cr = _fma(vr, wxv, cr, EMULATE)
                cg = _fma(vg, wxv, cg, EMULATE)
                cb = _fma(vb, wxv, cb, EMULATE)
        if ky == 0:
            r = cr * wyv
            g = cg * wyv
            b = cb * wyv
        else:
            r = _fma(cr, wyv, r, EMULATE)
            g = _fma(cg, wyv, g, EMULATE)
            b = _fma(cb, wyv, b, EMULATE)
    r = _round_u8(r)
    g = _round_u8(g)
    b = _round_u8(b)
    n_out = (s.to(tl.int64) * oh * ow + p) * 3
    if TWO_PASS:
        tl.store(mid + n_out, r.to(tl.uint8), mask=mask)
        tl.store(mid + n_out + 1, g.to(tl.uint8), mask=mask)
        tl.store(mid + n_out + 2, b.to(tl.uint8), mask=mask)
        bright = tl.load(fac + s * 8 + 2)
        gray = _gray(r * bright, g * bright, b * bright)
        total = tl.sum(tl.where(mask, gray.to(tl.float64), 0.0), axis=0)
        tl.store(part + s * nb + pb, total)
    else:
        _finish(r, g, b, fac, s, out, n_out, mask, 0.0, a_ptr, b_ptr, CONTRAST, SATURATION, HUE, RECIP)

@triton.jit
def jitter_kernel(mid, fac, out, part, a_ptr, b_ptr, oh, ow, nb, BLOCK: tl.constexpr, NB: tl.constexpr,
                   SATURATION: tl.constexpr, HUE: tl.constexpr, RECIP: tl.constexpr):
    """Pass 2: the sample's contrast mean (float64 sum of the partial sums / pixels, as float32), then the
    jitter and the conversion of block ``program_id(0)`` of sample ``program_id(1)``."""
    pb = tl.program_id(0)
    s = tl.program_id(1)
    k = tl.arange(0, NB)
    parts = tl.load(part + s * nb + k, mask=k < nb, other=0.0)
    m = (tl.sum(parts, axis=0) / (oh * ow)).to(tl.float32)   # float64 / int: float64
    p = pb * BLOCK + tl.arange(0, BLOCK)
    mask = p < oh * ow
    n_out = (s.to(tl.int64) * oh * ow + p) * 3
    r = tl.load(mid + n_out, mask=mask, other=0).to(tl.float32)
    g = tl.load(mid + n_out + 1, mask=mask, other=0).to(tl.float32)
    b = tl.load(mid + n_out + 2, mask=mask, other=0).to(tl.float32)
    _finish(r, g, b, fac, s, out, n_out, mask, m, a_ptr, b_ptr, True, SATURATION, HUE, RECIP)
