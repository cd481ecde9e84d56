"""What a package of ours reads or writes of other code's private names, found in its source (AST): the tests of
the exporters' "public APIs only" rule read it."""

from __future__ import annotations

import ast
from pathlib import Path


def _trees(package: Path) -> list:
    return [ast.parse(f.read_text()) for f in sorted(package.glob("*.py"))]


def foreign_private_names(package: Path) -> set[str]:
    """Private names (``_x``, not dunders) the package's modules read or write (``obj._x``, ``getattr(obj, "_x")``)
    that none of them defines (as a function, a class, or an attribute assigned)."""
    defined, used = set(), set()
    for tree in _trees(package):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                used.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
                used.update(a.value for a in node.args[1:2] if isinstance(a, ast.Constant))
    private = {n for n in used if isinstance(n, str) and n.startswith("_") and not n.startswith("__")}
    return private - defined


def private_imports(package: Path, library: str) -> list[str]:
    """The package's imports of a private module or name of ``library`` (a top-level package name), and any
    import of a private module at all."""
    found = []
    for tree in _trees(package):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == library:
                if any(part.startswith("_") for part in node.module.split(".")):
                    found.append(node.module)
                found.extend(f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_"))
            elif isinstance(node, ast.Import):
                found.extend(a.name for a in node.names if any(p.startswith("_") for p in a.name.split(".")))
    return found
