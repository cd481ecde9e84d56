"""The launcher and the ``dashboard`` subcommand: 127.0.0.1 only, the directory passed through, names outside it
refused, usage errors without a traceback."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from dashboard.app_config import ENV_DIR, ENV_RECORDING, ENV_REFRESH
from dashboard.data import DashboardInputError, RecordingDir
from dashboard.launch import APP, ROOT, Server, command
from instrumented_alloc.cli import build_parser
from tests.ctrl_c import restore_sigint

REPO = Path(__file__).resolve().parents[2]


def test_command_binds_localhost_and_passes_the_recording(tmp_path):
    rec = tmp_path / "run.sqlite"
    rec.write_bytes(b"")
    argv, env = command(rec, port=8600, refresh=0.5)
    assert argv[:5] == [sys.executable, "-m", "streamlit", "run", str(APP)]
    opts = dict(zip(argv[5::2], argv[6::2]))
    assert opts["--server.address"] == "127.0.0.1" and opts["--server.port"] == "8600"
    assert opts["--server.headless"] == "true" and opts["--browser.gatherUsageStats"] == "false"
    assert env[ENV_DIR] == str(tmp_path.resolve()) and env[ENV_RECORDING] == "run.sqlite"
    assert env[ENV_REFRESH] == "0.5"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_command_with_a_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    _, env = command("sub/x.sqlite", directory=tmp_path)
    assert env[ENV_DIR] == str(tmp_path.resolve()) and env[ENV_RECORDING] == os.path.join("sub", "x.sqlite")
    _, env = command(None, directory=tmp_path)
    assert ENV_RECORDING not in env
    with pytest.raises(ValueError, match="not inside the dashboard's directory"):
        command(tmp_path.parent / "elsewhere.sqlite", directory=tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        command(None, directory=tmp_path / "nope")
    with pytest.raises(ValueError, match="not a TCP port"):
        command(None, directory=tmp_path, port=70000)


def test_command_with_several_recordings(tmp_path):
    # `instrumented-alloc dashboard run-tp0.sqlite run-tp1.sqlite`: one recording per rank, shown side by side.
    (tmp_path / "sub").mkdir()
    a, b = tmp_path / "run-tp0.sqlite", tmp_path / "run-tp1.sqlite"
    _, env = command([a, b, a])  # a repeat is shown once
    assert env[ENV_DIR] == str(tmp_path.resolve()) and env[ENV_RECORDING] == "run-tp0.sqlite\nrun-tp1.sqlite"
    _, env = command(["run-tp1.sqlite", "sub/x.sqlite"], directory=tmp_path)
    assert env[ENV_RECORDING] == "run-tp1.sqlite\n" + os.path.join("sub", "x.sqlite")
    # Without --dir the dashboard's directory is theirs: it must be one (a common ancestor could be "/").
    with pytest.raises(ValueError, match=r"in different directories .*: give --dir, a directory that holds them"):
        command([a, tmp_path / "sub" / "x.sqlite"])
    _, env = command([a, tmp_path / "sub" / "x.sqlite"], directory=tmp_path)
    assert env[ENV_RECORDING] == "run-tp0.sqlite\n" + os.path.join("sub", "x.sqlite")
    with pytest.raises(ValueError, match="not inside the dashboard's directory"):
        command([a, tmp_path.parent / "elsewhere.sqlite"], directory=tmp_path)
    with pytest.raises(ValueError, match="a recording name with a line break"):
        command([a, tmp_path / "two\nlines.sqlite"])
    _, env = command([], directory=tmp_path)
    assert ENV_RECORDING not in env


def test_recording_dir_confines_every_name(tmp_path):
    root = tmp_path / "recs"
    root.mkdir()
    (root / "a.sqlite").write_bytes(b"")
    (root / "notes.txt").write_text("x")
    (root / "a.sqlite-wal").write_bytes(b"")
    (tmp_path / "secret.sqlite").write_bytes(b"")
    (root / "link.sqlite").symlink_to(tmp_path / "secret.sqlite")
    d = RecordingDir(root)
    assert d.names() == ["a.sqlite"]  # no -wal, no other suffix, no symlink
    assert d.resolve("a.sqlite") == root.resolve() / "a.sqlite"
    for bad in ("../secret.sqlite", "link.sqlite", str(tmp_path / "secret.sqlite"), "sub/../../secret.sqlite"):
        with pytest.raises(DashboardInputError, match="outside the dashboard's recording directory"):
            d.open(bad)
    with pytest.raises(DashboardInputError, match="no such file"):
        d.open("gone.sqlite")
    with pytest.raises(DashboardInputError, match="not a directory"):
        RecordingDir(tmp_path / "missing")


def test_parser_has_the_dashboard_command():
    args = build_parser().parse_args(["dashboard", "r.sqlite", "--port", "9000", "--dir", "/x"])
    assert (args.recording, args.port, args.dir, args.refresh) == ("r.sqlite", 9000, "/x", None)
    args = build_parser().parse_args(["dashboard"])
    assert (args.recording, args.more, args.port, args.dir) == (None, [], 8501, None)
    args = build_parser().parse_args(["dashboard", "run-tp0.sqlite", "run-tp1.sqlite", "run-tp2.sqlite"])
    assert (args.recording, args.more) == ("run-tp0.sqlite", ["run-tp1.sqlite", "run-tp2.sqlite"])


def test_cli_refuses_a_recording_outside_dir_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "instrumented_alloc.cli", "dashboard", "/etc/passwd", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 2
    assert "not inside the dashboard's directory" in res.stderr and "Traceback" not in res.stderr


def test_cli_refuses_recordings_in_different_directories_without_a_traceback(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "instrumented_alloc.cli", "dashboard", str(tmp_path / "a" / "run-tp0.sqlite"),
         str(tmp_path / "b" / "run-tp1.sqlite"), "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 2
    assert "the recordings are in different directories" in res.stderr and "give --dir" in res.stderr
    assert "Traceback" not in res.stderr


def test_demo_dashboard_flag_serves_the_live_recording_and_stops_with_the_demo(tmp_path):

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "instrumented_alloc.cli", "demo", "--preset", "swa-128", "--pace", "50",
         "--record", str(tmp_path / "live.sqlite"), "--dashboard", "--dashboard-port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=restore_sigint,  # the test sends Ctrl-C (see tests/ctrl_c.py)
        start_new_session=True,  # its own process group: a stop that hangs is killed with its app (below)
    )  # fmt: skip
    try:
        url = None
        for line in proc.stdout:
            m = re.match(r"dashboard: (http://127\.0\.0\.1:\d+/)", line)
            if m:
                url = m.group(1)
                break
        assert url == f"http://127.0.0.1:{port}/"
        probe = Server(proc, port)  # only its health check: the demo owns the app's process
        assert probe.wait_ready(90)
        with urllib.request.urlopen(url + "_stcore/health", timeout=5) as r:
            assert r.read().strip() == b"ok"
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the demo stops cleanly, and its dashboard with it
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the demo and its app: a failed stop leaves neither running
            proc.communicate()
            raise
    assert proc.returncode == 0, err[-2000:]
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT; a listener still refuses
        s.bind(("127.0.0.1", port))
        s.listen()  # the app is gone: nobody listens on its port any more


def test_dashboard_command_stopped_by_sigterm_takes_the_app_with_it(tmp_path):
    """``instrumented-alloc dashboard`` runs Streamlit as a child: SIGTERM to the command (a service manager, a
    test's terminate()) stops the app too, and its port is free again; it is never left running, orphaned."""
    rec = tmp_path / "empty.sqlite"
    rec.write_bytes(b"")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "instrumented_alloc.cli", "dashboard", str(rec), "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert Server(proc, port).wait_ready(90), "the dashboard did not come up"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]  # streamlit's own status after a clean stop
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT; a listener still refuses
        s.bind(("127.0.0.1", port))
        s.listen()  # the app is gone: nobody listens on its port any more


def test_a_leading_tilde_is_a_home_only_as_a_shell_reads_it(tmp_path, monkeypatch):
    from dashboard.launch import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "~x.sqlite").touch()
    assert resolve("~x.sqlite") == (tmp_path.resolve(), "~x.sqlite")  # a name, not user x's home
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("~/~x.sqlite") == (tmp_path.resolve(), "~x.sqlite")
    assert RecordingDir("~").root == tmp_path.resolve()
