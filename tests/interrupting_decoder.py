"""Test decoder of test_rebuild_equals_clean_outside: the image decoder, which raises KeyboardInterrupt (what a
Ctrl-C raises in the build's process) on the input whose file name is in PRECOMPILE_TEST_INTERRUPT_AT, so a
-j1 build stops mid-way as an interrupted one does. A module of its own, importing only what a build imports."""
from __future__ import annotations

import os

from precompile.decoders.image import ImageDecoder
from precompile.registry import DECODERS


class _InterruptingImage(ImageDecoder):
    name = "_interrupting_image_test"

    def read(self, path):
        if os.path.basename(path) == os.environ.get("PRECOMPILE_TEST_INTERRUPT_AT"):
            raise KeyboardInterrupt
        return super().read(path)


if _InterruptingImage.name not in DECODERS:
    DECODERS.register()(_InterruptingImage)
