"""The package's shape: no import cycle in sebulba/, and only the env registry names the
vectorizations."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import sebulba

ROOT = pathlib.Path(sebulba.__file__).parent


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Every module of the package under `root`, by dotted name (a package by its own)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: pathlib.Path, name: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that module `name` imports, at any depth of its code (an
    import inside a function runs too); `from p import m` is an edge to module p.m
    where there is one, else to p. Imports under `if TYPE_CHECKING:` never run."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def import_cycles(root: pathlib.Path, package: str) -> list[list[str]]:
    """The import cycles among the package's modules (strongly connected components of
    more than one module), each sorted."""
    modules = module_names(root, package)
    graph = {name: imports(path, name, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


@pytest.mark.timeout(60)
def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import A\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from pkg.sub import A\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg import b\n")
    assert import_cycles(pkg, "pkg") == [["pkg.b", "pkg.sub", "pkg.sub.a"]]


@pytest.mark.timeout(60)
def test_sebulba_has_no_import_cycle():
    assert len(module_names(ROOT, "sebulba")) > 30  # the walk found the package
    assert import_cycles(ROOT, "sebulba") == []


@pytest.mark.timeout(60)
def test_only_the_registry_names_the_vectorizations():
    """`Config`, the loop, evaluation and the launcher ask `sebulba.envs.registry` what a
    vectorization supports; a comparison with a vectorization's name anywhere else is a
    branch that a new source would have to find. The gymnasium source picks among gymnasium's own
    modes, which are its business."""
    names = "sync|async|vector_entry_point|envpool|pettingzoo"
    branch = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']""")
    allowed = {ROOT / "envs" / "registry.py", ROOT / "envs" / "gymnasium_source.py"}
    paths = [*ROOT.rglob("*.py"), *(ROOT.parent / "examples").glob("*.py")]
    assert len(paths) > 35
    offenders = [f"{path.relative_to(ROOT.parent)}:{i}: {line.strip()}"
                 for path in sorted(paths) if path not in allowed
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if branch.search(line)]
    assert offenders == []


@pytest.mark.timeout(120)
def test_ruff_is_clean():
    """The lint rules of pyproject.toml, function size (C901, PLR0912, PLR0915) among
    them, hold for the whole checkout."""
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT.parent,
                          capture_output=True, text=True, timeout=110)
    assert lint.returncode == 0, lint.stdout + lint.stderr
