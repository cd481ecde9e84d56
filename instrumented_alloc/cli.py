"""The command line: ``instrumented-alloc``. The composition root (the only core module that may import
exporters/ and dashboard/, and only inside functions)."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from instrumented_alloc.sim.scripted import run

    for line in run(page_size=args.page_size, window=args.window, mode=args.mode):
        print(line)
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from dashboard.launch import launch  # the composition root imports front ends only here

    try:
        return launch(args.recording, port=args.port, directory=args.dir, refresh=args.refresh)
    except ValueError as exc:
        print(f"instrumented-alloc dashboard: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="instrumented-alloc",
        description="An invariant-checking, observable wrapper for LLM-serving KV-cache page allocators.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a scripted scenario through an instrumented SWA allocator")
    demo.add_argument("--page-size", type=int, default=16, choices=(4, 16, 64))
    demo.add_argument("--window", type=int, default=64, help="sliding window in tokens (default 64)")
    demo.add_argument("--mode", choices=("record", "raise"), default="record")
    demo.set_defaults(func=_demo)
    dash = sub.add_parser(
        "dashboard",
        help="the Streamlit app: live view and incident review of flight recordings (127.0.0.1)",
        description="Start the Streamlit dashboard on 127.0.0.1. It opens recordings read-only, and only under "
        "--dir (default: the directory of RECORDING, else the working directory).",
    )
    dash.add_argument("recording", nargs="?", metavar="RECORDING", help="the flight recording selected first")
    dash.add_argument("--port", type=int, default=8501, help="TCP port on 127.0.0.1 (default 8501)")
    dash.add_argument("--dir", default=None, help="the directory whose recordings the dashboard may open")
    dash.add_argument("--refresh", type=float, default=None, help="seconds between live refreshes (default 2)")
    dash.set_defaults(func=_dashboard)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
