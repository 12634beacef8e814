"""The package's layers, read from its sources: the runtime loads and launches and imports no
code generator (so no llvmlite), nor does the checker; the code generator knows nothing of
the runtime, and no module imports itself back through others at import time. A module past
LONG_MODULE_LINES lines says in its docstring why it stays one module.

The import graph is read with `ast`, folders mapped as pyproject maps them (codegen/ is
`mhadsl.codegen`, ...). Its edges are the imports that run when a module is imported: the
top-level ones (inside `if`/`try` blocks and class bodies too, but not under `if
TYPE_CHECKING`, which never runs), and from each imported module to the packages above it,
which Python imports first. Imports inside functions run later, when called, so they are
left out of the cycle check; the layer checks (runtime, codegen, check) read every import.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"mhadsl": "mhadsl", "codegen": "mhadsl.codegen", "runtime": "mhadsl.runtime",
           "grammar": "mhadsl.grammar"}
LONG_MODULE_LINES = 800


def package_modules() -> dict[str, Path]:
    """Every module of the package by its import name."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = package_modules()


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.Module, everywhere: bool):
    """The module's import statements: all of them, or those that run at import."""
    def walk(nodes):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif everywhere:
                yield from walk(ast.iter_child_nodes(node))
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
                    and not _type_checking_only(node):
                yield from walk(ast.iter_child_nodes(node))
    return walk(tree.body)


def _package_module(name: str) -> str | None:
    """The package's module that importing `name` loads: `name` itself, or the nearest
    package above it (`from mhadsl.codegen.backends import Layout` loads the package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules one import statement of `module` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's own package up
            package = module if MODULES[module].name == "__init__.py" else \
                module.rpartition(".")[0]
            package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{package}.{base}".rstrip(".")
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                 for alias in node.names]
    return {m for m in map(_package_module, names) if m is not None}


def import_graph(everywhere: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports (with the packages above them)."""
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for node in import_nodes(ast.parse(path.read_text(), str(path)), everywhere):
            for target in imported_modules(module, node):
                parts = target.split(".")
                edges.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as its modules in import order (the first repeated last), or
    None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return None


def test_the_graph_reads_every_kind_of_import():
    graph = import_graph()
    assert {"mhadsl.runtime.driver", "mhadsl.runtime", "mhadsl"} <= graph["mhadsl.runtime.tensors"]
    assert "mhadsl.codegen.backends" in graph["mhadsl.build"]  # `from pkg import name`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def assert_loads_no_code_generator(module: str) -> None:
    """In a fresh interpreter: importing `module` loads neither llvmlite nor mhadsl.codegen."""
    check = (f"import {module}, sys; "
             "loaded = sorted(m for m in sys.modules "
             "if m.split('.')[0] == 'llvmlite' or m.startswith('mhadsl.codegen')); "
             "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", ["mhadsl.runtime.launch", "mhadsl.runtime.driver",
                                    "mhadsl.runtime.tensors", "mhadsl.runtime.cache",
                                    "mhadsl.runtime.faults"])
def test_the_runtime_loads_without_llvmlite(module):
    assert_loads_no_code_generator(module)


def test_no_module_imports_itself_back_at_import():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _imports_from(layer: str, other: str) -> list[str]:
    """`layer`'s modules that import anything of `other`, anywhere in their source."""
    graph = import_graph(everywhere=True)
    return [f"{module} imports {target}" for module in sorted(graph)
            if module.startswith(layer + ".") or module == layer
            for target in sorted(graph[module])
            if target.startswith(other + ".") or target == other]


def test_the_runtime_imports_nothing_of_the_code_generator():
    assert _imports_from("mhadsl.runtime", "mhadsl.codegen") == []


def test_the_code_generator_imports_nothing_of_the_runtime():
    assert _imports_from("mhadsl.codegen", "mhadsl.runtime") == []


def test_the_checker_imports_no_code_generator():
    """`check` asks the kernel designs through the function its caller hands it, so
    checking a program needs neither the code generator nor llvmlite."""
    assert _imports_from("mhadsl.front.check", "mhadsl.codegen") == []
    tree = ast.parse(MODULES["mhadsl.front.check"].read_text())
    imported = {alias.name if isinstance(node, ast.Import) else node.module or ""
                for node in import_nodes(tree, everywhere=True) for alias in node.names}
    assert not {name for name in imported if name.split(".")[0] == "llvmlite"}
    assert_loads_no_code_generator("mhadsl.front.check")


def test_a_long_module_says_why_it_stays_one_module():
    """Past LONG_MODULE_LINES lines a module is split by job, or its docstring says why it
    stays "one module"."""
    unexplained = []
    for module, path in sorted(MODULES.items()):
        text = path.read_text()
        docstring = " ".join((ast.get_docstring(ast.parse(text)) or "").split())
        if len(text.splitlines()) > LONG_MODULE_LINES and "one module" not in docstring:
            unexplained.append(f"{module} ({len(text.splitlines())} lines)")
    assert unexplained == []
