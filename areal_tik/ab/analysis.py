"""The A/B analysis: the arms' step logs (one JSON line per step: AReaL's committed stats,
the wall time between step commits, the actor's per-batch record) turned into per-step rows
with phase times, tokens, reward and the tik counters, and the report's numbers: step-time and
throughput ratios, phase means, reward with a confidence interval. Also the rollout server's
per-interval counters from its log.

Step 0 carries warm-up (and the tik audit); ratios are taken over steps >= 1 when there are at
least two steps (steps recorded under torch.profiler left out when others remain), and each
ratio can be recomputed from the logged times. The step-throughput ratio comes with a 95%
interval from the step-to-step spread of both arms (:func:`ratio_of_means_ci`); a run with
fewer than :data:`MIN_MEASURED` measured steps is a smoke test: it shows the job runs, not a speed.
"""
from __future__ import annotations

import ast
import json
import math
import os
import re
import statistics

__all__ = ["ARMS", "ARM_ENGINES", "SKIP_ARMS", "REFERENCES", "PHASES", "MIN_MEASURED", "load_steps", "analyze",
           "reference_arm", "headline_arm", "server_intervals", "ratio_of_means_ci", "t_quantile_975"]

# every arm, in report order: the rollout engine, the kernels, recompute or skip
ARMS = ("vllm", "baseline", "vllm_loglinear", "tik", "tik_ipc", "vllm_tik", "vllm_tik_ipc")
ARM_ENGINES = {"vllm": "stock vLLM (AReaL's vLLM server), HF-default trainer kernels, recompute every step",
               "vllm_loglinear": "stock vLLM (AReaL's vLLM server), HF-default trainer kernels, no recompute: "
                                 "AReaL's log-linear approximation of the proximal log-probs (prox_logp_method=loglinear)",
               "baseline": "areal-tik serve on default kernels, recompute every step (diagnostic: our engine without "
                           "our kernels, which isolates what the kernels and the skip change)",
               "tik": "areal-tik serve on tik kernels, recompute skipped when the skip rule allows",
               "tik_ipc": "areal-tik serve on tik kernels, recompute skipped when allowed, weights handed over through "
                          "a shared buffer on the trainer's GPU (actor.tik.weight_transfer=ipc) instead of a checkpoint",
               "vllm_tik": "vLLM with the tik plugin (AReaL's vLLM server), tik kernels, recompute skipped when allowed",
               "vllm_tik_ipc": "vLLM with the tik plugin, tik kernels, recompute skipped when allowed, weights through "
                               "a shared buffer on the trainer's GPU (actor.tik.weight_transfer=ipc)"}
SKIP_ARMS = ("tik", "tik_ipc", "vllm_tik", "vllm_tik_ipc")      # actor.kernel_backend=tik: may skip, audits
REFERENCES = ("vllm", "baseline")    # what ratios are taken against, first present wins
PHASES = (("rollout", "timeperf/rollout"), ("recompute", "timeperf/recompute_logp"),
          ("train_step", "timeperf/train_step"), ("weight_update", "timeperf/update_weights"),
          # PPO only (0 without a critic): the value forward before, and the critic update after, the actor's
          ("critic", ("timeperf/critic_values", "timeperf/critic_train_step")))


# fewer measured steps than this (per arm) and the run is a smoke test: no interval worth reading
MIN_MEASURED = 3

# the 0.975 quantile of Student's t for 1..30 degrees of freedom (two-sided 95%); above 30 the values
# of 40, 60 and 120 degrees of freedom, then the normal 1.960
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: float) -> float:
    """Student's t 0.975 quantile at ``df`` degrees of freedom, rounded down to a tabled df (so the
    interval errs wide)."""
    if not df >= 1:
        return math.nan
    if df < 31:
        return _T975[int(df) - 1]
    return 2.021 if df < 60 else 2.000 if df < 120 else 1.980 if df < 1000 else 1.960


def ratio_of_means_ci(ref: list[float], arm: list[float]) -> list[float]:
    """95% interval of ``mean(ref) / mean(arm)`` (the step-throughput ratio when both are step times),
    from the two arms' step-to-step spread as independent samples: Welch's t on the log scale, the
    standard error of each log mean by the delta method. ``[nan, nan]`` with fewer than two steps in
    an arm or a non-positive mean. The arms run one after the other, so drift of the machine between
    them is not in the interval."""
    if len(ref) < 2 or len(arm) < 2:
        return [math.nan, math.nan]
    mr, ma = statistics.fmean(ref), statistics.fmean(arm)
    if not (mr > 0 and ma > 0):
        return [math.nan, math.nan]
    vr = statistics.variance(ref) / (len(ref) * mr * mr)   # var of log(mean) ~ var(mean) / mean^2
    va = statistics.variance(arm) / (len(arm) * ma * ma)
    r = mr / ma
    if vr + va == 0.0:
        return [r, r]
    df = (vr + va) ** 2 / (vr ** 2 / (len(ref) - 1) + va ** 2 / (len(arm) - 1))
    half = t_quantile_975(df) * math.sqrt(vr + va)
    return [r * math.exp(-half), r * math.exp(half)]


def load_steps(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _step_row(rec: dict) -> dict:
    s = rec.get("stats", {})
    row = {"step": rec["global_step"], "wall_s": float(rec["wall_s"])}
    for name, key in PHASES:
        row[name] = sum(float(s.get(k, 0.0)) for k in ((key,) if isinstance(key, str) else key))
    row["other"] = row["wall_s"] - sum(row[n] for n, _ in PHASES)
    # the trainer's share of a disk weight update (AReaL's HF save, timed by the tik actor); nan when not logged
    row["weight_save"] = float(s.get("tik/hf_save_s", math.nan))
    tik = rec.get("tik") or []
    # an arm that never calls compute_logp (prox_logp_method=loglinear) has no tik record: AReaL's own count
    row["gen_tokens"] = (sum(int(t.get("gen_tokens", 0)) for t in tik) if tik
                         else int(s.get("ppo_actor/n_valid_tokens", 0)))
    row["total_tokens"] = sum(int(t.get("total_tokens", 0)) for t in tik)
    rewards = [t["reward_mean"] for t in tik if "reward_mean" in t]
    row["reward"] = statistics.fmean(rewards) if rewards else float(s.get("ppo_actor/task_reward/avg", math.nan))
    row["recompute_skipped"] = bool(tik) and all(t.get("skipped") for t in tik)
    row["recompute_forward_s"] = sum(float(t.get("recompute_forward_s", 0.0)) for t in tik)
    row["skip_reasons"] = sorted({r for t in tik for r in t.get("reasons", [])})
    # the per-sequence skip (counts over every trainer rank; the first rank's record is enough)
    for k in ("seqs_skipped", "seqs_total", "gen_tokens_skipped", "gen_tokens_total", "seqs_stale_version",
              "seqs_mixed_versions"):
        row[k] = int(tik[0].get(k) or 0) if tik else 0
    row["recompute_saved_s"] = float(tik[0].get("recompute_saved_s") or 0.0) if tik else 0.0
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
            "std": statistics.stdev(xs) if len(xs) > 1 else math.nan, "n": len(xs)}  # one value: no spread


def _ratio_ci(rb: list[float], rt: list[float]) -> dict:
    """Standard errors of the two arms' mean reward (per-step means as the samples) and a 95%
    interval for tik/baseline (:func:`ratio_of_means_ci`). An approximation: the steps of one arm
    are not independent (the policy improves), but both arms share the curve's shape."""
    out = {"se_baseline": math.nan, "se_tik": math.nan, "ratio_ci95": [math.nan, math.nan]}
    if min(len(rb), len(rt)) < MIN_MEASURED or not all(math.isfinite(x) for x in (*rb, *rt)):
        return out   # too few steps for a spread worth printing
    out.update(se_baseline=statistics.stdev(rb) / math.sqrt(len(rb)), se_tik=statistics.stdev(rt) / math.sqrt(len(rt)))
    out["ratio_ci95"] = ratio_of_means_ci(rt, rb)
    return out


def reference_arm(arms) -> str:
    """The arm every other is compared with: stock vLLM (``vllm``) when present, else ``baseline``, else the
    first arm."""
    arms = list(arms)
    return next((a for a in REFERENCES if a in arms), arms[0])


def headline_arm(arms, ref: str) -> str | None:
    """The arm the summary leads with: ``tik`` when present, else the first arm that is not ``ref``."""
    others = [a for a in arms if a != ref]
    return "tik" if "tik" in others else (others[0] if others else None)


def _skip_stats(rows: list[dict]) -> dict:
    seqs, toks = sum(r["seqs_total"] for r in rows), sum(r["gen_tokens_total"] for r in rows)
    return {"steps_skipped": sum(r["recompute_skipped"] for r in rows),
            "seq_skip_frac": sum(r["seqs_skipped"] for r in rows) / seqs if seqs else math.nan,
            "token_skip_frac": sum(r["gen_tokens_skipped"] for r in rows) / toks if toks else math.nan,
            "seqs_stale_version": sum(r["seqs_stale_version"] for r in rows),
            "seqs_mixed_versions": sum(r["seqs_mixed_versions"] for r in rows),
            "recompute_saved_s": sum(r["recompute_saved_s"] for r in rows),
            "audits": sum(r["audit"] for r in rows),
            "audit_tokens": sum(r["audit_tokens"] for r in rows),
            "audit_mismatch_tokens": sum(r["audit_mismatch_tokens"] for r in rows),
            "audit_max_abs_diff": max([r["audit_max_abs_diff"] for r in rows] or [0.0]),
            "skip_reasons": sorted({x for r in rows for x in r["skip_reasons"]})}


def _compare_stats(rows: list[dict]) -> dict:
    return {"tokens": sum(r["compare_tokens"] for r in rows),
            "mismatch_tokens": sum(r["compare_mismatch_tokens"] for r in rows),
            "max_abs_diff": max([r["compare_max_abs_diff"] for r in rows] or [0.0])}


def analyze(steps_by_arm: dict[str, list[dict]]) -> dict:
    """Report dict from the arms' step logs (``{arm: [step record, ...]}``, in :data:`ARMS` order or any).

    Every arm is compared with :func:`reference_arm` over the same measured steps (the steps every arm
    logged, step 0 left out when there are two or more, profiled steps left out when others remain):
    ``vs_reference[arm]`` holds its step-time, throughput, tokens/s and reward ratios (arm over
    reference: > 1 means the arm is faster). The top-level ``throughput_ratio_total``,
    ``step_time_ratio``, ``tokens_per_s_ratio`` and ``reward_mean["ratio"]`` are the headline arm's
    (:func:`headline_arm`); ``skip[arm]`` counts the skips and audits of every arm that may skip (tik
    kernels: whole-step skips, the fraction of sequences and of generated tokens skipped over every step,
    the sequences recomputed per reason, the estimated forward time saved, audits); ``rollout_vs_recompute[arm]``
    the log-prob comparison of every recompute arm."""
    arms = [a for a in ARMS if a in steps_by_arm] + [a for a in steps_by_arm if a not in ARMS]
    if not arms:
        raise ValueError("no arm to analyze")
    rows = {a: [_step_row(r) for r in steps_by_arm[a]] for a in arms}
    n = min(len(rows[a]) for a in arms)
    first = 1 if n >= 2 else 0  # step 0: warm-up and the tik audit
    # a step recorded under torch.profiler (any arm) is slowed by it: left out when others remain
    measured = [i for i in range(first, n) if not any(rows[a][i]["profiled"] for a in arms)]
    measured = measured or list(range(first, n))
    ref = reference_arm(arms)
    head = headline_arm(arms, ref)
    tot = {a: sum(rows[a][i]["wall_s"] for i in measured) for a in arms}
    toks = {a: sum(rows[a][i]["gen_tokens"] for i in measured) for a in arms}
    tps = {a: (toks[a] / tot[a] if tot[a] > 0 else math.nan) for a in arms}
    phase_means = {a: {p: _spread([rows[a][i][p] for i in measured])["mean"] for p, _ in PHASES} for a in arms}
    for a in arms:
        phase_means[a]["other"] = _spread([rows[a][i]["other"] for i in measured])["mean"]
        phase_means[a]["wall_s"] = _spread([rows[a][i]["wall_s"] for i in measured])["mean"]
        saves = [rows[a][i].get("weight_save", math.nan) for i in measured]
        phase_means[a]["weight_save"] = statistics.fmean(saves) if saves else math.nan
    rewards = {a: [rows[a][i]["reward"] for i in range(n)] for a in arms}
    mean_r = {a: (statistics.fmean(rewards[a]) if rewards[a] else math.nan) for a in arms}

    def versus(a: str) -> dict:
        ci = _ratio_ci(rewards[ref], rewards[a])
        mr = mean_r[ref]
        return {"reference": ref,
                "step_time_ratio": _spread([rows[ref][i]["wall_s"] / rows[a][i]["wall_s"] for i in measured
                                            if rows[a][i]["wall_s"] > 0]),
                "throughput_ratio_total": tot[ref] / tot[a] if tot[a] > 0 else math.nan,
                "throughput_ratio_ci95": ratio_of_means_ci([rows[ref][i]["wall_s"] for i in measured],
                                                           [rows[a][i]["wall_s"] for i in measured]),
                "tokens_per_s_ratio": (tps[a] / tps[ref] if tot[a] > 0 and tot[ref] > 0 and toks[ref] > 0
                                       else math.nan),
                "reward_ratio": mean_r[a] / mr if mr != 0.0 and not math.isnan(mr) else math.nan,
                "reward_ratio_ci95": ci["ratio_ci95"], "se_reference": ci["se_baseline"], "se": ci["se_tik"]}

    vs = {a: versus(a) for a in arms if a != ref}
    h = vs.get(head) or {"step_time_ratio": _spread([]), "throughput_ratio_total": math.nan,
                         "throughput_ratio_ci95": [math.nan, math.nan],
                         "tokens_per_s_ratio": math.nan, "reward_ratio": math.nan,
                         "reward_ratio_ci95": [math.nan, math.nan], "se_reference": math.nan, "se": math.nan}
    reward_mean = {**mean_r, "ratio": h["reward_ratio"], "ratio_ci95": h["reward_ratio_ci95"],
                   f"se_{ref}": h["se_reference"]}
    if head is not None:
        reward_mean[f"se_{head}"] = h["se"]
    report = {
        "arms": arms,
        "reference": ref,
        "headline": head,
        "n_steps": n,
        "measured_steps": measured,
        "n_measured": len(measured),
        # too few measured steps (or only the warm-up step) for a spread: it shows the job runs, not a speed
        "smoke": len(measured) < MIN_MEASURED,
        "warmup_step_dropped": first == 1,
        "rows": rows,
        "vs_reference": vs,
        "step_time_ratio": h["step_time_ratio"],
        "throughput_ratio_total": h["throughput_ratio_total"],
        "throughput_ratio_ci95": h["throughput_ratio_ci95"],
        "tokens_per_s": tps,
        "tokens_per_s_ratio": h["tokens_per_s_ratio"],
        "phase_mean_s": phase_means,
        "reward_mean": reward_mean,
        "skip": {a: _skip_stats(rows[a]) for a in arms if a in SKIP_ARMS},
        "rollout_vs_recompute": {a: _compare_stats(rows[a]) for a in arms if a not in SKIP_ARMS},
        "limiting_phase": {a: max([p for p, _ in PHASES] + ["other"], key=lambda p: phase_means[a][p]) for a in arms},
    }
    if "tik" in report["skip"]:             # the keys of the two-arm report, kept for its readers
        report["tik"] = report["skip"]["tik"]
    if "baseline" in report["rollout_vs_recompute"]:
        report["baseline_rollout_vs_recompute"] = report["rollout_vs_recompute"]["baseline"]
    return report


def server_intervals(out: str, arm: str) -> list[dict]:
    """Per weight update, the rollout server's counters for the interval before it (engine busy
    seconds, steps, requests, tokens, first request to last finish), from ``<arm>/tik_server.log``."""
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
