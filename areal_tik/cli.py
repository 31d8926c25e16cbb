"""``areal-tik`` command line: thin argparse over the library.

Subcommands live in their own modules; each exposes ``add_parser(subparsers)`` which
registers the parser and sets ``func`` to a callable taking the parsed args and
returning an exit status. Only this layer (and the AReaL entry point) reads files and
environment variables.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

# (module path, attribute) of each subcommand's add_parser; missing optional modules are skipped.
SUBCOMMANDS = [
    "areal_tik.cli_env",
    "areal_tik.cli_compile",
    "areal_tik.cli_verify",
    "areal_tik.cli_serve",
    "areal_tik.cli_train",
    "areal_tik.cli_ab",
    "areal_tik.cli_warmstart",
    "areal_tik.cli_bench",
    "areal_tik.cli_agent",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal-tik",
        description="Unified rollout/training kernels for AReaL: bitwise-equal log-probs, recompute skipped.",
    )
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (may go anywhere on the "
                                                        "command line)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for modname in SUBCOMMANDS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue
            raise
        mod.add_parser(sub)
    return p


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit status. A user error (bad argument, unsupported model,
    missing file, port in use) is one line on stderr and status 2; ``--debug`` (anywhere on
    the line) adds the traceback."""
    from areal_tik.cli_errors import run_command

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
