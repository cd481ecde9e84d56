"""Shared test settings: hypothesis profiles (CI runs the "ci" profile: more examples, no deadline; "deep" is for a
long hunt by hand) and the ``integration``/``slow`` markers (``make test-fast`` runs ``-m "not slow"``)."""

import fnmatch
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




# The markers (registered in pyproject.toml), applied here by what a test is or uses rather than in every file:
# ``integration``: a real external component (an SGLang Engine or server, a Prometheus server, promtool, Chromium,
# an OTLP receiver, subprocess servers); ``slow``: more than about 5 s on an idle machine (measured with
# ``--durations``). A test file may also mark itself (``pytestmark``) or a test (a decorator).
_BY_NODE = {  # fnmatch patterns of node ids (relative to the repository root)
    "tests/sglang/*": ("integration", "slow"),  # an SGLang Engine per module (20-60 s per start)
    "tests/test_cli_sglang.py::*": ("integration", "slow"),
    "tests/dashboard/test_browser.py::*": ("integration", "slow"),  # streamlit in a subprocess, headless Chromium
    "tests/dashboard/test_launch.py::test_*_stop*": ("integration", "slow"),  # the dashboard's server in a subprocess
    "tests/grafana/test_integration.py::*": ("integration", "slow"),  # the demo scraped by a real Prometheus
    "tests/test_soak.py::*": ("slow",),  # the demo with every exporter on (~50 s)
    "tests/allocators/test_differential_sglang.py::*": ("slow",),  # SGLang's own allocators, call for call
    "tests/test_state_machines.py::Test_*_sglang_*": ("slow",),  # hypothesis state machines on SGLang's classes
    "tests/test_cli.py::test_bad_input_gets_one_line_and_exit_2": ("slow",),  # console-script subprocesses, in turn
    "tests/test_cli.py::test_a_clean_run_checks_clean_and_replays": ("slow",),
    "tests/test_cli.py::test_a_dashboard_that_cannot_start_leaves_the_recording_untouched": ("slow",),
    "tests/test_cli.py::test_help_lists_the_commands": ("slow",),
    "tests/test_cli.py::test_ctrl_c_stops_cleanly_and_closes_the_recording": ("slow",),
    "tests/test_fault_matrix.py::test_otlp_collector_slow_queue_full_is_counted": ("slow",),  # a receiver's delays
}
_BY_FIXTURE = {"prometheus_server": ("integration", "slow")}  # starts a Prometheus server and waits for scrapes
_BY_MARKER = {"sglang": ("integration", "slow")}
# Names a test's own code uses (its function's and nested functions' global and attribute names).
_BY_NAME_USED = {
    "Receiver": ("integration",),  # tests/otlp_receiver.py: an OTLP/HTTP receiver
    "need_binary": ("integration",),  # promtool or prometheus
    "promtool": ("integration",),  # tests/grafana/test_rules.py's helper
    "Popen": ("integration",),  # a process it talks to
}


def _names_used(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def pytest_collection_modifyitems(config, items):
    for item in items:
        marks = set()
        for pattern, names in _BY_NODE.items():
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                marks.update(names)
        for fixture in set(getattr(item, "fixturenames", ())) & _BY_FIXTURE.keys():
            marks.update(_BY_FIXTURE[fixture])
        for marker, names in _BY_MARKER.items():
            if item.get_closest_marker(marker) is not None:
                marks.update(names)
        code = getattr(getattr(item, "function", None), "__code__", None)
        if code is not None:
            for name in _names_used(code) & _BY_NAME_USED.keys():
                marks.update(_BY_NAME_USED[name])
        for name in sorted(marks):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
