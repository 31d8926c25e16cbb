"""The ``replay`` proposer: scripted candidates in order (tests, and replaying an old run)."""
from __future__ import annotations

from areal_tik.agent.proposers.base import Proposal, Proposer


class ReplayProposer(Proposer):
    """Returns scripted candidates in order: each item {source, meta, description[, kind]}."""

    name = "replay"

    def __init__(self, script: list[dict]):
        self.script = list(script)

    def opportunities(self, task, version, context: dict) -> list[dict]:
        # one opportunity per scripted item, all on the root (the first head), in order
        if context.get("is_root"):
            return [{"key": f"replay:{i}", "kind": "replay", "description": s.get("description", f"scripted #{i}"),
                     "payload": {"index": i}, "priority": 1000.0 - i} for i, s in enumerate(self.script)]
        return []

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        s = self.script[opportunity.payload["index"]]
        return Proposal(s["source"], s.get("meta", parent.meta), description=s.get("description", ""),
                        kind=s.get("kind"))
