"""The ``xferkit`` command."""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xferkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan and execute a heterogeneous-TP handoff in memory")
    demo.add_argument("--src-tp", type=_positive, default=2)
    demo.add_argument("--dst-tp", type=_positive, default=4)
    demo.add_argument("--layers", type=_positive, default=8)
    listing = sub.add_parser("backends", help="list installed backends and whether they work here")
    listing.add_argument(
        "--check",
        action="store_true",
        help="also import each usable driver and check its class (slower: imports the drivers)",
    )
    keygen = sub.add_parser(
        "keygen", help="write a CurveZMQ key pair (NAME.key, NAME.key_secret) for Sessions"
    )
    keygen.add_argument("directory")
    keygen.add_argument("--name", default="xferkit", help="file name stem (default: xferkit)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run
        from .errors import XferError

        try:
            return 0 if run(args.src_tp, args.dst_tp, args.layers) else 1
        except XferError as exc:
            print(f"xferkit demo: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    if args.command == "backends":
        from .plugins import backends

        for b in backends(check=args.check):
            state = "usable" if b.available else f"unusable: {b.reason}"
            print(f"{b.name:<12}{b.distribution} {b.version:<10}{state}")
        return 0
    if args.command == "keygen":
        from .errors import XferError
        from .session.keys import keygen as write_pair

        try:
            public, secret = write_pair(args.directory, args.name)
        except (OSError, XferError) as exc:
            print(f"xferkit keygen: {exc}", file=sys.stderr)
            return 2
        print(f"public key: {public}\nsecret key: {secret} (keep it private)")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
