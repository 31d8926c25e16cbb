"""End-to-end throughput A/B: the recompute baseline against tik, same recipe, seed and data.

Each arm is one ``python -m areal_tik.areal.train`` process (AReaL's real trainer):

- ``baseline``: ``actor.kernel_backend=default`` (recompute runs every step);
- ``tik``: ``actor.kernel_backend=tik`` (recompute skipped when docs/design.md, "The skip rule"
  allows, audits on step 0 and every ``actor.tik.audit_interval`` steps).

The trainer appends one JSON line per step (``--step-log``): AReaL's committed stats
(``timeperf/rollout``, ``timeperf/recompute_logp``, ``timeperf/train_step``,
``timeperf/update_weights`` ...), the wall time between step commits, and the actor's
per-batch record (tokens, reward, skip decision, audit / comparison counts).

:func:`analyze` turns both logs into the report; :func:`write_report` writes
``report.json``, ``steps.csv``, ``summary.md``, ``step_time.png`` and ``reward.png``.
Step 0 carries warm-up (and the tik audit); ratios are taken over steps >= 1 when
there are at least two steps, and each ratio can be recomputed from the logged times.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

ARMS = ("baseline", "tik")
PHASES = (("rollout", "timeperf/rollout"), ("recompute", "timeperf/recompute_logp"),
          ("train_step", "timeperf/train_step"), ("weight_update", "timeperf/update_weights"),
          # PPO only (0 without a critic): the value forward before, and the critic update after, the actor's
          ("critic", ("timeperf/critic_values", "timeperf/critic_train_step")))
REPORT_FILES = ("report.json", "steps.csv", "summary.md", "step_time.png", "reward.png")
ARM_OVERRIDES = {"baseline": ["actor.kernel_backend=default"], "tik": ["actor.kernel_backend=tik"]}

__all__ = ["run_arm", "run_ab", "load_steps", "analyze", "write_report", "ARMS", "PHASES"]


def load_steps(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _runs_dir(out: str, runs_dir: str | None) -> str:
    return os.path.abspath(runs_dir) if runs_dir else os.path.join(os.path.abspath(out), "runs")


def _arm_cmd(config: str, arm: str, steps: int, out: str, overrides: list[str], runs_dir: str | None = None) -> list[str]:
    return [sys.executable, "-m", "areal_tik.areal.train", "--config", os.path.abspath(config),
            *ARM_OVERRIDES[arm], f"total_train_steps={steps}", f"trial_name={arm}",
            f"cluster.fileroot={_runs_dir(out, runs_dir)}",
            "--step-log", os.path.join(os.path.abspath(out), arm, "steps.jsonl"), *overrides]


def _copy_server_log(out: str, arm: str, runs_dir: str | None) -> None:
    """``<fileroot>/<experiment>/<arm>/tik_server.log`` -> ``<out>/<arm>/tik_server.log`` (the runs
    dir may live outside the report dir, e.g. off a device's small result folder)."""
    import shutil
    for p in _server_logs(out, arm, runs_dir):
        try:
            shutil.copyfile(p, os.path.join(out, arm, "tik_server.log"))
        except OSError:
            pass


SERVER_FATAL = ("engine.step failed",)  # a server that logs this answers every /generate with 500 from then on


def _server_logs(out: str, arm: str, runs_dir: str | None) -> dict[str, int]:
    """The arm's rollout server logs now and their sizes (the server appends: a log from an
    earlier run in the same runs dir must not count against this one)."""
    import glob
    sizes = {}
    for p in glob.glob(os.path.join(_runs_dir(out, runs_dir), "*", arm, "tik_server.log")):
        try:
            sizes[p] = os.path.getsize(p)
        except OSError:
            pass
    return sizes


def _server_failure(out: str, arm: str, runs_dir: str | None, offsets: dict[str, int]) -> str | None:
    """The first fatal line the arm's rollout server logged past ``offsets`` (per log: bytes
    already scanned, or there before this run), if any; ``offsets`` advances to the last whole
    line read, so each poll reads only what is new (AReaL's client retries failed generations
    until the arm's timeout, so without this check a broken server costs the whole budget)."""
    for p in _server_logs(out, arm, runs_dir):
        try:
            with open(p, "rb") as f:
                f.seek(offsets.get(p, 0))
                data = f.read()
        except OSError:
            continue
        lines = data.decode(errors="replace").splitlines(keepends=True)
        for i, line in enumerate(lines):
            if any(k in line for k in SERVER_FATAL):
                return "".join(lines[i:i + 60])
        offsets[p] = offsets.get(p, 0) + data.rfind(b"\n") + 1  # a partly written last line is read again
    return None


def run_arm(config: str, arm: str, steps: int, out: str, overrides: list[str] = (), on_step=None,
            timeout: float | None = None, env: dict | None = None, runs_dir: str | None = None,
            partial_ok: bool = False, teardown_grace_s: float = 30.0) -> dict:
    """Run one arm to completion; ``on_step(arm, n_done)`` after every logged step.

    ``timeout``: seconds before the arm is killed; then ``TimeoutError``, or with ``partial_ok``
    the steps logged so far are returned with ``timed_out: True`` (a device call has a hard
    wall-clock limit: a partial A/B beats none). ``runs_dir``: AReaL's ``cluster.fileroot``
    (model dirs, checkpoints; default ``<out>/runs``). Once all ``steps`` are logged the process
    gets ``teardown_grace_s`` to exit, then it is killed and the arm counts as complete
    (``teardown_killed``): on 2x H200 with xccl both trainers hung ~2 min after their last step."""
    os.makedirs(os.path.join(out, arm), exist_ok=True)
    log = os.path.join(out, arm, "steps.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = _arm_cmd(config, arm, steps, out, list(overrides), runs_dir)
    run_env = {k: v for k, v in os.environ.items() if k not in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT")}
    run_env.update(env or {})
    t0 = time.perf_counter()
    timed_out = teardown_killed = False
    server_failure = None
    scanned = _server_logs(out, arm, runs_dir)  # what earlier runs appended is not this run's failure
    t_all_logged = None
    with open(os.path.join(out, arm, "train.log"), "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
        seen = 0
        polls = 0
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                n = sum(1 for _ in open(log)) if os.path.exists(log) else 0
                if n != seen and on_step:
                    on_step(arm, n)
                seen = n
                if n >= steps:
                    t_all_logged = t_all_logged or time.perf_counter()
                    if time.perf_counter() - t_all_logged > teardown_grace_s:
                        teardown_killed = True
                        break
                if timeout is not None and time.perf_counter() - t0 > timeout:
                    timed_out = n < steps
                    teardown_killed = not timed_out
                    break
                polls += 1
                if polls % 10 == 0 and (server_failure := _server_failure(out, arm, runs_dir, scanned)):
                    break
        finally:
            if proc.poll() is None:  # timeout or interrupt: the trainer and its rollout server (same group)
                import signal
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
                proc.wait()
    _copy_server_log(out, arm, runs_dir)
    rows = load_steps(log) if os.path.exists(log) else []
    if server_failure:
        raise RuntimeError(f"{arm} arm stopped: its rollout server failed (see {out}/{arm}/tik_server.log):\n"
                           f"{server_failure}")
    if timed_out:
        if not partial_ok:
            raise TimeoutError(f"{arm} arm ran past {timeout}s; see {out}/{arm}/train.log")
    elif proc.returncode != 0 and not teardown_killed:
        tail = open(os.path.join(out, arm, "train.log"), errors="replace").read()[-3000:]
        raise RuntimeError(f"{arm} arm failed (exit {proc.returncode}); log tail:\n{tail}")
    if on_step:
        on_step(arm, len(rows))
    return {"cmd": cmd, "wall_s": time.perf_counter() - t0, "steps": rows, "timed_out": timed_out,
            "teardown_killed": teardown_killed}


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


def _has_critic(report: dict) -> bool:
    return any(r.get("critic", 0.0) > 0 for a in ARMS for r in report["rows"][a])


def _fmt(x, nd=3):
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def summary_markdown(report: dict, meta: dict) -> str:
    r = report
    lines = [f"# areal-tik A/B: {meta.get('config')}", ""]
    cut = [a for a, t in (meta.get("timed_out") or {}).items() if t]
    if cut:
        lines += [f"**PARTIAL: {', '.join(cut)} arm(s) stopped at the per-arm timeout; "
                  f"{r['n_steps']} of {meta.get('steps')} requested steps compared.**", ""]
    lines += [
             f"{r['n_steps']} steps per arm; ratios over steps {r['measured_steps']} "
             "(step 0 = warm-up + tik audit, excluded when there are >= 2 steps; so is a step recorded "
             "under torch.profiler).", "",
             f"- **step throughput tik/baseline: {_fmt(r['throughput_ratio_total'])}x** "
             f"(sum of baseline step times / sum of tik step times); per-step ratio mean "
             f"{_fmt(r['step_time_ratio']['mean'])}, min {_fmt(r['step_time_ratio']['min'])}, "
             f"max {_fmt(r['step_time_ratio']['max'])}, std {_fmt(r['step_time_ratio']['std'])}",
             f"- generated tokens/s: baseline {_fmt(r['tokens_per_s']['baseline'], 1)}, "
             f"tik {_fmt(r['tokens_per_s']['tik'], 1)} (ratio {_fmt(r['tokens_per_s_ratio'])})",
             f"- mean training reward: baseline {_fmt(r['reward_mean']['baseline'])} "
             f"(+- {_fmt(r['reward_mean'].get('se_baseline'))} s.e.), tik {_fmt(r['reward_mean']['tik'])} "
             f"(+- {_fmt(r['reward_mean'].get('se_tik'))}); ratio {_fmt(r['reward_mean']['ratio'])}, "
             f"95% CI [{', '.join(_fmt(x) for x in r['reward_mean'].get('ratio_ci95', [math.nan, math.nan]))}] "
             f"(per-step means as samples, all steps)",
             f"- tik: recompute skipped on {r['tik']['steps_skipped']}/{r['n_steps']} steps, "
             f"{r['tik']['audits']} audits, {r['tik']['audit_mismatch_tokens']}/{r['tik']['audit_tokens']} "
             f"audited tokens mismatching (max |diff| {r['tik']['audit_max_abs_diff']:.3g}); "
             f"reasons recompute ran: {', '.join(r['tik']['skip_reasons']) or 'none (audit only)'}",
             f"- baseline rollout vs recompute log-probs: {r['baseline_rollout_vs_recompute']['mismatch_tokens']}/"
             f"{r['baseline_rollout_vs_recompute']['tokens']} tokens differ "
             f"(max |diff| {r['baseline_rollout_vs_recompute']['max_abs_diff']:.3g})",
             f"- limiting phase: baseline {r['limiting_phase']['baseline']}, tik {r['limiting_phase']['tik']}",
             f"- baseline packed attention (train + recompute forward): "
             f"{', '.join(sorted({x['default_attention'] for x in r['rows']['baseline'] if x.get('default_attention')})) or 'not recorded'}",
             "",
             "## Mean seconds per measured step", "",
             "| arm | rollout | recompute | train step | weight update |" + (" critic |" if _has_critic(r) else "")
             + " other | step |",
             "|---|---|---|---|---|---|---|" + ("---|" if _has_critic(r) else "")]
    for a in ARMS:
        p = r["phase_mean_s"][a]
        lines.append(f"| {a} | {_fmt(p['rollout'])} | {_fmt(p['recompute'])} | {_fmt(p['train_step'])} | "
                     f"{_fmt(p['weight_update'])} |" + (f" {_fmt(p['critic'])} |" if _has_critic(r) else "")
                     + f" {_fmt(p['other'])} | {_fmt(p['wall_s'])} |")
    srv_iv = {a: (meta.get("server_intervals") or {}).get(a, []) for a in ARMS}
    lines += ["", "## Per step", "",
              "| arm | step | step s | rollout | recompute | recompute fwd | train | weights | gen tok | tok/s | "
              "reward | skipped | audit mism | JIT compiles (trainer / server) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in ARMS:
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
    for a in ARMS:   # process start-up (AReaL init, rollout server, model) + teardown: what device calls pay
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
    for a in ARMS:   # the rollout server's view of each step's rollout (intervals between weight updates)
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
    lines += ["", "Recompute column = AReaL's `timeperf/recompute_logp` timer (in the tik arm it holds the "
              "skip decision: server query + weight digest); `recompute fwd` = time in the actual forward.",
              "", f"Commands: `{' '.join(meta.get('cmd_baseline', []))}` / `{' '.join(meta.get('cmd_tik', []))}`", ""]
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = dict(zip([p for p, _ in PHASES] + ["other"], ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3",
                                                          "#8c8c8c"]))
    names = [p for p in colors if p != "critic" or _has_critic(report)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for k, a in enumerate(ARMS):
        rows = report["rows"][a]
        xs = [r["step"] + (k - 0.5) * width for r in rows]
        bottom = [0.0] * len(rows)
        for name in names:
            c = colors[name]
            vals = [max(0.0, r[name]) for r in rows]
            ax.bar(xs, vals, width, bottom=bottom, color=c, edgecolor="black" if a == "tik" else None,
                   hatch="//" if a == "tik" else None, label=name if k == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step (left bar: baseline, hatched: tik)")
    ax.set_ylabel("seconds")
    ax.set_title(f"step time by phase (throughput ratio {_fmt(report['throughput_ratio_total'])}x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(out, "step_time.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for a, c in zip(ARMS, ("#4c72b0", "#dd8452")):
        rows = report["rows"][a]
        ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], marker="o", label=a, color=c)
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
        for a in ARMS:
            for r in report["rows"][a]:
                f.write(a + "," + ",".join(str(r[c]) for c in cols) + "\n")
    md = summary_markdown(report, meta)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    pngs = plot(report, out)
    return {"summary": md, "files": ["report.json", "steps.csv", "summary.md", *map(os.path.basename, pngs)]}


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


def _arm_record_path(out: str, arm: str) -> str:
    return os.path.join(out, arm, "arm.json")


def _write_arm_record(out: str, arm: str, rec: dict) -> None:
    os.makedirs(os.path.join(out, arm), exist_ok=True)
    with open(_arm_record_path(out, arm), "w") as f:
        json.dump(rec, f, indent=2)


def _shared(config: str, overrides) -> dict:
    """What both arms of one A/B must share: the recipe and the overrides given to both."""
    return {"config": os.path.abspath(config), "overrides": list(overrides)}


def load_arm(out: str, arm: str) -> dict | None:
    """An arm run by an earlier ``run_ab(arms=...)`` call: its record and step log, or None.

    The record is written when the arm starts (``complete: false``) and rewritten when it
    ends, so an arm whose process or device call was killed still loads, as a partial
    (timed-out) arm with the steps it logged."""
    rec, log = _arm_record_path(out, arm), os.path.join(out, arm, "steps.jsonl")
    if not os.path.exists(rec):
        return None
    with open(rec) as f:
        res = json.load(f)
    res["steps"] = load_steps(log) if os.path.exists(log) else []
    if not res.get("complete", True):
        res["timed_out"] = True
    return res


def run_ab(config: str, steps: int, out: str, overrides: list[str] = (), progress: bool = True,
           timeout: float | None = None, runs_dir: str | None = None, partial_ok: bool = False,
           arms: tuple[str, ...] = ARMS) -> dict:
    """Run the ``arms`` (baseline first), analyze, write the report directory; return the report.

    ``arms`` may name one arm (or none): the other arm's results are then read from ``out``
    (``<arm>/arm.json`` + ``<arm>/steps.jsonl``, written by an earlier call), so the two arms can
    run in separate processes or device calls. While an arm is still missing, nothing is analyzed
    and the return value says which (``{"pending": [...]}``). Arms are only paired when they ran
    the same recipe with the same overrides (``ValueError`` otherwise, before anything runs), and
    an arm is not run against a loaded baseline that logged no step. Running the baseline alone
    starts a new pair: an earlier tik arm in ``out`` is no longer paired with it.

    With ``partial_ok`` an arm that runs past ``timeout`` keeps the steps it logged; when the
    baseline stopped early the tik arm is asked for the same number of steps (the report
    compares equal step counts anyway)."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    os.makedirs(out, exist_ok=True)
    to_run = [a for a in ARMS if a in arms]
    if to_run == ["baseline"] and os.path.exists(_arm_record_path(out, "tik")):
        os.remove(_arm_record_path(out, "tik"))  # a new baseline starts a new pair (the old tik logs stay)
    results = {a: r for a in ARMS if a not in arms and (r := load_arm(out, a)) is not None}
    here = _shared(config, overrides)
    for a, r in results.items():
        theirs = r.get("shared")
        if to_run and theirs is not None and theirs != here:
            raise ValueError(f"the {a} arm in {out} ran {theirs}, this call asks for {here}: start a new pair "
                             f"(run the baseline again or use another --out)")
        if to_run and not r["steps"]:
            raise RuntimeError(f"the {a} arm in {out} logged no step (see {out}/{a}/train.log); run it again first")

    def arm_steps(a):
        if a == "tik" and results.get("baseline", {}).get("timed_out"):
            return max(1, len(results["baseline"]["steps"]))
        return steps

    def one(a, on_step=None):
        n = arm_steps(a)
        _write_arm_record(out, a, {"cmd": _arm_cmd(config, a, n, out, list(overrides), runs_dir), "wall_s": None,
                                   "timed_out": None, "complete": False, "steps_requested": n, "shared": here})
        res = run_arm(config, a, n, out, overrides, on_step=on_step, timeout=timeout, runs_dir=runs_dir,
                      partial_ok=partial_ok)
        results[a] = res
        _write_arm_record(out, a, {"cmd": res["cmd"], "wall_s": res["wall_s"], "timed_out": res["timed_out"],
                                   "teardown_killed": res.get("teardown_killed", False),
                                   "complete": True, "steps_requested": n, "shared": here})

    if to_run:  # a report from an earlier pair no longer describes these arms
        for f in REPORT_FILES:
            if os.path.exists(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
    if progress and to_run:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                      TimeElapsedColumn()) as prog:
            tasks = {a: prog.add_task(f"{a:8s}", total=arm_steps(a)) for a in to_run}
            for a in to_run:
                prog.update(tasks[a], total=arm_steps(a))
                one(a, on_step=lambda arm, n: prog.update(tasks[arm], completed=n))
    else:
        for a in to_run:
            one(a)
    pending = [a for a in ARMS if a not in results]
    if pending:
        done = {a: len(r["steps"]) for a, r in results.items()}
        return {"pending": pending, "done": done, "files": [],
                "summary_md": f"arm(s) {', '.join(pending)} not run yet in {out}; done: "
                              + (", ".join(f"{a} ({n} steps)" for a, n in done.items()) or "none")}
    if not all(results[a]["steps"] for a in ARMS):
        raise RuntimeError(f"an arm logged no step (killed, failed or past its timeout); see {out}/<arm>/train.log: "
                           + ", ".join(f"{a}: {len(results[a]['steps'])} steps" for a in ARMS))
    pair = [results[a].get("shared") for a in ARMS]
    if None not in pair and pair[0] != pair[1]:
        raise ValueError(f"the arms in {out} ran different recipes/overrides: baseline {pair[0]}, tik {pair[1]}")
    report = analyze(results["baseline"]["steps"], results["tik"]["steps"])
    meta = {"config": config, "steps": steps, "overrides": list(overrides),
            "cmd_baseline": results["baseline"]["cmd"], "cmd_tik": results["tik"]["cmd"],
            "arm_wall_s": {a: results[a]["wall_s"] for a in ARMS},
            "timed_out": {a: results[a]["timed_out"] for a in ARMS},
            "teardown_killed": {a: bool(results[a].get("teardown_killed")) for a in ARMS},
            "arms_run_here": list(to_run),
            "server_intervals": {a: server_intervals(out, a) for a in ARMS}}
    try:
        from areal_tik.dispatch.fingerprint import compute
        meta["environment"] = compute()["environment"]
    except Exception:  # noqa: BLE001
        pass
    written = write_report(report, out, meta)
    report["summary_md"] = written["summary"]
    report["files"] = written["files"]
    return report
