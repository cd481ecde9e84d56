"""Shared test settings: hypothesis profiles (CI runs the "ci" profile: more examples, no deadline; "deep" is for a
long hunt by hand) and the ``integration``/``slow`` markers (``make test-fast`` runs ``-m "not slow"``)."""

import os
import socket

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A long hunt, by hand: HYPOTHESIS_PROFILE=deep (20x the CI profile's examples; tests that fix their own count keep it).
settings.register_profile("deep", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") == "true" else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The real-Prometheus fixture, shared by tests/exporters and tests/grafana.
from tests.prometheus_server import prometheus_server  # noqa: E402, F401


@pytest.fixture
def otel_env(monkeypatch):
    """A clean OTEL_* environment (the machine's own settings must not leak into the tests)."""
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.fixture
def taken_port():
    """A TCP port on 127.0.0.1 that a listening socket holds for the test (bad input: a port in use)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()



# The markers (registered in pyproject.toml), applied here by what a test uses rather than in every file:
# ``integration``: a real external component (an SGLang Engine or server, a Prometheus server, promtool, Chromium,
# an OTLP receiver, subprocess servers); ``slow``: more than about 5 s. Paths are relative to the repository root;
# a directory ends with "/". A test file may also mark itself (``pytestmark``) or a test (a decorator).
_BY_PATH = {
    "tests/sglang/": ("integration", "slow"),  # an SGLang Engine per module (20-60 s per start)
    "tests/test_cli_sglang.py": ("integration", "slow"),
    "tests/dashboard/test_browser.py": ("integration", "slow"),  # streamlit in a subprocess, headless Chromium
    "tests/grafana/test_integration.py": ("integration", "slow"),  # the demo scraped by a real Prometheus (~1 min)
    "tests/grafana/test_rules.py": ("integration",),  # promtool
    "tests/test_soak.py": ("slow",),
    "tests/allocators/test_differential_sglang.py": ("slow",),  # SGLang's own allocators, call for call
}
_BY_FIXTURE = {"prometheus_server": ("integration", "slow")}  # starts a Prometheus server and waits for scrapes
_BY_MARKER = {"sglang": ("integration", "slow")}


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath)
    for item in items:
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        names = set()
        for prefix, marks in _BY_PATH.items():
            if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
                names.update(marks)
        for fixture in set(getattr(item, "fixturenames", ())) & _BY_FIXTURE.keys():
            names.update(_BY_FIXTURE[fixture])
        for marker, marks in _BY_MARKER.items():
            if item.get_closest_marker(marker) is not None:
                names.update(marks)
        for name in sorted(names):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
