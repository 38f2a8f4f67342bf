"""transformers code whose module cannot be imported here (it imports torchvision at load time), read from the
installed source instead: a class's assignments and methods as AST nodes, or one method compiled on its own.
The reference stays transformers' own code, at the installed version, not a copy of it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any, Callable


def class_body(module: str, cls: str) -> dict[str, ast.AST]:
    """Assignments and methods of a class, parsed from the module's source without importing it."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out[node.target.id] = node.value
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = node
    return out


def method(module: str, cls: str, name: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """One method of the class compiled alone, its globals `namespace` (the names it uses), annotations
    dropped (they name types the namespace need not hold)."""
    node = class_body(module, cls)[name]
    assert isinstance(node, ast.FunctionDef)
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    node.returns = None
    code = compile(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[])), f"<{module}.{cls}>", "exec")
    scope = dict(namespace)
    exec(code, scope)  # noqa: S102 (transformers' installed source, compiled to be called as the reference)
    return scope[name]
