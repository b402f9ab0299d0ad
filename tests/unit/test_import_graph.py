"""No import circles between library files. The graph is built from the source of every module
of the library packages (rl, envs, serving, launch) without importing any: an edge for every
import a module makes, at its top, inside a function or under `TYPE_CHECKING`, so a circle
cannot hide in a function body. A package's `__init__.py` is the module of the package's name;
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`. Dynamic
imports (`importlib.import_module`) are not seen. A circle fails the test, named module by
module; the layers contracts in pyproject.toml (`make lint`) keep the floors, this keeps the
files within a floor apart too."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rl", "envs", "serving", "launch")


def library_modules(root: Path, packages: Iterable[str]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's `__init__`)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The library module `name` names: itself, or the closest package or module above it
    (`pkg.mod.attr` -> `pkg.mod`); None outside the library."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the library modules it imports (anywhere in its file)."""
    modules = library_modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                # `from pkg import mod` imports the module pkg.mod; `from mod import attr`, mod
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                found = _resolve(target, modules)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as the modules on it."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{component} is no cycle")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle per set of modules that import each other, round or not."""
    return [_shortest_cycle(graph, c) for c in _components(graph)]


def _describe(graph: dict[str, set[str]]) -> str:
    lines = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        lines.append(
            " -> ".join([*cycle, cycle[0]])
            + (
                f" (its circle holds {len(component)} modules: {', '.join(component)})"
                if len(component) > len(cycle)
                else ""
            )
        )
    return "\n".join(lines)


def test_no_import_circles_between_library_files():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the library, read
    assert not import_cycles(graph), (
        "import circles between library files (move what both sides need to where its "
        "boundary is; an import inside a function counts too):\n" + _describe(graph)
    )


def _package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_circle_through_a_function_body_or_a_relative_import_is_found_and_named(tmp_path):
    _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from pkg.c import g\n",
            "pkg/c.py": "import json\n\ndef g():\n    from . import a\n",
            "pkg/d.py": "from pkg.a import nothing  # into the circle, not part of it\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/e.py": "from ..d import x\nfrom .f import y\n",
            "pkg/sub/f.py": "from pkg import sub\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.sub.e"] == {"pkg.d", "pkg.sub.f"}
    assert graph["pkg.sub.f"] == {"pkg.sub"}
    assert graph["pkg.c"] == {"pkg.a"}  # json is no library module
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert _describe(graph) == "pkg.a -> pkg.b -> pkg.c -> pkg.a"
    _package(tmp_path, {"pkg/b.py": "import pkg.a\nfrom pkg.c import g\n"})
    assert import_cycles(import_graph(tmp_path, ["pkg"])) == [["pkg.a", "pkg.b"]]
