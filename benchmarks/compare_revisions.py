"""This checkout (head) side by side with a previous revision (base): one table of medians, base / head / head/base.

``python -m benchmarks.compare_revisions --base REV [--quick] [--only ops|exporters|engine|sglang]
[--configs record,prometheus] [--runs N] [--json PATH]``

REV is anything git resolves to a commit (a tag such as ``pre-restructure``, a branch, a hash). It is checked out
into a temporary detached git worktree, removed at the end. Head is this checkout's working tree as it is
(uncommitted changes included). Every measurement runs in a fresh subprocess of the same python, with PYTHONPATH
set to one tree only (the child checks that ``instrumented_alloc`` came from it), base and head alternating in
one run so that machine drift hits both:

- ``ops``: the wrapper rows of ``benchmarks.bench_ops`` (wrapped / bare per operation, through its ``rows()``
  function, which the base offers too: ``bench_ops`` has no command line); ``--runs`` subprocesses per tree, each
  the median of ``--repeats`` samples per row; the table gives the median over the runs.
- ``exporters`` and ``engine``: the same for ``bench_exporters.rows`` (each exporter on vs off) and
  ``bench_engine.loop_rows`` (the demo step loop, everything on vs bare), with the arguments ``python -m
  benchmarks`` gives them.
- ``sglang``: ``benchmarks.bench_sglang``'s self-cost in host microseconds per scheduler iteration, configurations
  ``--configs`` (default record and prometheus) at batch 256, through its ``--json`` output; one ``bench_sglang``
  run per tree and configuration (``--pairs`` bare/instrumented Engine pairs each, at least 3), the order of the
  trees alternating between configurations (a configuration named twice runs twice, its pairs pooled); the table
  gives the median over the pairs. Minutes per Engine start: run it on a quiet machine.

``--quick``: bench_ops' quick sizes with 3 repeats and 2 runs per tree, 3 SGLang pairs. The figures are ratios
(ops) or microseconds (sglang): head/base < 1 means head is cheaper.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("base", "head")
SGLANG_CONFIGS = ("record", "prometheus")
ROW_SECTIONS = ("ops", "exporters", "engine")
SGLANG_BATCH = 256
CHILD_TIMEOUT_S = 3600
SGLANG_TIMEOUT_S = 4 * 3600
RESULT = "RESULT "

# Run in the child with ``-c``: ``benchmarks.bench_ops.rows`` of whichever tree is on PYTHONPATH, as one JSON line.
OPS_CHILD = """
import json, sys
import torch
spec = json.loads(sys.argv[1])
import instrumented_alloc
from benchmarks import bench_engine, bench_exporters, bench_ops
from benchmarks.common import CLOCKS
tree = spec["tree"]
for mod in (instrumented_alloc, bench_ops, bench_exporters, bench_engine):
    if not mod.__file__.startswith(tree + "/"):
        sys.exit(f"{mod.__name__} imported from {mod.__file__}, not from {tree}")
torch.set_num_threads(1)
thread_clock, process_clock = CLOCKS[spec["clock"]]
repeats, quick = spec["repeats"], spec["quick"]
section = spec.get("section", "ops")
if section == "ops":
    rows = bench_ops.rows(repeats=repeats, quick=quick, clock=thread_clock)
elif section == "exporters":
    rows = bench_exporters.rows(repeats=repeats, iterations=10 if quick else 20, clock=process_clock,
                                demo_steps=1000 if quick else 3000)
else:
    rows = bench_engine.loop_rows(repeats=repeats, quick=quick, clock=process_clock)
print("RESULT " + json.dumps([[name, list(rs)] for name, rs, _target in rows]), flush=True)
"""


# -- the trees -------------------------------------------------------------------------------------------------------
def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def base_worktree(rev: str):
    """A detached worktree of ``rev`` in a temporary directory; removed (and pruned) on exit, whatever happens."""
    try:
        commit = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"compare_revisions: --base {rev!r} is not a commit of this repository") from None
    tmp = tempfile.mkdtemp(prefix="kvalloc-compare-")
    path = Path(tmp) / "base"
    try:
        _git("worktree", "add", "--detach", str(path), commit)
        yield path.resolve(), commit
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _git("worktree", "remove", "--force", str(path))
        with contextlib.suppress(subprocess.CalledProcessError):
            _git("worktree", "prune")
        shutil.rmtree(tmp, ignore_errors=True)


def child_env(tree: Path) -> dict:
    """This environment with PYTHONPATH set to ``tree`` alone and no plugin or exporter settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "OTEL_", "PROMETHEUS_"))}
    env["PYTHONPATH"] = str(tree)
    return env


def orders(n: int, start: int = 0) -> list[tuple[str, str]]:
    """The order of the two trees in each of ``n`` runs: base first, then head first, and so on."""
    return [SIDES if (i + start) % 2 == 0 else SIDES[::-1] for i in range(n)]


# -- the measurements ------------------------------------------------------------------------------------------------
def parse_result(stdout: str):
    """The JSON of the last ``RESULT `` line a child printed."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise ValueError("the child printed no RESULT line")
    return json.loads(lines[-1][len(RESULT) :])


def ops_medians(result: list) -> dict[str, float]:
    """One ops child's rows ``[[name, [ratio per repeat]], ...]`` -> row name -> the median ratio."""
    return {name: statistics.median(rs) for name, rs in result}


def run_ops(tree: Path, *, repeats: int, quick: bool, clock: str, section: str = "ops") -> dict[str, float]:
    """One child's medians per row of ``section`` (ops, exporters or engine) of the tree on its PYTHONPATH."""
    spec = {"tree": str(tree), "repeats": repeats, "quick": quick, "clock": clock, "section": section}
    proc = subprocess.run(
        [sys.executable, "-c", OPS_CHILD, json.dumps(spec)],
        cwd=tree, env=child_env(tree), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{section} rows in {tree} failed:\n{proc.stderr[-4000:]}")
    return ops_medians(parse_result(proc.stdout))


def self_cost_us(measured: list, config: str, batch: int) -> list[float]:
    """bench_sglang's ``--json`` document -> the self-cost per iteration of each pair's instrumented run for
    ``config`` at ``batch``, in microseconds (its accounting's total less the idle sweeps, as its table has it)."""
    k = str(batch)
    for name, pairs in measured:
        if name == config:
            out = []
            for _bare, inst in pairs:
                r = inst[k]
                out.append(1e6 * (sum(r["self_cost"].values()) - r["aside"]) / r["iterations"])
            return out
    raise KeyError(f"no {config} configuration in the results")


def run_sglang(tree: Path, config: str, *, pairs: int, batch: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="kvalloc-compare-sglang-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "benchmarks.bench_sglang", "--configs", config, "--batches", str(batch),
                "--pairs", str(pairs), "--json", str(out)]  # fmt: skip
        proc = subprocess.run(
            argv, cwd=tree, env=child_env(tree), capture_output=True, text=True, timeout=SGLANG_TIMEOUT_S, check=False
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench_sglang in {tree} failed:\n{proc.stderr[-4000:]}")
        return self_cost_us(json.loads(out.read_text()), config, batch)


def sglang_row(config: str, batch: int) -> str:
    return f"sglang {config} batch {batch}: self-cost us/iteration"


# -- the table -------------------------------------------------------------------------------------------------------
def compare(samples: dict[str, dict[str, list[float]]]) -> list[tuple[str, float | None, float | None, float | None]]:
    """``{"base": {row: [values]}, "head": {...}}`` -> (row, base median, head median, head/base) per row, in
    head's order then the rows only the base has; None where a side lacks the row (or base's median is 0)."""
    base, head = samples["base"], samples["head"]
    names = list(head) + [n for n in base if n not in head]
    out = []
    for name in names:
        b = statistics.median(base[name]) if base.get(name) else None
        h = statistics.median(head[name]) if head.get(name) else None
        out.append((name, b, h, h / b if b and h is not None else None))
    return out


def _fmt(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def table(rows: list, title: str | None = None) -> str:
    """One line per row: base and head medians (3 decimals for ratios, 1 for microseconds) and head/base."""
    width = max([40, *(len(name) for name, *_ in rows)])
    head = f"{'row':{width}} {'base':>10} {'head':>10} {'head/base':>10}"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for name, b, h, r in rows:
        digits = 1 if max(abs(x) for x in (b, h) if x is not None) >= 10 else 3
        lines.append(f"{name:{width}} {_fmt(b, 10, digits)} {_fmt(h, 10, digits)} {_fmt(r, 10, 3)}")
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------------------------------
def _note(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)


def measure(trees: dict[str, Path], args) -> dict[str, dict[str, list[float]]]:
    """Every row's values per side: ops (a median per run) then sglang (a self-cost per pair)."""
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    for section in ROW_SECTIONS:
        if section not in args.only:
            continue
        for i, order in enumerate(orders(args.runs)):
            for side in order:
                t0 = time.perf_counter()
                got = run_ops(trees[side], repeats=args.repeats, quick=args.quick, clock=args.clock, section=section)
                for name, value in got.items():
                    samples[side].setdefault(name, []).append(value)
                _note(f"{section} run {i + 1}/{args.runs} {side}: {len(got)} rows, {time.perf_counter() - t0:.0f} s")
    if "sglang" in args.only:
        for config, order in zip(args.configs, orders(len(args.configs))):
            for side in order:
                t0 = time.perf_counter()
                got = run_sglang(trees[side], config, pairs=args.pairs, batch=SGLANG_BATCH)
                samples[side].setdefault(sglang_row(config, SGLANG_BATCH), []).extend(got)  # a config may repeat
                _note(f"sglang {config} {side}: {[round(x) for x in got]} us, {time.perf_counter() - t0:.0f} s")
    return samples


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare_revisions", description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the revision to compare against (tag, branch, commit)")
    ap.add_argument("--quick", action="store_true", help="quick sizes, fewer runs and pairs")
    ap.add_argument("--only", choices=(*ROW_SECTIONS, "sglang"), action="append", help="run only these parts")
    ap.add_argument(
        "--configs", default=",".join(SGLANG_CONFIGS), help="bench_sglang configurations (default record,prometheus)"
    )
    ap.add_argument("--runs", type=int, help="bench_ops subprocesses per tree (default 3; --quick 2)")
    ap.add_argument("--repeats", type=int, help="bench_ops samples per row in each run (default 5; --quick 3)")
    ap.add_argument("--pairs", type=int, help="bench_sglang pairs per configuration and tree (default 5; --quick 3)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="bench_ops' clock (default cpu)")
    ap.add_argument("--json", help="also write the rows and every value here")
    args = ap.parse_args(argv)
    args.only = set(args.only or (*ROW_SECTIONS, "sglang"))
    args.configs = tuple(c for c in args.configs.split(",") if c)
    args.runs = args.runs or (2 if args.quick else 3)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.pairs = args.pairs or (3 if args.quick else 5)
    if args.runs < 1 or args.repeats < 1 or args.pairs < 3:
        ap.error("--runs and --repeats: at least 1; --pairs: at least 3")
    started = time.perf_counter()
    with base_worktree(args.base) as (base_tree, commit):
        samples = measure({"base": base_tree, "head": ROOT}, args)
    rows = compare(samples)
    what = []
    if args.only & set(ROW_SECTIONS):
        sections = ", ".join(s for s in ROW_SECTIONS if s in args.only)
        what.append(f"{sections}: ratios, over {args.runs} runs of {args.repeats} samples")
    if "sglang" in args.only:
        what.append(f"sglang: us per iteration, over {args.pairs} pairs")
    title = (
        f"python -m benchmarks.compare_revisions --base {args.base}{' --quick' if args.quick else ''}: base "
        f"{commit[:12]}, head {ROOT}; medians ({'; '.join(what)}); {time.perf_counter() - started:.0f} s"
    )
    out = table(rows, title)
    print(out)
    if args.json:
        doc = {"base": args.base, "base_commit": commit, "rows": rows, "samples": samples}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return out


if __name__ == "__main__":
    main()
