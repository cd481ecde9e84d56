"""Request arrivals for the demo engine: a seeded synthetic stream, or a trace.

Time is measured in engine steps (one scheduler iteration), the unit the allocator sees. Synthetic arrivals are
a Poisson process; prompt and output lengths are lognormal (a heavy right tail, as in production chat traffic),
clipped to the preset's maxima. The same seed gives the same requests. Pure: traces are parsed from lines the
caller read (``parse_trace``), so nothing here touches a file.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from instrumented_alloc.sim.presets import Preset


@dataclass(frozen=True)
class RequestSpec:
    rid: str
    arrival: float  # in steps
    prompt_len: int  # prompt tokens (on the PD decode side: the prefilled tokens that arrive with the request)
    output_len: int  # tokens to generate


class TraceError(ValueError):
    """A trace line that cannot be used; the message names the source and the line."""


def synthetic(preset: Preset, seed: int) -> Iterator[RequestSpec]:
    """An endless, seeded stream of requests in arrival order."""
    rng = random.Random(f"workload:{seed}")
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(preset.rate)
        prompt = _lognormal(rng, preset.prompt_median, preset.prompt_sigma, preset.prompt_max)
        output = _lognormal(rng, preset.output_median, preset.output_sigma, preset.output_max)
        yield RequestSpec(f"r{n}", t, prompt, output)
        n += 1


def _lognormal(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


def parse_trace(lines: Iterable[str], source: str = "trace", max_tokens: int | None = None) -> list[RequestSpec]:
    """Requests from JSON lines ``{"arrival": steps, "prompt_len": n, "output_len": n}`` (blank lines skipped).

    Raises ``TraceError`` naming ``source`` and the 1-based line number of the first bad line. Arrivals must not
    go back in time (a trace is a log). ``max_tokens``: the full pool's capacity in tokens; a request that needs
    more (prompt and output) could never finish, and is refused here, as an engine refuses a request longer than
    its KV pool at admission."""
    out: list[RequestSpec] = []
    last = 0.0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: expected an object with arrival, prompt_len, output_len")
        missing = [k for k in ("arrival", "prompt_len", "output_len") if k not in rec]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        arrival = rec["arrival"]
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
            raise TraceError(f"{where}: arrival must be a number of steps, got {arrival!r}")
        if arrival < 0:
            raise TraceError(f"{where}: arrival must be >= 0 steps, got {arrival!r}")
        if arrival < last:
            raise TraceError(f"{where}: arrival {arrival} is earlier than the line before ({last})")
        lens = []
        for key in ("prompt_len", "output_len"):
            v = rec[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TraceError(f"{where}: {key} must be an integer >= 1, got {v!r}")
            lens.append(v)
        if max_tokens is not None and lens[0] + lens[1] > max_tokens:
            raise TraceError(
                f"{where}: prompt_len + output_len = {lens[0] + lens[1]} tokens is more than the KV pool holds "
                f"({max_tokens} tokens): the request could never finish"
            )
        last = float(arrival)
        out.append(RequestSpec(f"t{len(out)}", last, lens[0], lens[1]))
    if not out:
        raise TraceError(f"{source}: no requests in the trace")
    return out
