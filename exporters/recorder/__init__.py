"""The flight recorder: an ``InstrumentedAllocator``'s events, violations and periodic page snapshots in one SQLite
file (``FlightRecorder``), and its reader (``Recording``).

Modules by job: ``format`` (schema, version, errors), ``codec`` (block and snapshot encoding), ``reader``
(``Recording``), ``writer`` (commits, retention, metadata; runs behind ``instrumented_alloc.sinks.NonBlockingSink``),
``lock`` (one writer per path), ``sink`` (``FlightRecorder``: what runs on the engine thread).
Importing the package loads the format, the codec and the reader only: front ends that read (the dashboard, the
CLI's readers) never load the writer. ``FlightRecorder`` is loaded on first use.
"""

from __future__ import annotations

from .codec import decode_event, encode_event
from .format import (
    FIRST_VIOLATIONS_KEPT,
    FORMAT,
    FORMAT_VERSION,
    SINK_NAME,
    RecorderError,
    RecordingError,
    RecordingNotFoundError,
    RecordingVersionError,
)
from .reader import Recording

__all__ = [
    "FIRST_VIOLATIONS_KEPT",
    "FORMAT",
    "FORMAT_VERSION",
    "SINK_NAME",
    "FlightRecorder",
    "RecorderError",
    "Recording",
    "RecordingError",
    "RecordingNotFoundError",
    "RecordingVersionError",
    "decode_event",
    "encode_event",
]


def __getattr__(name: str):
    if name == "FlightRecorder":  # the writer side, loaded by its first user only
        from .sink import FlightRecorder

        return FlightRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
