"""Runs SGLang's real ``Engine`` (plugin on) through workloads, in a process of its own: what the SGLang tests run.

``python -m tests.sglang.driver SPEC.json`` reads a spec, starts the Engine, runs its workloads in order, waits for
the scheduler's idle sweep, shuts the Engine down and writes what happened to ``spec["out"]`` (JSON). A process of
its own because a scheduler that dies (raise mode, an injected fault) makes SGLang kill its whole process tree, and
a caller blocked in ``Engine.generate`` can wait forever: the test runs this with a deadline and reads the
recording the plugin wrote, which survives. A watchdog ends the process at ``spec["deadline"]`` seconds.

Spec: ``model`` (dense | swa), ``model_dir``, ``engine`` (Engine keyword arguments beyond the CPU recipe),
``env`` (KVALLOC_*, SGLANG_* ...), ``workloads`` (a list of {"kind": ...}), ``out``, ``deadline``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

CPU_RECIPE = {
    "load_format": "dummy",
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "log_level": "warning",
}


def _watchdog(seconds: float) -> None:
    def fire():
        time.sleep(seconds)
        print(f"driver: deadline of {seconds}s passed; exiting", file=sys.stderr, flush=True)
        os._exit(124)

    threading.Thread(target=fire, daemon=True).start()


def _waves(eng, w: dict, note) -> dict:
    from instrumented_alloc.sglang_plugin import traffic

    out = {"cached": [], "rids": [], "completion": []}
    for wave in traffic.prefix_waves(w.get("seed", 0), waves=w.get("waves", 3), per_wave=w.get("per_wave", 16)):
        res = eng.generate(input_ids=wave.input_ids, rid=wave.rids, sampling_params=wave.sampling_params())
        out["cached"].append(sum(r["meta_info"]["cached_tokens"] for r in res))
        out["completion"].append(sum(r["meta_info"]["completion_tokens"] for r in res))
        out["rids"] += wave.rids
    return out


def _abort(eng, w: dict, note) -> dict:
    """Requests aborted in the middle of their decode: streamed, aborted after a few chunks."""
    import random

    from instrumented_alloc.sglang_plugin import traffic

    rng = random.Random(w.get("seed", 0))
    reasons = []
    rids = []
    for _ in range(w.get("n", 3)):
        rid = traffic.rid(rng, "abort")
        ids = [rng.randrange(3, 32000) for _ in range(40)]
        last = None
        params = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0}
        for chunks, chunk in enumerate(eng.generate(input_ids=ids, rid=rid, stream=True, sampling_params=params), 1):
            last = chunk
            if chunks == 3:
                eng.tokenizer_manager.abort_request(rid)
        reasons.append((last or {}).get("meta_info", {}).get("finish_reason"))
        rids.append(rid)
    return {"rids": rids, "finish_reasons": reasons}


def _decode(eng, w: dict, note) -> dict:
    """One decode-heavy batch; with ``ignore_eos`` False SGLang reserves by its token ratio and retracts under
    pressure (the tiny model's random weights practically never sample EOS)."""
    from instrumented_alloc.sglang_plugin import traffic

    wave = traffic.decode_batch(
        w.get("seed", 0), n=w.get("n", 24), prompt_len=w.get("prompt_len", 20), new_tokens=w.get("new_tokens", 200)
    )
    res = eng.generate(
        input_ids=wave.input_ids,
        rid=wave.rids,
        sampling_params=wave.sampling_params(ignore_eos=w.get("ignore_eos", True)),
    )
    return {"rids": wave.rids, "completion": [r["meta_info"]["completion_tokens"] for r in res]}


def _fault(eng, w: dict, note) -> dict:
    """A few requests sharing a prefix, the first of them tagged for an injected fault (``faults.tag``)."""
    import random

    from instrumented_alloc.sglang_plugin import faults, traffic

    rng = random.Random(w.get("seed", 0))
    prefix = [rng.randrange(3, 32000) for _ in range(w.get("prefix", 40))]
    n = w.get("n", 3)
    ids = [prefix + [rng.randrange(3, 32000) for _ in range(w.get("suffix", 12))] for _ in range(n)]
    rids = [traffic.rid(rng, faults.tag(w["fault"]))] + [traffic.rid(rng) for _ in range(n - 1)]
    note({"rids": rids, "target": rids[0]})  # before the call: an injected fault may end the engine in it
    eng.generate(
        input_ids=ids,
        rid=rids,
        sampling_params={"max_new_tokens": w.get("new_tokens", 50), "ignore_eos": True, "temperature": 0.0},
    )
    return {"rids": rids, "target": rids[0]}


def _pd(eng, w: dict, note) -> dict:
    """PD decode side with the fake transfer backend: every request preallocated through alloc_for_decode_prealloc."""
    import random

    from instrumented_alloc.sglang_plugin import faults, traffic

    rng = random.Random(w.get("seed", 0))
    n = w.get("n", 8)
    ids = [[rng.randrange(3, 32000) for _ in range(rng.randint(*w.get("prompt", (20, 90))))] for _ in range(n)]
    rids = [traffic.rid(rng) for _ in range(n)]
    if w.get("fault"):
        rids[-1] = traffic.rid(rng, faults.tag(w["fault"]))
    note({"rids": rids, "prompt_lens": [len(x) for x in ids]})
    res = eng.generate(
        input_ids=ids,
        rid=rids,
        bootstrap_host=["2.2.2.2"] * n,
        bootstrap_port=[8998] * n,
        bootstrap_room=[rng.getrandbits(32) for _ in range(n)],
        sampling_params={"max_new_tokens": w.get("new_tokens", 16), "ignore_eos": True, "temperature": 0.0},
    )
    return {
        "rids": rids,
        "prompt_lens": [len(x) for x in ids],
        "completion": [r["meta_info"]["completion_tokens"] for r in res],
    }


def _scrape(eng, w: dict, note) -> dict:
    """GET ``url`` (a metrics endpoint the plugin serves): its text."""
    import urllib.request

    time.sleep(w.get("after", 0))
    with urllib.request.urlopen(w["url"], timeout=30) as r:
        return {"text": r.read().decode()}


def _idle(eng, w: dict, note) -> dict:
    time.sleep(w.get("seconds", 1.5))
    return {}


WORKLOADS = {
    "waves": _waves,
    "abort": _abort,
    "decode": _decode,
    "fault": _fault,
    "pd": _pd,
    "scrape": _scrape,
    "idle": _idle,
}


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    _watchdog(spec.get("deadline", 300))
    os.environ.update({"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"})
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    from instrumented_alloc.sglang_plugin import tiny_model

    model = tiny_model.write(spec["model_dir"], spec.get("model", "dense"))
    import sglang as sgl

    results: dict = {"workloads": [], "phase": "start"}

    def save():
        with open(spec["out"], "w", encoding="utf-8") as f:
            json.dump(results, f)

    save()
    t0 = time.monotonic()
    recipe = dict(CPU_RECIPE)
    if spec.get("model") == "swa":
        # SGLang's torch_native attention reads an SWA layer's KV at the request's full-pool slots on the CPU: an
        # SWA pool smaller than the full one (SGLang's default ratio, 0.8) ends the scheduler with an IndexError
        # once a full slot passes its size, plugin on or off.
        recipe["swa_full_tokens_ratio"] = 1.0
    eng = sgl.Engine(model_path=model, **{**recipe, **spec.get("engine", {})})
    results["start_s"] = round(time.monotonic() - t0, 2)
    results["phase"] = "started"
    save()
    for w in spec.get("workloads", []):
        t = time.monotonic()
        current = {"kind": w["kind"], "done": False}
        results["workloads"].append(current)

        def note(partial: dict, current=current) -> None:
            current.update(partial)
            save()

        current.update(WORKLOADS[w["kind"]](eng, w, note))
        current.update(done=True, seconds=round(time.monotonic() - t, 2))
        save()
    results["phase"] = "shutdown"
    save()
    eng.shutdown()
    results["phase"] = "done"
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
