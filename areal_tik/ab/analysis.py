"""The A/B analysis: the two arms' step logs (one JSON line per step: AReaL's committed stats,
the wall time between step commits, the actor's per-batch record) turned into per-step rows
with phase times, tokens, reward and the tik counters, and the report's numbers: step-time and
throughput ratios, phase means, reward with a confidence interval. Also the rollout server's
per-interval counters from its log.

Step 0 carries warm-up (and the tik audit); ratios are taken over steps >= 1 when there are at
least two steps (steps recorded under torch.profiler left out when others remain), and each
ratio can be recomputed from the logged times.
"""
from __future__ import annotations

import json
import math
import os
import statistics

__all__ = ["ARMS", "PHASES", "load_steps", "analyze", "server_intervals"]

ARMS = ("baseline", "tik")
PHASES = (("rollout", "timeperf/rollout"), ("recompute", "timeperf/recompute_logp"),
          ("train_step", "timeperf/train_step"), ("weight_update", "timeperf/update_weights"),
          # PPO only (0 without a critic): the value forward before, and the critic update after, the actor's
          ("critic", ("timeperf/critic_values", "timeperf/critic_train_step")))


def load_steps(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _step_row(rec: dict) -> dict:
    s = rec.get("stats", {})
    row = {"step": rec["global_step"], "wall_s": float(rec["wall_s"])}
    for name, key in PHASES:
        row[name] = sum(float(s.get(k, 0.0)) for k in ((key,) if isinstance(key, str) else key))
    row["other"] = row["wall_s"] - sum(row[n] for n, _ in PHASES)
    tik = rec.get("tik") or []
    row["gen_tokens"] = sum(int(t.get("gen_tokens", 0)) for t in tik)
    row["total_tokens"] = sum(int(t.get("total_tokens", 0)) for t in tik)
    rewards = [t["reward_mean"] for t in tik if "reward_mean" in t]
    row["reward"] = statistics.fmean(rewards) if rewards else float(s.get("ppo_actor/task_reward/avg", math.nan))
    row["recompute_skipped"] = bool(tik) and all(t.get("skipped") for t in tik)
    row["recompute_forward_s"] = sum(float(t.get("recompute_forward_s", 0.0)) for t in tik)
    row["skip_reasons"] = sorted({r for t in tik for r in t.get("reasons", [])})
    row["audit"] = any(t.get("audit") for t in tik)
    row["audit_tokens"] = sum(int(t.get("audit_tokens", 0)) for t in tik)
    row["audit_mismatch_tokens"] = sum(int(t.get("audit_mismatch_tokens", 0)) for t in tik)
    row["audit_max_abs_diff"] = max([float(t.get("audit_max_abs_diff", 0.0)) for t in tik] or [0.0])
    row["compare_tokens"] = sum(int(t.get("compare_tokens", 0)) for t in tik)
    row["compare_mismatch_tokens"] = sum(int(t.get("compare_mismatch_tokens", 0)) for t in tik)
    row["compare_max_abs_diff"] = max([float(t.get("compare_max_abs_diff", 0.0)) for t in tik] or [0.0])
    row["tokens_per_s"] = row["gen_tokens"] / row["wall_s"] if row["wall_s"] > 0 else math.nan
    row["default_attention"] = ",".join(sorted({t["default_attention"] for t in tik if t.get("default_attention")}))
    jit = rec.get("jit") or {}
    row["jit_compiles"] = int(jit.get("compiles", 0)) if jit.get("installed", True) else None  # None: not counted
    row["jit_compile_s"] = float(jit.get("seconds", 0.0))
    row["profiled"] = bool(rec.get("profiled"))
    return row


def _spread(xs: list[float]) -> dict:
    if not xs:
        return {"mean": math.nan, "min": math.nan, "max": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def _ratio_ci(rb: list[float], rt: list[float]) -> dict:
    """Standard errors of the two arms' mean reward (per-step means as the samples) and a 95%
    interval for tik/baseline by the delta method. An approximation: the steps of one arm are
    not independent (the policy improves), but both arms share the curve's shape."""
    out = {"se_baseline": math.nan, "se_tik": math.nan, "ratio_ci95": [math.nan, math.nan]}
    if len(rb) < 2 or len(rt) < 2 or not all(math.isfinite(x) for x in (*rb, *rt)):
        return out
    mb, mt = statistics.fmean(rb), statistics.fmean(rt)
    sb, st = statistics.stdev(rb) / math.sqrt(len(rb)), statistics.stdev(rt) / math.sqrt(len(rt))
    out.update(se_baseline=sb, se_tik=st)
    if mb > 0 and mt > 0:
        r = mt / mb
        half = 1.96 * r * math.sqrt((sb / mb) ** 2 + (st / mt) ** 2)
        out["ratio_ci95"] = [r - half, r + half]
    return out


def analyze(baseline: list[dict], tik: list[dict]) -> dict:
    """Report dict from the two step logs (lists of step records)."""
    rows = {"baseline": [_step_row(r) for r in baseline], "tik": [_step_row(r) for r in tik]}
    n = min(len(rows["baseline"]), len(rows["tik"]))
    first = 1 if n >= 2 else 0  # step 0: warm-up and the tik audit
    # a step recorded under torch.profiler (either arm) is slowed by it: left out when others remain
    measured = [i for i in range(first, n) if not (rows["baseline"][i]["profiled"] or rows["tik"][i]["profiled"])]
    measured = measured or list(range(first, n))
    per_step_ratio = [rows["baseline"][i]["wall_s"] / rows["tik"][i]["wall_s"] for i in measured
                      if rows["tik"][i]["wall_s"] > 0]
    tot = {a: sum(rows[a][i]["wall_s"] for i in measured) for a in ARMS}
    toks = {a: sum(rows[a][i]["gen_tokens"] for i in measured) for a in ARMS}
    phase_means = {a: {p: _spread([rows[a][i][p] for i in measured])["mean"] for p, _ in PHASES}
                   for a in ARMS}
    for a in ARMS:
        phase_means[a]["other"] = _spread([rows[a][i]["other"] for i in measured])["mean"]
        phase_means[a]["wall_s"] = _spread([rows[a][i]["wall_s"] for i in measured])["mean"]
    rb = [rows["baseline"][i]["reward"] for i in range(n)]
    rt = [rows["tik"][i]["reward"] for i in range(n)]
    mean_rb, mean_rt = (statistics.fmean(rb) if rb else math.nan), (statistics.fmean(rt) if rt else math.nan)
    tik_rows = rows["tik"]
    report = {
        "n_steps": n,
        "measured_steps": measured,
        "rows": rows,
        "step_time_ratio": _spread(per_step_ratio),
        "throughput_ratio_total": tot["baseline"] / tot["tik"] if tot["tik"] > 0 else math.nan,
        "tokens_per_s": {a: (toks[a] / tot[a] if tot[a] > 0 else math.nan) for a in ARMS},
        "tokens_per_s_ratio": ((toks["tik"] / tot["tik"]) / (toks["baseline"] / tot["baseline"])
                               if tot["tik"] > 0 and tot["baseline"] > 0 and toks["baseline"] > 0 else math.nan),
        "phase_mean_s": phase_means,
        "reward_mean": {"baseline": mean_rb, "tik": mean_rt,
                        "ratio": (mean_rt / mean_rb) if mean_rb not in (0.0,) and not math.isnan(mean_rb) else math.nan,
                        **_ratio_ci(rb, rt)},
        "tik": {
            "steps_skipped": sum(r["recompute_skipped"] for r in tik_rows),
            "audits": sum(r["audit"] for r in tik_rows),
            "audit_tokens": sum(r["audit_tokens"] for r in tik_rows),
            "audit_mismatch_tokens": sum(r["audit_mismatch_tokens"] for r in tik_rows),
            "audit_max_abs_diff": max([r["audit_max_abs_diff"] for r in tik_rows] or [0.0]),
            "skip_reasons": sorted({x for r in tik_rows for x in r["skip_reasons"]}),
        },
        "baseline_rollout_vs_recompute": {
            "tokens": sum(r["compare_tokens"] for r in rows["baseline"]),
            "mismatch_tokens": sum(r["compare_mismatch_tokens"] for r in rows["baseline"]),
            "max_abs_diff": max([r["compare_max_abs_diff"] for r in rows["baseline"]] or [0.0]),
        },
    }
    report["limiting_phase"] = {a: max([p for p, _ in PHASES] + ["other"], key=lambda p: phase_means[a][p])
                                for a in ARMS}
    return report


def server_intervals(out: str, arm: str) -> list[dict]:
    """Per weight update, the rollout server's counters for the interval before it (engine busy
    seconds, steps, requests, tokens, first request to last finish), from ``<arm>/tik_server.log``."""
    import ast
    import re
    path = os.path.join(out, arm, "tik_server.log")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            m = re.search(r"since the previous update: (\{.*\})\s*$", line)
            if m:
                try:
                    rows.append(ast.literal_eval(m.group(1)))
                except (ValueError, SyntaxError):
                    pass
    return rows
