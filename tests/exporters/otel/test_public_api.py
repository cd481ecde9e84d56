"""The OTel exporter package uses only the OpenTelemetry SDK's public API: no private attribute, no private module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "exporters" / "otel"


def _trees() -> list:
    return [ast.parse(f.read_text()) for f in sorted(PACKAGE.glob("*.py"))]


def test_the_exporter_touches_no_private_attribute_of_opentelemetry():
    # Every private name the package reads or writes (``obj._x``, ``getattr(obj, "_x")``) is one it defines itself,
    # or a namedtuple's public ``_replace`` (urllib's split URL): none of the SDK's.
    defined, used = set(), set()
    for tree in _trees():
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
    assert private - defined == {"_replace"}


def test_the_exporter_imports_no_private_module_or_name_of_opentelemetry():
    for tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opentelemetry"):
                assert not any(part.startswith("_") for part in node.module.split(".")), node.module
                assert not any(a.name.startswith("_") for a in node.names), node.module
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert not any(part.startswith("_") for part in a.name.split(".")), a.name
