"""The house has no knots: no import circle among superfluid's own modules.

A circle makes a module's behaviour depend on which side was imported first, hides the
direction of a dependency, and is usually papered over by an import deferred into a function.
So the check is static (``ast`` over every ``.py`` file in ``core/`` and ``plugins/``) and counts
every import that runs as an edge: at module level and inside functions alike (an import deferred
into a function is still a circle, only a hidden one). Imports under ``if TYPE_CHECKING:`` never
run; they are how an annotation names a type of a module that imports this one, so they are not
edges. A circle found here is broken by moving what both sides need to where it belongs, not by
hiding an import from this test."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"core": "superfluid.core", "plugins": "superfluid.plugins"}


# Circles tolerated for now, each with what closes it (none today). The list only
# shrinks: a new circle fails the test, and so does one listed here that is gone (delete its line).
KNOWN: set[tuple[str, str]] = set()


def module_files() -> dict[str, Path | None]:
    """Every superfluid module by its import name (a package by its ``__init__.py``); a C
    extension (``_rounds.c``, built or not) by its name, with no file to read."""
    out: dict[str, Path | None] = {}
    for folder, prefix in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".c", ".so") or ".venv" in path.parts:
                continue
            parts = list(path.relative_to(ROOT / folder).parts)
            parts[-1] = parts[-1].split(".")[0]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if path.suffix == ".py":
                out[name] = path
            else:
                out.setdefault(name, None)
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The superfluid modules ``name`` imports anywhere in its file: ``from X import y`` is an
    edge to ``X.y`` when that is a module, else to ``X``."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) if path else set() for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def test_the_checker_sees_a_circle_and_every_kind_of_import():
    """The check itself: a circle is found and a straight line is not; imports at module level,
    inside functions and of a C extension are edges, imports under TYPE_CHECKING are not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "superfluid.core.lane" in graph["superfluid.core.kv"]                 # relative, module level
    assert "superfluid.core.engine" not in graph["superfluid.core.kv"]           # only under TYPE_CHECKING
    assert "superfluid.plugins.llamacpp._rounds" in graph["superfluid.plugins.llamacpp.native"]  # in a function
    assert "superfluid.core.qos" in graph["superfluid.plugins.http.options"]     # absolute, ``from pkg import mod``


def test_no_import_circles():
    found = {tuple(c) for c in cycles(import_graph())}
    new = sorted(found - KNOWN)
    assert not new, "import circles (break them by moving what both sides need):\n" + "\n".join(
        " <-> ".join(c) for c in new)
    assert not KNOWN - found, f"gone, delete from KNOWN: {sorted(KNOWN - found)}"
