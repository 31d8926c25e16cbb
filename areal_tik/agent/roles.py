"""The agent's roles: initialize, act, audit, lineage. Each step is one transaction.

- :func:`initialize` qualifies the root (full contract checks in the evaluator's
  process), freezes the contract and the workloads, and measures the noise floor (the
  root timed interleaved against itself); creates the ``main`` branch with the root as
  head and stores the proposer's first opportunities.
- :func:`act` picks the best open opportunity whose parent is the head of an active
  branch (heads are verified by construction), asks the proposer for one complete
  candidate and records it as ``pending`` together with the proposer call.
- :func:`audit` sends a pending candidate to the evaluator (checks, then timing
  interleaved with its branch head and the global best) and records checks,
  measurements, the decision and its reason. Promotion needs every check to pass, the
  weighted total latency to improve by more than the noise floor and no workload to
  slow down past its regression limit.
- :func:`lineage` archives branches that stopped improving and abandons branches whose
  candidates keep failing; a branch head that beats ``main``'s head is merged.

Failed candidates stay in the store with their evidence and are never heads, hence
never parents.
"""
from __future__ import annotations

import dataclasses

from areal_tik.agent.checks import first_failure
from areal_tik.agent.records import (
    Branch, CheckResult, Contract, Decision, Edge, KernelVersion, Measurement, Opportunity, ProposerCall, Run,
    Workload,
)
from areal_tik.agent.roots import load_root
from areal_tik.agent.tasks import get_task

__all__ = ["Policy", "initialize", "act", "audit", "lineage", "weighted_total", "job_for", "summarize"]


@dataclasses.dataclass
class Policy:
    """Lineage and promotion knobs (stored in the run's config)."""
    min_noise_floor: float = 0.01
    max_noise_floor: float = 0.05
    noise_sessions: int = 3
    branch_patience: int = 4           # archive a side branch after this many non-improving candidates
    branch_max_failures: int = 3       # abandon after this many consecutive failed candidates
    branch_tolerance: float = 0.10     # a verified transform within this of its parent opens a branch
    rounds: int = 7                    # interleaved timing rounds (gpu)
    min_ms: float = 1.0                # per timing sample (gpu)


def weighted_total(workloads: list[Workload], lat: dict) -> float:
    return sum(w.weight * lat[str(w.id)]["median_us"] for w in workloads)


def _version_ref(v: KernelVersion, label: str) -> dict:
    return {"label": label, "kind": v.kind, "source": v.source, "meta": v.meta, "key": v.hash}


def job_for(store, run: Run, cand: KernelVersion, references: list[tuple[str, KernelVersion]],
            skip_checks: bool = False, policy: Policy | None = None) -> dict:
    policy = policy or Policy()
    contract = store.contract(run.id)
    wls = store.workloads(run.id)
    return {"op": run.op, "candidate": {"kind": cand.kind, "source": cand.source, "meta": cand.meta, "key": cand.hash},
            "references": [_version_ref(v, lab) for lab, v in references],
            "contract": contract.spec, "workloads": [{"id": w.id, "name": w.name, "shape": w.shape} for w in wls],
            "timer": run.timer, "skip_checks": skip_checks, "rounds": policy.rounds, "min_ms": policy.min_ms}


def _record_checks(store, run_id: int, vid: int, checks: list[dict]) -> None:
    for c in checks:
        store.add_check(CheckResult(run_id=run_id, version_id=vid, check=c["check"], passed=c["passed"],
                                    shape=c.get("shape", ""), detail=c.get("detail", {})))


def _record_timing(store, run: Run, label_to_vid: dict, timing: dict, role_of: dict) -> None:
    for lab, per in timing["latency"].items():
        vid = label_to_vid.get(lab)
        if vid is None:
            continue
        for wid, m in per.items():
            store.add_measurement(Measurement(run_id=run.id, version_id=vid, workload_id=int(wid),
                                              session=timing["session"], latency_us=m["median_us"],
                                              samples=m.get("samples", []), simulated=timing["simulated"],
                                              role=role_of.get(lab, "reference")))


def _context(store, run: Run, v: KernelVersion, latency: dict | None = None) -> dict:
    wls = store.workloads(run.id)
    if latency is None:
        latency = {}
        for m in store.measurements(v.id):
            latency[str(m.workload_id)] = m.latency_us   # last session wins
    return {"workloads": wls, "latency": latency, "is_root": v.id == run.root_version,
            "contract_text": (store.contract(run.id).spec.get("invariance", "") if store.contract(run.id) else "")}


def _add_opportunities(store, run: Run, proposer, v: KernelVersion, latency: dict | None = None) -> int:
    """Store the proposer's hypotheses for head ``v``, re-ranked by the evidence so far.

    A hypothesis (same key) that already produced a candidate failing the contract is not
    offered again; one that produced a verified but slower candidate is pushed down.
    """
    task = get_task(run.op)
    history = store.opportunity_outcomes(run.id)
    n = 0
    for o in proposer.opportunities(task, v, _context(store, run, v, latency)):
        prio = float(o.get("priority", 0.0))
        past = history.get(o["key"], [])
        if any(a == "reject" for a, _ in past):
            continue
        if any(a == "keep" and d.get("gain", 0.0) < 0 for a, d in past):
            prio -= 100.0
        if store.add_opportunity(Opportunity(run_id=run.id, parent_id=v.id, key=o["key"], kind=o["kind"],
                                             description=o["description"], payload=o.get("payload", {}),
                                             priority=prio)):
            n += 1
    return n


def _withdraw(store, run_id: int, parent_id: int) -> None:
    for o in store.opportunities(run_id, status="open", parent_id=parent_id):
        store.set_opportunity_status(o.id, "withdrawn")


# ------------------------------------------------------------------------------ initialize
def initialize(store, evaluator, proposer, name: str, op: str, preset: str, timer: str, device: str = "",
               env: dict | None = None, policy: Policy | None = None, config: dict | None = None) -> Run:
    """Create (or finish creating) run ``name``: qualify root, freeze contract, noise floor."""
    policy = policy or Policy()
    task = get_task(op)
    run = store.run(name)
    if run is None:
        kind, _, _ = load_root(op)
        with store.transaction():
            run = store.add_run(Run(name=name, op=op, kind=kind, timer=timer, device=device, env=env or {},
                                    config={"preset": preset, "policy": dataclasses.asdict(policy), **(config or {})}))
            store.freeze_contract(Contract(run_id=run.id, op=op, spec=task.contract_spec(preset)))
            for w in task.workloads(preset):
                store.add_workload(Workload(run_id=run.id, name=w["name"], shape=w["shape"], weight=w["weight"],
                                            regression_limit=w["regression_limit"]))
    if run.status != "created":
        return run
    kind, src, meta = load_root(op)
    root = KernelVersion(run_id=run.id, op=op, kind=kind, source=src, meta=meta, origin="root", step=0,
                         description=f"root ({op}, {kind})")
    res = evaluator.evaluate(job_for(store, run, root, [("root_b", root)], policy=policy))
    sessions = [res["timing"]] if res.get("timing") else []
    for _ in range(policy.noise_sessions - 1):
        if not res["passed"]:
            break
        r2 = evaluator.evaluate(job_for(store, run, root, [("root_b", root)], skip_checks=True, policy=policy))
        if r2.get("timing"):
            sessions.append(r2["timing"])
    wls = store.workloads(run.id)
    with store.transaction():
        root = store.add_version(root)
        _record_checks(store, run.id, root.id, res["checks"])
        if not res["passed"]:
            f = first_failure(res["checks"])
            store.set_version_status(root.id, "failed")
            store.add_decision(Decision(run_id=run.id, step=0, action="reject", version_id=root.id,
                                        reason=f"root fails the contract: {f['check']}", data={"check": f}))
            store.update_run(run.id, status="failed", root_version=root.id, stop_reason="root fails the contract")
            return store.run(run.id)
        ratios = []
        for t in sessions:
            _record_timing(store, run, {"candidate": root.id}, t, {"candidate": "noise"})
            a, b = weighted_total(wls, t["latency"]["candidate"]), weighted_total(wls, t["latency"]["root_b"])
            ratios.append(abs(a / b - 1.0))
        noise = min(policy.max_noise_floor, max(policy.min_noise_floor, 2.0 * max(ratios, default=0.0)))
        total = weighted_total(wls, sessions[0]["latency"]["candidate"]) if sessions else None
        store.set_version_status(root.id, "verified", total)
        main = store.add_branch(Branch(run_id=run.id, name="main", base_version=root.id, head_version=root.id))
        store.conn.execute("UPDATE kernel_versions SET branch_id = ? WHERE id = ?", (main.id, root.id))
        store.add_decision(Decision(run_id=run.id, step=0, action="qualify_root", version_id=root.id, branch_id=main.id,
                                    reason=f"root passes all {len(res['checks'])} checks; noise floor {noise:.3%}"
                                           f" from {len(sessions)} A/A sessions",
                                    data={"noise_ratios": ratios, "weighted_us": total, "simulated": timer == "simulated"}))
        store.update_run(run.id, status="initialized", noise_floor=noise, root_version=root.id, best_version=root.id)
        run = store.run(run.id)
        root = store.version(root.id)
        lat = {str(k): v["median_us"] for k, v in sessions[0]["latency"]["candidate"].items()} if sessions else {}
        _add_opportunities(store, run, proposer, root, lat)
    return store.run(run.id)


# ------------------------------------------------------------------------------ act
def _pick(store, run: Run) -> tuple[Opportunity, Branch] | None:
    heads = {b.head_version: b for b in store.branches(run.id, status="active")}
    for o in store.opportunities(run.id, status="open"):
        if o.parent_id in heads:
            return o, heads[o.parent_id]
    return None


def act(store, run: Run, proposer, step: int) -> dict:
    """One proposal. Returns {"status": "pending"|"duplicate"|"no_candidate"|"exhausted", ...}."""
    pick = _pick(store, run)
    if pick is None:
        return {"status": "exhausted"}
    opp, branch = pick
    parent = store.version(opp.parent_id)
    ctx = _context(store, run, parent)
    ctx["tokens_used"] = store.tokens_used(run.id)
    ctx["recent_failures"] = [d.reason for d in store.decisions(run.id) if d.action == "reject"][-5:]
    prop = proposer.propose(get_task(run.op), parent, opp, ctx)
    with store.transaction():
        store.set_opportunity_status(opp.id, "consumed")
        call = ProposerCall(run_id=run.id, step=step, proposer=proposer.name, model=prop.model,
                            prompt_tokens=prop.prompt_tokens, completion_tokens=prop.completion_tokens,
                            total_tokens=prop.prompt_tokens + prop.completion_tokens, latency_s=prop.latency_s,
                            ok=prop.ok, error=prop.error, opportunity_id=opp.id)
        if not prop.ok:
            store.add_proposer_call(call)
            store.add_decision(Decision(run_id=run.id, step=step, action="reject", branch_id=branch.id,
                                        reason=f"proposer produced no candidate: {prop.error}",
                                        data={"opportunity": opp.id}))
            return {"status": "no_candidate", "opportunity": opp.description, "error": prop.error}
        v = KernelVersion(run_id=run.id, op=run.op, kind=prop.kind or parent.kind, source=prop.source, meta=prop.meta,
                          origin=proposer.name, step=step, parent_id=parent.id, branch_id=branch.id,
                          opportunity_id=opp.id, description=prop.description or opp.description)
        dup = store.version_by_hash(run.id, v.hash)
        if dup is not None:
            call.version_id = dup.id
            store.add_proposer_call(call)
            store.add_decision(Decision(run_id=run.id, step=step, action="duplicate", version_id=dup.id,
                                        branch_id=branch.id, reason=f"identical to version {dup.id} ({dup.status})",
                                        data={"opportunity": opp.id}))
            return {"status": "duplicate", "version": dup.id, "opportunity": opp.description}
        v = store.add_version(v)
        store.add_edge(Edge(run_id=run.id, parent_id=parent.id, child_id=v.id))
        call.version_id = v.id
        store.add_proposer_call(call)
    return {"status": "pending", "version": v.id, "opportunity": opp.description}


# ------------------------------------------------------------------------------ audit
def audit(store, run: Run, evaluator, proposer, vid: int, policy: Policy | None = None) -> dict:
    """Evaluate pending version ``vid`` and record the outcome in one transaction."""
    policy = policy or Policy()
    v = store.version(vid)
    assert v.status == "pending", f"version {vid} is {v.status}, not pending"
    branch = store.branch(v.branch_id)
    incumbent = store.version(branch.head_version)
    best = store.version(run.best_version)
    refs = [("incumbent", incumbent)] + ([("best", best)] if best.id != incumbent.id else [])
    res = evaluator.evaluate(job_for(store, run, v, refs, policy=policy))
    wls = store.workloads(run.id)
    opp = store.opportunity(v.opportunity_id) if v.opportunity_id else None
    out = {"version": vid}
    with store.transaction():
        run = store.run(run.id)
        _record_checks(store, run.id, vid, res["checks"])
        if not res["passed"]:
            f = first_failure(res["checks"])
            detail = f.get("detail", {})
            why = detail.get("error") or (f"{detail.get('n_mismatch', '?')}/{detail.get('n_compared', '?')} mismatching"
                                          + (f", rel_err={detail['rel_error']:.3g}" if detail.get("rel_error") is not None else ""))
            store.set_version_status(vid, "failed")
            store.update_branch(branch.id, attempts=branch.attempts + 1, failures=branch.failures + 1,
                                since_improvement=branch.since_improvement + 1)
            store.add_decision(Decision(run_id=run.id, step=v.step, action="reject", version_id=vid, branch_id=branch.id,
                                        reason=f"{f['check']}: {why}"[:500],
                                        data={"check": f["check"], "shape": f.get("shape", "")}))
            out.update(action="reject", check=f["check"], reason=why)
            return out
        t = res["timing"]
        lat = t["latency"]
        _record_timing(store, run, {"candidate": vid, "incumbent": incumbent.id, "best": best.id}, t,
                       {"candidate": "candidate"})
        cand_tot, inc_tot = weighted_total(wls, lat["candidate"]), weighted_total(wls, lat["incumbent"])
        best_tot = weighted_total(wls, lat["best"]) if "best" in lat else inc_tot
        gain = 1.0 - cand_tot / inc_tot
        regress = {w.name: lat["candidate"][str(w.id)]["median_us"] / lat["incumbent"][str(w.id)]["median_us"] - 1.0
                   for w in wls}
        over = {n: r for n, r in regress.items() if r > next(w.regression_limit for w in wls if w.name == n)}
        data = {"gain": gain, "candidate_us": cand_tot, "incumbent_us": inc_tot, "best_us": best_tot,
                "noise_floor": run.noise_floor, "regressions": over, "session": t["session"], "simulated": t["simulated"]}
        store.set_version_status(vid, "verified", cand_tot)
        if gain > run.noise_floor and not over:
            _withdraw(store, run.id, incumbent.id)
            store.update_branch(branch.id, head_version=vid, attempts=branch.attempts + 1, failures=0,
                                since_improvement=0)
            store.add_decision(Decision(run_id=run.id, step=v.step, action="promote", version_id=vid, branch_id=branch.id,
                                        reason=f"all checks pass; weighted latency {gain:+.2%} vs head {incumbent.id} "
                                               f"(> noise {run.noise_floor:.2%}), no workload past its limit", data=data))
            out.update(action="promote", gain=gain)
            if branch.name == "main" or cand_tot < best_tot * (1.0 - run.noise_floor):
                if branch.name != "main":
                    main = next(b for b in store.branches(run.id) if b.name == "main")
                    store.add_edge(Edge(run_id=run.id, parent_id=main.head_version, child_id=vid, relation="merge"))
                    _withdraw(store, run.id, main.head_version)
                    store.update_branch(main.id, head_version=vid, since_improvement=0)
                    store.update_branch(branch.id, status="merged")
                    store.add_decision(Decision(run_id=run.id, step=v.step, action="merge", version_id=vid,
                                                branch_id=branch.id, reason=f"branch '{branch.name}' head beats main "
                                                f"head {best.id} by {1 - cand_tot / best_tot:+.2%}", data=data))
                    out.update(action="merge")
                store.update_run(run.id, best_version=vid)
            _add_opportunities(store, run, proposer, store.version(vid),
                               {k: m["median_us"] for k, m in lat["candidate"].items()})
            return out
        store.update_branch(branch.id, attempts=branch.attempts + 1, failures=0,
                            since_improvement=branch.since_improvement + 1)
        if opp is not None and opp.kind == "transform" and gain > -policy.branch_tolerance:
            nb = store.add_branch(Branch(run_id=run.id, name=f"{opp.payload.get('transform', 'variant')}@v{vid}",
                                         base_version=vid, head_version=vid))
            store.conn.execute("UPDATE kernel_versions SET branch_id = ? WHERE id = ?", (nb.id, vid))
            store.add_decision(Decision(run_id=run.id, step=v.step, action="branch", version_id=vid, branch_id=nb.id,
                                        reason=f"structural variant verified ({gain:+.2%} vs head, within "
                                               f"{policy.branch_tolerance:.0%}); opened branch to tune it", data=data))
            _add_opportunities(store, run, proposer, store.version(vid),
                               {k: m["median_us"] for k, m in lat["candidate"].items()})
            out.update(action="branch", gain=gain)
            return out
        why = (f"regression past limit: {', '.join(f'{n} {r:+.1%}' for n, r in over.items())}" if over and gain > run.noise_floor
               else f"no improvement beyond noise: {gain:+.2%} vs floor {run.noise_floor:.2%}")
        store.add_decision(Decision(run_id=run.id, step=v.step, action="keep", version_id=vid, branch_id=branch.id,
                                    reason="verified but not promoted: " + why, data=data))
        out.update(action="keep", gain=gain)
    return out


# ------------------------------------------------------------------------------ lineage
def lineage(store, run: Run, step: int, policy: Policy | None = None) -> list[dict]:
    """Archive or abandon side branches; returns the actions taken (one transaction)."""
    policy = policy or Policy()
    acts = []
    with store.transaction():
        for b in store.branches(run.id, status="active"):
            if b.name == "main":
                continue
            if b.failures >= policy.branch_max_failures:
                status, why = "abandoned", f"{b.failures} consecutive failed candidates"
            elif b.since_improvement >= policy.branch_patience:
                status, why = "archived", f"no improvement in {b.since_improvement} candidates"
            elif not store.opportunities(run.id, status="open", parent_id=b.head_version):
                status, why = "archived", "no open opportunities left"
            else:
                continue
            _withdraw(store, run.id, b.head_version)
            store.update_branch(b.id, status=status)
            store.add_decision(Decision(run_id=run.id, step=step, action=status[:-1] if status != "abandoned" else "abandon",
                                        version_id=b.head_version, branch_id=b.id, reason=why))
            acts.append({"branch": b.name, "status": status, "reason": why})
    return acts


# ------------------------------------------------------------------------------ summary
def summarize(store, run_id) -> dict:
    run = store.run(run_id)
    vs = store.versions(run.id)
    decs = store.decisions(run.id)
    by_status: dict = {}
    for v in vs:
        by_status[v.status] = by_status.get(v.status, 0) + 1
    actions: dict = {}
    for d in decs:
        actions[d.action] = actions.get(d.action, 0) + 1
    rejects: dict = {}
    for d in decs:
        if d.action == "reject" and d.data.get("check"):
            rejects[d.data["check"]] = rejects.get(d.data["check"], 0) + 1
    final = next((d for d in reversed(decs) if d.action == "stop"), None)
    best = store.version(run.best_version) if run.best_version else None
    root = store.version(run.root_version) if run.root_version else None
    chain = store.lineage(best.id) if best else []
    return {
        "run": run.name, "op": run.op, "kind": run.kind, "timer": run.timer,
        "SIMULATED": run.timer == "simulated", "device": run.device, "status": run.status,
        "stop_reason": run.stop_reason, "noise_floor": run.noise_floor,
        "versions": len(vs), "by_status": by_status, "decisions": actions, "rejections_by_check": rejects,
        "root": {"id": root.id, "hash": root.hash, "weighted_us": root.weighted_latency_us} if root else None,
        "best": {"id": best.id, "hash": best.hash, "weighted_us": best.weighted_latency_us, "meta": best.meta,
                 "description": best.description, "lineage": chain} if best else None,
        "final": final.data if final else None,
        "tokens": store.tokens_used(run.id), "proposer_calls": len(store.proposer_calls(run.id)),
        "branches": [{"name": b.name, "status": b.status, "head": b.head_version} for b in store.branches(run.id)],
        "workloads": [{"id": w.id, "name": w.name, "shape": w.shape, "weight": w.weight,
                       "regression_limit": w.regression_limit} for w in store.workloads(run.id)],
        "contract_hash": store.contract(run.id).hash if store.contract(run.id) else None,
    }
