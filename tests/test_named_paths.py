"""The index read the other way: every repository path and every `bandpo_lut.…` module path that the docs, the
comments and the docstrings name exists (tests/test_architecture.py checks that every file is named).

What counts as a name: in Markdown the whole text; in Python the comments and docstrings; in C++/CUDA the comments;
in shell, requirements and TOML files the `#` comments. A word is a path when it ends in a file suffix of this
repository's kinds; it is found relative to the repository root, the package, csrc/, tests/, tools/ or the naming
file's own folder. A dotted word that starts with the package's name must resolve to modules, then at most one
attribute defined at the top level of the last module. Names of other projects' files and of files the build or
the user makes are listed below, each with its reason; an upper-case placeholder (`tables/NAME.bplut`) is not a name.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Names that are right although no tracked file has them.
NOT_OURS = {
    # made by the build or by pip
    "bandpo_lut/_build_config.py": "written by setup.py at build time (git-ignored)",
    "_build_config.py": "written by setup.py at build time (git-ignored)",
    "bandpo_build_config.h": "written by setup.py at build time",
    "bandpo_lut.egg": "pip's egg-info folder, `bandpo_lut.egg-info`",
    "bandpo_lut.tables.data": "the tables' install location, declared as package data in setup.py",
    # made by the user or by a command
    "bandpo-demo.png": "the demo's default output file",
    "my_div.bplut": "a user's table in an example command",
    "my_main.py": "a user's own trainer entry script in an example",
    # other projects' files
    "grpo_trainer.py": "TRL's trainer module",
    "backend.py": "SkyRL's backend module",
    "utils.py": "a trainer's utility module in an example",
    "examples/data_preprocess/gsm8k.py": "verl's data preprocessing script, in verl's checkout",
    "immintrin.h": "the compiler's intrinsics header",
    "cuda_runtime.h": "the CUDA toolkit's header",
    "cublas_v2.h": "the CUDA toolkit's header",
    "cusparse.h": "the CUDA toolkit's header",
    "Python.h": "CPython's header",
}
# first folder of other projects' paths (verl/trainer/..., torch/_inductor/..., openrlhf/models/...)
OTHER_PROJECTS = ("verl/", "torch/", "openrlhf/", "skyrl/", "skyrl_train/", "trl/", "ATen/", "c10/", "codegen/",
                  "cuda/std/", "liger_kernel/")

SUFFIXES = r"(?:py|h|cpp|cu|cuh|inc|md|sh|txt|toml|bplut|png)"
PATH_WORD = re.compile(r"(?<![\w./$<-])((?:\.\./)*(?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\." + SUFFIXES + r")(?![\w/(])")
MODULE_WORD = re.compile(r"(?<![\w./])(bandpo_lut(?:\.\w+)+)")
SEARCH_ROOTS = ("", "bandpo_lut/", "csrc/", "tests/", "tools/")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:   # not a git checkout (an sdist): every file on disk
        return sorted(str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts)
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


def prose(name: str, text: str) -> str:
    """The parts of a file written for readers: comments and docstrings (all of a Markdown page)."""
    if name.endswith(".md"):
        return text
    if name.endswith(".py"):
        parts = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                parts.append(ast.get_docstring(node, clean=False) or "")
        return "\n".join(parts)
    if name.endswith((".h", ".cpp", ".cu", ".cuh", ".inc")):
        return "\n".join(re.findall(r"//[^\n]*|/\*.*?\*/", text, re.S))
    if name.endswith((".sh", ".txt", ".toml")) or name in (".ci/run", ".gitignore"):
        return "\n".join(re.findall(r"#[^\n]*", text))
    return ""


def module_exists(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return (path / "__init__.py").is_file() or path.with_suffix(".py").is_file()


def top_level_names(dotted: str) -> set[str]:
    """The names a module defines at import: its top-level statements, inside `if`/`try` too, the names a `from
    ... import *` brings, and the names a module `__getattr__` serves."""
    path = REPO.joinpath(*dotted.split("."))
    is_package = (path / "__init__.py").is_file()
    source = path / "__init__.py" if is_package else path.with_suffix(".py")
    package = dotted if is_package else dotted.rpartition(".")[0]
    names = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                      + [s for h in getattr(node, "handlers", []) for s in h.body])
            elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                names.update(re.findall(r"['\"](\w+)['\"]", ast.unparse(node)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*":
                base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if module_exists(target):
                    names.update(top_level_names(target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)

    visit(ast.parse(source.read_text()).body)
    return names


def module_path_exists(word: str) -> bool:
    parts = word.split(".")
    if parts[1] in ("_C", "_build_config"):   # the compiled extension and the build's generated facts
        return True
    known = 1
    while known < len(parts) and module_exists(".".join(parts[: known + 1])):
        known += 1
    if known == len(parts):
        return True
    return known == len(parts) - 1 and parts[-1] in top_level_names(".".join(parts[:known]))


def stale_names(name: str, text: str, files: set[str], basenames: set[str]) -> list[str]:
    """The path and module words of `text` (the contents of the file `name`) that name nothing."""
    here = Path(name).parent
    stale = set()
    for m in PATH_WORD.finditer(text):
        word = m.group(1)
        if word in NOT_OURS or word.startswith(OTHER_PROJECTS) or any(p.isupper() for p in re.split(r"[/.]", word)):
            continue
        if "/" not in word:
            found = word in basenames
        else:
            candidates = [root + word for root in SEARCH_ROOTS] + [str(here / word)]
            found = any(c in files or (REPO / c).is_dir() or (REPO / c).resolve().relative_to(REPO).as_posix()
                        in files for c in candidates if (REPO / c).resolve().is_relative_to(REPO))
        if not found:
            stale.add(word)
    for m in MODULE_WORD.finditer(text):
        word = m.group(1)
        if word not in NOT_OURS and not module_path_exists(word):
            stale.add(word)
    return sorted(stale)


def all_stale() -> dict[str, list[str]]:
    files = tracked_files()
    names, basenames = set(files), {Path(f).name for f in files}
    found = {}
    for f in files:
        if f.endswith((".png", ".bplut")) or f == "LICENSE":
            continue
        stale = stale_names(f, prose(f, (REPO / f).read_text(errors="replace")), names, basenames)
        if stale:
            found[f] = stale
    return found


def test_every_path_the_docs_and_comments_name_exists():
    stale = all_stale()
    assert not stale, "names of files or modules that do not exist:\n" + "\n".join(
        f"  {f}: {', '.join(words)}" for f, words in stale.items())


@pytest.mark.parametrize("planted, word", [
    ("// the scalar loop lives in csrc/cpu/band_loops.cpp", "csrc/cpu/band_loops.cpp"),
    ("# see tables/limits.py for the refusals", "tables/limits.py"),
    ("(`bandpo_lut.runtime.loss_rules` builds it)", "bandpo_lut.runtime.loss_rules"),
    ("`bandpo_lut.runtime.loss.no_such_function`", "bandpo_lut.runtime.loss.no_such_function"),
    ("the bits of `band_math_old.h`", "band_math_old.h"),
    ("[api](../docs/no_such_page.md)", "../docs/no_such_page.md"),
])
def test_a_planted_stale_name_is_found(planted, word):
    files = tracked_files()
    name = "csrc/cpu/band_cpu.cpp" if planted.startswith("//") else "docs/api.md"
    text = prose(name, planted) if name.endswith(".md") else planted
    assert stale_names(name, text, set(files), {Path(f).name for f in files}) == [word]


def test_names_that_exist_are_not_reported():
    files = tracked_files()
    text = ("csrc/cpu/band_cpu.cpp, cpu/band_cpu.cpp, runtime/loss.py, `bandpo_lut.runtime.loss.ratio_bounds`, "
            "`bandpo_lut.policy_loss`, [api](api.md), tables/kl.bplut, tables/NAME.bplut")
    assert stale_names("docs/index.md", text, set(files), {Path(f).name for f in files}) == []
