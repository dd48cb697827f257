"""precompile: an offline dataset preprocessing compiler.

Public API: :func:`open` (map-style dataset over a built output),
:func:`load_recipe` (a path or a dict), :func:`build` (a path, a dict or a
``Recipe``; returns the build report), and :class:`Loader` (the GPU-feeding reader).
Imports are lazy so that ``import precompile`` stays light and the build
path never pulls in torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["open", "load_recipe", "build", "Loader", "__version__"]


def open(path, fields=None):  # noqa: A001  (mirrors h5py.File / builtins.open naming on purpose)
    """Open a built output as a map-style dataset."""
    from .formats import open_dataset

    return open_dataset(path, fields=fields)


def load_recipe(path_or_dict, base_dir=None):
    """A validated :class:`~precompile.recipe.Recipe` from a YAML file's path or from a dict
    (relative paths in a dict resolve against ``base_dir``, default the current folder)."""
    if isinstance(path_or_dict, dict):
        from .recipe import parse_recipe

        return parse_recipe(path_or_dict, base_dir=base_dir)
    import os as _os

    from .recipe import load_recipe as _load

    if not isinstance(path_or_dict, (str, _os.PathLike)):
        from .errors import RecipeError

        raise RecipeError(f"expected a recipe file's path or a dict, got {type(path_or_dict).__name__}")

    return _load(path_or_dict)


def __getattr__(name):
    if name == "build":
        # the submodule precompile.build is callable: precompile.build(recipe, out_dir=..., n_jobs=...)
        import importlib

        return importlib.import_module(".build", __name__)
    if name == "Loader":
        from .reader.loader import Loader

        return Loader
    raise AttributeError(f"module 'precompile' has no attribute {name!r}")
