"""The documentation is kept true by tests: what is registered is documented, links resolve, the README's
set-up commands are the two CI runs, and the examples run as written.

The rule for the registries (what "documented" means here), over every ``docs/*.md`` page:

- every decoder, step and output format the package registers (as the JSON Schema of ``precompile
  schema`` lists them; classes that tests or user code register are not the docs' business) is named in backticks (`name`) somewhere under docs/;
- every option of each is written in backticks (`option`) *within that item's own text*: a section
  whose heading names the item in backticks (down to the next heading of the same or a higher
  level), a table row whose first cell names it, or a line that names both. An option mentioned only
  under another item does not count, so `size` documented for `resize` does not cover `center_crop`;
- every key of the recipe's top level, ``inputs``, ``inputs.label`` and ``output``, every parameter of
  ``precompile.Loader`` and every CLI command (``precompile <cmd>``) and long option (``--opt``)
  appears somewhere under docs/;
- the table of rules per kind in docs/reference-steps.md equals ``Step.rule`` for every step and kind
  (``python tests/test_docs.py --write-rules`` rewrites it after a change).

Examples: every code block of README.md and docs/*.md runs in tests/test_doc_snippets.py (or says why not);
here the tour's recipe is checked to be recipes/images.yaml.

Links: every relative link and image in README.md, ARCHITECTURE.md and docs/*.md points to a file that
exists (and, for ``#anchor`` links into markdown, to a heading that exists). Pages that other work adds
(``ARRIVING``) are skipped while absent from this checkout.
"""
from __future__ import annotations

import inspect
import re
import shlex
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
#: pages and images the README and docs link to that arrive with other branches; skipped while absent
ARRIVING = {"docs/tables.md", "docs/annotations.md", "docs/coco.md", "docs/faults.md", "docs/quiet-defects.md",
            "docs/preview-segmentation.png", "docs/preview-images_native.png"}
#: example recipes the README's table names that arrive with other branches
ARRIVING_RECIPES = {"segmentation", "coco", "chexpert", "kinetics", "lung_ct_table"}
SETUP_COMMANDS = [
    "pip install -e . && precompile build recipes/images.yaml",
    "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q",
]
RULES_BEGIN, RULES_END = "<!-- rules:begin -->", "<!-- rules:end -->"
RULE_MARK = {"apply": "**A**", "keep": "-", "refuse": "R"}


def doc_pages() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}


def all_docs() -> str:
    return "\n".join(doc_pages().values())


# -- what an item's own text is --------------------------------------------------------------------

HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def item_texts(text: str, name: str) -> list[str]:
    """The parts of ``text`` that document ``name``: heading sections naming it, table rows whose first
    cell names it, and lines that name it (each in backticks)."""
    tick = f"`{name}`"
    lines = text.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        h = HEADING.match(line)
        if h and tick in h.group(2):
            level, body = len(h.group(1)), [line]
            for nxt in lines[i + 1:]:
                m = HEADING.match(nxt)
                if m and len(m.group(1)) <= level:
                    break
                body.append(nxt)
            out.append("\n".join(body))
        elif line.startswith("|") and tick in line.split("|")[1]:
            out.append(line)
        elif tick in line:
            out.append(line)
    return out


def registry_items() -> list[tuple[str, str, list[str]]]:
    """``(what, name, options)`` for every decoder, step and output format the package registers, from the
    schema (classes that tests or recipes register from outside the package are left out)."""
    from precompile.registry import DECODERS, STEPS, WRITERS
    from precompile.tools.schema import recipe_schema

    defs = recipe_schema()["$defs"]
    ours = {n for reg in (DECODERS, STEPS, WRITERS) for n, c in reg.items() if c.__module__.startswith("precompile.")}
    items = []
    for v in defs["field"]["oneOf"]:
        name = v["properties"]["decoder"]["const"]
        items.append(("decoder", name, [k for k in v["properties"] if k not in ("decoder", "path")]))
    for v in defs["step"]["oneOf"]:
        (name, params), = v["properties"].items()
        params = params["anyOf"][0] if "anyOf" in params else params
        items.append(("step", name, [k for k in params.get("properties", {}) if k != "fields"]))
    for v in defs["output"]["oneOf"]:
        name = v["properties"]["format"]["const"]
        items.append(("format", name, list(v["properties"]["options"].get("properties", {}))))
    return [item for item in items if item[1] in ours]


def test_every_decoder_step_and_format_and_each_option_is_documented():
    pages = doc_pages()
    text = "\n".join(pages.values())
    missing = []
    for what, name, options in registry_items():
        if f"`{name}`" not in text:
            missing.append(f"{what} `{name}`: not named in backticks in any docs/*.md")
            continue
        own = "\n".join(t for page in pages.values() for t in item_texts(page, name))
        missing += [f"{what} `{name}`: option `{o}` is not in its section, table row or a line naming it"
                    for o in options if f"`{o}`" not in own]
    assert not missing, "undocumented (see the rule in tests/test_docs.py):\n" + "\n".join(missing)


def test_the_item_rule_is_strict():
    """An option documented only under another item does not count for this one."""
    text = "## `resize`\n\n| `size` | x |\n\n## `center_crop`\n\nno options here\n"
    assert "`size`" in "\n".join(item_texts(text, "resize"))
    assert "`size`" not in "\n".join(item_texts(text, "center_crop"))
    assert "`pad`" in "\n".join(item_texts("| `random_crop` | `size`, `pad` |\n", "random_crop"))


def test_every_recipe_key_is_documented():
    from precompile.tools.schema import recipe_schema

    s = recipe_schema()
    defs = s["$defs"]
    keys = {("top level", k) for k in s["properties"]}
    keys |= {("inputs", k) for k in defs["Inputs"]["properties"]}
    keys |= {("inputs.label", k) for k in defs.get("LabelSpec", {}).get("properties", {})}
    keys |= {("output", k) for v in defs["output"]["oneOf"] for k in v["properties"]}
    text = all_docs()
    missing = sorted(f"{where}: `{k}`" for where, k in keys if f"`{k}`" not in text)
    assert not missing, "recipe keys not documented under docs/:\n" + "\n".join(missing)


def test_every_loader_argument_is_documented():
    import precompile

    text = all_docs()
    params = [p for p in inspect.signature(precompile.Loader.__init__).parameters if p != "self"]
    missing = [p for p in params if f"`{p}`" not in text]
    assert not missing, f"Loader arguments not documented under docs/: {missing}"


def test_every_cli_command_and_option_is_documented():
    import click

    from precompile.cli import main

    text = all_docs()
    missing = []
    for name, cmd in sorted(main.commands.items()):
        if f"precompile {name}" not in text:
            missing.append(f"command `precompile {name}`")
        for p in cmd.params:
            if isinstance(p, click.Option):
                for opt in p.opts + p.secondary_opts:
                    if opt.startswith("--") and opt != "--help" and \
                            not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                        missing.append(f"`precompile {name} {opt}`")
    assert not missing, "CLI not documented under docs/:\n" + "\n".join(missing)


# -- the rules table -------------------------------------------------------------------------------

def rules_table() -> str:
    """The markdown table of ``Step.rule`` for every registered step and kind."""
    from precompile.kinds import Kind
    from precompile.registry import STEPS, load_builtins

    load_builtins()
    kinds = list(Kind)
    rows = ["| step | " + " | ".join(k.value for k in kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for name, cls in sorted(STEPS.items()):
        if cls.__module__.startswith("precompile."):
            rows.append(f"| `{name}` | " + " | ".join(RULE_MARK[cls.rule(k)] for k in kinds) + " |")
    return "\n".join(rows)


def write_rules(path: Path = DOCS / "reference-steps.md") -> None:
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(RULES_BEGIN, 1)
    _, tail = rest.split(RULES_END, 1)
    path.write_text(f"{head}{RULES_BEGIN}\n{rules_table()}\n{RULES_END}{tail}", encoding="utf-8")


def test_the_rules_table_is_the_code():
    text = (DOCS / "reference-steps.md").read_text(encoding="utf-8")
    documented = text.split(RULES_BEGIN, 1)[1].split(RULES_END, 1)[0].strip()
    assert documented == rules_table(), ("docs/reference-steps.md's table of rules per kind differs from "
                                         "Step.rule; run: python tests/test_docs.py --write-rules")


# -- links -----------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    out = set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = HEADING.match(line)
        if m and not in_code:
            out.add(slug(m.group(2)))
    return out


def linking_pages() -> list[Path]:
    return [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted(DOCS.glob("*.md"))]


def test_links_point_to_files_and_headings_that_exist():
    broken = []
    for page in linking_pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else str(dest)
            if not dest.exists():
                if rel not in ARRIVING:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor} in {rel})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_links_every_reference_page_and_the_pages_others_add():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(readme) if not re.match(r"^[a-z]+:", t)}
    want = {p.resolve() for p in DOCS.glob("*.md")} | {(REPO / a).resolve() for a in ARRIVING if a.endswith(".md")}
    assert not want - linked, f"docs pages the README does not link: {sorted(str(p) for p in want - linked)}"


def test_readme_names_every_example_recipe():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w.-]+)\.yaml`", readme))
    have = {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    assert not have - named, f"recipes the README's table does not describe: {sorted(have - named)}"
    assert not named - have - ARRIVING_RECIPES, f"recipes the README names that do not exist: {named - have}"


# -- set up and tour -------------------------------------------------------------------------------

def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_readme_has_exactly_the_two_setup_commands_and_ci_runs_the_second():
    section = readme_section("Set up")
    commands = [ln.strip() for ln in section.splitlines() if ln.startswith("    ") and ln.strip()]
    assert commands == SETUP_COMMANDS
    assert "--index-url https://download.pytorch.org/whl/cpu" in section    # the torch wheel note
    ci = [shlex.split(ln) for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]

    def runs(part: list[str]) -> bool:      # some CI line holds the command's words in order
        for line in ci:
            it = iter(line)
            if all(any(w == x for x in it) for w in part):
                return True
        return False

    for part in SETUP_COMMANDS[1].split("&&"):
        words = shlex.split(part)
        words = words[2:] if words[:2] == ["python", "-m"] else words
        assert runs(words), f".ci/run does not run {part.strip()!r}"


def test_the_tours_recipe_is_recipes_images_yaml():
    block = re.search(r"^```yaml\n(.*?)^```", readme_section("A ten-minute tour"), re.S | re.M).group(1)
    recipe = (REPO / "recipes" / "images.yaml").read_text(encoding="utf-8")
    body = "".join(ln for ln in recipe.splitlines(keepends=True) if not ln.startswith("#"))
    assert block == body


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-rules"]:
        write_rules()
        print("rewrote the rules table in docs/reference-steps.md")
    else:
        print("usage: python tests/test_docs.py --write-rules")
