"""``areal-tik`` command line: thin argparse over the library.

Subcommands live in their own modules; each exposes ``add_parser(subparsers)`` which
registers the parser and sets ``func`` to a callable taking the parsed args and
returning an exit status. Only this layer (and the AReaL entry point) reads files and
environment variables.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from areal_tik.cli.errors import run_command
from areal_tik.cli.help_format import apply_formatter

# the module of each subcommand; each exposes add_parser(subparsers)
SUBCOMMANDS = [f"areal_tik.cli.{name}" for name in ("env", "compile", "verify", "serve", "train", "ab", "warmstart",
                                                     "agent")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-tik",
        description="Unified rollout/training kernels for AReaL: bitwise-equal log-probs, recompute skipped.",
    )
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (may go anywhere on the "
                                                        "command line)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for modname in SUBCOMMANDS:
        importlib.import_module(modname).add_parser(sub)
    apply_formatter(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit status. A user error (bad argument, unsupported model,
    missing file, port in use) is one line on stderr and status 2; ``--debug`` (anywhere on
    the line) adds the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return run_command(args.func, args, prog=f"areal-tik {args.command}", debug=debug)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
