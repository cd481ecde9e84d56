"""The soak, short (CI): the demo engine with every exporter on and a small retention bound. The full-length run
is ``make soak`` (1,000,000 steps); its figures are in docs/reliability.md."""

from __future__ import annotations

from benchmarks.soak import soak, within_bounds
from tests.otlp_receiver import Receiver

STEPS = 6000


def test_short_soak_with_every_exporter_on(tmp_path):
    max_bytes = 2 * 2**20
    with Receiver(keep=False) as rx:
        res = soak(STEPS, workdir=tmp_path, otlp_endpoint=rx.endpoint, spans_received=rx.span_count,
                   max_bytes=max_bytes, scrape_interval=0.5)
    print("\n" + res.table())
    assert res.steps == STEPS
    assert res.violations == {}
    assert res.sweep_findings == 0
    assert res.pages_back
    assert res.finished > 1000 and res.evictions > 1000
    # Retention holds the recording near its bound (it trims in whole chunks, after the bound is passed).
    assert res.recording_bytes_max > max_bytes // 2
    assert res.recording_bytes_end <= max_bytes * 1.1
    assert within_bounds(res), res.table()
    # Every exporter ran for real: scrapes answered, spans decoded by the receiver, nothing dropped.
    assert res.scrapes >= 1 and res.scrape_errors == 0
    assert res.spans_received >= res.finished
    assert res.events_dropped == {} or set(res.events_dropped.values()) == {0}
