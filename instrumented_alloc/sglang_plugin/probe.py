"""Host time in the scheduler functions the plugin hooks, bare or wrapped: what ``benchmarks/bench_sglang.py``
measures the plugin's cost with. Benchmark-only: nothing is installed unless ``KVALLOC_PROBE_FILE`` is set.

With ``KVALLOC_PROBE_FILE=PATH`` the plugin's entry point installs timing hooks (whether the plugin itself is on
or not, so a bare run and a wrapped run are timed alike) around every SGLang function whose host work the plugin
changes: allocation for extend, decode and speculative decode, the release of a request's KV, the prefix cache's
checkpoint, the SWA evicted length's writer, the start of each scheduler iteration and the idle handler. They are
registered after the plugin's own hooks, so they wrap them: a wrapped function's time includes the plugin's work
in it. ``run_batch`` calls are counted (one per scheduler iteration that ran a batch). Whenever the scheduler goes
idle after work (and at exit) the totals go to ``PATH`` as JSON (``{"pid", "seconds": {target: s}, "calls":
{target: n}, "iterations": n, "self_cost": {"iterations": n, "seconds": {part: s}} or null,
"self_cost_per_iteration": [[s per part], ...]}``: the wrapper's own accounting, see ``selfcost``, in total and
from each ``run_batch`` call to the next), one file per scheduler process (``PATH`` gets ``.<pid>`` appended).

With ``KVALLOC_PROBE_PROFILE=K[,K...]`` it also profiles whole scheduler iterations with ``cProfile``: from the
K-th ``run_batch`` call (1-based) to the next one (or to the scheduler's idle), written as
``PATH.<pid>.iter<K>.pstats`` (deterministic profiling inflates every call; read it for where the time goes, not
for how much).

What it does not see: writes of a request's KV record made outside these functions (SGLang's speculative
accepts), and the exporters' threads (they run off the scheduler's thread).
"""

from __future__ import annotations

import atexit
import cProfile
import itertools
import json
import os
import time

TIMED = (
    "sglang.srt.mem_cache.allocation.alloc_for_extend",
    "sglang.srt.mem_cache.allocation.alloc_for_decode",
    "sglang.srt.mem_cache.allocation.alloc_for_spec_decode",
    "sglang.srt.mem_cache.common.release_kv_cache",
    "sglang.srt.mem_cache.common.checkpoint_kv_cache",
    "sglang.srt.managers.schedule_batch.ReqKvInfo.set_evicted_seqlen",
)
# The plugin's own work outside those functions: its step at the start of an iteration (the loop's busy-polling
# start is not timed: idle polls would drown it).
STEP = "instrumented_alloc.sglang_plugin.session.Session.step"
COUNTED = "sglang.srt.managers.scheduler.Scheduler.run_batch"
# Where the totals are written: when the scheduler goes idle after work (SGLang may end a scheduler process
# without running its exit handlers).
IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"


class Probe:
    def __init__(self, path: str, clock=time.perf_counter, profile=()):
        self.path = path
        self.profile = frozenset(profile)  # the iterations to profile (see the module docstring)
        self.profiler = None
        self.cost_marks: list = []  # the self-cost totals at each run_batch call (see write)
        self.clock = clock
        self.seconds = dict.fromkeys((*TIMED, STEP), 0.0)
        self.calls = dict.fromkeys((*TIMED, STEP), 0)
        self.iterations = 0
        self.scheduler = False  # set once a scheduler iteration ran: only scheduler processes write a file
        self.written = 0  # the iterations counted at the last write

    def timed(self, target: str):
        clock, seconds, calls = self.clock, self.seconds, self.calls

        def around(original, *args, **kwargs):
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[target] += clock() - t0
                calls[target] += 1

        return around

    def end_profile(self) -> None:
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(f"{self.path}.{os.getpid()}.iter{self.iterations}.pstats")
            self.profiler = None

    def counted(self, original, *args, **kwargs):
        self.end_profile()
        self.iterations += 1
        self.scheduler = True
        sess = _session()
        if sess is not None and sess.alloc is not None:
            self.cost_marks.append(sess.alloc.cost.totals())
        if self.iterations in self.profile:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        return original(*args, **kwargs)

    def idle(self, original, *args, **kwargs):
        self.end_profile()  # the last iteration's profile ends where the scheduler goes idle
        out = original(*args, **kwargs)
        if self.iterations != self.written:
            self.write()
        return out

    def write(self) -> None:
        if not self.scheduler:
            return
        self.written = self.iterations
        sess = _session()
        cost = sess.alloc.cost.as_dict() if sess is not None and sess.alloc is not None else None
        doc = {"pid": os.getpid(), "seconds": self.seconds, "calls": self.calls, "iterations": self.iterations}
        marks = self.cost_marks
        per_iteration = [[y - x for x, y in zip(a, b)] for a, b in itertools.pairwise(marks)]
        with open(f"{self.path}.{os.getpid()}", "w", encoding="utf-8") as f:
            json.dump({**doc, "self_cost": cost, "self_cost_per_iteration": per_iteration}, f)


def _session():
    from instrumented_alloc.sglang_plugin import session

    return session.current()


def hooks(path: str) -> tuple:
    """The timing hooks (target, type, hook) of a new ``Probe`` writing to ``path`` at exit. They go to the
    registry with the plugin's own, after them (SGLang's registry applies a target's hooks once)."""
    from instrumented_alloc.sglang_plugin.session import Session

    profile = os.environ.get("KVALLOC_PROBE_PROFILE", "")
    probe = Probe(path, profile=[int(k) for k in profile.split(",") if k.strip()])
    atexit.register(probe.write)
    step, timed = Session.step, probe.timed(STEP)
    Session.step = lambda self: timed(step, self)
    return (
        *((target, "AROUND", probe.timed(target)) for target in TIMED),
        (COUNTED, "AROUND", probe.counted),
        (IDLE, "AROUND", probe.idle),
    )
