"""The house's walls (ARCHITECTURE.md, "Rooms and floors"): the import graph of precompile/, module-level and
function-level imports alike, has no circle but the registry's plugin loading, and no room imports a room it
may not (every allowed import goes down the floors).

The graph is read from the source (``ast``), not from ``sys.modules``: an import inside a function counts as
much as one at the top of a module. ``from . import x``, ``from .x import y``, ``from .. import x`` and
``import precompile.x`` are all edges; a module importing its own package (``from . import names`` in
``formats/dataset.py`` names ``precompile.formats.names``, not ``precompile.formats``) is not an edge to the
package's ``__init__``, which Python runs first anyway.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "precompile"

#: the rooms from the lowest floor up; a room may import only rooms on floors below its own, and of those only
#: what ALLOWED lists (rooms on one floor never import each other)
FLOORS: list[tuple[str, ...]] = [
    ("base",),                            # errors, kinds, sample, seeding, optschema, spill
    ("storage", "kernels", "registry"),   # files and stores; pure kernels; name -> class registries
    ("decoders", "transforms", "formats"),
    ("plugins", "inputs"),
    ("recipe",),
    ("tools",),
    ("compiler", "reader"),
    ("front",),                           # the package's __init__, cli, __main__, lightning, hf
]

#: module prefix -> room (the longest prefix wins)
ROOMS = {
    "precompile.errors": "base", "precompile.kinds": "base", "precompile.sample": "base",
    "precompile.seeding": "base", "precompile.optschema": "base", "precompile.spill": "base",
    "precompile.storage": "storage", "precompile.transforms.kernels": "kernels", "precompile.registry": "registry",
    "precompile.decoders": "decoders", "precompile.transforms": "transforms", "precompile.formats": "formats",
    "precompile.plugins": "plugins", "precompile.inputs": "inputs", "precompile.recipe": "recipe",
    "precompile.tools": "tools", "precompile.compiler": "compiler", "precompile.reader": "reader",
    "precompile": "front", "precompile.cli": "front", "precompile.__main__": "front",
    "precompile.lightning": "front", "precompile.hf": "front",
}

#: room -> the rooms it may import (its own always)
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "storage": {"base"},
    "kernels": {"base"},
    "registry": {"base"},
    "decoders": {"base", "kernels", "registry"},
    "transforms": {"base", "kernels", "registry"},
    "formats": {"base", "storage", "kernels", "registry"},
    "plugins": {"base", "registry", "decoders", "transforms"},
    "inputs": {"base", "storage", "decoders", "formats"},
    "recipe": {"base", "storage", "kernels", "registry", "decoders", "transforms", "formats", "plugins", "inputs"},
    "tools": {"base", "storage", "registry", "formats", "recipe"},
    # the build: everything below it; the reader: the on-disk formats and the device steps, never the recipe,
    # the inputs or the decoders
    "compiler": {"base", "storage", "kernels", "registry", "decoders", "transforms", "formats", "plugins", "inputs",
                 "recipe", "tools"},
    "reader": {"base", "storage", "kernels", "registry", "transforms", "formats", "tools"},
    "front": {"base", "storage", "kernels", "registry", "decoders", "transforms", "formats", "plugins", "inputs",
              "recipe", "tools", "compiler", "reader"},
}

#: the one accepted circle: the registry loads the built-in families (registry.load_builtins), which register in it
REGISTRY_LOADING = {("precompile.registry", f"precompile.{p}") for p in ("decoders", "formats", "transforms")}


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = (package, *p.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: the line of the first such import}, every import in the file
    (module level, in functions, in ``if TYPE_CHECKING``)."""
    mods = modules(root, package)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for m, path in mods.items():
        here = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for t in names:
                if t in mods and t != m and not m.startswith(t + "."):
                    graph[m].setdefault(t, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]], accepted: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), ``accepted`` edges left
    out; each sorted, the list sorted."""
    edges = {m: sorted(t for t in ts if (m, t) not in accepted) for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            for j in range(i, len(edges[v])):
                w = edges[v][j]
                if w not in index:
                    work += [(v, j + 1), (w, 0)]
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
    return sorted(out)


def room_of(module: str) -> str:
    best = max((p for p in ROOMS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise KeyError(f"{module} is in no room: add it to ROOMS (and to ARCHITECTURE.md)")
    return ROOMS[best]


def _where(graph: dict[str, dict[str, int]], a: str, b: str) -> str:
    path = modules(PACKAGE, "precompile")[a].relative_to(REPO)
    return f"{path}:{graph[a][b]}: {a} -> {b}"


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph(PACKAGE, "precompile")


def test_no_circle_but_the_registrys(graph):
    found = circles(graph, REGISTRY_LOADING)
    detail = ["  " + _where(graph, a, b) for comp in found for a in comp for b in graph[a] if b in comp]
    assert not found, "import circles (each module reaches the others and itself):\n" + "\n".join(
        f"  {c}" for c in found) + "\n" + "\n".join(detail)


def test_the_registrys_circle_is_the_loading_of_the_builtins(graph):
    """With the loading edges in, the registry and the families are one circle; the exception is that and no more."""
    assert all(b in graph[a] for a, b in REGISTRY_LOADING)
    ring = [c for c in circles(graph) if "precompile.registry" in c]
    assert len(ring) == 1 and {"precompile.decoders", "precompile.formats", "precompile.transforms"} <= set(ring[0])


def test_every_module_is_in_a_room(graph):
    for m in graph:
        room_of(m)


def test_no_room_imports_a_room_it_may_not(graph):
    bad = [_where(graph, a, b) + f" ({room_of(a)} may not import {room_of(b)})"
           for a in sorted(graph) for b in sorted(graph[a])
           if room_of(a) != room_of(b) and room_of(b) not in ALLOWED[room_of(a)] and (a, b) not in REGISTRY_LOADING]
    assert not bad, "imports against the floors (ARCHITECTURE.md, Rooms and floors):\n" + "\n".join(bad)


def test_the_allowed_imports_go_down_the_floors():
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    assert set(floor) == set(ALLOWED) == set(ROOMS.values())
    up = [(a, b) for a, bs in ALLOWED.items() for b in bs if floor[b] >= floor[a]]
    assert not up, f"ALLOWED lets a room import its own floor or one above: {up}"


def test_the_walker_sees_every_kind_of_import_and_finds_a_circle(tmp_path):
    """The walker on a small package of its own: each form of import is an edge, a circle through a function's
    import is found, and a module's import of its own package is not an edge."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",                                 # from . import module
        "b.py": "def f():\n    from .sub.c import thing\n",          # function level, from .x.y import name
        "sub/__init__.py": "from .. import d\n",                     # from .. import module
        "sub/c.py": "from . import e\nthing = 1\n",                  # a sibling in the subpackage
        "sub/e.py": "import pkg.a\nfrom pkg import sub\n",           # absolute; its own package: no edge
        "d.py": "x = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    g = import_graph(pkg, "pkg")
    assert {m: set(t) for m, t in g.items() if t} == {
        "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": {"pkg.d"}, "pkg.sub.c": {"pkg.sub.e"},
        "pkg.sub.e": {"pkg.a"}}
    assert circles(g) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.e"]]
    assert circles(g, {("pkg.b", "pkg.sub.c")}) == []


def test_architecture_names_every_room():
    """ARCHITECTURE.md's table of rooms names each room of this test (so the two are read together)."""
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [room for room in ALLOWED if f"**{room}**" not in text]
    assert not missing, f"ARCHITECTURE.md does not describe the room(s) {missing} (as **name**)"
    assert os.path.basename(__file__) in text
