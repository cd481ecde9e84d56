"""What the wrapper's events cost before any exporter touches them: ``python -m benchmarks.event_floor``.

The engine loop of ``bench_exporters`` (``engine_loop``) with a null sink that declares each exporter's
``event_types`` (and one with none: every kind), against the same loop with no sink, interleaved; CPU time of the
process, median ratio of the repeats (a warm-up round first). The floor under each exporter's engine-loop row:
what the wrapper spends building and delivering the events that exporter reads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_exporters import _wrapped, engine_loop


class _Null:
    """A sink that reads nothing; ``event_types`` as given (None: none declared, every kind is built)."""

    def __init__(self, name: str, types):
        self.name = name
        if types is not None:
            self.event_types = frozenset(types)

    def __call__(self, batch) -> None:
        return None


def _sets() -> dict:
    from exporters.otel import OtelExporter
    from exporters.prometheus import _Sink
    from exporters.recorder import FlightRecorder

    return {
        "prometheus": _Sink.event_types,
        "otel": OtelExporter.event_types,
        "recorder": FlightRecorder.event_types,
        "all": None,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sets = _sets()
    engine_loop(_wrapped(), iterations=2)  # lazy initialisation
    ratios: dict = {k: [] for k in sets}
    for r in range(args.repeats + 1):
        for name, types in sets.items():
            base = _wrapped()
            t0 = time.process_time()
            engine_loop(base, iterations=args.iterations)
            off = time.process_time() - t0
            alloc = _wrapped()
            alloc.subscribe(_Null(name, types))
            t0 = time.process_time()
            engine_loop(alloc, iterations=args.iterations)
            on = time.process_time() - t0
            if r:  # the first round warms up
                ratios[name].append(on / off)
    for name, rs in ratios.items():
        print(
            f"null sink with {name:10s} event types / no sink: median {statistics.median(rs):.3f}  "
            f"(min {min(rs):.3f}, max {max(rs):.3f}, {len(rs)} runs)"
        )
    return ratios


if __name__ == "__main__":
    main()
