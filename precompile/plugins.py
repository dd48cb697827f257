"""User code in recipes: decoders and steps from ``imports:`` modules and from installed plugins.

A recipe may name Python modules to import before its decoders and steps are
looked up::

    imports: [my_pkg.my_steps]     # importable module names (sys.path, then the recipe's folder)

Importing the module registers its classes with :func:`register_decoder` /
:func:`register_step` (or ``precompile.registry.DECODERS.register()``). An
installed package can instead declare an entry point in the group
``precompile.plugins`` (``my_pkg = my_pkg.precompile_plugin``); every such
entry point is loaded when a recipe is read.

User classes get the same plan-time checks as built-in ones (their ``Params``
model validates the recipe's options; ``plan``/``output_specs`` give every
shape before anything is decoded) and run the same way under ``-j1``, loky
workers and dask: a worker rebuilds the recipe from its JSON-able model, which
imports the same modules there (nothing user-defined is pickled).

Shard keys include a fingerprint of the user code a recipe uses
(:func:`code_fingerprint`): for each user class, its qualified name, its
``version`` attribute (or its module's or package's ``__version__``, or its
distribution's version) and the SHA-256 of its module's source file. Editing that file, or
bumping the version, rebuilds the shards. A module whose file changed since it
was imported is re-imported before use, so the code that runs is the code that
was fingerprinted. Helper modules that a plugin module imports are not
hashed: bump ``version`` when only they change.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import threading
from typing import Any, Callable, Optional, TypeVar

from .errors import BuildError, RecipeError

ENTRY_POINT_GROUP = "precompile.plugins"
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))

T = TypeVar("T")

_lock = threading.RLock()
_source_hash: dict[str, Optional[str]] = {}   # module name -> sha256 of its source file when (re)imported
_entry_points_loaded = False


def register_decoder(name: Optional[str] = None) -> Callable[[T], T]:
    """Class decorator: register a :class:`precompile.decoders.Decoder` subclass under ``name``."""
    from .decoders.base import Decoder
    from .registry import DECODERS

    def deco(cls: T) -> T:
        _check_class(cls, Decoder, "decoder")
        return DECODERS.register(name)(cls)

    return deco


def register_step(name: Optional[str] = None) -> Callable[[T], T]:
    """Class decorator: register a :class:`precompile.transforms.Step` subclass under ``name``."""
    from .registry import STEPS
    from .transforms.base import Step

    def deco(cls: T) -> T:
        _check_class(cls, Step, "step")
        return STEPS.register(name)(cls)

    return deco


def _check_class(cls: Any, base: type, what: str) -> None:
    from pydantic import BaseModel

    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"a {what} must be a subclass of {base.__module__}.{base.__qualname__}, got {cls!r}")
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise TypeError(f"{what} {cls.__qualname__}: Params must be a pydantic model class")


def is_user_class(cls: type) -> bool:
    """True for a class defined outside the precompile package itself."""
    mod = sys.modules.get(cls.__module__)
    f = getattr(mod, "__file__", None)
    if f is None:
        return not cls.__module__.startswith("precompile.")
    return not os.path.abspath(f).startswith(_PKG_DIR + os.sep)


def _hash_file(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def _module_file(mod: Any) -> Optional[str]:
    f = getattr(mod, "__file__", None)
    if f and f.endswith((".pyc", ".pyo")):
        f = f[:-1]
    return f if f and os.path.isfile(f) else None


def _record(name: str) -> None:
    _source_hash[name] = _hash_file(_module_file(sys.modules.get(name)))


def _fresh(name: str) -> bool:
    """Re-import module ``name`` if its source file changed since it was imported here; True if it was."""
    mod = sys.modules[name]
    if name not in _source_hash:
        _record(name)
        return False
    now = _hash_file(_module_file(mod))
    if now is not None and now != _source_hash[name]:
        importlib.invalidate_caches()
        importlib.reload(mod)   # its register decorators run again and replace the old classes
        _record(name)
        return True
    return False


def import_modules(names: list[str], source: Optional[str], base_dir: str) -> None:
    """Import (or refresh) the recipe's ``imports``; errors name the recipe key."""
    with _lock:
        for i, name in enumerate(names):
            loc = f"imports[{i}]"
            if not isinstance(name, str) or not MODULE_RE.match(name):
                raise RecipeError(f"{name!r} is not a module name (dotted Python identifiers, e.g. my_pkg.steps)",
                                  source=source, loc=loc)
            try:
                if name in sys.modules:
                    _fresh(name)
                    continue
                try:
                    importlib.import_module(name)
                except ModuleNotFoundError as e:
                    top = name.split(".")[0]
                    if e.name not in (name, top) and not name.startswith(f"{e.name}."):
                        raise
                    # not on sys.path: also look in the recipe's folder (after everything else, so a file
                    # there never shadows an installed module)
                    if base_dir and base_dir not in sys.path:
                        sys.path.append(base_dir)
                        importlib.invalidate_caches()
                    importlib.import_module(name)
                _record(name)
            except RecipeError:
                raise
            except ModuleNotFoundError as e:
                raise RecipeError(f"cannot import {name!r}: {e} (searched sys.path and the recipe's folder "
                                  f"{base_dir})", source=source, loc=loc) from None
            except Exception as e:
                raise RecipeError(f"importing {name!r} failed: {type(e).__name__}: {e}", source=source,
                                  loc=loc) from e


def load_entry_points(source: Optional[str] = None) -> None:
    """Load every installed ``precompile.plugins`` entry point once per process."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            try:
                ep.load()
            except Exception as e:
                raise RecipeError(f"the installed plugin {ep.name!r} ({ep.value}, entry point group "
                                  f"{ENTRY_POINT_GROUP!r}) failed to load: {type(e).__name__}: {e}",
                                  source=source) from e
            mod = ep.value.split(":")[0].strip()
            if mod in sys.modules:
                _record(mod)


def refresh_class(cls: type, registry: Any, name: str) -> type:
    """``cls``, or the class registered under ``name`` again after its module was re-imported."""
    with _lock:
        mod = cls.__module__
        if mod not in sys.modules or mod == "__main__" or not is_user_class(cls):
            return cls
        parts = mod.split(".")
        for i in range(1, len(parts)):  # parent packages first: they may hold the __version__
            parent = ".".join(parts[:i])
            if parent in sys.modules:
                _fresh(parent)
        if _fresh(mod):
            return registry.get(name)
    return cls


def _version_of(cls: type) -> Optional[str]:
    v = getattr(cls, "version", None)
    if v is not None:
        return str(v)
    parts = cls.__module__.split(".")
    for i in range(len(parts), 0, -1):  # the module's __version__, else its package's
        v = getattr(sys.modules.get(".".join(parts[:i])), "__version__", None)
        if v is not None:
            return str(v)
    top = cls.__module__.split(".")[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top, [])
        if dists:
            return importlib.metadata.version(dists[0])
    except Exception:  # broken metadata: the source hash still counts
        pass
    return None


def class_fingerprint(cls: type) -> dict[str, Any]:
    mod = cls.__module__
    src = _source_hash.get(mod)
    if src is None:
        src = _hash_file(_module_file(sys.modules.get(mod)))
    if src is None:
        try:  # a class defined in a notebook or `python -c`: hash its own source text
            src = hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()
        except (OSError, TypeError):
            src = None
    return {"class": f"{mod}.{cls.__qualname__}", "version": _version_of(cls), "source_sha256": src}


def code_fingerprint(decoders: dict[str, Any], steps: list[Any]) -> dict[str, Any]:
    """Fingerprints of the user classes among ``decoders`` and ``steps`` ({} when all are built in)."""
    out: dict[str, Any] = {}
    for f, d in sorted(decoders.items()):
        if is_user_class(type(d)):
            out[f"decoder:{type(d).name}"] = class_fingerprint(type(d))
    for s in steps:
        if is_user_class(type(s)):
            out[f"step:{type(s).name}"] = class_fingerprint(type(s))
    return out


def check_same_code(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    """In a worker: the user code loaded here must be what the build planned with."""
    if expected == actual:
        return
    for k in sorted(set(expected) | set(actual)):
        if expected.get(k) != actual.get(k):
            e, a = expected.get(k) or {}, actual.get(k) or {}
            raise BuildError(f"the user code for {k} ({e.get('class') or a.get('class')}) in this worker differs "
                             f"from the code the build planned with (version {e.get('version')} -> "
                             f"{a.get('version')}, source {str(e.get('source_sha256'))[:12]} -> "
                             f"{str(a.get('source_sha256'))[:12]}); was it edited during the build? Run build again")


__all__ = ["ENTRY_POINT_GROUP", "register_decoder", "register_step", "import_modules", "load_entry_points",
           "code_fingerprint"]
