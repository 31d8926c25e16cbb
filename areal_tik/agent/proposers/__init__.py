"""Proposers: given a verified parent and an opportunity, return ONE complete candidate.

A candidate is complete source text plus meta-parameters (the agent's whole notion of a
kernel). Proposers are chosen by name (:func:`make_proposer`):

- ``offline``: zero tokens. Explores meta-parameters (per-M buckets of block sizes,
  warps, stages, group size, programs per SM) with H200-oriented priors, and applies
  known code transformations to ``<tik:...>`` regions of the source (grouped tile
  order, unmasked/pointer-increment K loop with EVEN_K specialisation, persistent
  schedule; for the csrc rms_norm: 16-byte vector loads, or the row held in registers).
  A transformation that does not find its region is not offered.
- ``llm``: an OpenAI-compatible chat endpoint (``openai`` package); base URL, model and
  key come from :class:`LLMConfig` (the CLI fills it from flags or environment); stops
  asking once the run's token budget is spent. Every call's token counts are recorded.
- ``replay``: returns scripted candidates in order (tests, and replaying an old run).

Opportunities (hypotheses) come from :meth:`Proposer.opportunities`; the loop stores
them and marks them consumed/withdrawn.
"""
from __future__ import annotations

from areal_tik.agent.proposers.base import Proposal, Proposer
from areal_tik.agent.proposers.llm import LLMConfig, LLMProposer
from areal_tik.agent.proposers.offline import OfflineProposer
from areal_tik.agent.proposers.replay import ReplayProposer
from areal_tik.agent.proposers.transforms import TRANSFORMS

__all__ = ["Proposal", "Proposer", "OfflineProposer", "ReplayProposer", "LLMProposer", "LLMConfig",
           "make_proposer", "TRANSFORMS"]


def make_proposer(name: str, **kw) -> Proposer:
    if name == "offline":
        return OfflineProposer()
    if name == "replay":
        return ReplayProposer(kw["script"])
    if name == "llm":
        return LLMProposer(kw["config"])
    raise KeyError(f"unknown proposer {name!r}; choose offline, llm or replay")
