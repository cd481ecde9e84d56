"""The flight recorder: an ``InstrumentedAllocator``'s events, violations and periodic page snapshots in one SQLite
file (``FlightRecorder``), and its reader (``Recording``).

Modules by job: ``format`` (schema, version, errors), ``codec`` / ``decode`` (binary encoding), ``reader``
(``Recording``), ``writer`` (commits, retention, metadata; runs behind ``instrumented_alloc.sinks.NonBlockingSink``),
``lock`` (one writer per path), ``sink`` (``FlightRecorder``: what runs on the engine thread).
Importing the package loads the format, the decoder and the reader only: front ends that read (the dashboard, the
CLI's readers) never load the writer side. ``FlightRecorder`` and ``encode_event`` are loaded on first use.
"""

from __future__ import annotations

from .decode import decode_event
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
    # The writer side, loaded by its first user only.
    if name == "FlightRecorder":
        from .sink import FlightRecorder

        return FlightRecorder
    if name == "encode_event":
        from .codec import encode_event

        return encode_event
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
