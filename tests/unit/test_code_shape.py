"""The code keeps a shape a newcomer can read: no function in vpsd/ over 60 lines (one job each; a longer one is
a sign it does several), and a README of at most 350 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vpsd"
MAX_LINES = 60


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_readme_fits_in_350_lines():
    """The README says how to run, install and trust vpsd; the details live in docs/ (design, jobs, benchmarks)."""
    lines = len((PACKAGE.parent / "README.md").read_text().splitlines())
    assert lines <= 350, f"README.md has {lines} lines: move details to docs/"
