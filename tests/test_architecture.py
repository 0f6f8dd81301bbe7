"""The package's shape, held true: no module imports a layer above its own, and the architecture and development
pages name every source, tool and test file (a file added without its line in the index fails here)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "bandpo_lut"

# bottom to top; a module may import its own layer and those below (the public facade `bandpo_lut` itself only from
# the layers that consume it: integrations and the command line)
LAYERS = ["base", "tables", "runtime", "reference", "facade", "integrations", "cli"]
BASE = {"bandpo_lut._C", "bandpo_lut._build_config", "bandpo_lut._version"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str) -> bool:
    return (REPO / Path(*name.split(".")) / "__init__.py").is_file()


def is_module(name: str) -> bool:
    return is_package(name) or (REPO / Path(*name.split("."))).with_suffix(".py").is_file() or name in BASE


def layer(name: str) -> str:
    if name in BASE:
        return "base"
    if name == "bandpo_lut":
        return "facade"
    return name.split(".")[1]


def imported_modules(path: Path):
    """(line, module) for every import of a bandpo_lut module in `path`, function-level imports included;
    `from P import x` counts as importing P.x when that is a module, else P."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bandpo_lut":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "bandpo_lut":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if is_module(sub) else target


def modules():
    return sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_imports_upward(path):
    me = module_name(path)
    mine = LAYERS.index(layer(me))
    problems = []
    for line, other in imported_modules(path):
        theirs = layer(other)
        if LAYERS.index(theirs) > mine:
            problems.append(f"line {line}: {other} ({theirs}) is above {me} ({layer(me)})")
        # a package's own __init__ sits above its modules (the command line's entry point above the subcommands);
        # only its __main__ (`python -m`) sits above the __init__
        own_package = me.rpartition(".")[0]
        if path.name not in ("__init__.py", "__main__.py") and other != "bandpo_lut" and other == own_package:
            problems.append(f"line {line}: {me} imports its own package's __init__ ({other})")
    assert not problems, "\n".join(problems)


def test_the_layers_cover_every_module():
    assert {layer(module_name(p)) for p in modules()} <= set(LAYERS)


def named_paths(doc: Path) -> set[str]:
    """Every path-like word of a page, with `dir/{a,b}.py` brace groups expanded."""
    text = doc.read_text()
    words = set(re.findall(r"[\w./-]*\{[\w.,/-]+\}[\w./-]*|[\w][\w./-]*", text))
    out = set()
    for word in words:
        m = re.fullmatch(r"([\w./-]*)\{([\w.,/-]+)\}([\w./-]*)", word)
        out.update(m.group(1) + part + m.group(3) for part in m.group(2).split(",")) if m else out.add(word)
    return out


def tracked(pattern: str):
    return sorted(str(p.relative_to(REPO)) for p in REPO.glob(pattern)
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc")
                  and p.name != "_build_config.py")


@pytest.mark.parametrize("page, patterns", [
    ("docs/architecture.md", ["bandpo_lut/**/*.py", "csrc/**/*", "tools/**/*"]),
    ("docs/development.md", ["tests/**/*.py"]),
])
def test_the_index_names_every_file(page, patterns):
    named = named_paths(REPO / page)
    missing = [f for pattern in patterns for f in tracked(pattern) if f not in named]
    assert not missing, f"{page} does not name: {missing}"


def test_importing_the_package_installs_no_import_machinery():
    """Module paths resolve by the files alone: no finder of the package's own on sys.meta_path (a moved module,
    where one is kept, is a plain re-export file)."""
    import subprocess
    import sys

    code = ("import sys; before = list(sys.meta_path); import bandpo_lut; "
            "extra = [type(f).__module__ for f in sys.meta_path if f not in before]; "
            "assert not [m for m in extra if m.startswith('bandpo_lut')], extra")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_import_cycle():
    """No module reaches itself through imports (function-level ones included): a cycle inside one layer is as hard
    to read as an upward import. A name imported from a package's __init__ counts as the package."""
    graph = {module_name(p): {other for _, other in imported_modules(p) if other != module_name(p)} for p in modules()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
