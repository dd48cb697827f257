"""Registered decoders. Importing this package registers the built-in ones."""
from __future__ import annotations

from .base import Decoder, DecoderParams
from . import image  # noqa: F401  (registers "image")

__all__ = ["Decoder", "DecoderParams"]
