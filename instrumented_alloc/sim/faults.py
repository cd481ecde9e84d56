"""Fault injection for the demo engine: each fault is one small mistake a real engine could make, and the
invariant id the wrapper must report for it.

A fault is armed at a step and fires once, at the first point at or after that step where the engine does the
operation the mistake belongs to (an SWA eviction, a finishing request, an allocation...). Without an explicit
step, the seed picks one while the run has traffic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from instrumented_alloc.sim.presets import Preset


@dataclass(frozen=True)
class Fault:
    name: str
    mistake: str
    invariant: str
    needs_swa: bool = False
    needs_pages: bool = False  # page size > 1 (at page size 1 every length is aligned)


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "swa-misaligned",
            "an SWA eviction writes an evicted length off a page boundary (the seed's bug)",
            "swa_evicted_seqlen_page_aligned",
            needs_swa=True,
            needs_pages=True,
        ),
        Fault(
            "swa-inside-window",
            "an SWA eviction reaches one page into the window",
            "swa_evicted_within_window",
            needs_swa=True,
        ),
        Fault("double-free", "a finished request's pages are freed twice", "double_free"),
        Fault("leak", "a finished request is released without freeing its pages", "request_leak"),
        Fault(
            "duplicate-alloc",
            "the allocator's free list is corrupted with a page in use, which the next allocation hands out",
            "duplicate_allocation",
        ),
        Fault(
            "segment-unaligned",
            "a segment free (an SWA eviction, or a finishing request's free on a dense model) starts off a page "
            "boundary",
            "segment_start_unaligned",
            needs_pages=True,
        ),
        Fault(
            "alloc-len-misaligned",
            "a request's kv_allocated_len is written as its token count, not rounded up to a page",
            "kv_allocated_len_page_aligned",
            needs_pages=True,
        ),
    )
}


class FaultError(ValueError):
    """An --inject value that names no fault, has a bad step, or does not apply to the preset."""


@dataclass(frozen=True)
class Injection:
    fault: Fault
    step: int  # armed from this step on (steps count from 0, as the wrapper's and the recording's do)
    explicit: bool  # the user gave @STEP


def parse_injection(text: str) -> tuple[str, int | None]:
    """``FAULT[@STEP]`` -> (name, step or None). Raises ``FaultError`` for an unknown fault or a bad step."""
    name, sep, step_s = text.partition("@")
    if name not in FAULTS:
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    if not sep:
        return name, None
    try:
        step = int(step_s)
    except ValueError:
        raise FaultError(f"{text!r}: the step after @ must be an integer, got {step_s!r}") from None
    if step < 0:
        raise FaultError(f"{text!r}: the step must be >= 0")
    return name, step


def plan(specs: list[str], preset: Preset, *, seed: int, steps: int | None) -> list[Injection]:
    """Resolve ``--inject`` values against a preset and run length. Raises ``FaultError`` with one clear line."""
    out = []
    for i, text in enumerate(specs):
        name, step = parse_injection(text)
        fault = FAULTS[name]
        if fault.needs_swa and not preset.is_swa:
            raise FaultError(f"fault {name} needs an SWA preset; {preset.name} has no sliding window")
        if fault.needs_pages and preset.page_size == 1:
            raise FaultError(f"fault {name} needs a page size > 1 (at page size 1 every length is page-aligned)")
        if step is not None and steps is not None and step >= steps:
            raise FaultError(f"{text!r}: step {step} is outside the run (steps 0..{steps - 1})")
        explicit = step is not None
        if step is None:
            # While the preset has traffic: past the ramp-up (the pool fills in a few hundred steps), early
            # enough in a bounded run to leave room for the fault's operation to come round.
            hi = 600 if steps is None else max(2, steps // 2)
            lo = min(200, hi // 2) if steps is None or steps >= 400 else max(1, hi // 2)
            step = random.Random(f"fault:{seed}:{i}:{name}").randint(lo, hi)
        out.append(Injection(fault, step, explicit))
    return out
