"""The plugin's settings, read from the environment of each SGLang process: one place that names every variable.

- ``KVALLOC_MODE``: ``record`` or ``raise`` switches the plugin on; unset, empty or ``off`` leaves it inert;
  anything else is an error at start.
- ``KVALLOC_RECORD_DIR``: one recording per rank in this directory (``kvalloc-<engine>-tp<N>....sqlite``).
- ``KVALLOC_METRICS_PORT``: serve the ``kvalloc_`` metrics on this port (plus the rank: rank r serves on port + r)
  when SGLang's own ``/metrics`` is off (``--enable-metrics`` unset); ``KVALLOC_METRICS_ADDR`` (127.0.0.1).
- ``KVALLOC_SWEEP_INTERVAL``: the least number of seconds between two consistency sweeps, which run when the
  scheduler is idle after some activity (default 1).
- ``KVALLOC_LEDGER``: how SGLang's writes of a request's KV lengths are checked: ``deferred`` (record mode's
  default: verified together at each scheduler iteration's boundary, nothing added per write) or ``immediate``
  (each write as it is made; raise mode's only way, so that a rejected value raises before SGLang stores it).
- ``KVALLOC_INJECT``: faults to inject through test-only hooks (``faults.py``), comma-separated.

Pure: reads only the mapping it is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MODES = ("record", "raise")
LEDGER = ("deferred", "immediate")
INERT = ("", "off")
SUPPORTED_SGLANG = "0.5.23"


class ConfigError(ValueError):
    """A setting the plugin cannot run with: the message names the variable and the value."""


@dataclass(frozen=True)
class Config:
    mode: str
    record_dir: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    sweep_interval: float = 1.0
    inject: tuple[str, ...] = ()
    ledger: str = "deferred"


def seconds(text: str) -> float | None:
    """``text`` as a finite number of seconds >= 0, or None when it is not one."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def from_env(env: Mapping[str, str]) -> Config | None:
    """The settings in ``env``, or None when the plugin is to stay inert. Raises ``ConfigError``."""
    mode = env.get("KVALLOC_MODE", "").strip().lower()
    if mode in INERT:
        return None
    if mode not in MODES:
        raise ConfigError(
            f"KVALLOC_MODE={env.get('KVALLOC_MODE')!r}: expected one of {', '.join(MODES)} (or off / unset to "
            "leave SGLang uninstrumented)"
        )
    port = env.get("KVALLOC_METRICS_PORT", "").strip()
    metrics_port = None
    if port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"KVALLOC_METRICS_PORT={port!r}: expected a TCP port, 1..65535")
        metrics_port = int(port)
    interval = env.get("KVALLOC_SWEEP_INTERVAL", "").strip()
    sweep = 1.0
    if interval:
        sweep = seconds(interval)
        if sweep is None:
            raise ConfigError(f"KVALLOC_SWEEP_INTERVAL={interval!r}: expected a number of seconds >= 0")
    ledger = env.get("KVALLOC_LEDGER", "").strip().lower() or ("immediate" if mode == "raise" else "deferred")
    if ledger not in LEDGER:
        raise ConfigError(f"KVALLOC_LEDGER={env.get('KVALLOC_LEDGER')!r}: expected one of {', '.join(LEDGER)}")
    if mode == "raise" and ledger != "immediate":
        raise ConfigError(
            f"KVALLOC_LEDGER={env.get('KVALLOC_LEDGER')!r} with KVALLOC_MODE=raise: raise mode refuses a bad "
            "length as SGLang writes it, which needs immediate (the default there)"
        )
    record_dir = env.get("KVALLOC_RECORD_DIR", "").strip() or None
    inject = tuple(x.strip() for x in env.get("KVALLOC_INJECT", "").split(",") if x.strip())
    return Config(
        mode=mode,
        record_dir=record_dir,
        metrics_port=metrics_port,
        metrics_addr=env.get("KVALLOC_METRICS_ADDR", "").strip() or "127.0.0.1",
        sweep_interval=sweep,
        inject=inject,
        ledger=ledger,
    )
