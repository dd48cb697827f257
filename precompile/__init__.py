"""precompile: an offline dataset preprocessing compiler.

Public API: :func:`open` (map-style dataset over a built output),
:func:`load_recipe` (a path or a dict), :func:`build` (a path, a dict or a
``Recipe``; returns the build report), :class:`Loader` (the GPU-feeding reader), :class:`Mix` (several builds
mixed by weight, with the source of every sample),
:func:`collate` (a ``DataLoader``'s ``collate_fn`` over :func:`open`),
:func:`detection_targets` (a padded batch as per-image detection target dicts) and
:func:`coco_results` / :func:`write_coco_results` (detections mapped back to the source images as COCO
results, for ``COCOeval``).
Imports are lazy so that ``import precompile`` stays light and the build
path never pulls in torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["open", "load_recipe", "build", "Loader", "Mix", "collate", "detection_targets", "coco_results",
           "write_coco_results", "__version__"]


#: name -> (module, attribute): what ``import precompile`` does not import until first used
_LAZY = {
    "open": (".formats", "open_dataset"),         # a built output as a map-style dataset
    "load_recipe": (".recipe", "load_recipe"),    # a validated Recipe from a YAML file's path or a dict
    "build": (".compiler", "build"),              # the compiler's entry point
    "Loader": (".reader.loader", "Loader"),       # the GPU-feeding reader (imports torch)
    "Mix": (".reader.mix", "Mix"),                # several builds mixed by weight (imports torch)
    "coco_results": (".tools.coco_results", "coco_results"),              # predictions -> COCO result records
    "write_coco_results": (".tools.coco_results", "write_coco_results"),  # ... written as a results JSON
    "collate": (".reader.targets", "collate"),    # a DataLoader's collate_fn over precompile.open (imports torch)
    "detection_targets": (".reader.targets", "detection_targets"),   # padded batch -> per-image target dicts
}


def __getattr__(name: str):
    """The lazy exports (the one lazy mechanism of the package): see ``_LAZY``."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module, __name__), attr)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'precompile' has no attribute {name!r}")
