"""The exporters inside SGLang: which ones a scheduler process gets, with SGLang's labels and switches.

The composition root of the plugin: the only plugin module that imports ``exporters``, and only inside functions
(the core stays importable without them).

- Recordings: ``KVALLOC_RECORD_DIR`` gives one per rank, named ``kvalloc-<run>-tp<N>-pp<N>[-dp<N>].sqlite``
  (``<run>``: the pid of the process that launched the schedulers, shared by the ranks of one server), with the
  run metadata: engine ``sglang``, SGLang's version, the model, the ranks.
- Prometheus and OpenTelemetry: ``metrics.py`` and ``tracing.py``.

An exporter that cannot start (an unwritable directory, a taken port) never stops SGLang: the failure is logged
once, with what was wrong, and counted where a counter exists (``kvalloc_events_dropped_total{sink}``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("instrumented_alloc.sglang")


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


def run_meta(labels: dict, model_path: str | None) -> dict:
    from importlib.metadata import version

    meta = {"engine": "sglang", "sglang_version": version("sglang"), "model": labels.get("model_name")}
    if model_path:
        meta["model_path"] = str(model_path)
    for key in ("engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"):
        if key in labels:
            meta[key] = int(labels[key]) if labels[key].isdigit() else labels[key]
    return meta


def recording_path(directory: str, labels: dict) -> str:
    name = f"kvalloc-{os.getppid()}-tp{labels['tp_rank']}-pp{labels['pp_rank']}"
    if "dp_rank" in labels:
        name += f"-dp{labels['dp_rank']}"
    return os.path.join(directory, name + ".sqlite")


def attach(sess, server_args, model_config) -> None:
    """Attach the exporters the settings and SGLang's own switches ask for."""
    labels = rank_labels()
    sess.labels = labels
    model_path = getattr(server_args, "model_path", None)
    if sess.cfg.record_dir:
        _attach_recorder(sess, labels, model_path)


def _attach_recorder(sess, labels: dict, model_path) -> None:
    from exporters.recorder import FlightRecorder, RecorderError

    directory = os.path.expanduser(sess.cfg.record_dir)
    path = recording_path(directory, labels)
    try:
        os.makedirs(directory, exist_ok=True)
        rec = FlightRecorder(sess.alloc, path, meta=run_meta(labels, model_path), overwrite=True)
    except (RecorderError, OSError, ValueError) as exc:
        log.error("instrumented-alloc: KVALLOC_RECORD_DIR=%s: no recording for this rank: %s", directory, exc)
        sess.record_error = str(exc)
        return
    sess.recording = path
    sess.closers.append(rec.close)
    log.info("instrumented-alloc: recording to %s", path)
