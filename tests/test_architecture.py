"""The layout docs/architecture.md declares, checked on the code: no import circle, no upward import,
one module that runs programs.

The import graph is read from the source with ast (lazy imports inside functions count too), so the
check needs no import of dfbuild. Each test also runs its check on a small made-up package, so it is
known to fail when the rule is broken.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "dfbuild"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# the one module that imports subprocess (issue 38: phase 2b moved the last others onto proc and gitrun)
RUNNER = "dfbuild.core.proc"
# issue 38: no module over 700 lines (phase 2b split the last three)
MAX_LINES = 700
# what starts or replaces a process besides subprocess
PROCESS_CALLS = re.compile(r"^(system|popen|spawn\w*|exec\w*|posix_spawn\w*|fork\w*)$")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}; importing a package's module from outside the package
    runs the package first, so that counts as importing the package too."""
    files = {module_name(p, root): p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "data"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in targets:
                while target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target not in files or target == name:
                    continue
                found.add(target)
                parent = target.rsplit(".", 1)[0] if "." in target else ""
                while parent in files and parent != root.name and not name.startswith(parent + "."):
                    found.add(parent)
                    parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def declared_floors(text: str, package: str = "dfbuild") -> dict[str, int]:
    """{module: floor number} from the `### Floors` table of docs/architecture.md (lowest first)."""
    section = text.split("### Floors", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    for number, row in enumerate(rows):
        for name in re.findall(r"`([^`]+)`", row.split("|")[2]):
            full = package if name == package else f"{package}.{name}"
            assert full not in floors, f"{name} is on two floors"
            floors[full] = number
    return floors


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    return sorted(f"{module} (floor {floors[module]}) imports {target} (floor {floors[target]})"
                  for module, targets in graph.items() for target in targets
                  if module in floors and target in floors and floors[target] > floors[module])


def subprocess_users(root: Path) -> dict[str, list[str]]:
    """{module: what it uses}: `import subprocess`, `from subprocess import ...`, os.system/exec*/spawn*..."""
    users: dict[str, list[str]] = {}
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "data":
            continue
        name = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(a.name == "subprocess" for a in node.names):
                users.setdefault(name, []).append(f"import subprocess (line {node.lineno})")
            elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
                users.setdefault(name, []).append(f"from subprocess import (line {node.lineno})")
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                  and PROCESS_CALLS.match(node.attr)):
                users.setdefault(name, []).append(f"os.{node.attr} (line {node.lineno})")
    return users


def long_modules(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """{module: its line count} for the modules over LIMIT lines."""
    counts = {module_name(p, root): len(p.read_text(encoding="utf-8").splitlines())
              for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "data"}
    return {name: n for name, n in counts.items() if n > limit}


# --- the checks on dfbuild --------------------------------------------------------------------------


def test_no_import_circle():
    assert cycles(import_graph(SRC)) == []


def test_every_module_is_on_a_declared_floor():
    floors = declared_floors(ARCHITECTURE.read_text(encoding="utf-8"))
    modules = set(import_graph(SRC))
    assert sorted(modules - set(floors)) == [], "place these modules in docs/architecture.md's floors table"
    assert sorted(set(floors) - modules) == [], "the floors table names modules that do not exist"


def test_no_module_imports_one_on_a_higher_floor():
    floors = declared_floors(ARCHITECTURE.read_text(encoding="utf-8"))
    assert upward_imports(import_graph(SRC), floors) == []


def test_only_the_runner_starts_programs():
    users = subprocess_users(SRC)
    assert RUNNER in users
    assert sorted(set(users) - {RUNNER}) == [], {m: users[m] for m in users}


def test_no_module_is_over_the_line_limit():
    assert long_modules(SRC) == {}


# --- the checks can fail ----------------------------------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_lazy_circle_is_found(tmp_path):
    root = _package(tmp_path, {"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"})
    assert cycles(import_graph(root)) == [["pkg.a", "pkg.b"]]


def test_importing_a_packages_module_from_outside_counts_the_package(tmp_path):
    root = _package(tmp_path, {"sub/__init__.py": "from .inner import x\n", "sub/inner.py": "from ..low import y\n",
                               "low.py": "from .sub.other import z\n", "sub/other.py": ""})
    graph = import_graph(root)
    assert "pkg.sub" in graph["pkg.low"] and "pkg.sub" not in graph["pkg.sub.inner"]
    assert cycles(graph) == [["pkg.low", "pkg.sub", "pkg.sub.inner"]]


def test_an_upward_import_is_found(tmp_path):
    root = _package(tmp_path, {"low.py": "def f():\n    from . import high\n", "high.py": "from . import low\n"})
    text = "### Floors\n\n| floor | modules |\n| --- | --- |\n| base | `low` |\n| top | `high` `pkg` |\n"
    floors = declared_floors(text, package="pkg")
    assert floors == {"pkg.low": 0, "pkg.high": 1, "pkg": 1}
    assert upward_imports(import_graph(root), floors) == ["pkg.low (floor 0) imports pkg.high (floor 1)"]


@pytest.mark.parametrize("code", ["import subprocess\n", "from subprocess import run\n",
                                  "import os\nos.execvp('x', ['x'])\n", "import os\nos.system('x')\n"])
def test_a_program_started_outside_the_runner_is_found(tmp_path, code):
    root = _package(tmp_path, {"proc.py": "import subprocess\n", "other.py": code})
    assert set(subprocess_users(root)) == {"pkg.proc", "pkg.other"}


def test_a_long_module_is_found(tmp_path):
    root = _package(tmp_path, {"short.py": "x = 1\n" * 3, "long.py": "x = 1\n" * 4})
    assert long_modules(root, limit=3) == {"pkg.long": 4}
