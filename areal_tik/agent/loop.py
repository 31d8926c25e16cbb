"""The agent loop: resume pending audits, then act -> audit -> lineage until a stop rule.

Small on purpose. Every step commits on its own (roles.py), so a killed process resumes
with :func:`run_loop` on the same store: a candidate recorded but not yet audited is
audited first; nothing is proposed twice (consumed opportunities stay consumed, and an
identical candidate is caught by its content hash).

Stop rules (checked between steps): candidate budget, wall-clock budget, token budget,
stagnation (``stagnation`` consecutive audited candidates without a promotion), or no
open opportunity on any active branch. On stop, the best version is timed interleaved
against the root once more (session ``final``) and the speedup is recorded in a
``stop`` decision.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from areal_tik.agent import roles
from areal_tik.agent.records import Decision

__all__ = ["Budget", "run_loop", "finalize"]


@dataclasses.dataclass
class Budget:
    max_candidates: int | None = None     # proposals audited in this invocation
    minutes: float | None = None
    tokens: int | None = None
    stagnation: int = 16


def _stagnant(store, run_id: int) -> int:
    n = 0
    for d in reversed(store.decisions(run_id)):
        if d.action in ("promote", "merge"):
            break
        if d.action in ("reject", "keep", "branch") and d.version_id is not None:
            n += 1
    return n


def finalize(store, run, evaluator, policy: roles.Policy, reason: str) -> dict:
    """Time best vs root interleaved (no re-check: both verified) and record the stop."""
    run = store.run(run.id)
    best, root = store.version(run.best_version), store.version(run.root_version)
    wls = store.workloads(run.id)
    data = {"best_version": best.id, "root_version": root.id, "simulated": run.timer == "simulated"}
    if best.id != root.id:
        res = evaluator.evaluate(roles.job_for(store, run, best, [("root", root)], skip_checks=True, policy=policy))
        if res.get("timing"):
            lat = res["timing"]["latency"]
            b, r = roles.weighted_total(wls, lat["candidate"]), roles.weighted_total(wls, lat["root"])
            data.update(best_us=b, root_us=r, speedup=r / b, session=res["timing"]["session"],
                        per_workload={w.name: lat["root"][str(w.id)]["median_us"] / lat["candidate"][str(w.id)]["median_us"]
                                      for w in wls})
            with store.transaction():
                roles._record_timing(store, run, {"candidate": best.id, "root": root.id}, res["timing"],
                                     {"candidate": "final", "root": "final"})
        else:
            data["error"] = "final timing failed"
    else:
        data.update(speedup=1.0)
    with store.transaction():
        store.add_decision(Decision(run_id=run.id, step=store.last_step(run.id), action="stop", reason=reason,
                                    version_id=best.id, data=data))
        store.update_run(run.id, status="stopped", stop_reason=reason)
    return data


def run_loop(store, run_name: str, proposer, evaluator, budget: Budget, policy: roles.Policy | None = None,
             on_event: Callable[[dict], None] | None = None, finalize_on_stop: bool = True) -> dict:
    """Resume or continue run ``run_name``; returns the summary."""
    emit = on_event or (lambda e: None)
    run = store.run(run_name)
    if run is None:
        raise KeyError(f"no run named {run_name!r}; run `areal-tik agent init` first")
    if run.status in ("created", "failed"):
        raise RuntimeError(f"run {run_name!r} is {run.status}; initialisation did not finish")
    policy = policy or roles.Policy(**{k: v for k, v in run.config.get("policy", {}).items()
                                       if k in {f.name for f in dataclasses.fields(roles.Policy)}})
    store.update_run(run.id, status="running", stop_reason=None)
    t0 = time.time()
    audited = 0
    tokens0 = store.tokens_used(run.id)
    # 1. resume: audit what was proposed but not audited
    for v in store.versions(run.id, status="pending"):
        emit({"type": "resume", "version": v.id})
        out = roles.audit(store, store.run(run.id), evaluator, proposer, v.id, policy)
        audited += 1
        emit({"type": "audit", **out, "step": v.step})
    reason = None
    while True:
        run = store.run(run.id)
        if budget.max_candidates is not None and audited >= budget.max_candidates:
            reason = f"budget: {audited} candidates"
        elif budget.minutes is not None and time.time() - t0 >= budget.minutes * 60:
            reason = f"budget: {budget.minutes} minutes"
        elif budget.tokens is not None and store.tokens_used(run.id) - tokens0 >= budget.tokens:
            reason = f"budget: {budget.tokens} tokens"
        elif _stagnant(store, run.id) >= budget.stagnation:
            reason = f"stagnation: {budget.stagnation} candidates without a promotion"
        if reason:
            break
        step = store.last_step(run.id) + 1
        a = roles.act(store, run, proposer, step)
        emit({"type": "act", "step": step, **a})
        if a["status"] == "exhausted":
            if roles.lineage(store, run, step, policy):
                continue
            reason = "no open opportunities on any active branch"
            break
        if a["status"] == "pending":
            out = roles.audit(store, store.run(run.id), evaluator, proposer, a["version"], policy)
            audited += 1
            emit({"type": "audit", "step": step, **out})
        for ev in roles.lineage(store, store.run(run.id), step, policy):
            emit({"type": "lineage", **ev})
    emit({"type": "stop", "reason": reason})
    if finalize_on_stop:
        data = finalize(store, store.run(run.id), evaluator, policy, reason)
        emit({"type": "final", **data})
    else:
        store.update_run(run.id, status="stopped", stop_reason=reason)
    return roles.summarize(store, run.id)
