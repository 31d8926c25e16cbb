"""``--help`` of every ``areal-tik`` command: each option's help ends with its default, when it has
one worth stating (not for flags, nor where the help already says what the default is)."""
from __future__ import annotations

import argparse

__all__ = ["DefaultsHelpFormatter", "apply_formatter"]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Option help gains ``(default: X)``."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction))):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".replace("%", "%%").replace("%%(", "%(")


def apply_formatter(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand parser below it :class:`DefaultsHelpFormatter`."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                apply_formatter(sub)
