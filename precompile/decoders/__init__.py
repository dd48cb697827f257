"""Registered decoders. Importing this package registers the built-in ones."""
from __future__ import annotations

from .base import Decoder, DecoderParams
from . import image  # noqa: F401  (registers "image")
from . import audio, dicom, flo, mask, video  # noqa: F401  (audio, dicom, dicom_series, flo, flow_mask, mask, video)
from . import nifti  # noqa: F401  (nifti, nifti_labels)

__all__ = ["Decoder", "DecoderParams"]
