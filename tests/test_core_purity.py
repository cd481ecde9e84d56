"""The core stays pure: nothing in instrumented_alloc/ imports prometheus_client, opentelemetry, streamlit,
exporters or dashboard (cli.py, the composition root, only inside functions; the SGLang plugin gets its exporters
injected by its entry point, exporters/sglang.py);
importing the core loads none of them; and no core module reads the environment at import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "instrumented_alloc"
BANNED = ("prometheus_client", "opentelemetry", "streamlit", "exporters", "dashboard")
# The composition root: it may import exporters, but only inside functions.
ROOTS = (CORE / "cli.py",)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def _banned(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in BANNED


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _inside_function(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, _FUNCS):
            return True
    return False


def banned_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, inside a function) for every import of a banned package, at any depth, including
    ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = _parents(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:  # a relative import stays inside the core package
                names = [node.module or ""]
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names = [arg.value]
        for name in names:
            if _banned(name):
                found.append((node.lineno, name, _inside_function(node, parents)))
    return found


def test_core_files_found():
    names = {p.relative_to(CORE).as_posix() for p in core_files()}
    assert {"__init__.py", "wrapper/core.py", "ledger.py", "events.py", "prealloc.py", "stats.py"} <= names
    assert any("/" in n for n in names)  # subpackages (allocators/) are walked too


@pytest.mark.parametrize("path", core_files(), ids=lambda p: p.relative_to(CORE).as_posix())
def test_no_banned_imports(path):
    found = banned_imports(path)
    if path in ROOTS:
        # The composition root may import them, but only inside functions.
        assert [f for f in found if not f[2]] == [], found
    else:
        assert found == [], found


def test_scanner_catches_what_it_should(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\n"
        "import prometheus_client\n"
        "from opentelemetry.trace import get_tracer\n"
        "import exporters.prometheus as p\n"
        "if True:\n"
        "    import streamlit\n"
        "class C:\n"
        "    def f(self):\n"
        "        from dashboard import app\n"
        "        importlib.import_module('exporters.otel')\n"
        "try:\n"
        "    import dashboardish\n"
        "except ImportError:\n"
        "    pass\n"
    )
    assert banned_imports(src) == [
        (2, "prometheus_client", False),
        (3, "opentelemetry.trace", False),
        (4, "exporters.prometheus", False),
        (6, "streamlit", False),
        (9, "dashboard", True),
        (10, "exporters.otel", True),
    ]


def test_importing_the_core_loads_no_exporter():
    banned = ", ".join(repr(b) for b in BANNED)
    code = (
        "import sys\n"
        "import instrumented_alloc, instrumented_alloc.wrapper, instrumented_alloc.stats, instrumented_alloc.prealloc\n"
        "import instrumented_alloc.ledger, instrumented_alloc.events, instrumented_alloc.allocators\n"
        "import instrumented_alloc.cli, instrumented_alloc.sglang_plugin, instrumented_alloc.sglang_plugin.hooks\n"
        f"banned = ({banned},)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in banned)\n"
        "print('LOADED', loaded)\n"
        "assert 'instrumented_alloc.wrapper' in sys.modules\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout


# -- no environment reads at import time -----------------------------------------------------------------------
def import_time_env_reads(path: Path) -> list[tuple[int, str]]:
    """``os.environ`` / ``os.getenv`` / ``os.environb`` (or names imported from os) evaluated at import time:
    module and class bodies, decorators and default values, but not function bodies."""
    tree = ast.parse(path.read_text(), filename=str(path))
    from_os: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for a in node.names:
                if a.name in ("environ", "getenv", "environb", "getenvb"):
                    from_os.add(a.asname or a.name)
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                visit(d)
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if d is not None:
                    visit(d)
            return  # the body runs when called, not at import
        if isinstance(node, ast.Lambda):
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if d is not None:
                    visit(d)
            return
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb", "getenvb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in from_os and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.id))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@pytest.mark.parametrize("path", core_files(), ids=lambda p: p.relative_to(CORE).as_posix())
def test_no_environment_read_at_import_time(path):
    assert import_time_env_reads(path) == []


def test_env_scanner_catches_what_it_should(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\n"
        "from os import getenv as ge\n"
        "A = os.environ.get('X')\n"
        "def f(x=os.getenv('Y')):\n"
        "    return os.environ['Z']\n"
        "class C:\n"
        "    B = ge('W')\n"
        "    def g(self):\n"
        "        return ge('V')\n"
        "if 'K' in os.environ:\n"
        "    pass\n"
        "h = lambda: os.environ\n"
    )
    assert import_time_env_reads(src) == [(3, "os.environ"), (4, "os.getenv"), (7, "ge"), (10, "os.environ")]
