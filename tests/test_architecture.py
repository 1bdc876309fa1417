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
# issue 45: the stages live in packages; the top of src/dfbuild keeps the package's entry and little else
MAX_TOP_MODULES = 8
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


def declared_packages(text: str, package: str = "dfbuild") -> dict[str, int]:
    """{package: floor number} from the `### Packages` table of docs/architecture.md (lowest first): a package
    is a folder under src/dfbuild, or one of the few modules at its top (`_version`, `_entry`, ...)."""
    section = text.split("### Packages", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    for number, row in enumerate(rows):
        for name in re.findall(r"`([^`]+)`", row.split("|")[2]):
            assert name not in floors, f"{name} is on two floors"
            floors[name] = number
    return floors


def package_of(module: str, package: str = "dfbuild") -> str:
    """dfbuild.core.errors -> core; dfbuild._entry -> _entry; dfbuild -> dfbuild (the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else package


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package: the other packages its modules import}"""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = package_of(module)
        out.setdefault(here, set()).update(package_of(t) for t in targets if package_of(t) != here)
    return out


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Each import of a module in a package on a higher floor, or in a package the table does not name."""
    found = []
    for module, targets in sorted(graph.items()):
        here = package_of(module)
        for target in sorted(targets):
            there = package_of(target)
            if there == here or any(t.startswith(target + ".") for t in targets):  # the package of a module named
                continue
            if here not in floors or there not in floors:
                missing = here if here not in floors else there
                found.append(f"{module} imports {target}: package {missing} is on no floor of the table")
            elif floors[there] > floors[here]:
                found.append(f"{module} ({here}, floor {floors[here]}) imports {target} "
                             f"({there}, floor {floors[there]}): an import upward")
    return found


def private_imports(root: Path) -> list[str]:
    """`from dfbuild.X.y import _name` where dfbuild.X is another package than the importer's: a private
    name is its package's own business (make it public, or move the code that needs it)."""
    files = {module_name(p, root): p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "data"}
    found = []
    for name, path in sorted(files.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules: dict[str, str] = {}  # a name bound to a module of another package -> that module
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith(root.name):
                continue
            for alias in node.names:
                target = f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module
                if package_of(target or "") == package_of(name):
                    continue
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name} (line {node.lineno}) imports the private {alias.name} from {node.module}")
                elif target == f"{node.module}.{alias.name}":
                    modules[alias.asname or alias.name] = target
        for node in ast.walk(tree):  # module._name, where module is another package's
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name} (line {node.lineno}) uses the private {node.attr} of {modules[node.value.id]}")
    return sorted(set(found))


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


def test_every_package_is_on_a_declared_floor():
    floors = declared_packages(ARCHITECTURE.read_text(encoding="utf-8"))
    packages = {package_of(m) for m in import_graph(SRC)}
    assert sorted(packages - set(floors)) == [], "place these packages in docs/architecture.md's packages table"
    assert sorted(set(floors) - packages) == [], "the packages table names packages that do not exist"


def test_packages_import_only_downward():
    floors = declared_packages(ARCHITECTURE.read_text(encoding="utf-8"))
    assert upward_imports(import_graph(SRC), floors) == []


def test_no_circle_between_packages():
    assert cycles(package_graph(import_graph(SRC))) == []


def test_no_package_imports_a_private_name_of_another():
    assert private_imports(SRC) == []


def test_few_modules_at_the_top_and_every_package_says_what_it_does():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    for init in sorted(SRC.rglob("__init__.py")):
        if init.relative_to(SRC).parts[0] == "data":
            continue
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"{init.relative_to(SRC.parent)} has no docstring: say what the package does"


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


def test_an_upward_import_between_packages_is_found(tmp_path):
    root = _package(tmp_path, {"low/__init__.py": '"""low"""\n', "low/a.py": "def f():\n    from pkg.high import b\n",
                               "high/__init__.py": '"""high"""\n', "high/b.py": "from pkg.low import a\n"})
    text = "### Packages\n\n| floor | packages |\n| --- | --- |\n| 0 | `low` |\n| 1 | `high` `pkg` |\n"
    floors = declared_packages(text)
    assert floors == {"low": 0, "high": 1, "pkg": 1}
    graph = {m.replace("pkg", "dfbuild", 1): {t.replace("pkg", "dfbuild", 1) for t in ts}
             for m, ts in import_graph(root).items()}
    floors["dfbuild"] = floors.pop("pkg")
    assert upward_imports(graph, floors) == [
        "dfbuild.low.a (low, floor 0) imports dfbuild.high.b (high, floor 1): an import upward"]
    assert cycles(package_graph(graph)) == [["high", "low"]]


def test_a_package_missing_from_the_table_is_named(tmp_path):
    # today's flat layout (before issue 45) fails so: dfbuild.build imports dfbuild.errors, in no package
    graph = {"dfbuild.build": {"dfbuild.errors"}, "dfbuild.errors": set()}
    assert upward_imports(graph, {"core": 0}) == [
        "dfbuild.build imports dfbuild.errors: package build is on no floor of the table"]


def test_a_private_name_from_another_package_is_found(tmp_path):
    root = _package(tmp_path, {"core/__init__.py": "", "core/util.py": "def _helper(): pass\n",
                               "core/same.py": "from pkg.core.util import _helper\n",
                               "stage/__init__.py": "", "stage/user.py": "from pkg.core.util import _helper, ok\n",
                               "stage/other.py": "from pkg.core import util\nutil._helper()\n"})
    assert private_imports(root) == ["pkg.stage.other (line 2) uses the private _helper of pkg.core.util",
                                     "pkg.stage.user (line 1) imports the private _helper from pkg.core.util"]


@pytest.mark.parametrize("code", ["import subprocess\n", "from subprocess import run\n",
                                  "import os\nos.execvp('x', ['x'])\n", "import os\nos.system('x')\n"])
def test_a_program_started_outside_the_runner_is_found(tmp_path, code):
    root = _package(tmp_path, {"proc.py": "import subprocess\n", "other.py": code})
    assert set(subprocess_users(root)) == {"pkg.proc", "pkg.other"}


def test_a_long_module_is_found(tmp_path):
    root = _package(tmp_path, {"short.py": "x = 1\n" * 3, "long.py": "x = 1\n" * 4})
    assert long_modules(root, limit=3) == {"pkg.long": 4}
