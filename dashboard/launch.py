"""Start the dashboard: ``streamlit run dashboard/app.py`` on 127.0.0.1, with the recording directory (and the
recordings selected first: several are shown side by side) passed to the app through its environment (see
``dashboard.app``).

Contract: ``command(...)`` builds the command line and environment (pure); ``launch(...)`` runs it in the
foreground and returns its exit status; ``start(...)`` runs it in the background (``instrumented-alloc demo
--dashboard``) and returns a ``Server`` to stop. The app imports this checkout (its root goes first on
PYTHONPATH), binds 127.0.0.1 only, runs headless (no browser is opened, no usage statistics are sent). Bad
arguments raise ``ValueError`` with a message for the command line; the app itself reports bad recordings on
the page.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dashboard.app_config import ENV_DIR, ENV_RECORDING, ENV_REFRESH
from dashboard.data import home_expanded

APP = Path(__file__).resolve().with_name("app.py")
ROOT = APP.parents[1]


def resolve(recording=None, directory=None) -> tuple[Path, str | None]:
    """(directory, recording name relative to it). Without ``directory``: the recording's own directory, or the
    working directory. A recording outside ``directory`` is refused."""
    rec = home_expanded(os.fspath(recording)) if recording else None
    if directory is not None:
        d = home_expanded(os.fspath(directory)).resolve()
    elif rec is not None:
        d = (rec if rec.is_absolute() else Path.cwd() / rec).resolve().parent
    else:
        d = Path.cwd().resolve()
    if not d.is_dir():
        raise ValueError(f"--dir {d}: not a directory")
    name = None
    if rec is not None:
        full = (rec if rec.is_absolute() else (Path.cwd() / rec)).resolve()
        if directory is not None and not rec.is_absolute() and not full.exists():
            full = (d / rec).resolve()  # a name relative to --dir
        if d not in full.parents:
            raise ValueError(f"{recording}: not inside the dashboard's directory {d}")
        name = str(full.relative_to(d))
    return d, name


def resolve_all(recordings=(), directory=None) -> tuple[Path, list[str]]:
    """(directory, recording names relative to it) for several recordings (``resolve`` for each, repeats dropped).
    Without ``directory`` they must lie in one directory, which becomes the dashboard's: the app opens files
    under its directory only, and a common ancestor of scattered files could be the whole disk."""
    if directory is not None or not recordings:
        pairs = [resolve(r, directory) for r in recordings] or [resolve(None, directory)]
    else:
        pairs = [resolve(r) for r in recordings]
        dirs = list(dict.fromkeys(d for d, _ in pairs))
        if len(dirs) > 1:
            raise ValueError(
                f"the recordings are in different directories ({', '.join(map(str, dirs))}): give --dir, a "
                "directory that holds them all"
            )
    names = list(dict.fromkeys(n for _, n in pairs if n is not None))
    for n in names:
        if "\n" in n:  # the app receives the names one a line
            raise ValueError(f"{n!r}: a recording name with a line break cannot be passed to the dashboard")
    return pairs[0][0], names


def command(recording=None, *, port: int = 8501, directory=None, refresh: float | None = None):
    """(argv, env) that start the app (see the module contract). ``recording``: a recording, or a list of them
    (shown side by side)."""
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"--port {port}: not a TCP port")
    many = [] if recording is None else [recording] if isinstance(recording, (str, os.PathLike)) else list(recording)
    d, names = resolve_all(many, directory)
    argv = [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", "127.0.0.1",
        "--server.port", str(int(port)),
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        "--global.developmentMode", "false",
        "--client.toolbarMode", "viewer",
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV_DIR] = str(d)
    env.pop(ENV_RECORDING, None)
    if names:
        env[ENV_RECORDING] = "\n".join(names)
    if refresh is not None:
        env[ENV_REFRESH] = str(float(refresh))
    return argv, env


class Server:
    """A dashboard started in the background by ``start``: ``url``, ``proc``; ``wait_ready()``, ``stop()``."""

    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}/"

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Whether the app answers its health check within ``timeout`` seconds (False if it exited)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        return True
            except OSError:
                time.sleep(0.2)
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the app (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def check_port(port: int) -> int:
    """``port`` if the app could bind it on 127.0.0.1 now (0: any free port); OSError naming the port otherwise.
    Binds as the app's server does, with ``SO_REUSEADDR``: a port whose earlier connections are still in
    TIME-WAIT (a dashboard just stopped, its browser tab still open) is free, one with a listener is not."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise OSError(f"port {port} on 127.0.0.1 is taken ({exc.strerror or exc}): choose another") from None
        return sock.getsockname()[1]


def require_streamlit() -> None:
    """ImportError naming the extra when streamlit is not installed: the app runs as ``python -m streamlit``, so
    nothing here imports it, and without this check the child would only fail after the URL was announced."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("streamlit")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ImportError("No module named 'streamlit'")


def start(recording=None, *, port: int = 8501, directory=None, refresh: float | None = None) -> Server:
    """Start the dashboard in the background (e.g. next to a running demo) and return at once; the caller
    stops it (``Server.stop``). ValueError for bad arguments, OSError when the port is taken."""
    port = check_port(int(port))
    argv, env = command(recording, port=port, directory=directory, refresh=refresh)
    # The app's own banner would interleave with the caller's output; its errors still reach stderr.
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    return Server(proc, port)


def launch(recording=None, *, port: int = 8501, directory=None, refresh: float | None = None) -> int:
    """Run the dashboard in the foreground until interrupted; returns streamlit's exit status.

    The app runs as a child process and never outlives this one: SIGTERM (a service manager, a test) is forwarded
    to it, and Ctrl-C (which the terminal sends to both) waits for it to stop, terminating it after 15 s.
    OSError naming the port when it is taken (port 0: a free one is picked and printed), before anything starts."""
    port = check_port(int(port))
    argv, env = command(recording, port=port, directory=directory, refresh=refresh)
    print(f"dashboard: http://127.0.0.1:{port}  (recordings under {env[ENV_DIR]})", flush=True)
    proc = subprocess.Popen(argv, env=env)
    server = Server(proc, port)
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    except ValueError:  # not the main thread: nobody can deliver SIGTERM to this call anyway
        previous = None
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            server.stop()
        return 0
    finally:
        if proc.poll() is None:  # an exception of ours: the app must not be left behind
            server.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
