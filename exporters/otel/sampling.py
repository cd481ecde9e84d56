"""Sampling questions the exporter asks itself, through the sampler's public ``should_sample`` only.

The SDK samples each span at ``start_span`` (spans are per request, so that is once per request). The exporter
asks one question of its own, at construction: can this sampler sample any span of ours at all? If not
(``always_off``, a ratio of 0, a ``ParentBased`` whose every delegate drops), it subscribes to nothing.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

__all__ = ["samples_nothing", "trace_hex"]

# Low 64 bits zero: the trace id a ratio sampler samples whenever its ratio is above 0 (it compares those bits).
_PROBE_TRACE_ID = 1 << 64
_PROBE_SPAN_ID = 1


def _parents() -> list:
    """A root (None) and the four parents a ``ParentBased`` tells apart: remote or local, sampled or not."""
    out: list = [None]
    for remote in (True, False):
        for flags in (TraceFlags.SAMPLED, TraceFlags.DEFAULT):
            ctx = SpanContext(_PROBE_TRACE_ID, _PROBE_SPAN_ID, remote, TraceFlags(flags))
            out.append(set_span_in_context(NonRecordingSpan(ctx), Context()))
    return out


def samples_nothing(sampler) -> bool:
    """Whether ``sampler`` drops every span of ours: root spans and children of an engine's span (``set_parent``),
    remote or local, sampled or not. Asked of the SDK's own samplers only (their decision for the probe trace id
    is their decision for every id that can sample); any other sampler is assumed to sample something."""
    if type(sampler).__module__ != sampling.__name__:
        return False
    for parent in _parents():
        result = sampler.should_sample(parent, _PROBE_TRACE_ID, "kv.request")
        if result.decision is not sampling.Decision.DROP:
            return False
    return True


def trace_hex(ctx) -> str | None:
    """A sampled span's trace id as 32 hex digits; None for no context, an invalid one or an unsampled span (never
    exported: its id would link to nothing, as OpenTelemetry's trace-based exemplar filter keeps sampled ones)."""
    if ctx is None or not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return format(ctx.trace_id, "032x")
