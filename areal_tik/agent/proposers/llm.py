"""The ``llm`` proposer: an OpenAI-compatible chat endpoint (``openai`` package) asked for one
complete replacement module plus meta-parameters; base URL, model and key from
:class:`LLMConfig`; stops asking once the run's token budget is spent; every call's token
counts are recorded."""
from __future__ import annotations

import dataclasses
import json
import re
import time

from areal_tik.agent.proposers.base import Proposal, Proposer
from areal_tik.agent.proposers.offline import OfflineProposer


@dataclasses.dataclass
class LLMConfig:
    base_url: str | None = None
    model: str = ""
    api_key: str | None = None
    token_budget: int = 2_000_000
    max_completion_tokens: int = 8000
    temperature: float = 0.7
    timeout_s: float = 300.0


_SYSTEM = """You optimise GPU kernels under a strict numerical contract. You receive a complete
kernel module and its meta-parameters. Return ONE complete replacement: the full module in a
```python block and the meta-parameters as JSON in a ```json block. Keep the entry point and its
signature. Contract: {contract}. Every output element must be accumulated in fp32 over K in
ascending order with acc = tl.dot(a, b, acc) (a split of K only if fixed by K alone, never by M; nothing
that depends on the batch size);
rows are independent. Candidates are checked for unwritten outputs, input mutation, fresh inputs,
unseen shapes, determinism and bitwise row-subset/batch-extension invariance, then timed against
the incumbent."""


class LLMProposer(Proposer):
    """OpenAI-compatible chat completions; records token counts; respects a token budget."""

    name = "llm"

    def __init__(self, config: LLMConfig, client=None):
        self.cfg = config
        self._client = client

    def client(self):
        if self._client is None:
            import openai  # optional dependency (openai): imported only on this path
            self._client = openai.OpenAI(base_url=self.cfg.base_url, api_key=self.cfg.api_key or "EMPTY",
                                         timeout=self.cfg.timeout_s)
        return self._client

    def opportunities(self, task, version, context: dict) -> list[dict]:
        ideas = [
            ("memory", "improve memory access: unmasked/vectorised loads, pointer increments, fewer index ops"),
            ("decode", "speed up small-M (decode) shapes: more parallelism over N without splitting K"),
            ("prefill", "speed up large-M shapes: bigger tiles, deeper pipelining, better L2 reuse (tile order)"),
            ("schedule", "restructure the launch: persistent programs, fewer launches, better occupancy"),
        ]
        off = OfflineProposer().opportunities(task, version, context)
        return [{"key": f"llm:{k}", "kind": "llm", "description": d, "payload": {"hint": d}, "priority": 50.0}
                for k, d in ideas] + off[:4]

    def propose(self, task, parent, opportunity, context: dict) -> Proposal:
        used = int(context.get("tokens_used", 0))
        if used >= self.cfg.token_budget:
            return Proposal(None, None, error=f"token budget spent ({used} >= {self.cfg.token_budget})")
        failures = context.get("recent_failures", [])[-3:]
        user = (f"Opportunity: {opportunity.description}\n\nCurrent meta-parameters:\n```json\n"
                f"{json.dumps(parent.meta, indent=1)}\n```\n\nCurrent module:\n```python\n{parent.source}\n```\n")
        if context.get("latency"):
            user += f"\nMeasured latency per workload (us): {json.dumps(context['latency'])}\n"
        if failures:
            user += "\nRecent rejected attempts (do not repeat): " + "; ".join(failures) + "\n"
        msgs = [{"role": "system", "content": _SYSTEM.format(contract=context.get("contract_text", ""))},
                {"role": "user", "content": user}]
        t0 = time.time()
        try:
            r = self.client().chat.completions.create(
                model=self.cfg.model, messages=msgs, temperature=self.cfg.temperature,
                max_tokens=min(self.cfg.max_completion_tokens, max(256, self.cfg.token_budget - used)))
        except Exception as e:
            return Proposal(None, None, model=self.cfg.model, latency_s=time.time() - t0, error=f"{type(e).__name__}: {e}")
        usage = getattr(r, "usage", None)
        pt = int(getattr(usage, "prompt_tokens", 0) or 0)
        ct = int(getattr(usage, "completion_tokens", 0) or 0)
        text = r.choices[0].message.content or ""
        src, meta = parse_completion(text, parent.meta)
        prop = Proposal(src, meta, description=f"llm: {opportunity.description}", prompt_tokens=pt,
                        completion_tokens=ct, model=self.cfg.model, latency_s=time.time() - t0)
        if src is None:
            prop.error = "no ```python block in the completion"
        return prop


def parse_completion(text: str, default_meta: dict) -> tuple[str | None, dict | None]:
    code = re.findall(r"```python\n(.*?)```", text, re.S)
    js = re.findall(r"```json\n(.*?)```", text, re.S)
    meta = default_meta
    if js:
        try:
            meta = json.loads(js[-1])
        except json.JSONDecodeError:
            pass
    return (code[-1] if code else None), meta
