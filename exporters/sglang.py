"""The exporters inside SGLang: which ones a scheduler process gets, with SGLang's labels and switches; and the
plugin's entry point, which hands them to the core plugin.

``register`` is what SGLang's ``sglang.srt.plugins`` entry-point group names: it starts the core plugin
(``instrumented_alloc.sglang_plugin``, which imports no exporter) with ``attach`` as the function that attaches a
scheduler's exporters once its allocator is built. The exporters' libraries are imported inside functions, when a
switch asks for them.

- Prometheus: with SGLang's ``--enable-metrics`` (SGLang then sets ``PROMETHEUS_MULTIPROC_DIR`` for its processes
  and its HTTP server's ``/metrics`` serves every file there), the ``kvalloc_`` metrics are multiprocess files in
  that directory, labelled as SGLang labels its scheduler's metrics (``rank_labels``): they appear on SGLang's own
  ``/metrics``. Without it, ``KVALLOC_METRICS_PORT`` serves them per rank on that port plus the rank's index.
- OpenTelemetry: with SGLang's ``--enable-trace``, on the tracer provider SGLang set up in the scheduler process;
  each ``kv.request`` span is a child of SGLang's root span of the request (``Session.parent``).
- Recordings: ``KVALLOC_RECORD_DIR`` gives one per rank, ``kvalloc-<run>-tp<N>-pp<N>[-dp<N>].sqlite`` (``<run>``:
  the pid of the process that launched the schedulers, shared by the ranks of one server), with the run metadata
  (engine ``sglang``, SGLang's version, the model, the ranks).

An exporter that cannot start (an unwritable directory, a taken port, a missing package) never stops SGLang: one
log line names the problem, and a stand-in sink under the exporter's name refuses every batch, so the events it
would have taken are counted in ``kvalloc_events_dropped_total{sink}`` (and ``alloc.bus.dropped``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("instrumented_alloc.sglang")

_RANK_KEYS = ("engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank")


def register() -> None:
    """SGLang's entry point (``sglang.srt.plugins``): inert unless ``KVALLOC_MODE`` switches the plugin on."""
    from instrumented_alloc.sglang_plugin import register as start

    start(attach_sinks=attach)


def rank_labels() -> dict:
    """SGLang's scheduler labels (as its ``SchedulerMetricsCollector`` sets them): ``model_name``, ``engine_type``,
    ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank`` when set, and ``--extra-metric-labels``."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_observability, get_parallel, get_serving

    parallel = get_parallel()
    engine_type = (
        "dynamic"
        if get_disagg().enable_pd_role_switch
        else DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode)
    )
    labels = {
        "model_name": str(get_serving().served_model_name),
        "engine_type": str(engine_type),
        "tp_rank": str(parallel.tp_rank),
        "pp_rank": str(parallel.pp_rank),
        "moe_ep_rank": str(parallel.moe_ep_rank),
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = str(parallel.dp_rank)
    extra = get_observability().extra_metric_labels
    if extra:
        labels.update({str(k): str(v) for k, v in extra.items()})
    return labels


def rank_index(labels: dict) -> int:
    """This scheduler's index among the server's ranks (tp fastest, then pp, then dp): a port offset."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    tp_size, pp_size = int(parallel.tp_size), int(parallel.pp_size)
    dp = int(labels.get("dp_rank", 0))
    return int(labels["tp_rank"]) + tp_size * (int(labels["pp_rank"]) + pp_size * dp)


def run_meta(labels: dict, model_path) -> dict:
    from importlib.metadata import version

    meta = {"engine": "sglang", "sglang_version": version("sglang"), "model": labels.get("model_name")}
    if model_path:
        meta["model_path"] = str(model_path)
    for key in _RANK_KEYS:
        if key in labels:
            meta[key] = int(labels[key]) if labels[key].isdigit() else labels[key]
    return meta


def recording_path(directory: str, labels: dict) -> str:
    name = f"kvalloc-{os.getppid()}-tp{labels['tp_rank']}-pp{labels['pp_rank']}"
    if "dp_rank" in labels:
        name += f"-dp{labels['dp_rank']}"
    return os.path.join(directory, name + ".sqlite")


class _Lost:
    """Stands in for an exporter that could not start: refuses every batch, so the bus counts the loss under the
    exporter's name. Reads only the kinds that exporter reads (no cost beyond building what it would have got)."""

    def __init__(self, name: str, event_types):
        self.name = name
        if event_types is not None:
            self.event_types = event_types

    def __call__(self, batch) -> bool:
        return False


def _lost(sess, name: str, what: str, exc: BaseException, event_types=None) -> None:
    log.error("instrumented-alloc: %s: %s; SGLang goes on without it (its events are counted as dropped)", what, exc)
    sess.errors[name] = f"{what}: {exc}"
    sess.alloc.subscribe(_Lost(name, event_types))


def attach(sess, server_args, model_config) -> None:
    """Attach the exporters the settings and SGLang's own switches ask for."""
    from sglang.srt.runtime_context import get_observability

    labels = rank_labels()
    sess.labels = labels
    obs = get_observability()
    mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if obs.enable_metrics and mp_dir:
        _attach_prometheus(sess, labels, multiprocess=True)
    elif sess.cfg.metrics_port is not None:
        _attach_prometheus(sess, labels, multiprocess=False)
    if obs.enable_trace:
        _attach_otel(sess)
    if sess.cfg.record_dir:
        _attach_recorder(sess, labels, getattr(server_args, "model_path", None))


def _attach_prometheus(sess, labels: dict, *, multiprocess: bool) -> None:
    try:
        from exporters.prometheus import PrometheusExporter
    except ImportError as exc:
        _lost(sess, "prometheus", "Prometheus metrics (pip install 'instrumented-alloc[prometheus]')", exc)
        return
    what = "Prometheus metrics"
    try:
        prom = PrometheusExporter(sess.alloc, const_labels=labels, multiprocess=multiprocess)
    except (OSError, ValueError, RuntimeError) as exc:
        _lost(sess, "prometheus", what, exc)
        return
    sess.closers.append(prom.close)
    sess.prometheus = prom
    if multiprocess:
        log.info("instrumented-alloc: kvalloc_ metrics join SGLang's /metrics (%s)", labels)
        return
    port = sess.cfg.metrics_port + rank_index(labels)
    try:
        bound = prom.serve(port, addr=sess.cfg.metrics_addr)
    except (OSError, ValueError) as exc:
        prom.close()
        sess.closers.remove(prom.close)
        sess.prometheus = None
        _lost(sess, "prometheus", f"KVALLOC_METRICS_PORT: serving on {sess.cfg.metrics_addr}:{port}", exc)
        return
    sess.metrics_url = f"http://{sess.cfg.metrics_addr}:{bound}/metrics"
    log.info("instrumented-alloc: metrics on %s", sess.metrics_url)


def _attach_otel(sess) -> None:
    try:
        from opentelemetry import trace

        from exporters.otel import OtelExporter
    except ImportError as exc:
        _lost(sess, "otel", "OpenTelemetry spans (pip install 'instrumented-alloc[otel]')", exc)
        return
    try:
        otel = OtelExporter(sess.alloc, tracer_provider=trace.get_tracer_provider())
    except (ValueError, TypeError, RuntimeError) as exc:
        _lost(sess, "otel", "OpenTelemetry spans", exc)
        return
    sess.otel = otel
    sess.closers.append(otel.shutdown)


def _attach_recorder(sess, labels: dict, model_path) -> None:
    from exporters.recorder import FlightRecorder, RecorderError

    directory = os.path.expanduser(sess.cfg.record_dir)
    path = recording_path(directory, labels)
    try:
        os.makedirs(directory, exist_ok=True)
        meta = run_meta(labels, model_path)
        # How this rank checks: what an incident reviewer reads the violations by.
        meta["ledger_checks"] = sess.cfg.ledger
        if sess.errors:
            meta["exporters_failed"] = dict(sess.errors)  # what this rank runs without, for whoever reads it
        rec = FlightRecorder(sess.alloc, path, meta=meta, overwrite=True)
    except (RecorderError, OSError, ValueError) as exc:
        what = f"KVALLOC_RECORD_DIR={directory}: no recording for this rank"
        _lost(sess, "recorder", what, exc, FlightRecorder.event_types)
        return
    sess.recording = path
    sess.closers.append(rec.close)
    log.info("instrumented-alloc: recording to %s", path)
