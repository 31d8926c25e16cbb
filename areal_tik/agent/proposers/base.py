"""What a proposer is: :class:`Proposer` (opportunities for a version, then one candidate per
opportunity) and :class:`Proposal`, the candidate it returns (complete source text plus
meta-parameters, with the token counts and latency of the call that produced it)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Proposal:
    source: str | None
    meta: dict | None
    description: str = ""
    kind: str | None = None          # None: same kind as the parent
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    latency_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.source is not None and self.meta is not None


class Proposer:
    name = "?"

    def opportunities(self, task, version, context: dict) -> list[dict]:
        """Hypotheses for improving ``version``: dicts with key, kind, description, payload, priority."""
        return []

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        raise NotImplementedError
