"""Counts the suite's assertions, at the working tree or at a commit, so a change that makes the
suite faster can show it kept what the suite checks.

An assertion is an ``assert`` statement or a ``pytest.raises``/``pytest.warns`` check, counted in
the source (``ast``), not at run time: a parametrized test's assert counts once.

    python -m tools.dev.count_assertions            # the working tree
    python -m tools.dev.count_assertions a6ad881    # a commit
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

CHECKS = {"raises", "warns", "deprecated_call"}


def count(source: str) -> tuple[int, int]:
    """(asserts and pytest.raises/warns checks, test functions) in one module's source."""
    checks = tests = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            checks += 1
        elif isinstance(node, ast.Call):
            func = node.func
            checks += (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in CHECKS
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            tests += node.name.startswith("test_")
    return checks, tests


def test_sources(rev: str | None, root: Path) -> dict[str, str]:
    """Every ``tests/**/*.py`` by path, read from the tree or from commit ``rev``."""
    if rev is None:
        return {str(p.relative_to(root)): p.read_text() for p in sorted((root / "tests").rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "tests/"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=root, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", help="a commit (default: the working tree)")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    sources = test_sources(args.rev, root)
    counts = [count(s) for s in sources.values()]
    total, tests = sum(c for c, _ in counts), sum(t for _, t in counts)
    print(f"{args.rev or 'working tree'}: {total} assertions in {tests} test functions, {len(sources)} files")


if __name__ == "__main__":
    main()
