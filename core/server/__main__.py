"""`python -m core.server [flags]`: the same as `core serve` (without --config)."""

from __future__ import annotations

import argparse
import sys

from core.plan.args import add_cli_args, from_namespace
from core.server import serve_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.server",
                                     description="serve a model over HTTP")
    add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    return serve_main(args)


if __name__ == "__main__":
    sys.exit(main())
