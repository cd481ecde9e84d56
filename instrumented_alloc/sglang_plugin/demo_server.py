"""The demo's SGLang server: its command line, its environment, and its lifecycle (start, health, failure, stop).

Contract: ``Server`` starts ``python -m sglang.launch_server`` in a process group of its own (on Linux the kernel
sends it SIGTERM if the demo dies), its output in a log file; ``stop`` returns with the group gone (or only zombies
left), whatever happens meanwhile. ``failed`` is true once the server ended or logged a failed scheduler. The
plugin is imported in the server's processes from this checkout (``ROOT`` first on their PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from instrumented_alloc.sglang_plugin.demo import Options

ROOT = Path(__file__).resolve().parents[2]  # what the server's processes import the plugin from (this checkout)
STOP_GRACE_S = 30.0  # SIGTERM to SIGKILL


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _pdeathsig():
    """A preexec function that has the kernel send SIGTERM to the server when this process dies (Linux), so that
    a demo killed outright leaves no server behind; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig():
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG

    return set_pdeathsig


class Server:
    """``python -m sglang.launch_server`` in a process group of its own, its output in a log file."""

    def __init__(self, argv: list, env: dict, cwd: str, log_path: str):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_pdeathsig(),
            )  # fmt: skip
        self._log_pos = 0
        self._log_tail = ""
        self._failed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, base: str) -> bool:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the server (SGLang stops its schedulers, which close their recordings), then to its process
        group, then SIGKILL; a Ctrl-C meanwhile goes straight to SIGKILL. Returns with the group gone (or only
        zombies left in it)."""
        try:
            if self.alive():
                self._signal(signal.SIGTERM, group=False)
                if not self._wait_exit(grace * 2 / 3):
                    self._signal(signal.SIGTERM, group=True)
                    if not self._wait_exit(grace / 3):
                        self._signal(signal.SIGKILL, group=True)
            self._wait_group(5.0)
        except KeyboardInterrupt:
            pass
        self._signal(signal.SIGKILL, group=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def _signal(self, sig, *, group: bool) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.alive():
                os.kill(self.proc.pid, sig)

    def _wait_exit(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _wait_group(self, timeout: float) -> None:
        """Until no process of the server's group is left (its schedulers exit after it), or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)

    # What SGLang 0.5.23 logs when a scheduler fails: its main process may then take seconds to end (or hang in
    # its crash dump), so the demo watches the log too.
    FAILED = ("Scheduler hit an exception", "SIGQUIT received", "Received sigquit from a child process")

    def failed(self) -> bool:
        """Whether the server ended or logged that a scheduler failed (read incrementally from the log)."""
        if self._failed or not self.alive():
            return True
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_pos)
                chunk = f.read()
        except OSError:
            return False
        text = self._log_tail + chunk.decode(errors="replace")
        self._log_pos += len(chunk)
        self._log_tail = text[-200:]
        self._failed = any(m in text for m in self.FAILED)
        return self._failed

    def last_error(self) -> str | None:
        """The last exception line SGLang logged (its scheduler's traceback ends with it), if any."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return None
        found = re.findall(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Violation|Exit)\w*: .*$", text, re.M)
        return found[-1].strip() if found else None


def server_command(o: Options, model_dir: str, port: int) -> list:
    # The hybrid model's SWA pool as large as its full pool: on the CPU, SGLang's torch_native attention reads an
    # SWA layer's KV at the request's full-pool slots, and with SGLang's default ratio (0.8) the first full slot past
    # the SWA pool's size ends the scheduler with an IndexError (traffic that fills most of the pool reaches it).
    swa = ["--swa-full-tokens-ratio", "1"] if o.model == "swa" else []
    return [
        sys.executable, "-m", "sglang.launch_server",
        *swa,
        "--model-path", model_dir,
        "--load-format", "dummy",
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        "--page-size", str(o.page_size),
        "--max-total-tokens", str(o.max_total_tokens),
        "--tp-size", str(o.tp_size),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip


def server_env(o: Options, record_dir: str, metrics_port: int | None, injections) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "PROMETHEUS_MULTIPROC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", KVALLOC_MODE=o.mode, KVALLOC_RECORD_DIR=record_dir)
    env.setdefault("SGLANG_SWA_EVICTION_INTERVAL", "16")  # the window evicts often: the demo's SWA traffic
    if metrics_port is not None:
        env["KVALLOC_METRICS_PORT"] = str(metrics_port)
        env["KVALLOC_METRICS_ADDR"] = o.metrics_addr
    if injections:
        env["KVALLOC_INJECT"] = ",".join(j.fault for j in injections)
        # SGLang's own idle leak check would end the scheduler at the first injected leak; it logs instead.
        env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "0"
    if o.tp_size > 1 and not env.get("SGLANG_CPU_OMP_THREADS_BIND"):
        cpus = usable_cpus()
        share = len(cpus) // o.tp_size
        groups = [cpus[i * share : (i + 1) * share] for i in range(o.tp_size)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(map(_cpulist, groups))
    return env


def _cpulist(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpu list format, as SGLANG_CPU_OMP_THREADS_BIND takes it)."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
