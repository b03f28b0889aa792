"""The ``xferkit`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xferkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan and execute a heterogeneous-TP handoff in memory")
    demo.add_argument("--src-tp", type=int, default=2)
    demo.add_argument("--dst-tp", type=int, default=4)
    demo.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return 0 if run(args.src_tp, args.dst_tp, args.layers) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
