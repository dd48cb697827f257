"""The test decoder of test_readers_agree_outside: an .npz (no pickles) -> the arrays it holds, as the fields its
``specs`` option declares (JSON: ``{name: [kind, shape, dtype, of]}``, shape entries null where they vary). A
module of its own, importing only what a build imports (a build's workers import the module that defines a
decoder; the build path never imports torch)."""
from __future__ import annotations

import json

import numpy as np

from precompile.decoders.base import Decoder, DecoderParams
from precompile.registry import DECODERS
from precompile.sample import FieldSpec


class _AnyArrays(Decoder):
    name = "_readers_outside_test"
    kind = "image"

    class Params(DecoderParams):
        specs: str = "{}"

    def output_specs(self, field):
        specs = json.loads(self.params.specs)
        return {field if n == "@" else n: FieldSpec(k, tuple(s), d, of=o) for n, (k, s, d, o) in specs.items()}

    def decode(self, path, field):
        names = list(self.output_specs(field))
        with np.load(path, allow_pickle=False) as z:
            return {n: z["@" if n == field else n] for n in names}, {}


if _AnyArrays.name not in DECODERS:
    DECODERS.register()(_AnyArrays)
