"""Every code block of README.md and docs/*.md runs here, or says why not (issue 35, "Docs that run").

A page's blocks run in reading order, as a reader would run them: in one folder per page (``sample_data/`` and
``recipes/`` linked in, plus what :data:`PAGE_SETUP` prepares for that page) and one Python namespace per page.

- ```` ```python ```` blocks are executed.
- ```` ```yaml ```` blocks are recipes: a whole recipe (``name`` and ``inputs``) is written to ``doc-recipes/``
  in the page's folder (a sibling of ``sample_data/``, so ``../sample_data/...`` resolves as it does from
  ``recipes/``) and checked as ``precompile validate`` checks it; a fragment names the recipe it belongs in
  (``into``) and is merged into it first.
- Indented blocks whose first line is a command (``precompile ...``, ``pip ...``, ``python ...``) are shell
  blocks: every ``precompile`` line is checked against the CLI (the command and each ``--option`` exist) and
  then run with click's test runner (``> FILE`` writes its output to FILE); it must exit 0.
- Blocks that show output are ```` ```text ````; indented blocks that do not start with a command are output too.
  An untagged fence is an error: say what it is.

A marker comment on the line before a block (blank lines between allowed) says more,
``<!-- test: DIRECTIVE; DIRECTIVE -->``:

==========================  ==========================================================================================
``skip: REASON``            not run (a skipped block is still checked: Python compiles, YAML parses, commands exist)
``needs cuda``              run only where CUDA is present (likewise ``needs lightning``, ``needs datasets``)
``given NAME, ...``         python: names the block uses but does not define (:data:`GIVEN`: a model, a trainer, ...)
``file PATH``               python: written to ``doc-recipes/PATH`` before the page runs (a module a recipe imports)
``prints``                  python: each ``print(...)  # COMMENT`` line prints what its comment starts with
                            (the comment may go on after ``: ``)
``into BASE``               yaml: a fragment; merged into BASE (a file of recipes/ by stem, or :data:`BASES`); mappings
                            merge key by key, but a field declaration (a mapping with ``decoder``) and a list
                            replace; a fragment that is a list is a list of steps, appended to BASE's
``with PREFIX as FIXTURE``  yaml: paths starting with PREFIX (a folder of yours) point into a generated FIXTURE
``plan``, ``build DIR``     yaml: also plan the recipe (list the inputs), or build it into DIR (relative to the page)
``synopsis``                shell: a usage line: its command and options are checked, it is not run
==========================  ==========================================================================================

A block with neither a way to run nor a marked reason fails :func:`test_every_block_runs_or_says_why`.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import sys
import tokenize
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]

RUNNABLE = ("python", "yaml", "shell")
OUTPUT_LANGS = ("text",)
SHELL_WORDS = ("precompile ", "pip ", "python ")
FENCE = re.compile(r"^```(.*)$")
MARK = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
REQUIREMENTS = {"cuda", "lightning", "datasets"}


# -- the blocks of a page --------------------------------------------------------------------------

@dataclass
class Block:
    page: str
    line: int                 # 1-based: the opening fence, or an indented block's first line
    lang: str                 # python | yaml | shell | text | "" (untagged fence)
    code: str
    marks: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def directive(self, word: str) -> list[str]:
        """The arguments of every directive ``word`` (``skip: why`` -> ['why'])."""
        out = []
        for m in self.marks:
            head, _, rest = m.partition(":" if m.startswith("skip") else " ")
            if head.strip() == word:
                out.append(rest.strip())
        return out


def page_blocks(page: str, text: str | None = None) -> list[Block]:
    """The code blocks of ``page`` (a path relative to the repository; ``text``: its text, default the file's)."""
    lines = (text if text is not None else (REPO / page).read_text(encoding="utf-8")).splitlines()

    def marks_before(k: int) -> list[str]:
        j = k - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARK.match(lines[j].strip()) if j >= 0 else None
        return [d.strip() for d in m.group(1).split(";") if d.strip()] if m else []

    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append(Block(page, i + 1, m.group(1).strip(), "\n".join(lines[i + 1:j]) + "\n", marks_before(i)))
            i = j + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or
                                      (not lines[j].strip() and j + 1 < len(lines) and lines[j + 1].startswith("    "))):
                j += 1
            body = "\n".join(ln[4:] for ln in lines[i:j]) + "\n"
            if body.lstrip().startswith(SHELL_WORDS):
                out.append(Block(page, i + 1, "shell", body, marks_before(i)))
            i = j
            continue
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in PAGES for b in page_blocks(p)]


# -- what a page's folder holds --------------------------------------------------------------------

def _png(path: Path, arr: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


COCO_KEYPOINTS = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder",
                  "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee",
                  "right_knee", "left_ankle", "right_ankle"]


def make_coco2017(root: Path) -> Path:
    """A tiny COCO-2017-like folder: ``train2017/`` (three 48x64 PNG images), ``depth/`` (16-bit depth PNGs
    beside them) and ``annotations/instances_train2017.json``: a person with COCO's 17 keypoints and a dog on
    the first image, a person on the second, nothing on the third."""
    rng = np.random.default_rng(0)
    images, anns = [], []
    for n in (1, 2, 3):
        name = f"{n:012d}"
        _png(root / "train2017" / f"{name}.png", rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
        _png(root / "depth" / f"{name}.png", rng.integers(0, 65535, (48, 64), dtype=np.uint16))
        images.append({"id": n, "file_name": f"{name}.png", "height": 48, "width": 64})

    def ann(i: int, image: int, cat: int, x: float, y: float, w: float, h: float) -> dict:
        a = {"id": i, "image_id": image, "category_id": cat, "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0,
             "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]}
        if cat == 1:
            a["keypoints"] = [v for k in range(17) for v in (x + 1 + k % 4 * w / 5, y + 1 + k // 4 * h / 6, 2)]
            a["num_keypoints"] = 17
        return a

    anns += [ann(1, 1, 1, 8, 6, 20, 34), ann(2, 1, 18, 34, 20, 22, 16), ann(3, 2, 1, 20, 4, 24, 40)]
    cats = [{"id": 1, "name": "person", "supercategory": "person", "keypoints": COCO_KEYPOINTS,
             "skeleton": [[16, 14], [14, 12], [17, 15], [15, 13], [12, 13]]},
            {"id": 18, "name": "dog", "supercategory": "animal"}]
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / "instances_train2017.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root


def make_captions(root: Path) -> Path:
    """``images/`` (two PNGs) and ``captions.parquet`` (columns file, caption), for docs/tables.md."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    for n in ("a", "b"):
        _png(root / "images" / f"{n}.png", rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    pq.write_table(pa.table({"file": ["a.png", "b.png"], "caption": ["a red square", "two dogs"]}),
                   root / "captions.parquet")
    return root


#: generated inputs a yaml block's ``with PREFIX as FIXTURE`` points into, or a base recipe uses
FIXTURES: dict[str, Callable[[Path], Path]] = {"coco2017": make_coco2017}


def _images_build(s: "Session") -> None:
    import precompile
    from precompile.tools.stats import stats

    precompile.build(REPO / "recipes" / "images.yaml", out_dir=s.dir / "build")
    stats(s.dir / "build" / "images.h5")


def _coco_build(s: "Session") -> None:
    import precompile

    precompile.build(REPO / "recipes" / "coco.yaml", out_dir=s.dir / "build")


def _imgs_splits(s: "Session") -> None:
    """``build/imgs.train.h5`` and ``build/imgs.val.h5`` with their stats: recipes/images.yaml named imgs, split."""
    import precompile

    r = yaml.safe_load((REPO / "recipes" / "images.yaml").read_text(encoding="utf-8"))
    r.update(name="imgs", stats=True, split={"by": "hash", "fractions": {"train": 0.75, "val": 0.25}})
    r["inputs"]["root"] = str(REPO / "sample_data" / "images")
    precompile.build(r, out_dir=s.dir / "build")


#: what a page's blocks find in its folder besides sample_data/ and recipes/ (the README's tour builds for itself)
PAGE_SETUP: dict[str, list[Callable[["Session"], None]]] = {
    "docs/reference-reader.md": [_images_build, _coco_build],   # the tour's build with its stats; the COCO sample
    "docs/reference-formats.md": [_images_build],
    "docs/integrations.md": [_imgs_splits],
}


def _base_recipe_file(stem: str) -> Callable[["Session"], dict]:
    return lambda s: yaml.safe_load((REPO / "recipes" / f"{stem}.yaml").read_text(encoding="utf-8"))


def _coco2017_base(s: "Session") -> dict:
    root = s.fixture("coco2017")
    return {"name": "coco", "seed": 0,
            "inputs": {"root": str(root / "train2017"),
                       "coco": {"file": str(root / "annotations" / "instances_train2017.json"), "keypoints": True}},
            "output": {"format": "hdf5", "samples_per_shard": 2}}


def _captions_base(s: "Session") -> dict:
    make_captions(s.recipes)    # beside the recipe: the fragment's paths are relative to its folder
    return {"name": "captions", "output": {"samples_per_shard": 2}}


#: recipes a fragment goes ``into``: every recipes/*.yaml by its stem, and these
BASES: dict[str, Callable[["Session"], dict]] = {
    **{p.stem: _base_recipe_file(p.stem) for p in (REPO / "recipes").glob("*.yaml")},
    "coco2017": _coco2017_base,     # the generated COCO-2017-like set, keypoints on
    "captions": _captions_base,     # only a name: the fragment gives the inputs (generated beside it)
    "empty": lambda s: {"name": "doc"},
}


# -- names a block uses but does not define --------------------------------------------------------

def _train_step(s: "Session") -> Callable:
    def train_step(images: Any, labels: Any) -> None:   # what a training step gets from the Loader
        import torch

        assert images.dtype == torch.float32 and images.ndim == 4 and labels.dtype == torch.int64
        s.ns.setdefault("_steps", 0)
        s.ns["_steps"] += 1
    return train_step


def _pl() -> Any:
    import importlib
    import importlib.util

    return importlib.import_module("lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning")


def _trainer(s: "Session") -> Any:
    return _pl().Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _model(s: "Session") -> Any:
    import torch

    class Classifier(_pl().LightningModule):
        """Linear over the normalised pixels of the imgs build (64x64 RGB, 3 classes)."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64 * 64 * 3, 3)
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch: dict, i: int) -> Any:
            x = batch["image"]
            assert x.dtype == torch.float32     # normalised: mean="stats" gives floats
            self.seen.append(x.detach().mean())
            return torch.nn.functional.cross_entropy(self.lin(x.flatten(1)), batch["label"])

        def validation_step(self, batch: dict, i: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Classifier()


def _datasets(s: "Session") -> Any:
    """``datasets`` as the snippet uses it, its ``load_dataset`` giving a small dataset of the columns the
    snippet's comment names (image: Image, label: ClassLabel) made from sample_data/images, not the Hub's."""
    import types

    import datasets

    files = sorted((REPO / "sample_data" / "images").rglob("*.jpg"))[:6]
    names = sorted({p.parent.name for p in files})
    ds = datasets.Dataset.from_dict(
        {"image": [str(p) for p in files], "label": [names.index(p.parent.name) for p in files]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}))
    return types.SimpleNamespace(load_dataset=lambda *a, **k: ds)


GIVEN: dict[str, Callable[["Session"], Any]] = {"train_step": _train_step, "trainer": _trainer, "model": _model,
                                                "datasets": _datasets}


# -- what must hold after a page ran ----------------------------------------------------------------

def _readme_after(s: "Session") -> None:
    assert (s.dir / "build" / "images.h5").exists() and (s.dir / "sheet.png").exists()
    assert s.ns["loss"].item() > 0


def _reader_after(s: "Session") -> None:
    assert s.ns["_steps"] == 10       # ten epochs, each one batch (36 samples, batch_size=256)


PAGE_AFTER: dict[str, Callable[["Session"], None]] = {"README.md": _readme_after,
                                                      "docs/reference-reader.md": _reader_after}


# -- running -------------------------------------------------------------------------------------------

def available(req: str) -> bool:
    import importlib.util

    if req == "cuda":
        try:
            import torch
        except ImportError:
            return False
        return torch.cuda.is_available()
    if req == "lightning":
        return importlib.util.find_spec("lightning") is not None or importlib.util.find_spec("pytorch_lightning") is not None
    return importlib.util.find_spec(req) is not None


def check_block(b: Block) -> list[str]:
    """What is wrong with ``b`` as a block of the docs (its tag, its marker); [] when it runs or says why."""
    if b.lang == "":
        return [f"{b.id}: an untagged code block: tag it (python, yaml; text for output shown)"]
    if b.lang in OUTPUT_LANGS:
        return [f"{b.id}: a text block takes no test marker"] if b.marks else []
    if b.lang not in RUNNABLE:
        return [f"{b.id}: a {b.lang!r} block: nothing runs it here; tag it python, yaml, or text for output"]
    problems = []
    for m in b.marks:
        word = m.split(":", 1)[0].split(" ", 1)[0]
        allowed = {"skip", "needs"} | {"python": {"given", "file", "prints"}, "yaml": {"into", "with", "plan", "build"},
                                       "shell": {"synopsis"}}[b.lang]
        if word not in allowed:
            problems.append(f"{b.id}: unknown directive {m!r} for a {b.lang} block (see tests/test_doc_snippets.py)")
    for m in b.marks:
        if m.split(":", 1)[0].split(" ", 1)[0] == "skip" and not re.match(r"skip:\s*\S", m):
            problems.append(f"{b.id}: {m!r}: a skip names its reason: <!-- test: skip: WHY -->")
    for req in b.directive("needs"):
        if req not in REQUIREMENTS:
            problems.append(f"{b.id}: needs {req!r}: one of {sorted(REQUIREMENTS)}")
    for names in b.directive("given"):
        problems += [f"{b.id}: given {n!r}: not in GIVEN" for n in given_names(names) if n not in GIVEN]
    for base in b.directive("into"):
        if base not in BASES:
            problems.append(f"{b.id}: into {base!r}: no such base recipe")
    for w in b.directive("with"):
        m = re.fullmatch(r"(\S+) as (\S+)", w)
        if not m or m.group(2) not in FIXTURES:
            problems.append(f"{b.id}: 'with {w}': use 'with PREFIX as FIXTURE' (FIXTURE in {sorted(FIXTURES)})")
    if b.lang == "shell" and not b.directive("skip"):
        for ln in shell_lines(b):
            if any(not c.strip().startswith("precompile ") for c in ln.split("&&")):
                problems.append(f"{b.id}: {ln!r}: only precompile commands run here; mark the block skip with a reason")
    return problems


def given_names(arg: str) -> list[str]:
    """``"a, b (a note)"`` -> ['a', 'b']."""
    return [n for n in re.split(r"[,\s]+", re.sub(r"\(.*\)", "", arg)) if n]


def shell_lines(b: Block) -> list[str]:
    return [ln.strip() for ln in b.code.splitlines() if ln.strip()]


def commands(b: Block) -> list[str]:
    """The ``precompile`` commands of a shell block, ``&&`` chains split."""
    return [c.strip() for ln in shell_lines(b) for c in ln.split("&&") if c.strip().startswith("precompile ")]


def cli_check(line: str, synopsis: bool = False) -> list[str]:
    """``precompile CMD ...``: the command exists and every ``--option`` / ``-o`` is one of its options."""
    import click

    from precompile.cli import main

    words = shlex.split(line, comments=True)
    if ">" in words:
        words = words[:words.index(">")]
    if synopsis:
        words = [w.strip("[]") for w in words if w.strip("[]") not in ("", "...")]
    if not words or words[0] != "precompile":
        return [f"{line!r}: not a precompile command"]
    if len(words) < 2 or words[1] == "--version":
        return []
    cmd = main.commands.get(words[1])
    if cmd is None:
        return [f"{line!r}: no command {words[1]!r} (commands: {', '.join(sorted(main.commands))})"]
    opts = {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts} | {"--help"}
    return [f"{line!r}: {w.split('=')[0]} is not an option of precompile {words[1]}"
            for w in words[2:] if w.startswith("-") and not re.fullmatch(r"-\d+", w) and w.split("=")[0] not in opts]


def merge(base: dict, frag: Any) -> dict:
    """``frag`` merged into ``base`` (see the module docstring)."""
    if isinstance(frag, list):
        return {**base, "steps": list(base.get("steps", [])) + frag}
    out = dict(base)
    for k, v in frag.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and "decoder" not in v:
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _repath(v: Any, prefix: str, to: str) -> Any:
    if isinstance(v, str) and (v == prefix or v.startswith(prefix + "/")):
        return to + v[len(prefix):]
    if isinstance(v, dict):
        return {k: _repath(x, prefix, to) for k, x in v.items()}
    if isinstance(v, list):
        return [_repath(x, prefix, to) for x in v]
    return v


def print_comments(code: str) -> dict[int, str]:
    """{line: comment} of the lines of ``code`` that end in a comment."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


class Session:
    """One page run in reading order: its folder, its namespace, each block's outcome."""

    def __init__(self, page: str, folder: Path):
        self.page, self.dir, self.ns = page, folder, {"__name__": "__doc__"}
        self.recipes = folder / "doc-recipes"
        self.outcome: dict[str, tuple[str, str]] = {}
        self._fixtures: dict[str, Path] = {}

    def fixture(self, name: str) -> Path:
        if name not in self._fixtures:
            self._fixtures[name] = FIXTURES[name](self.dir / name)
        return self._fixtures[name]

    # the runners: each raises when its block does not do what the page says
    def run_python(self, b: Block) -> None:
        for names in b.directive("given"):
            for n in given_names(names):
                self.ns[n] = GIVEN[n](self)
        if not b.directive("prints"):
            exec(compile(b.code, b.id, "exec"), self.ns)
            return
        comments = print_comments(b.code)
        for stmt in ast.parse(b.code).body:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(ast.Module([stmt], []), b.id, "exec"), self.ns)
            is_print = (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                        and getattr(stmt.value.func, "id", None) == "print")
            said = comments.get(stmt.end_lineno)
            if is_print and said is not None:
                got = out.getvalue().strip()
                assert said == got or said.startswith(got + ": "), \
                    f"{b.page} line {b.line + stmt.lineno}: prints {got!r}, its comment says {said!r}"

    def run_yaml(self, b: Block) -> None:
        import precompile
        from precompile.compiler import check_plan, check_recipe
        from precompile.compiler.plan import make_plan
        from precompile.recipe import load_recipe

        data = yaml.safe_load(b.code)
        for w in b.directive("with"):
            prefix, name = re.fullmatch(r"(\S+) as (\S+)", w).groups()
            data = _repath(data, prefix, str(self.fixture(name)))
        into = b.directive("into")
        if into:
            data = merge(BASES[into[0]](self), data)
        elif not (isinstance(data, dict) and "name" in data and "inputs" in data):
            raise AssertionError(f"{b.id}: not a whole recipe (no name or inputs): mark the recipe it belongs in "
                                 f"with <!-- test: into BASE -->")
        self.recipes.mkdir(exist_ok=True)
        path = self.recipes / f"{Path(b.page).stem}-{b.line}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        r = load_recipe(path)
        check_recipe(r)                      # what `precompile validate` checks
        if b.directive("plan"):
            check_plan(make_plan(r))
        for out in b.directive("build"):
            precompile.build(path, out_dir=self.dir / out)

    def run_shell(self, b: Block) -> None:
        from click.testing import CliRunner

        from precompile.cli import main

        for line in commands(b):
            words = shlex.split(line, comments=True)
            target = None
            if ">" in words:
                words, target = words[:words.index(">")], words[words.index(">") + 1]
            res = CliRunner().invoke(main, words[1:])
            assert res.exit_code == 0, f"{line}: exit {res.exit_code}: {res.output}{res.exception or ''}"
            if target:
                (self.dir / target).write_text(res.stdout, encoding="utf-8")

    def static(self, b: Block) -> None:
        """What is checked of every block, run or not."""
        if b.lang == "python":
            compile(b.code, b.id, "exec")
        elif b.lang == "yaml":
            yaml.safe_load(b.code)
        else:
            problems = [p for c in commands(b) for p in cli_check(c, synopsis=bool(b.directive("synopsis")))]
            assert not problems, "\n".join(problems)

    def why_not(self, b: Block) -> str | None:
        skip = b.directive("skip")
        if skip:
            return skip[0]
        missing = [r for r in b.directive("needs") if not available(r)]
        if missing:
            return f"needs {', '.join(missing)}: not available here"
        if b.directive("synopsis"):
            return "a usage synopsis: its command and options are checked, it is not run"
        return None

    def run(self, blocks: list[Block]) -> None:
        for setup in PAGE_SETUP.get(self.page, []):
            setup(self)
        for b in blocks:
            for path in b.directive("file"):
                (self.recipes / path).parent.mkdir(parents=True, exist_ok=True)
                (self.recipes / path).write_text(b.code, encoding="utf-8")
        failed = None
        for b in blocks:
            try:
                self.static(b)
                why = self.why_not(b)
                if why is not None:
                    self.outcome[b.id] = ("skip", why)
                    continue
                if b.directive("file"):
                    self.outcome[b.id] = ("ok", "")
                    continue
                with warnings.catch_warnings():
                    if b.directive("needs"):    # Lightning's and datasets' own advice and deprecations are not ours
                        warnings.simplefilter("ignore")
                    getattr(self, f"run_{b.lang}")(b)
                self.outcome[b.id] = ("ok", "")
            except BaseException as e:     # noqa: BLE001 (a block's SystemExit is a failure too)
                if isinstance(e, KeyboardInterrupt):
                    raise
                after = f" (after {failed} failed)" if failed else ""
                self.outcome[b.id] = ("fail", f"{b.id}{after}:\n{traceback.format_exc()}")
                failed = failed or b.id
        if failed is None and self.page in PAGE_AFTER:
            try:
                PAGE_AFTER[self.page](self)
            except AssertionError:
                last = [b for b in blocks if self.outcome.get(b.id, ("",))[0] == "ok"][-1]
                self.outcome[last.id] = ("fail", f"{self.page}: after its last block:\n{traceback.format_exc()}")


@contextlib.contextmanager
def page_context(folder: Path):
    """cwd in the page's folder; registries, sys.path, imported modules and environment restored after."""
    from precompile import plugins
    from precompile.registry import DECODERS, STEPS, WRITERS, load_builtins

    load_builtins()
    saved = ([dict(r._items) for r in (DECODERS, STEPS, WRITERS)], list(sys.path), set(sys.modules),
             dict(plugins._source_hash), dict(os.environ), os.getcwd())
    hf_config = sys.modules.get("datasets.config")
    hf_cache = getattr(hf_config, "HF_DATASETS_CACHE", None)
    os.environ["HF_HOME"] = os.environ["HF_DATASETS_CACHE"] = str(folder / "hf-cache")   # never the user's cache
    if hf_config is not None:
        hf_config.HF_DATASETS_CACHE = Path(folder / "hf-cache")
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(saved[5])
        for r, items in zip((DECODERS, STEPS, WRITERS), saved[0]):
            r._items.clear()
            r._items.update(items)
        sys.path[:] = saved[1]
        for m in set(sys.modules) - saved[2]:
            if not m.startswith(("precompile", "torch", "datasets", "lightning", "pytorch_lightning", "pyarrow")):
                mod = sys.modules[m]
                where = getattr(mod, "__file__", None) or " ".join(getattr(mod, "__path__", []))
                if str(folder) in where:
                    del sys.modules[m]
        plugins._source_hash.clear()
        plugins._source_hash.update(saved[3])
        os.environ.clear()
        os.environ.update(saved[4])
        if hf_config is not None and hf_cache is not None:
            hf_config.HF_DATASETS_CACHE = hf_cache


@pytest.fixture(scope="module")
def run_page(tmp_path_factory):
    done: dict[str, Session] = {}

    def run(page: str) -> Session:
        if page not in done:
            folder = tmp_path_factory.mktemp(re.sub(r"\W", "_", page))
            for name in ("recipes", "sample_data"):
                (folder / name).symlink_to(REPO / name)
            s = done[page] = Session(page, folder)
            with page_context(folder):
                s.run(page_blocks(page))
        return done[page]

    return run


# -- the tests -------------------------------------------------------------------------------------

def test_every_block_runs_or_says_why():
    blocks = all_blocks()
    assert sum(b.lang == "python" for b in blocks) >= 10 and sum(b.lang == "shell" for b in blocks) >= 5
    problems = [p for b in blocks for p in check_block(b)]
    assert not problems, "code blocks of the docs that no test runs or that say nothing of why:\n" + "\n".join(problems)


def test_the_block_finder_sees_fences_markers_and_commands():
    text = ("Intro\n\n<!-- test: skip: no bucket -->\n\n    precompile build r.yaml -o s3://b\n\n"
            "Output:\n\n    error: something\n\n```python\nx = 1\n```\n\n```\nout\n```\n")
    blocks = page_blocks("p.md", text)
    assert [(b.lang, b.line, b.marks) for b in blocks] == [("shell", 5, ["skip: no bucket"]), ("python", 11, []),
                                                          ("", 15, [])]
    assert blocks[0].directive("skip") == ["no bucket"]
    assert check_block(blocks[2]) and not check_block(blocks[1]) and not check_block(blocks[0])
    assert cli_check("precompile build r.yaml --jobz 2") == ["'precompile build r.yaml --jobz 2': --jobz is not an "
                                                           "option of precompile build"]
    assert cli_check("precompile stats build/x.h5 [--field image] [--json]", synopsis=True) == []
    assert cli_check("precompile schema > out.json") == []


CODE_BLOCKS = [b for b in all_blocks() if b.lang in RUNNABLE]


@pytest.mark.parametrize("block", CODE_BLOCKS, ids=[b.id for b in CODE_BLOCKS])
def test_doc_block(block, run_page):
    s = run_page(block.page)
    state, msg = s.outcome.get(block.id, ("fail", f"{block.id}: not run"))
    if state == "skip":
        pytest.skip(f"{block.id}: {msg}")
    assert state == "ok", msg
