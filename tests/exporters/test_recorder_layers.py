"""The recorder package's layering: readers (the dashboard, the CLI's reading commands, the package's
``Recording``) load the format, the codec and the reader, never the writer side (encoder, writer, sink, path lock)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WRITER_SIDE = (
    "exporters.recorder.codec",
    "exporters.recorder.writer",
    "exporters.recorder.sink",
    "exporters.recorder.lock",
)


def loaded_after(code: str) -> list[str]:
    """The writer-side modules loaded after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {WRITER_SIDE!r} if m in sys.modules]))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_dashboard_and_the_cli_load_the_reader_only():
    assert loaded_after("import dashboard.data, dashboard.views, instrumented_alloc.cli") == []


def test_the_package_loads_the_writer_side_on_first_use_of_flight_recorder():
    assert loaded_after("from exporters.recorder import Recording, RecordingError, FORMAT_VERSION") == []
    assert loaded_after("from exporters.recorder import FlightRecorder") == list(WRITER_SIDE)
