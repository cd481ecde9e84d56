"""The SGLang plugin: switches the instrumented allocator on inside SGLang's own server, with one setting.

Installing the distribution registers ``exporters.sglang.register`` in SGLang's ``sglang.srt.plugins`` entry-point
group; SGLang calls it at start in every one of its processes, and it calls ``register`` here with the function that
attaches the exporters. It is inert unless ``KVALLOC_MODE`` is ``record`` or ``raise``
(see ``config.py`` for every setting). Then it hooks SGLang (``hooks.py``) and each scheduler process wraps its
KV allocator, attributes allocations to requests, routes their KV length writes through the checked ledger,
follows the prefix cache's ownership, steps once per scheduler iteration and sweeps when idle.

A setting it cannot run with, an SGLang version other than the one supported, or a hook that did not apply stops
the process at start with one message (``PluginError``, a ``SystemExit``: SGLang logs and swallows a plugin's
ordinary exceptions, which would leave a silently uninstrumented engine).
"""

from __future__ import annotations

import os

from instrumented_alloc.sglang_plugin.config import SUPPORTED_SGLANG, ConfigError, from_env


class PluginError(SystemExit):
    """The plugin refuses to start SGLang: the message says why."""


def register(*, attach_sinks=None) -> None:
    """Start the plugin in this SGLang process: inert unless ``KVALLOC_MODE`` switches it on. ``attach_sinks``
    (``exporters.sglang.attach``, passed by the distribution's entry point, ``exporters.sglang.register``):
    ``attach_sinks(session, server_args, model_config)`` attaches a scheduler's exporters once its allocator and
    tree cache are built; None: no exporter (the core imports none)."""
    try:
        cfg = from_env(os.environ)
    except ConfigError as exc:
        raise PluginError(f"instrumented-alloc: {exc}") from None
    probe_path = os.environ.get("KVALLOC_PROBE_FILE")  # benchmarks only: see probe.py
    if cfg is None:
        if probe_path:
            from instrumented_alloc.sglang_plugin import hooks, probe

            hooks.apply(probe.hooks(probe_path))  # a bare run, timed as a wrapped one is
        return
    from importlib.metadata import version

    found = version("sglang")
    if found != SUPPORTED_SGLANG:
        raise PluginError(
            f"instrumented-alloc: the SGLang plugin supports sglang {SUPPORTED_SGLANG}; this is sglang {found} "
            "(unset KVALLOC_MODE to run SGLang without it)"
        )
    from instrumented_alloc.sglang_plugin import faults, hooks, probe, session

    session.start(cfg, attach_sinks=attach_sinks)
    try:
        extra = faults.hooks(cfg.inject) + (probe.hooks(probe_path) if probe_path else ())
        hooks.install(extra=extra, route=cfg.ledger == "immediate")
    except (hooks.HookError, faults.FaultError) as exc:
        raise PluginError(str(exc)) from None
