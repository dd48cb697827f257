"""Pure kernels by domain: functions of ``(array, **params)`` with no RNG and no I/O.

``geometry`` (2D grids: resize, flip, crop, pad, affine warps; flow has its own
kernels that keep unknown vectors out and move the vectors with the grid),
``colour`` (pixel formats, jitter, noise), ``temporal`` (clip and frame
indices), ``audio`` (length, resampling, gain, shift) and ``volume`` (3D
resampling, HU windows, the lung mask, patches, flips, rotations, elastic
deformation). Layouts are channel-last: images and masks (H, W, C), flow
(H, W, 2), clips (T, H, W, C), volumes (D, H, W), audio (C, N) channels first.
Steps (``precompile.transforms.*``) draw parameters and call these.
"""
