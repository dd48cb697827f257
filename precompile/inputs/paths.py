"""The path rule: every input read lies under ``inputs.root`` (docs/reference-recipe.md, "Paths and symlinks").

Two halves. The lexical checks, at plan time, on the paths an input kind makes (a template filled with
captures, a table's cells, a COCO ``file_name``): :func:`leaves_root` (absolute, a '..' part, a NUL byte),
:func:`path_problem` (a path no file can have). And :class:`InputRoot`, in the shard task, before an input is
opened: the path as written, and for a local root once symbolic links are resolved.
"""
from __future__ import annotations

import os
import stat
from typing import Any, Optional

from ..errors import DecodeError, echo
from ..storage.remote import dotted, is_url

#: the longest path a row may give (Linux's PATH_MAX): a longer one names no file on any file system
MAX_PATH_CHARS = 4096


def local_prefix(root: str, remote: bool) -> str:
    """What every input path of a folder listing starts with (a listed path is this plus its relative path)."""
    return f"{root}/" if remote else os.path.join(root, "")


def leaves_root(rel: str) -> bool:
    """Whether a path made from the file (relative to ``inputs.root``, '/'-separated) leaves the root as
    written: absolute, a '..' part, or a NUL byte (what the plan checks; symlinks are resolved when the
    input is read: :class:`InputRoot`)."""
    return rel.startswith("/") or ".." in rel.split("/") or "\0" in rel


def path_problem(rel: str) -> Optional[str]:
    """Why a path a row gives can name no file (a NUL byte, more than :data:`MAX_PATH_CHARS` characters),
    or None."""
    if "\x00" in rel:
        return f"the path {echo(rel)} holds a NUL byte, which no file name can"
    if len(rel) > MAX_PATH_CHARS:
        return f"the path {echo(rel)} is longer than {MAX_PATH_CHARS} characters, which no file system takes"
    return None


class InputRoot:
    """The path rule (docs/reference-recipe.md, "Paths and symlinks"): every input read lies under
    ``inputs.root``, as written (no '..' part, nothing outside the root's text) and, for a local root, once
    symbolic links are resolved (unless ``inputs.follow_links: outside``). Made once per recipe and process:
    the root's own resolved path is worked out once, and only the parts of a path below the root are looked
    at (one ``lstat`` each, the folders found free of links remembered: about one ``lstat`` an input, which
    also tells that it exists); a link among them is resolved in full (``os.path.realpath``) and must lead
    back under the root (benchmarks/bench_input_paths.py)."""

    def __init__(self, recipe: Any):
        root = recipe.input_root
        self.remote = is_url(root)
        self.root = root.rstrip("/") + "/" if self.remote else os.path.join(root, "")
        self.real = None if self.remote else os.path.join(os.path.realpath(root), "")
        self.follow = recipe.model.inputs.follow_links == "outside"
        self.plain: set[str] = set()   # folders below the root with no link on the way

    @classmethod
    def of(cls, recipe: Any) -> "InputRoot":
        rule = recipe.__dict__.get("_input_root")
        if rule is None:
            rule = recipe.__dict__["_input_root"] = cls(recipe)
        return rule

    def check(self, path: str) -> bool:
        """A DecodeError (the input's) when ``path`` leaves the root; the caller adds the field and key.
        Returns True when the look-ups found that the path exists (no ``os.path.exists`` needed then)."""
        sep = "/" if self.remote else os.sep
        if not path.startswith(self.root) or ".." in path[len(self.root):].split(sep):
            what = "another place" if self.remote else "an absolute path"
            raise DecodeError(f"the path leaves inputs.root {echo(self.root[:-1])} ('..' or {what})", path=path,
                              stage="decode")
        if self.remote and dotted(path[len(self.root):]):
            raise DecodeError(f"the path leaves inputs.root {echo(self.root[:-1])} (a '..' part once "
                              f"percent-decoded, or between backslashes: an HTTP client or a server resolves it "
                              f"to another place)", path=path, stage="decode")
        if self.remote or self.follow:
            return False
        if self._plain(path):
            return True
        real = os.path.realpath(path)
        if not (real + os.sep).startswith(self.real):
            raise DecodeError(f"the path resolves to {echo(real)}, outside inputs.root {echo(self.real[:-1])} (a "
                              f"symbolic link out of the root; `inputs.follow_links: outside` allows it for a "
                              f"trusted layout)", path=path, stage="decode")
        return False

    def _plain(self, path: str) -> bool:
        """Whether ``path`` exists and no part of it below the root is a symbolic link (False: a link, or a
        part missing or unreadable: resolve it in full, and let the caller look for the file). ``plain``
        remembers the folders whose every part below the root is no link: then one ``lstat`` decides."""
        path = path.rstrip(os.sep)   # (an lstat of "link/" would follow the link)
        if len(path) < len(self.root):
            return False   # the root itself
        try:
            folder = path.rpartition(os.sep)[0]
            if folder + os.sep != self.root and folder not in self.plain:
                d = self.root[:-1]
                for part in folder[len(self.root):].split(os.sep):
                    d = f"{d}{os.sep}{part}"
                    if part not in ("", ".") and stat.S_ISLNK(os.lstat(d).st_mode):
                        return False
                self.plain.add(folder)
            return not stat.S_ISLNK(os.lstat(path).st_mode)
        except OSError:
            return False
