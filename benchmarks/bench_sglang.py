"""The plugin's cost on SGLang's real Engine (CPU, the tiny dummy-weight model): bare vs plugin on.

``python -m benchmarks.bench_sglang [--pairs 3] [--batch 64] [--new-tokens 128] [--configs record,prometheus,all]``

Each run is one Engine start in a process of its own (``--child``): SGLang's Engine on the CPU recipe (page size
16, radix cache on, overlap scheduler on), a warm-up batch, then the measured batch: ``--batch`` requests with
32-token prompts that share a 16-token prefix, ``--new-tokens`` output tokens each (``ignore_eos``), all sent at
once, so that decode runs at batch ``--batch``. A run reports:
- output tokens/s of the measured batch (wall time of ``Engine.generate``);
- the scheduler process's CPU seconds over that batch (``psutil``: the ``sglang::scheduler`` child), per output
  token;
- the host time in the scheduler functions the plugin hooks (``sglang_plugin/probe.py``: timing hooks installed
  alike in bare and wrapped runs, around allocation, release, the cache's checkpoint, the SWA writer and the loop's
  start), per scheduler iteration that ran a batch.

Configurations, each a pair of runs with the same SGLang switches, bare then wrapped, alternating, ``--pairs``
pairs; the table gives the median of the pairs' wrapped/bare ratios (tokens/s, CPU s per token) and of the
per-iteration host time the plugin adds (wrapped - bare, microseconds):
- ``record``: ``KVALLOC_MODE=record``, no exporter;
- ``prometheus``: SGLang's ``--enable-metrics`` in both runs; wrapped, the ``kvalloc_`` metrics join its
  multiprocess ``/metrics``;
- ``all``: ``--enable-metrics`` and ``--enable-trace`` (OTLP/HTTP to a receiver in its own process) in both;
  wrapped, metrics, spans and a recording per rank.

What limits each figure on this machine: the tiny model's decode step on the CPU is slow (torch_native attention
works per sequence in Python: about 100 ms at batch 64), so tokens/s and CPU per token dilute the plugin's share;
two bare runs differ by several percent. The probe's per-iteration host time is the sharp figure: it isolates the
functions the plugin changes and is what a GPU step would have to hide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("record", "prometheus", "all")
TARGETS = {"record": "", "prometheus": "tokens/s >= 0.97x", "all": "tokens/s >= 0.95x"}


# -- one run (the child process) -----------------------------------------------------------------------------------
def _scheduler_cpu() -> float:
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            if "sglang::scheduler" in " ".join(p.cmdline()) or p.name().startswith("sglang::schedul"):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def child(spec: dict) -> dict:
    os.environ.update({"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", **spec["env"]})
    import random

    import sglang as sgl

    from instrumented_alloc.sglang_plugin import tiny_model

    model = tiny_model.write(spec["model_dir"], "dense")
    eng = sgl.Engine(
        model_path=model, load_format="dummy", device="cpu", attention_backend="torch_native",
        disable_cuda_graph=True, page_size=16, max_total_tokens=spec["max_total_tokens"],
        max_running_requests=spec["batch"], log_level="error", **spec["engine"],
    )  # fmt: skip
    rng = random.Random(spec["seed"])
    prefix = [rng.randrange(3, 32000) for _ in range(16)]

    def batch(n: int, new_tokens: int):
        ids = [prefix + [rng.randrange(3, 32000) for _ in range(16)] for _ in range(n)]
        return eng.generate(input_ids=ids, sampling_params={"max_new_tokens": new_tokens, "ignore_eos": True})

    batch(spec["batch"], 8)  # warm-up: allocator, caches, the exporters' first series
    cpu0, t0 = _scheduler_cpu(), time.perf_counter()
    out = batch(spec["batch"], spec["new_tokens"])
    wall, cpu = time.perf_counter() - t0, _scheduler_cpu() - cpu0
    tokens = sum(r["meta_info"]["completion_tokens"] for r in out)
    time.sleep(1.0)  # the scheduler goes idle: the probe writes its totals
    eng.shutdown()
    return {"wall": wall, "cpu": cpu, "tokens": tokens}


# -- the orchestration ---------------------------------------------------------------------------------------------
def _env(config: str, wrapped: bool, workdir: Path, endpoint: str | None) -> tuple[dict, dict]:
    env, engine = {}, {}
    if config in ("prometheus", "all"):
        engine["enable_metrics"] = True
    if config == "all":
        engine.update(enable_trace=True, otlp_traces_endpoint=endpoint)
        env.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
    if wrapped:
        env["KVALLOC_MODE"] = "record"
        if config == "all":
            env["KVALLOC_RECORD_DIR"] = str(workdir / "recordings")
    return env, engine


def run_one(config: str, wrapped: bool, args, workdir: Path, endpoint: str | None, index: int) -> dict:
    env, engine = _env(config, wrapped, workdir, endpoint)
    probe = workdir / f"probe-{config}-{int(wrapped)}-{index}"
    env["KVALLOC_PROBE_FILE"] = str(probe)
    spec = {
        "env": env, "engine": engine, "seed": 7, "batch": args.batch, "new_tokens": args.new_tokens,
        "max_total_tokens": args.batch * (32 + args.new_tokens + 32) + 1024, "model_dir": str(workdir / "model"),
    }  # fmt: skip
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "OTEL_", "PROMETHEUS_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_sglang", "--child", json.dumps(spec)],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{config} {'wrapped' if wrapped else 'bare'} run failed:\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    (probe_file,) = Path(workdir).glob(probe.name + ".*")
    p = json.loads(probe_file.read_text())
    result["hooked_s"] = sum(p["seconds"].values())
    result["iterations"] = p["iterations"]
    return result


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_sglang", description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="bare/wrapped pairs per configuration (at least 3)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return ""
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or args.pairs < 3:
        ap.error(f"--configs: unknown {bad}" if bad else "--pairs: at least 3")
    started = time.perf_counter()
    measured = measure(configs, args)
    return report(measured, args, time.perf_counter() - started)


def figures(pairs) -> dict:
    """Per pair: wrapped/bare tokens/s, wrapped/bare scheduler CPU seconds per output token, and the host time the
    plugin adds per scheduler iteration (microseconds)."""
    return {
        "tokens/s": [(w["tokens"] / w["wall"]) / (b["tokens"] / b["wall"]) for b, w in pairs],
        "cpu/token": [(w["cpu"] / w["tokens"]) / (b["cpu"] / b["tokens"]) for b, w in pairs],
        "us/iteration": [1e6 * (w["hooked_s"] / w["iterations"] - b["hooked_s"] / b["iterations"]) for b, w in pairs],
    }


def rows(*, pairs: int = 3, batch: int = 64, new_tokens: int = 128, configs=CONFIGS) -> list:
    """``make bench``'s rows (``benchmarks.common.table``): each configuration's three figures over its pairs."""
    args = argparse.Namespace(pairs=pairs, batch=batch, new_tokens=new_tokens)
    out = []
    for config, measured in measure(configs, args):
        f = figures(measured)
        out.append((f"sglang {config}: tokens/s, wrapped/bare (batch {batch})", f["tokens/s"], TARGETS[config]))
        out.append((f"sglang {config}: scheduler CPU per token, wrapped/bare", f["cpu/token"], ""))
        out.append((f"sglang {config}: host us added per iteration (not a ratio)", f["us/iteration"], ""))
    return out


def measure(configs, args) -> list:
    from benchmarks.bench_engine import _ReceiverProcess

    out = []
    with tempfile.TemporaryDirectory(prefix="kvalloc-bench-sglang-") as tmp, _ReceiverProcess() as rx:
        workdir = Path(tmp)
        for config in configs:
            pairs = []
            for i in range(args.pairs):
                order = (False, True) if i % 2 == 0 else (True, False)  # alternate which runs first
                got = {w: run_one(config, w, args, workdir, rx.endpoint, i) for w in order}
                pairs.append((got[False], got[True]))
                print(f"[{config} pair {i + 1}: bare {got[False]}, wrapped {got[True]}]", file=sys.stderr, flush=True)
            out.append((config, pairs))
    return out


def report(rows, args, elapsed: float) -> str:
    def med(xs):
        return statistics.median(xs)

    head = (
        f"python -m benchmarks.bench_sglang --pairs {args.pairs} --batch {args.batch} --new-tokens {args.new_tokens}:"
        f" SGLang's Engine on the CPU (tiny model, page size 16), wrapped vs bare, median of {args.pairs} pairs;"
        f" {elapsed:.0f} s"
    )
    cols = f"{'configuration':<12} {'tokens/s ratio':>15} {'sched CPU s/token ratio':>24} {'added host us/iter':>19}"
    cols += f" {'iters':>6}  target"
    lines = [head, cols, "-" * len(cols)]
    for config, pairs in rows:
        f = figures(pairs)
        tps, cpt, added = f["tokens/s"], f["cpu/token"], f["us/iteration"]
        iters = med([w["iterations"] for _, w in pairs])
        lines.append(
            f"{config:<12} {med(tps):>7.3f} ({min(tps):.3f}-{max(tps):.3f}) {med(cpt):>10.3f} ({min(cpt):.3f}-"
            f"{max(cpt):.3f}) {med(added):>10.0f} ({min(added):.0f}-{max(added):.0f}) {iters:>6.0f}  "
            f"{TARGETS[config]}"
        )
    for config, pairs in rows:
        b = pairs[0][0]
        lines.append(f"  {config}: bare {b['tokens'] / b['wall']:.0f} tokens/s, {1e3 * b['cpu'] / b['tokens']:.2f} ms "
                     f"scheduler CPU per token, {1e6 * b['hooked_s'] / b['iterations']:.0f} us/iteration in the "
                     "hooked functions (first pair)")  # fmt: skip
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
