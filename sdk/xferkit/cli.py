"""The ``xferkit`` command."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    """A bad option is one line (what is wrong, and where help is), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    from .bench.cli import add_parser
    from .bench.cli import main as bench

    parser = _Parser(prog="xferkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
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
    if args.command == "bench":
        return bench(args)
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
