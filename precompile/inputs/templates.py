"""The path templates of a folder listing and of ``inputs.coco``: ``{name}`` captures.

``inputs.match`` is a relative path with ``{name}`` captures (each matches one path component or part of one;
``where`` narrows a capture with a regular expression): :func:`pattern_regex`. A field's own ``path:`` is a
template over the same captures: :func:`fill_template`. (A table's templates, ``{column:spec}`` over a row's
cells, are the table's: :mod:`precompile.inputs.table.cells`.) The recipe checks its templates with these same
rules.
"""
from __future__ import annotations

import re

#: a ``{name}`` capture in ``inputs.match`` or a field's ``path``
CAPTURE_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def pattern_regex(pattern: str, where: dict[str, str]) -> re.Pattern:
    """The regular expression of an ``inputs.match`` pattern: ``{name}`` captures (a repeat must match the
    same text), each ``[^/]+`` or its ``where`` expression; everything else literal."""
    out, pos, seen = [], 0, set()
    for m in CAPTURE_RE.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        if name in seen:
            out.append(f"(?P={name})")
        else:
            seen.add(name)
            out.append(f"(?P<{name}>{where[name]})" if name in where else f"(?P<{name}>[^/]+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


def fill_template(template: str, captures: dict[str, str]) -> str:
    """Put capture values into ``{name}`` slots; nothing else in the template is interpreted."""
    return CAPTURE_RE.sub(lambda m: captures[m.group(1)], template)
