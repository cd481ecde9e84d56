"""The demo engine: a simulated serving engine with fault injection (see ``engine.py``)."""

from __future__ import annotations

from collections.abc import Iterable

from instrumented_alloc.sim.engine import EngineStats, Fired, SimEngine, make_allocator
from instrumented_alloc.sim.faults import FAULTS, Fault, FaultError, Injection, plan
from instrumented_alloc.sim.presets import PAGE_SIZES, PRESETS, Preset
from instrumented_alloc.sim.workload import RequestSpec, TraceError, parse_trace, synthetic

__all__ = [
    "FAULTS",
    "PAGE_SIZES",
    "PRESETS",
    "EngineStats",
    "Fault",
    "FaultError",
    "Fired",
    "Injection",
    "Preset",
    "RequestSpec",
    "SimEngine",
    "TraceError",
    "build_engine",
    "make_allocator",
    "parse_trace",
    "resolve_preset",
    "synthetic",
]


def resolve_preset(name: str, *, page_size: int | None = None, rate: float | None = None) -> Preset:
    """A preset by name, with the command line's overrides. ``ValueError`` with one clear line otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    if page_size is not None and page_size not in PAGE_SIZES:
        raise ValueError(f"page size {page_size} is not one of {', '.join(map(str, PAGE_SIZES))}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 arrivals per step, got {rate}")
    preset = PRESETS[name].with_page_size(page_size).with_rate(rate)
    if preset.pd_decode and preset.page_size == 1:
        raise ValueError(f"preset {name} preallocates SWA tails by page: page size 1 is not supported")
    return preset


def build_engine(
    preset: str | Preset = "dense",
    *,
    seed: int = 0,
    page_size: int | None = None,
    rate: float | None = None,
    mode: str = "record",
    inject: Iterable[str] = (),
    steps: int | None = None,
    trace: list[RequestSpec] | None = None,
    sinks=(),
    wrapped: bool = True,
    clock=None,
    verify: str = "auto",
) -> SimEngine:
    """A demo engine for a preset (name or ``Preset``), seeded; ``inject`` takes ``FAULT[@STEP]`` strings,
    resolved against ``steps`` (the run's length, when bounded). ``trace`` replaces the synthetic workload."""
    p = preset if isinstance(preset, Preset) else resolve_preset(preset, page_size=page_size, rate=rate)
    injections = plan(list(inject), p, seed=seed, steps=steps)
    requests = trace if trace is not None else synthetic(p, seed)
    return SimEngine(
        p, requests, mode=mode, wrapped=wrapped, injections=injections, sinks=sinks, clock=clock, verify=verify
    )
