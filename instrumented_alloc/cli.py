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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
