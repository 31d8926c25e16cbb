"""The A/B report directory: ``report.json``, ``steps.csv``, ``summary.md`` (the markdown
summary of :func:`areal_tik.ab.analysis.analyze`'s report) and the figures ``step_time.png``
(step time by phase, every arm) and ``reward.png``."""
from __future__ import annotations

import json
import math
import os
import statistics

from areal_tik.ab.analysis import ARM_ENGINES, ARMS, PHASES

__all__ = ["REPORT_FILES", "summary_markdown", "plot", "write_report"]

REPORT_FILES = ("report.json", "steps.csv", "summary.md", "step_time.png", "reward.png")


def _arms(report: dict) -> list[str]:
    return list(report.get("arms") or [a for a in ARMS if a in report["rows"]])


def _has_critic(report: dict) -> bool:
    return any(r.get("critic", 0.0) > 0 for a in _arms(report) for r in report["rows"][a])


def _fmt(x, nd=3):
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _ratio_lines(r: dict) -> list[str]:
    ref = r.get("reference", "baseline")
    ref_reward = (r.get("reward_mean") or {}).get(ref)
    out = []
    for a, v in (r.get("vs_reference") or {}).items():
        st, ci = v["step_time_ratio"], v.get("reward_ratio_ci95", [math.nan, math.nan])
        if ref_reward == 0.0:   # a random preset earns nothing: there is no ratio to give
            reward = f"reward ratio: none ({ref}'s mean reward is 0)"
        else:
            reward = f"reward ratio {_fmt(v['reward_ratio'])}, 95% CI [{', '.join(_fmt(x) for x in ci)}]"
        out += [f"- **step throughput {a}/{ref}: {_fmt(v['throughput_ratio_total'])}x** "
                f"(sum of {ref} step times / sum of {a} step times); per-step ratio mean {_fmt(st['mean'])}, "
                f"min {_fmt(st['min'])}, max {_fmt(st['max'])}, std {_fmt(st['std'])}; generated tokens/s ratio "
                f"{_fmt(v['tokens_per_s_ratio'])}; {reward}"]
    return out


def summary_markdown(report: dict, meta: dict) -> str:
    r = report
    arms = _arms(r)
    ref = r.get("reference", arms[0])
    lines = [f"# areal-tik A/B: {meta.get('config')}", ""]
    cut = [a for a, t in (meta.get("timed_out") or {}).items() if t]
    if cut:
        lines += [f"**PARTIAL: {', '.join(cut)} arm(s) stopped at the per-arm timeout; "
                  f"{r['n_steps']} of {meta.get('steps')} requested steps compared.**", ""]
    engines = meta.get("engines") or {}
    lines += ["Arms (rollout engine):", ""]
    lines += [f"- `{a}`{' (reference)' if a == ref else ''}: {engines.get(a) or ARM_ENGINES.get(a, a)}" for a in arms]
    rw = r["reward_mean"]
    if rw.get(ref) == 0.0:   # as in the ratio lines: no ratio against a reference that earns nothing
        headline = f"; no headline ratio ({ref}'s mean reward is 0)"
    else:
        headline = (f"; headline ratio {_fmt(rw.get('ratio'))}, 95% CI "
                    f"[{', '.join(_fmt(x) for x in rw.get('ratio_ci95', [math.nan, math.nan]))}] "
                    "(per-step means as samples, all steps)")
    lines += ["",
              f"{r['n_steps']} steps per arm; ratios against `{ref}` over steps {r['measured_steps']} "
              "(step 0 = warm-up + tik audit, excluded when there are >= 2 steps; so is a step recorded "
              "under torch.profiler).", "",
              *_ratio_lines(r),
              "- generated tokens/s: " + ", ".join(f"{a} {_fmt(r['tokens_per_s'][a], 1)}" for a in arms),
              "- mean training reward: " + ", ".join(
                  f"{a} {_fmt(rw.get(a))}" + (f" (+- {_fmt(rw[f'se_{a}'])} s.e.)" if f"se_{a}" in rw else "")
                  for a in arms) + headline]
    for a, k in (r.get("skip") or {}).items():
        lines.append(f"- {a}: recompute skipped on {k['steps_skipped']}/{r['n_steps']} steps, {k['audits']} audits, "
                     f"{k['audit_mismatch_tokens']}/{k['audit_tokens']} audited tokens mismatching (max |diff| "
                     f"{k['audit_max_abs_diff']:.3g}); reasons recompute ran: "
                     f"{', '.join(k['skip_reasons']) or 'none (audit only)'}")
        if k.get("seq_skip_frac") is not None and not math.isnan(k["seq_skip_frac"]):
            lines.append(f"- {a}: sequences skipped {_fmt(100 * k['seq_skip_frac'], 1)}%, generated tokens skipped "
                         f"{_fmt(100 * k['token_skip_frac'], 1)}% (all {r['n_steps']} steps, audits included); "
                         f"recomputed: {k['seqs_stale_version']} stale, {k['seqs_mixed_versions']} mixed-version "
                         f"sequences; recompute time saved (estimate) {_fmt(k['recompute_saved_s'], 2)} s")
    for a, c in (r.get("rollout_vs_recompute") or {}).items():
        lines.append(f"- {a} rollout vs recompute log-probs: {c['mismatch_tokens']}/{c['tokens']} tokens differ "
                     f"(max |diff| {c['max_abs_diff']:.3g})")
    lines.append("- limiting phase: " + ", ".join(f"{a} {r['limiting_phase'][a]}" for a in arms))
    for a in arms:
        if a not in (r.get("skip") or {}):
            att = sorted({x["default_attention"] for x in r["rows"][a] if x.get("default_attention")})
            lines.append(f"- {a} packed attention (train + recompute forward): {', '.join(att) or 'not recorded'}")
    crit = _has_critic(r)
    lines += ["", "## Mean seconds per measured step", "",
              "| arm | rollout | recompute | train step | weight update (trainer's save) |"
              + (" critic |" if crit else "") + " other | step |",
              "|---|---|---|---|---|---|---|" + ("---|" if crit else "")]
    for a in arms:
        p = r["phase_mean_s"][a]
        lines.append(f"| {a} | {_fmt(p['rollout'])} | {_fmt(p['recompute'])} | {_fmt(p['train_step'])} | "
                     f"{_fmt(p['weight_update'])} ({_fmt(p.get('weight_save'))}) |"
                     + (f" {_fmt(p['critic'])} |" if crit else "")
                     + f" {_fmt(p['other'])} | {_fmt(p['wall_s'])} |")
    srv_iv = {a: (meta.get("server_intervals") or {}).get(a, []) for a in arms}
    lines += ["", "## Per step", "",
              "| arm | step | step s | rollout | recompute | recompute fwd | train | weights | gen tok | tok/s | "
              "reward | skipped | audit mism | JIT compiles (trainer / server) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        for i, x in enumerate(r["rows"][a]):
            iv = srv_iv[a][i] if i < len(srv_iv[a]) else {}
            srv_jit = f"{iv['jit_compiles']} ({_fmt(iv.get('jit_compile_s'), 1)} s)" \
                if iv.get("jit_compiles") is not None else "-"
            own_jit = f"{x['jit_compiles']} ({_fmt(x.get('jit_compile_s', 0.0), 1)} s)" \
                if x.get("jit_compiles") is not None else "-"
            lines.append(f"| {a} | {x['step']}{' (profiled)' if x.get('profiled') else ''} | {_fmt(x['wall_s'])} | "
                         f"{_fmt(x['rollout'])} | {_fmt(x['recompute'])} | "
                         f"{_fmt(x['recompute_forward_s'])} | {_fmt(x['train_step'])} | {_fmt(x['weight_update'])} | "
                         f"{x['gen_tokens']} | {_fmt(x['tokens_per_s'], 1)} | {_fmt(x['reward'])} | "
                         f"{'yes' if x['recompute_skipped'] else 'no'} | "
                         f"{x['audit_mismatch_tokens'] if x['audit'] else '-'} | "
                         f"{own_jit} / {srv_jit} |")
    walls = meta.get("arm_wall_s") or {}
    outside = []
    for a in arms:   # process start-up (AReaL init, rollout server, model) + teardown: what device calls pay
        w = walls.get(a)
        if isinstance(w, (int, float)):
            in_steps = sum(x["wall_s"] for x in r["rows"][a])
            outside.append(f"{a} {_fmt(w, 1)} s, of which {_fmt(w - in_steps, 1)} s outside the logged steps")
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
            txt = (f"{a}: engine stepping {_fmt(busy, 2)} s of a {_fmt(span, 2)} s first-request-to-last-finish "
                   f"window ({len(iv)} steps)")
            if all("eager_s" in x for x in iv):
                txt += (f", of it eager steps (prefill) {_fmt(statistics.fmean(x['eager_s'] for x in iv), 2)} s, "
                        f"slowest step {_fmt(max(x['max_step_ms'] for x in iv), 1)} ms, "
                        f"{sum(x['graphs_captured'] for x in iv)} graph captures and "
                        f"{sum(x['jit_compiles'] or 0 for x in iv)} Triton compiles in all")
            srv.append(txt)
    if srv:
        lines += ["", "Rollout server, mean per step after the first: " + "; ".join(srv) + "."]
    cmds = meta.get("cmds") or {a: meta.get(f"cmd_{a}") for a in arms if meta.get(f"cmd_{a}")}
    lines += ["", "Recompute column = AReaL's `timeperf/recompute_logp` timer (in an arm that may skip it holds "
              "the skip decision: server query + weight digest); `recompute fwd` = time in the actual forward.",
              "", "Commands: " + " / ".join(f"`{' '.join(c)}`" for c in cmds.values()), ""]
    return "\n".join(lines)


_ARM_COLORS = {"vllm": "#4c72b0", "vllm_loglinear": "#8172b3", "baseline": "#8c8c8c", "tik": "#dd8452",
               "vllm_tik": "#55a868"}


def plot(report: dict, out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = _arms(report)
    paths = []
    colors = dict(zip([p for p, _ in PHASES] + ["other"], ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3",
                                                          "#8c8c8c"]))
    names = [p for p in colors if p != "critic" or _has_critic(report)]
    hatches = {a: h for a, h in zip(arms, ("", "//", "..", "xx", "--"))}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for k, a in enumerate(arms):
        rows = report["rows"][a]
        xs = [r["step"] + (k - (len(arms) - 1) / 2) * width for r in rows]
        bottom = [0.0] * len(rows)
        for name in names:
            c = colors[name]
            vals = [max(0.0, r[name]) for r in rows]
            ax.bar(xs, vals, width, bottom=bottom, color=c, edgecolor="black" if hatches[a] else None,
                   hatch=hatches[a] or None, label=name if k == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step (bars left to right: " + ", ".join(f"{a}{' ' + hatches[a] if hatches[a] else ''}"
                                                            for a in arms) + ")")
    ax.set_ylabel("seconds")
    ax.set_title(f"step time by phase ({report.get('headline')}/{report.get('reference')} throughput "
                 f"{_fmt(report['throughput_ratio_total'])}x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(out, "step_time.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for a in arms:
        rows = report["rows"][a]
        ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], marker="o", label=a,
                color=_ARM_COLORS.get(a))
    ax.set_xlabel("step")
    ax.set_ylabel("mean training reward")
    ax.legend()
    fig.tight_layout()
    p = os.path.join(out, "reward.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths


def write_report(report: dict, out: str, meta: dict) -> dict:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"meta": meta, **report}, f, indent=2, default=str)
    cols = ["step", "wall_s", "rollout", "recompute", "recompute_forward_s", "train_step", "weight_update", "critic",
            "other", "gen_tokens", "tokens_per_s", "reward", "recompute_skipped", "audit", "audit_tokens",
            "audit_mismatch_tokens", "audit_max_abs_diff", "compare_tokens", "compare_mismatch_tokens",
            "jit_compiles", "jit_compile_s", "profiled"]
    with open(os.path.join(out, "steps.csv"), "w") as f:
        f.write("arm," + ",".join(cols) + "\n")
        for a in _arms(report):
            for r in report["rows"][a]:
                f.write(a + "," + ",".join(str(r[c]) for c in cols) + "\n")
    md = summary_markdown(report, meta)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    pngs = plot(report, out)
    return {"summary": md, "files": ["report.json", "steps.csv", "summary.md", *map(os.path.basename, pngs)]}
