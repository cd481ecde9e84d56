"""The OTel exporter package uses only the OpenTelemetry SDK's public API: no private attribute, no private module."""

from __future__ import annotations

from pathlib import Path

from tests.public_api import foreign_private_names, private_imports

PACKAGE = Path(__file__).resolve().parents[3] / "exporters" / "otel"


def test_the_exporter_touches_no_private_attribute_of_opentelemetry():
    # Every private name the package reads or writes is one it defines itself, or a namedtuple's public
    # ``_replace`` (urllib's split URL): none of the SDK's.
    assert foreign_private_names(PACKAGE) == {"_replace"}


def test_the_exporter_imports_no_private_module_or_name_of_opentelemetry():
    assert private_imports(PACKAGE, "opentelemetry") == []


def test_the_check_finds_a_private_attribute_and_a_private_import(tmp_path):
    (tmp_path / "m.py").write_text(
        "from opentelemetry.sdk._logs import X\nfrom opentelemetry.trace import _helper\n"
        "class A:\n    def f(self, span):\n        self._own = 1\n        return span._attributes, self._own\n"
    )
    assert foreign_private_names(tmp_path) == {"_attributes"}
    assert private_imports(tmp_path, "opentelemetry") == ["opentelemetry.sdk._logs", "opentelemetry.trace._helper"]
