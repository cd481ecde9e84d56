"""A real Prometheus server for tests, and the few HTTP API calls they make (shared by tests/exporters and
tests/grafana, so there is one way to start, query and stop it).

Contract
- ``need_binary(name)``: the path of ``prometheus``/``promtool``; a missing one stops the test through
  ``tests.ci.missing`` (skip on a user's machine, failure under CI).
- ``prometheus_server`` (a pytest fixture; import it into a test module to use it): ``start(target_port,
  rule_files=(), config=None) -> base URL``. It writes a config scraping ``127.0.0.1:<target_port>`` every second
  and evaluating rules every second (or writes ``config`` verbatim when given), starts ``prometheus`` on a free
  127.0.0.1 port with exemplar storage on, and stops every server it started at teardown. The server's log is
  ``tmp_path / "prometheus.log"``.
- ``api(base, path, **params)``: GET an API path, assert ``status == "success"``, return ``data``.
- ``query(base, promql)``: an instant query's ``result`` list.
- ``wait_until_up(base, promql, tmp_path, timeout=30)``: poll ``promql`` until it has a result (Prometheus has
  scraped); fails with the tail of the server's log otherwise. Returns the result.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.ci import missing


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed (Debian: apt-get install prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_config(target_port: int, rule_files=()) -> str:
    """A one-target config: scrape and rule evaluation every second (tests wait for seconds, not minutes)."""
    text = (
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvalloc\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    if rule_files:
        text += "rule_files:\n" + "".join(f"  - '{Path(p).resolve()}'\n" for p in rule_files)
    return text


@pytest.fixture
def prometheus_server(tmp_path):
    """Start ``prometheus`` scraping 127.0.0.1:<target> every second; returns its API base URL."""
    binary = need_binary("prometheus")
    procs = []

    def start(target_port: int, rule_files=(), config: str | None = None) -> str:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(config if config is not None else scrape_config(target_port, rule_files))
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (closed by the finalizer)
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        return f"http://127.0.0.1:{port}"

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def api(base: str, path: str, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, promql: str) -> list:
    return api(base, "/api/v1/query", query=promql)["result"]


def wait_until_up(base: str, promql: str, tmp_path: Path, timeout: float = 30) -> list:
    """Poll ``promql`` until Prometheus returns a result (it is listening and has scraped the target)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = query(base, promql)
        except OSError:  # not listening yet
            result = []
        if result:
            return result
        time.sleep(0.25)
    log = (tmp_path / "prometheus.log").read_text(errors="replace")[-3000:]
    pytest.fail(f"Prometheus never returned {promql} within {timeout:g} s; its log:\n{log}")
