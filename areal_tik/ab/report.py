"""The A/B report directory: ``report.json``, ``steps.csv``, ``summary.md`` (the markdown
summary of :func:`areal_tik.ab.analysis.analyze`'s report) and the figures ``step_time.png``
(step time by phase, every arm) and ``reward.png``."""
from __future__ import annotations

import json
import math
import os
import statistics

from areal_tik.ab.analysis import ARM_ENGINES, MIN_MEASURED
from areal_tik.ab.describe import arms_of, fmt, has_critic, machine_label, on_cpu, workload_label
from areal_tik.ab.plots import plot

__all__ = ["REPORT_FILES", "summary_markdown", "write_report"]

REPORT_FILES = ("report.json", "steps.csv", "summary.md", "step_time.png", "reward.png")



def _steps_text(steps: list[int]) -> str:
    """[1, 2, 3] -> ``steps 1-3``; [1] -> ``step 1``; gaps listed."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


def _ci_text(ci) -> str:
    return f"95% CI [{', '.join(fmt(x, 2) for x in ci)}]"


def _verdict(r: dict, meta: dict) -> list[str]:
    """The summary's first paragraph: what this run can and cannot show."""
    ref, head, n = r.get("reference"), r.get("headline"), r.get("n_measured", len(r["measured_steps"]))
    if head is None:
        return [f"One arm ({ref}): nothing to compare."]
    where = _steps_text(r["measured_steps"]) + ("; step 0 is warm-up and not measured" if r.get("warmup_step_dropped")
                                                else "; step 0 carries the warm-up")
    ratio, ci = r["throughput_ratio_total"], r.get("throughput_ratio_ci95") or [math.nan, math.nan]
    if r.get("smoke"):
        spread = "one measured step: no spread" if n == 1 else f"{n} measured steps: too few for an interval"
        out = [f"**Smoke test ({spread}).** It shows that every arm runs end to end; its {head}/{ref} step "
               f"throughput ratio ({fmt(ratio, 2)}x, {where}) is not a measurement. For a ratio with a 95% "
               f"interval run at least {MIN_MEASURED + 1} steps per arm; the more steps, the narrower the interval."]
    else:
        lo, hi = ci
        if not (math.isfinite(lo) and math.isfinite(hi)):
            reading = "No interval: the step times are not positive."
        elif lo <= 1.0 <= hi:
            reading = "The interval includes 1.00: this run shows no speed difference."
        else:
            reading = f"The whole interval is {'above' if lo > 1 else 'below'} 1.00: {head} is " \
                      f"{'faster' if lo > 1 else 'slower'} than {ref} here."
        out = [f"**{head}/{ref} step throughput: {fmt(ratio, 2)}x, {_ci_text(ci)}** over {n} measured steps per "
               f"arm ({where}). {reading}"]
    out += _reward_warnings(r)
    notes = [f"Machine: {meta.get('machine') or '?'}."]
    if on_cpu(meta):
        notes.append("On a CPU the tik kernels run as their torch_ref reference code and the other arms on "
                     "PyTorch's own: the ratio says nothing about a GPU.")
    notes.append("The arms ran one after the other: a change in the machine's load between them moves the "
                 "ratio and is not in the interval.")
    load = {a: x for a, x in (meta.get("arm_load") or {}).items() if isinstance(x, (int, float))}
    cores = meta.get("cores")
    if load and cores and max(load.values()) > 0.8 * cores:
        notes.append("This machine was busy while the arms ran (mean load " + ", ".join(
            f"{a} {x:.1f}" for a, x in load.items()) + f" on {cores} cores): read the ratio as a rough one.")
    return out + ["", " ".join(notes)]


def _reward_warnings(r: dict) -> list[str]:
    """One bold line per arm whose reward ratio's 95% interval leaves out 1: the arms run one recipe, seed and data
    set, so their rewards should agree; when they do not, the rollout or the update differs in more than speed."""
    ref = r.get("reference", "baseline")
    if (r.get("reward_mean") or {}).get(ref) in (None, 0.0):
        return []
    out = []
    for a, v in (r.get("vs_reference") or {}).items():
        lo, hi = v.get("reward_ratio_ci95", [math.nan, math.nan])
        if math.isfinite(lo) and math.isfinite(hi) and not lo <= 1.0 <= hi:
            out += ["", f"**Reward differs: {a}/{ref} reward ratio {fmt(v['reward_ratio'])}, 95% CI [{fmt(lo)}, "
                        f"{fmt(hi)}] leaves out 1.** The arms share recipe, seed and data: look at how {a} samples "
                        f"and updates before reading its speed."]
    return out


def skip_ceiling(r: dict) -> tuple[float, float] | None:
    """(share of the reference's measured step spent in the recompute, the step-throughput ratio that removing all
    of it would give: ``1 / (1 - share)``), or None when the reference records no recompute."""
    p = (r.get("phase_mean_s") or {}).get(r.get("reference"))
    if not p:
        return None
    step, rec = p.get("wall_s", math.nan), p.get("recompute", math.nan)
    if not (math.isfinite(rec) and math.isfinite(step) and rec > 0 and step > rec):
        return None
    return rec / step, step / (step - rec)


def _ratio_lines(r: dict) -> list[str]:
    ref = r.get("reference", "baseline")
    ref_reward = (r.get("reward_mean") or {}).get(ref)
    n = r.get("n_measured", len(r["measured_steps"]))
    out = []
    for a, v in (r.get("vs_reference") or {}).items():
        st, ci = v["step_time_ratio"], v.get("reward_ratio_ci95", [math.nan, math.nan])
        if ref_reward == 0.0:   # a random preset earns nothing: there is no ratio to give
            reward = f"reward ratio: none ({ref}'s mean reward is 0)"
        elif not all(map(math.isfinite, ci)):
            reward = f"reward ratio {fmt(v['reward_ratio'])} (too few steps for an interval)"
        else:
            reward = f"reward ratio {fmt(v['reward_ratio'])}, 95% CI [{', '.join(fmt(x) for x in ci)}]"
        if n < 2:
            per_step = "one measured step: no spread"
        elif r.get("smoke"):   # as the verdict says: no interval from so few steps
            per_step = f"{n} measured steps: too few for an interval; per-step ratios {fmt(st['min'])} to {fmt(st['max'])}"
        else:
            per_step = (f"{_ci_text(v.get('throughput_ratio_ci95') or [math.nan, math.nan])}; per-step ratios "
                        f"{fmt(st['min'])} to {fmt(st['max'])}")
        out += [f"- **step throughput {a}/{ref}: {fmt(v['throughput_ratio_total'])}x** "
                f"(sum of {ref} step times / sum of {a} step times; > 1: {a} is faster); {per_step}; generated "
                f"tokens/s ratio {fmt(v['tokens_per_s_ratio'])}; {reward}"]
    return out


def summary_markdown(report: dict, meta: dict) -> str:
    r = report
    arms = arms_of(r)
    ref = r.get("reference", arms[0])
    lines = [f"# areal-tik A/B: {workload_label(meta)}", ""]
    cut = [a for a, t in (meta.get("timed_out") or {}).items() if t]
    if cut:
        lines += [f"**PARTIAL: {', '.join(cut)} arm(s) stopped at the per-arm timeout; "
                  f"{r['n_steps']} of {meta.get('steps')} requested steps compared.**", ""]
    lines += [*_verdict(r, meta), ""]
    engines = meta.get("engines") or {}
    lines += ["Arms (rollout engine):", ""]
    lines += [f"- `{a}`{' (reference)' if a == ref else ''}: {engines.get(a) or ARM_ENGINES.get(a, a)}" for a in arms]
    rw = r["reward_mean"]
    if rw.get(ref) == 0.0:   # as in the ratio lines: no ratio against a reference that earns nothing
        headline = f"; no reward ratio ({ref}'s mean reward is 0)"
    elif not all(map(math.isfinite, rw.get("ratio_ci95", [math.nan]))):
        headline = f"; reward ratio {r.get('headline')}/{ref} {fmt(rw.get('ratio'))} (too few steps for an interval)"
    else:
        headline = (f"; reward ratio {r.get('headline')}/{ref} {fmt(rw.get('ratio'))}, 95% CI "
                    f"[{', '.join(fmt(x) for x in rw.get('ratio_ci95', [math.nan, math.nan]))}] "
                    "(per-step means as samples, all steps)")
    lines += ["",
              f"{r['n_steps']} steps per arm; ratios against `{ref}` over {_steps_text(r['measured_steps'])} "
              "(step 0 = warm-up + tik audit, excluded when there are >= 2 steps; so is a step recorded "
              "under torch.profiler).", "",
              *_ratio_lines(r),
              "- generated tokens/s: " + ", ".join(f"{a} {fmt(r['tokens_per_s'][a], 1)}" for a in arms),
              "- mean training reward: " + ", ".join(
                  f"{a} {fmt(rw.get(a))}" + (f" (+- {fmt(rw[f'se_{a}'])} s.e.)"
                                             if math.isfinite(rw.get(f"se_{a}", math.nan)) else "")
                  for a in arms) + headline]
    for a, k in (r.get("skip") or {}).items():
        lines.append(f"- {a}: recompute skipped on {k['steps_skipped']}/{r['n_steps']} steps, {k['audits']} audits, "
                     f"{k['audit_mismatch_tokens']}/{k['audit_tokens']} audited tokens mismatching (max |diff| "
                     f"{k['audit_max_abs_diff']:.3g}); reasons recompute ran: "
                     f"{', '.join(k['skip_reasons']) or 'none (audit only)'}")
        if k.get("seq_skip_frac") is not None and not math.isnan(k["seq_skip_frac"]):
            lines.append(f"- {a}: sequences skipped {fmt(100 * k['seq_skip_frac'], 1)}%, generated tokens skipped "
                         f"{fmt(100 * k['token_skip_frac'], 1)}% (all {r['n_steps']} steps, audits included); "
                         f"recomputed: {k['seqs_stale_version']} stale, {k['seqs_mixed_versions']} mixed-version "
                         f"sequences; recompute time saved (estimate) {fmt(k['recompute_saved_s'], 2)} s")
    for a, c in (r.get("rollout_vs_recompute") or {}).items():
        lines.append(f"- {a} rollout vs recompute log-probs: {c['mismatch_tokens']}/{c['tokens']} tokens differ "
                     f"(max |diff| {c['max_abs_diff']:.3g})")
    lines.append("- limiting phase (the phase with the largest mean time per measured step: what to speed up first): "
                 + ", ".join(f"{a} {r['limiting_phase'][a]}" for a in arms))
    ceiling = skip_ceiling(r)
    if ceiling is not None:
        share, bound = ceiling
        lines.append(f"- what a skip can give here: {ref}'s recompute is {fmt(100 * share, 1)}% of its step, so skipping "
                     f"all of it, and nothing else, gives at most {fmt(bound, 3)}x over {ref}")
    for a in arms:
        if a not in (r.get("skip") or {}):
            att = sorted({x["default_attention"] for x in r["rows"][a] if x.get("default_attention")})
            lines.append(f"- {a} packed attention (train + recompute forward): {', '.join(att) or 'not recorded'}")
    crit = has_critic(r)
    lines += ["", f"## Mean seconds per measured step ({_steps_text(r['measured_steps'])})", "",
              "| arm | rollout | recompute | train step | weight update (trainer's save) |"
              + (" critic |" if crit else "") + " other | step |",
              "|---|---|---|---|---|---|---|" + ("---|" if crit else "")]
    for a in arms:
        p = r["phase_mean_s"][a]
        lines.append(f"| {a} | {fmt(p['rollout'])} | {fmt(p['recompute'])} | {fmt(p['train_step'])} | "
                     f"{fmt(p['weight_update'])} ({fmt(p.get('weight_save'))}) |"
                     + (f" {fmt(p['critic'])} |" if crit else "")
                     + f" {fmt(p['other'])} | {fmt(p['wall_s'])} |")
    srv_iv = {a: (meta.get("server_intervals") or {}).get(a, []) for a in arms}
    lines += ["", "## Per step", "",
              "| arm | step | step s | rollout | recompute | recompute fwd | train | weights | gen tok | tok/s | "
              "reward | skipped | audit mism | JIT compiles (trainer / server) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        for i, x in enumerate(r["rows"][a]):
            iv = srv_iv[a][i] if i < len(srv_iv[a]) else {}
            srv_jit = f"{iv['jit_compiles']} ({fmt(iv.get('jit_compile_s'), 1)} s)" \
                if iv.get("jit_compiles") is not None else "-"
            own_jit = f"{x['jit_compiles']} ({fmt(x.get('jit_compile_s', 0.0), 1)} s)" \
                if x.get("jit_compiles") is not None else "-"
            tag = " (profiled)" if x.get("profiled") else " (warm-up)" if x["step"] not in r["measured_steps"] else ""
            lines.append(f"| {a} | {x['step']}{tag} | {fmt(x['wall_s'])} | "
                         f"{fmt(x['rollout'])} | {fmt(x['recompute'])} | "
                         f"{fmt(x['recompute_forward_s'])} | {fmt(x['train_step'])} | {fmt(x['weight_update'])} | "
                         f"{x['gen_tokens']} | {fmt(x['tokens_per_s'], 1)} | {fmt(x['reward'])} | "
                         f"{'yes' if x['recompute_skipped'] else 'no'} | "
                         f"{x['audit_mismatch_tokens'] if x['audit'] else '-'} | "
                         f"{own_jit} / {srv_jit} |")
    walls = meta.get("arm_wall_s") or {}
    outside = []
    for a in arms:   # process start-up (AReaL init, rollout server, model) + teardown: what device calls pay
        w = walls.get(a)
        if isinstance(w, (int, float)):
            in_steps = sum(x["wall_s"] for x in r["rows"][a])
            outside.append(f"{a} {fmt(w, 1)} s, of which {fmt(w - in_steps, 1)} s outside the logged steps")
    if outside:
        lines += ["", "Arm wall time (whole process): " + "; ".join(outside) + "."]
    killed = [a for a, k in (meta.get("teardown_killed") or {}).items() if k]
    if killed:
        lines += ["", f"The {', '.join(killed)} process(es) logged every step but did not exit within the grace "
                      "period and were killed during teardown (their steps are complete)."]
    srv = []
    for a in arms:   # the rollout server's view of each step's rollout (intervals between weight updates)
        iv = [x for x in (meta.get("server_intervals") or {}).get(a, [])[1:] if x.get("requests")]
        if iv:
            busy = statistics.fmean(x["engine_busy_s"] for x in iv)
            span = statistics.fmean(x["first_request_to_last_finish_s"] or 0.0 for x in iv)
            txt = (f"{a}: engine stepping {fmt(busy, 2)} s of a {fmt(span, 2)} s first-request-to-last-finish "
                   f"window ({len(iv)} steps)")
            if all("eager_s" in x for x in iv):
                txt += (f", of it eager steps (prefill, run without a CUDA graph) {fmt(statistics.fmean(x['eager_s'] for x in iv), 2)} s, "
                        f"slowest step {fmt(max(x['max_step_ms'] for x in iv), 1)} ms, "
                        f"{sum(x['graphs_captured'] for x in iv)} graph captures and "
                        f"{sum(x['jit_compiles'] or 0 for x in iv)} Triton compiles in all")
            srv.append(txt)
    if srv:
        lines += ["", "Rollout server, mean per step after the first: " + "; ".join(srv) + "."]
    cmds = meta.get("cmds") or {a: meta.get(f"cmd_{a}") for a in arms if meta.get(f"cmd_{a}")}
    lines += ["", "## How to read this", "",
              "- A step is one GRPO/PPO step of AReaL's trainer: rollout (generate the batch), recompute (the "
              "old-policy log-prob forward; tik skips it when the skip rule holds), train step (the policy "
              "update), weight update (new weights to the rollout server), other (everything between).",
              "- Step throughput ratio = reference step time / arm step time, summed over the measured steps: "
              "above 1 the arm is faster. Its 95% interval comes from the step-to-step spread of both arms.",
              "- Recompute column = AReaL's `timeperf/recompute_logp` timer (in an arm that may skip it holds "
              "the skip decision: server query + weight digest); `recompute fwd` = time in the actual forward.",
              "- audit mism = tokens whose rollout and recomputed log-probs differ on an audited step (tik: 0).",
              "", "Commands: " + " / ".join(f"`{' '.join(c)}`" for c in cmds.values()), ""]
    return "\n".join(lines)


def write_report(report: dict, out: str, meta: dict) -> dict:
    os.makedirs(out, exist_ok=True)
    meta.setdefault("machine", machine_label(meta))   # where the report is written: the arms' machine
    meta.setdefault("cores", len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"meta": meta, **report}, f, indent=2, default=str)
    cols = ["step", "wall_s", "rollout", "recompute", "recompute_forward_s", "train_step", "weight_update", "critic",
            "other", "gen_tokens", "tokens_per_s", "reward", "recompute_skipped", "audit", "audit_tokens",
            "audit_mismatch_tokens", "audit_max_abs_diff", "compare_tokens", "compare_mismatch_tokens",
            "jit_compiles", "jit_compile_s", "profiled"]
    with open(os.path.join(out, "steps.csv"), "w") as f:
        f.write("arm," + ",".join(cols) + "\n")
        for a in arms_of(report):
            for r in report["rows"][a]:
                f.write(a + "," + ",".join(str(r[c]) for c in cols) + "\n")
    md = summary_markdown(report, meta)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    pngs = plot(report, out, meta)
    return {"summary": md, "files": ["report.json", "steps.csv", "summary.md", *map(os.path.basename, pngs)]}
