"""The project's error types: every failure a user can cause is one of these.

Each error carries where it happened (a recipe file and key path, or an input
file and a stage) so the CLI can print one clean line and an exit code.
"""
from __future__ import annotations

from typing import Any

#: how many characters of an input's own text (a cell, a path, a parser's words about it) a message echoes
ECHO_CHARS = 200


#: the longest a RecipeError's message and key path may be (a recipe value quoted whole could be megabytes)
MAX_MESSAGE_CHARS = 2000
MAX_LOC_CHARS = 400


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: a message never grows with its input."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def echo(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` as a message quotes it, cut like :func:`clip` (a long string's repr is never built
    whole)."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return clip(repr(value), limit)


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'a', 'b'?"`` naming the choices close to ``name`` (difflib), or ``""`` when none is."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    if close:   # only those about as close as the closest ('start_sec': 'start_s', not 'rotate' beside it)
        score = [difflib.SequenceMatcher(None, name, c).ratio() for c in close]
        close = [c for c, r in zip(close, score) if r >= max(score) - 0.15]
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


class PrecompileError(Exception):
    """Base of every error precompile raises on purpose."""

    exit_code = 1


class RecipeError(PrecompileError):
    """The recipe is malformed: names the recipe file and the key path."""

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, loc: str | None = None):
        # a message quotes the recipe's text, which may be any length: bounded here, whoever raised it
        loc = clip(loc, MAX_LOC_CHARS) if loc else loc
        message = clip(message, MAX_MESSAGE_CHARS)
        self.source = source
        self.loc = loc
        self.detail = message
        where = ": ".join(p for p in (source, loc) if p)
        super().__init__(f"{where}: {message}" if where else message)


class PlanError(PrecompileError):
    """The recipe is well formed but its inputs or shapes do not work out."""

    exit_code = 2


class InputError(PrecompileError):
    """An input file could not be turned into a sample.

    ``path`` is the input file, ``stage`` one of decode/steps/write, ``field``
    the recipe field and ``key`` the sample key.
    """

    exit_code = 3

    def __init__(self, message: str, *, path: str | None = None, stage: str | None = None,
                 field: str | None = None, key: str | None = None):
        self.path = path
        self.stage = stage
        self.field = field
        self.key = key
        self.detail = message
        parts = []
        if path:
            parts.append(str(path))
        if stage:
            parts.append(f"stage {stage}")
        if field:
            parts.append(f"field {field!r}")
        where = ", ".join(parts)
        super().__init__(f"{where}: {message}" if where else message)

    def with_context(self, **kw: str | None) -> "InputError":
        """Return a copy with missing context filled in from ``kw``: of the same type with the same attributes,
        made without calling the type's constructor (a plugin's subclass may take other arguments:
        ``BadMagic(magic, offset)``)."""
        fill = {k: getattr(self, k) or v for k, v in kw.items()}
        cur = dict(path=self.path, stage=self.stage, field=self.field, key=self.key)
        cur.update(fill)
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__)
        InputError.__init__(err, self.detail, **cur)
        err.__cause__ = self.__cause__
        return err


class DecodeError(InputError):
    """An input file is unreadable, truncated, or not what its decoder expects."""


class StepError(InputError):
    """A step could not be applied to a decoded sample."""


class MissingDependencyError(PrecompileError):
    """An optional library is needed; the message names the extra to install."""

    exit_code = 4


class FormatError(PrecompileError):
    """An output file is missing, corrupt, or of an unknown format version."""

    exit_code = 5


class SampleError(PrecompileError, ValueError):
    """A sample does not fit the shard it is written to (dtype, rank, shape, a file format's limits);
    ``field`` names the field at fault. The engine reports it as the input's StepError (stage write)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ShapeMismatchError(PrecompileError, ValueError):
    """``batch`` was asked to stack samples of different shapes without padding."""


class UnknownName(PrecompileError, KeyError):
    """A registry lookup of a name nobody registered; the message lists the close matches."""

    exit_code = 2

    def __init__(self, kind: str, name: str, choices: list[str]):
        self.kind = kind
        self.name = name
        self.choices = choices
        hint = did_you_mean(name, choices)
        self.message = f"unknown {kind} {echo(name)}{hint} (known: {', '.join(sorted(choices))})"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.kind, self.name, self.choices))


class BuildError(PrecompileError):
    """A build stopped: one or more shards failed under ``on_error: fail``."""

    exit_code = 3


class OutputError(PrecompileError):
    """The output folder cannot take the build: out of space (ENOSPC, EDQUOT), read-only, vanished, an I/O
    error, or not a local folder. Names the folder and, for space, the bytes needed and free. Never about an
    input: what was built before is kept (the index still names the previous build)."""

    exit_code = 6


class WorkerKilledError(PrecompileError):
    """A worker process was killed by a signal it cannot catch (SIGKILL: on Linux, most often the kernel's
    out-of-memory killer). Not about an input: the message suggests fewer jobs or smaller shards."""

    exit_code = 7


class CacheError(PrecompileError):
    """The local cache of a build read from a URL cannot hold what the reader needs: a shard larger than
    ``cache_limit``, batches that need more than it at once, files in use by other processes filling it,
    or a cache folder that cannot be used. Names the folder and both sizes; nothing in the cache is lost."""


class SourceMapError(PrecompileError, ValueError):
    """``Dataset.to_source`` cannot map a sample's coordinates back to its source image: the sample has no
    image, its build recorded no map (built before precompile recorded one: rebuild it), or a step moved the
    image by a map that is not a known 2D affine one (the message names the step)."""
