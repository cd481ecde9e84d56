"""Shared test settings: hypothesis profiles (CI runs the "ci" profile: more examples, no deadline; "deep" is for a
long hunt by hand)."""

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

