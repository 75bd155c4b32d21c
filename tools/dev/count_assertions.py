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


def count(source: str) -> int:
    """The asserts and pytest.raises/warns checks in one module's source."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            n += 1
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            n += name in CHECKS
    return n


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
    total = sum(count(s) for s in sources.values())
    tests = sum(s.count("\ndef test_") + s.count("\n    def test_") + s.startswith("def test_")
                for s in sources.values())
    print(f"{args.rev or 'working tree'}: {total} assertions in {tests} test functions, {len(sources)} files")


if __name__ == "__main__":
    main()
