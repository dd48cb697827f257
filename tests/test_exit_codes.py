"""The exit codes the CLI can return are the ones docs/reference-cli.md's table lists, and docs/faults.md
agrees with it (issue 35: the table lacked 6, the output folder and the store, and 7).

The code's side is read from the source, so a new code fails here until it is documented: every class under
precompile/ that sets its own ``exit_code`` (``exit_code = N``, or another class's ``X.exit_code``), every
constant ``sys.exit(N)`` (``sys.exit(a if c else b)`` too), click's usage errors (an unknown option: its
``UsageError.exit_code``) and 0. Each code is a row of the table, each row a code the CLI can return, and each
class that sets a code is named in backticks in its code's row."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "precompile"


def _const(node: ast.AST, classes: dict[str, int]) -> list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _const(node.body, classes) + _const(node.orelse, classes)
    if isinstance(node, ast.Attribute) and node.attr == "exit_code" and isinstance(node.value, ast.Name):
        return [classes[node.value.id]] if node.value.id in classes else []
    return []


def code_sources() -> dict[int, set[str]]:
    """{exit code: what returns it} from the package's source: class names that set ``exit_code``,
    ``sys.exit`` sites (``file:line``), ``click usage`` and ``done``."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(PKG.rglob("*.py"))}
    classes: dict[str, int] = {}
    for _ in range(2):      # twice: a class may take another's code (VerifyResult: FormatError.exit_code)
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    for st in node.body:
                        target = st.targets[0] if isinstance(st, ast.Assign) else getattr(st, "target", None)
                        if isinstance(target, ast.Name) and target.id == "exit_code" and st.value is not None:
                            for v in _const(st.value, classes):
                                classes[node.name] = v
    out: dict[int, set[str]] = {0: {"done"}, click.UsageError.exit_code: {"click usage"}}
    for name, code in classes.items():
        out.setdefault(code, set()).add(name)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit"
                    and getattr(node.func.value, "id", None) == "sys" and node.args):
                for v in _const(node.args[0], {}):
                    out.setdefault(v, set()).add(f"{path.relative_to(REPO)}:{node.lineno}")
    return out


def table_rows(page: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table of ``page`` whose header line starts with ``header``."""
    lines = (REPO / "docs" / page).read_text(encoding="utf-8").splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]])
    return rows


def documented() -> dict[int, str]:
    """{code: meaning} of docs/reference-cli.md's exit-code table."""
    return {int(r[0]): r[1] for r in table_rows("reference-cli.md", "| exit code |")}


def test_the_cli_table_lists_every_code_the_cli_returns_and_no_other():
    code, doc = code_sources(), documented()
    assert {1, 2, 3, 4, 5, 6, 7, 130, 143} <= set(code), code    # what the reader reads is the code
    missing = {c: sorted(w) for c, w in code.items() if c not in doc}
    assert not missing, f"exit codes the CLI returns that docs/reference-cli.md's table lacks: {missing}"
    extra = sorted(set(doc) - set(code))
    assert not extra, f"docs/reference-cli.md lists exit codes nothing returns: {extra}"


def test_each_error_class_is_named_in_its_codes_row():
    doc = documented()
    wrong = [f"`{name}` (exit {c}) is not named in the row of {c}" for c, names in code_sources().items()
             for name in names if name[0].isupper() and name != "VerifyResult" and f"`{name}`" not in doc.get(c, "")]
    assert not wrong, "docs/reference-cli.md's exit codes:\n" + "\n".join(wrong)
    assert "`verify`" in doc[5] and "command line" in doc[click.UsageError.exit_code]
    assert "`OutputError`" in doc[6] and "store" in doc[6] and "output folder" in doc[6]


def test_faults_md_uses_the_same_codes():
    doc = documented()
    used = []
    for row in table_rows("faults.md", "| fault |"):
        used += [int(n) for n in re.findall(r"\b\d+\b", row[2])]
    assert used and not sorted(set(used) - set(doc)), f"faults.md's table uses codes reference-cli.md lacks: " \
                                                     f"{sorted(set(used) - set(doc))}"
    text = (REPO / "docs" / "faults.md").read_text(encoding="utf-8")
    para = text[text.index("Exit codes of `precompile build`"):]
    para = para[:para.index("\n\n")]
    said = {int(n) for n in re.findall(r"[:;,.]\s+\**(\d+)\b", para)}
    assert said == set(doc), f"faults.md's summary of the exit codes {sorted(said)} differs from reference-cli.md's " \
                             f"table {sorted(doc)}"
    clauses: dict[int, list[str]] = {}
    for clause in re.split(r"[;.]\s+", para.split(":", 1)[1]):
        m = re.match(r"\W*(\d+)\b", clause)
        if m:
            clauses.setdefault(int(m.group(1)), []).append(clause)
    code = code_sources()
    for name in set(re.findall(r"`(?:precompile\.errors\.)?(\w+Error)`", para)) - {"PrecompileError"}:
        c = next(c for c, names in code.items() if name in names)
        assert any(name in cl for cl in clauses.get(c, [])), f"faults.md names `{name}` but not with its code {c}"
