"""The package's shape: no import cycles between its modules (the lower floors never import the higher ones),
in the library and the CLI; no imports inside functions in the library (the CLI defers its heavy ones into the
commands, so that --help and usage errors answer before MLX loads: tests/cli/test_cli_imports.py), where the
package's __init__ names its public API lazily (PEP 562), the one deferred import."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Where the CLI lives in the source tree and what it is installed as (pyproject.toml's package-dir).
CLI = ("cli", "mlx_infer.cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == CLI[0]:
        parts = CLI[1].split(".") + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources():
    for folder in ("mlx_infer", CLI[0]):
        yield from sorted((REPO / folder).rglob("*.py"))


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported(path: Path, known: set) -> set:
    """The project modules a file imports, wherever the import statement stands (an import inside a
    function still ties the two modules), an import of a package counting as its __init__, except the
    importer's own ancestors, which Python has already started."""
    name = module_name(path)
    package = name if is_package(path) else name.rsplit(".", 1)[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                m = ".".join(parts[:i])
                if m in known and m not in ancestors and m != name:
                    out.add(m)
    return out


def test_no_imports_inside_functions_in_the_library():
    """Every library module imports at its top; only the CLI (cli/) may import inside its commands."""
    found = []
    for path in sources():
        if module_name(path).startswith(CLI[1]):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(REPO)}:{s.lineno}" for s in ast.walk(node)
                          if isinstance(s, (ast.Import, ast.ImportFrom))]
    assert found == []


def test_the_only_deferred_import_of_the_library_is_its_public_names():
    """importlib.import_module in the library only where the package's __init__ resolves a public name on first
    use (and where `python -m mlx_infer` starts the CLI): no import hides inside a function as a call either."""
    found = sorted(str(p.relative_to(REPO)) for p in sources()
                   if not module_name(p).startswith(CLI[1]) and re.search(r"import_module|__import__", p.read_text()))
    assert found == ["mlx_infer/__init__.py", "mlx_infer/__main__.py"]


def test_no_import_cycles():
    paths = {module_name(p): p for p in sources()}
    known = set(paths)
    graph = {m: imported(p, known) for m, p in paths.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
    assert "mlx_infer.engine" not in set().union(*(graph[m] for m in graph if m.startswith("mlx_infer.speculative")))


def test_every_package_is_installed():
    """Each folder of the library with an __init__.py is listed in pyproject.toml's packages (a missing one
    works from the source tree and fails once installed)."""
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)
    listed = set(re.findall(r'"([^"]+)"', block))
    found = {module_name(p) for p in sources() if is_package(p)}
    assert found - listed == set()


def layout_block() -> str:
    """The code block under CONTRIBUTING.md's "## Layout" heading."""
    text = (REPO / "CONTRIBUTING.md").read_text()
    return re.search(r"^## Layout\n+```\n(.*?)^```", text, re.S | re.M).group(1)


def test_contributing_layout_names_every_package():
    """CONTRIBUTING.md's layout names every package folder of the library (as `name/`, indented under its
    parent), so that a reader finds every room of the house there."""
    lines = layout_block().splitlines()
    named = set()
    stack = []  # (indent, folder) of the folders open above the current line
    for line in lines:
        m = re.match(r"^( *)(\S+)/ ", line + " ")
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        named.add("/".join(f for _, f in stack))
    found = {str(p.parent.relative_to(REPO)) for p in (REPO / "mlx_infer").rglob("__init__.py")}
    assert found - named == set()


def test_test_files_have_unique_names():
    """pytest imports each test folder's files under their bare names (no __init__.py): two test_x.py in two
    folders stop the whole run at collection."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
