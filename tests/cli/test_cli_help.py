"""``--help`` of every ``areal-tik`` command: a description of what the command does, a help text for
every option, and the default of every option that has one (read from the parser, so a new option
without help fails here)."""
import argparse

import pytest

from areal_tik.cli import build_parser


def _parsers(parser, name="areal-tik"):
    """(command name, parser) for the top parser and every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = list(_parsers(build_parser()))


def test_every_command_is_listed():
    names = {n for n, _ in PARSERS}
    assert {"areal-tik ab", "areal-tik train", "areal-tik serve", "areal-tik agent run", "areal-tik warmstart"} <= names


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_description_help_and_defaults(name, parser):
    assert parser.description and len(parser.description) > 40, f"{name}: no description"
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        label = "/".join(action.option_strings) or action.dest
        assert action.help, f"{name} {label}: no help text"
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else str(action.default)
            flat = " ".join(text.split())
            assert "default" in action.help or f"(default: {shown})" in flat, f"{name} {label}: default not shown"
