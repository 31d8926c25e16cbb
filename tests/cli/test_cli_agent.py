"""``areal-tik agent``'s proposer choice: the LLM proposer's model comes from ``--model`` only
(required with ``--proposer llm``); base URL and key from the flag or the openai client's own
environment variables."""
import argparse

import pytest

from areal_tik.cli import agent as cli_agent


def _args(*argv):
    p = argparse.ArgumentParser()
    cli_agent.add_parser(p.add_subparsers(dest="cmd"))
    return p.parse_args(["agent", "run", *argv])


def test_llm_proposer_needs_model_flag(monkeypatch):
    monkeypatch.setenv("AREAL_TIK_AGENT_MODEL", "from-env")  # not read
    from areal_tik.cli.errors import UsageError
    with pytest.raises(UsageError, match="--model"):
        cli_agent._proposer(_args("--proposer", "llm"))


def test_llm_proposer_from_flags_and_openai_env(monkeypatch):
    from areal_tik.agent.proposers import LLMProposer
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:1/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    prop = cli_agent._proposer(_args("--proposer", "llm", "--model", "m1", "--token-budget", "7"))
    assert isinstance(prop, LLMProposer)
    assert (prop.cfg.model, prop.cfg.base_url, prop.cfg.api_key, prop.cfg.token_budget) == (
        "m1", "http://localhost:1/v1", "k", 7)
    prop = cli_agent._proposer(_args("--proposer", "llm", "--model", "m2", "--base-url", "http://h:2/v1"))
    assert (prop.cfg.model, prop.cfg.base_url) == ("m2", "http://h:2/v1")


def test_offline_proposer_is_the_default():
    from areal_tik.agent.proposers import OfflineProposer
    assert isinstance(cli_agent._proposer(_args()), OfflineProposer)
