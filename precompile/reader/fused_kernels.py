"""The Triton kernels of :mod:`~precompile.reader.fused` (imported by it when first needed: this module
imports triton, which is optional; ``TRITON_INTERPRET`` is read when it is imported). See that module for
what they compute and the bound against the eager steps."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_u8(v):
    """float32 -> the uint8 value, as float32: clamped to [0, 255], rounded half to even (torch's ``round``)
    with exact ops only (floor, a difference below 1, a comparison), whatever the compiler does."""
    v = tl.minimum(tl.maximum(v, 0.0), 255.0)
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


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
def _store(ptr, v, mask, BF16: tl.constexpr):
    """A float32 result stored as the output's dtype (float32, float16 or bfloat16: ``.to`` after the float32
    conversion, as the eager ``Convert`` casts), rounded to nearest even; bfloat16 by its bits first (Triton's
    interpreter truncates), then the exact cast."""
    if BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = bits.to(tl.float32, bitcast=True)
    tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(r, g, b, fac, s, out, n_out, mask, m, a_ptr, b_ptr,
            CONTRAST: tl.constexpr, SATURATION: tl.constexpr, HUE: tl.constexpr, RECIP: tl.constexpr,
            BF16: tl.constexpr):
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
    _store(out + n_out, r * tl.load(a_ptr) + tl.load(b_ptr), mask, BF16)
    _store(out + n_out + 1, g * tl.load(a_ptr + 1) + tl.load(b_ptr + 1), mask, BF16)
    _store(out + n_out + 2, b * tl.load(a_ptr + 2) + tl.load(b_ptr + 2), mask, BF16)


@triton.jit
def _column(base, sh, sw, ix, wx, n, s, ow, sx, row, mask, KX, KXB: tl.constexpr, EMULATE: tl.constexpr):
    """One source row's value at each output column: ``w0 * x0``, then each further tap of the ``KX`` added
    by ``fma`` (the eager column pass), per channel. The loop runs to ``KXB`` (a power of two >= KX, so few
    compiled variants); a slot past ``KX`` loads nothing and adds ``fma(0, 0, c) = c``: nothing."""
    xo = s * ow + sx
    src = base + row * sh + tl.load(ix + xo, mask=mask, other=0) * sw
    w = tl.load(wx + xo, mask=mask, other=0.0)
    cr = tl.load(src, mask=mask, other=0).to(tl.float32) * w
    cg = tl.load(src + 1, mask=mask, other=0).to(tl.float32) * w
    cb = tl.load(src + 2, mask=mask, other=0).to(tl.float32) * w
    for kx in tl.static_range(1, KXB):
        on = mask & (kx < KX)
        xo = (kx * n + s) * ow + sx
        src = base + row * sh + tl.load(ix + xo, mask=on, other=0) * sw
        w = tl.load(wx + xo, mask=on, other=0.0)
        cr = _fma(tl.load(src, mask=on, other=0).to(tl.float32), w, cr, EMULATE)
        cg = _fma(tl.load(src + 1, mask=on, other=0).to(tl.float32), w, cg, EMULATE)
        cb = _fma(tl.load(src + 2, mask=on, other=0).to(tl.float32), w, cb, EMULATE)
    return cr, cg, cb


@triton.jit
def rrc_kernel(x, sn, sh, sw, ix, wx, iy, wy, fac, out, mid, part, a_ptr, b_ptr, n, oh, ow, nb, KX, KY,
               KXB: tl.constexpr, KYB: tl.constexpr, BLOCK: tl.constexpr, TWO_PASS: tl.constexpr,
               SATURATION: tl.constexpr, HUE: tl.constexpr, RECIP: tl.constexpr, EMULATE: tl.constexpr,
               BF16: tl.constexpr):
    """Pass 1 for block ``program_id(0)`` of sample ``program_id(1)``: the resize read through the flip,
    each output pixel from its ``KY`` row taps of ``KX`` column taps (the eager row pass over the column
    pass; loops to the powers of two ``KYB``, ``KXB``), rounded to uint8; then either the rest of the chain
    (``TWO_PASS`` false: no contrast) or the uint8 image and the block's float64 sum of the
    brightness-adjusted gray."""
    pb = tl.program_id(0)
    s = tl.program_id(1)
    p = pb * BLOCK + tl.arange(0, BLOCK)
    mask = p < oh * ow
    oy = p // ow
    ox = p % ow
    sx = tl.where(tl.load(fac + s * 8) != 0.0, ow - 1 - ox, ox)
    sy = tl.where(tl.load(fac + s * 8 + 1) != 0.0, oh - 1 - oy, oy)
    base = x + s.to(tl.int64) * sn
    yo = s * oh + sy
    w = tl.load(wy + yo, mask=mask, other=0.0)
    cr, cg, cb = _column(base, sh, sw, ix, wx, n, s, ow, sx, tl.load(iy + yo, mask=mask, other=0), mask, KX,
                         KXB, EMULATE)
    r = cr * w
    g = cg * w
    b = cb * w
    for ky in tl.static_range(1, KYB):
        on = mask & (ky < KY)
        yo = (ky * n + s) * oh + sy
        w = tl.load(wy + yo, mask=on, other=0.0)
        cr, cg, cb = _column(base, sh, sw, ix, wx, n, s, ow, sx, tl.load(iy + yo, mask=on, other=0), on, KX,
                             KXB, EMULATE)
        r = _fma(cr, w, r, EMULATE)
        g = _fma(cg, w, g, EMULATE)
        b = _fma(cb, w, b, EMULATE)
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
        tl.store(part + s * nb + pb, tl.sum(tl.where(mask, gray.to(tl.float64), 0.0), axis=0))
    else:
        _finish(r, g, b, fac, s, out, n_out, mask, 0.0, a_ptr, b_ptr, False, SATURATION, HUE, RECIP, BF16)


@triton.jit
def jitter_kernel(mid, fac, out, part, a_ptr, b_ptr, oh, ow, nb, BLOCK: tl.constexpr, NB: tl.constexpr,
                   SATURATION: tl.constexpr, HUE: tl.constexpr, RECIP: tl.constexpr, BF16: tl.constexpr):
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
    _finish(r, g, b, fac, s, out, n_out, mask, m, a_ptr, b_ptr, True, SATURATION, HUE, RECIP, BF16)


@triton.jit
def taps_kernel(t, idx, w, n, size, K, KB: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`~precompile.reader.augment.device_taps` in one launch (its torch form is some forty small
    kernels): for output pixels ``program_id(0) * BLOCK + ...`` of sample ``program_id(1)``, from the sample's
    window in ``t`` ((4, n) float64 rows: start, length, rule (0 linear, 1 area growing, 2 area shrinking),
    OpenCV's scale ``augment.cv_scale(length, size)``, divided on the host), the ``K`` taps' source indices
    ``idx`` (K, n, size) int64 and float32 weights ``w``, by the same float64 operations in the same order (so
    the same values, bit for bit); slots past a sample's own taps weigh 0 at index ``start``. ``KB``: a power
    of two >= K."""
    pb = tl.program_id(0)
    s = tl.program_id(1)
    d = pb * BLOCK + tl.arange(0, BLOCK)
    mask = d < size
    s0 = tl.load(t + s)
    L = tl.load(t + n + s)
    code = tl.load(t + 2 * n + s)
    scale = tl.load(t + 3 * n + s)
    df = d.to(tl.float64)
    # INTER_LINEAR, and INTER_AREA's rule on a growing axis: two taps
    f = ((df + 0.5) * scale - 0.5).to(tl.float32).to(tl.float64)
    sx = tl.floor(f)
    fx = f - sx
    sxu = tl.floor(df * scale)
    fxu = ((df + 1.0) - (sxu + 1.0) / scale).to(tl.float32).to(tl.float64)
    fxu = tl.where(fxu <= 0.0, 0.0, fxu - tl.floor(fxu))
    up = code == 1.0
    sx = tl.where(up, sxu, sx)
    fx = tl.where(up, fxu, fx)
    low = sx < 0.0
    sx = tl.where(low, 0.0, sx)
    fx = tl.where(low, 0.0, fx)
    high = sx >= L - 1.0
    sx = tl.where(high, L - 1.0, sx)
    fx = tl.where(high, 0.0, fx)
    # INTER_AREA shrinking: a partial tap on the left, whole ones, a partial one on the right
    fsx1 = df * scale
    fsx2 = fsx1 + scale
    cell = tl.where(mask, tl.minimum(scale, L - fsx1), 1.0)   # (past ``size`` it is not a cell: no 0 / 0)
    sx2 = tl.minimum(tl.floor(fsx2), L - 1.0)
    sx1 = tl.minimum(tl.ceil(fsx1), sx2)
    left = (sx1 - fsx1) > 1e-3
    right = (fsx2 - sx2) > 1e-3
    part = tl.minimum(tl.minimum(fsx2 - sx2, 1.0), cell) / cell
    down = code == 2.0
    for j in tl.static_range(KB):
        s_j = sx1 - left.to(tl.float64) + j
        whole = (s_j >= sx1) & (s_j < sx2)
        is_left = left & (j == 0)
        is_right = right & (s_j == sx2)
        w_area = tl.where(is_left, (sx1 - fsx1) / cell,
                          tl.where(whole, 1.0 / cell, tl.where(is_right, part, 0.0)))
        i_area = tl.where(is_left | whole | is_right, s_j, 0.0)
        if j == 0:
            i_lin = sx
            w_lin = 1.0 - fx
        elif j == 1:
            i_lin = tl.minimum(sx + 1.0, L - 1.0)
            w_lin = fx
        else:
            i_lin = tl.zeros([BLOCK], dtype=tl.float64)
            w_lin = tl.zeros([BLOCK], dtype=tl.float64)
        i_j = tl.where(down, i_area, i_lin)
        w_j = tl.where(down, w_area, w_lin)
        o = (j * n + s) * size + d
        on = mask & (j < K)
        tl.store(idx + o, (i_j + s0).to(tl.int64), mask=on)
        tl.store(w + o, w_j.to(tl.float32), mask=on)
