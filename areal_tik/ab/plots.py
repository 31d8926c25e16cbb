"""The A/B report's figures, each readable without the summary beside it.

``step_time.png``: left, the mean of the measured steps per arm, stacked by phase (one bar per arm, so
a run of one measured step reads as well as one of fifty); right, every step's time per arm, with
the warm-up step named and left out of the axis when it is not measured. ``reward.png``: the mean
training reward of each step per arm. Both titles name the workload and the machine; step axes
carry whole steps only.
"""
from __future__ import annotations

import math
import os
import textwrap

from areal_tik.ab.analysis import PHASES
from areal_tik.ab.describe import arms_of, fmt, has_critic, machine_label, workload_label

__all__ = ["plot", "step_time_figure", "reward_figure", "ARM_COLORS", "PHASE_COLORS"]

ARM_COLORS = {"vllm": "#4c72b0", "vllm_loglinear": "#8172b3", "baseline": "#7f7f7f", "tik": "#dd8452",
              "vllm_tik": "#55a868", "tik_ipc": "#c44e52", "vllm_tik_ipc": "#64b5cd"}
PHASE_COLORS = {"rollout": "#4c72b0", "recompute": "#dd8452", "train_step": "#55a868", "weight_update": "#c44e52",
                "critic": "#8172b3", "other": "#bbbbbb"}
_PHASE_NAMES = {"rollout": "rollout", "recompute": "recompute (log-prob forward)", "train_step": "train step",
                "weight_update": "weight update", "critic": "critic", "other": "other"}


def _pyplot():
    import matplotlib  # optional dependency (matplotlib): imported only on this path
    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt  # optional dependency (matplotlib): imported only on this path
    return plt


def _integer_steps(ax, steps: list[int]) -> None:
    """Ticks on whole steps: every step when there are few, else matplotlib's integer locator."""
    from matplotlib.ticker import MaxNLocator  # optional dependency (matplotlib): imported only on this path
    if steps and len(set(steps)) <= 16:
        ax.set_xticks(sorted(set(steps)))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps:
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)


def _title(what: str, report_meta: dict) -> str:
    """``what: <workload>`` and ``on <machine>``, wrapped to the figure's width."""
    meta = report_meta
    return "\n".join(textwrap.wrap(f"{what}: {workload_label(meta)} on {meta.get('machine') or machine_label(meta)}",
                                    width=100))


def _headline(report: dict) -> str:
    head, ref, n = report.get("headline"), report.get("reference"), report.get("n_measured", 0)
    if head is None:
        return "one arm"
    ratio = fmt(report.get("throughput_ratio_total"), 2)
    if report.get("smoke"):
        spread = "1 measured step, no spread" if n == 1 else f"{n} measured steps, too few for an interval"
        return f"smoke test ({spread}): {head}/{ref} {ratio}x is not a measurement"
    ci = report.get("throughput_ratio_ci95") or [math.nan, math.nan]
    return (f"{head}/{ref} step throughput {ratio}x, 95% CI [{fmt(ci[0], 2)}, {fmt(ci[1], 2)}], "
            f"{n} measured steps")


def step_time_figure(report: dict, meta: dict):
    """The step-time figure (a matplotlib Figure)."""
    plt = _pyplot()
    arms = arms_of(report)
    measured = report["measured_steps"]
    phases = [p for p, _ in PHASES if p != "critic" or has_critic(report)] + ["other"]
    fig, (ax_mean, ax_steps) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1, 1.5]})

    # left: mean of the measured steps, one stacked bar per arm
    for k, a in enumerate(arms):
        means = report["phase_mean_s"][a]
        bottom = 0.0
        for p in phases:
            v = max(0.0, means.get(p, 0.0))
            ax_mean.bar(k, v, 0.6, bottom=bottom, color=PHASE_COLORS[p], edgecolor="white", linewidth=0.5,
                        label=_PHASE_NAMES[p] if k == 0 else None)
            bottom += v
        ax_mean.annotate(f"{fmt(means['wall_s'], 2)} s", (k, bottom), ha="center", va="bottom", fontsize=9,
                         xytext=(0, 2), textcoords="offset points")
    ax_mean.set_xticks(range(len(arms)))
    ax_mean.set_xticklabels(arms)
    ax_mean.set_ylabel("seconds per step")
    where = f"step {measured[0]}" if len(measured) == 1 else f"{len(measured)} measured steps"
    ax_mean.set_title(f"mean by phase ({where})", fontsize=10)
    ax_mean.margins(y=0.15)
    ax_mean.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)

    # right: every step's time per arm; the warm-up step off the axis when it is not measured
    shown = sorted({r["step"] for a in arms for r in report["rows"][a]
                    if r["step"] in measured or not report.get("warmup_step_dropped")})
    top = 0.0
    for a in arms:
        pts = [(r["step"], r["wall_s"]) for r in report["rows"][a] if r["step"] in shown]
        ax_steps.plot([s for s, _ in pts], [w for _, w in pts], marker="o", color=ARM_COLORS.get(a), label=a)
        top = max([top, *(w for _, w in pts)])
    _integer_steps(ax_steps, shown)
    ax_steps.set_ylim(0, top * 1.15 if top > 0 else 1.0)   # room above the highest point
    ax_steps.set_xlabel("training step")
    ax_steps.set_ylabel("step time (s)")
    warm = {a: r["wall_s"] for a in arms for r in report["rows"][a] if r["step"] == 0}
    if report.get("warmup_step_dropped"):
        note = "step 0 (warm-up: " + ", ".join(f"{a} {fmt(w, 1)} s" for a, w in warm.items()) + ") not shown"
    else:
        note = "step 0 includes the warm-up"
    ax_steps.set_title(f"every step ({note})", fontsize=10)
    ax_steps.legend(fontsize=8, title="arm", title_fontsize=8, loc="lower right")
    ax_steps.grid(axis="y", alpha=0.3)

    fig.suptitle(_title("Step time", meta) + "\n" + _headline(report), fontsize=10)
    fig.tight_layout()
    return fig


def reward_figure(report: dict, meta: dict):
    """The reward figure (a matplotlib Figure)."""
    plt = _pyplot()
    arms = arms_of(report)
    fig, ax = plt.subplots(figsize=(9, 4.4))
    steps, values = [], []
    for a in arms:
        rows = report["rows"][a]
        xs, ys = [r["step"] for r in rows], [r["reward"] for r in rows]
        steps += xs
        values += [y for y in ys if not math.isnan(y)]
        ax.plot(xs, ys, marker="o", color=ARM_COLORS.get(a), label=a)
    _integer_steps(ax, steps)
    if values and 0.0 <= min(values) and max(values) <= 1.0:
        ax.set_ylim(-0.03, 1.03)   # a 0/1 reward (exact match): the whole scale
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward of the step's samples\n(1 = every sample earns the full reward)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, title="arm", title_fontsize=8)
    if values and max(values) == 0.0 == min(values):
        ax.text(0.5, 0.5, "every sample scored 0: the model never answers\n(an untrained preset: use a warm start)",
                transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#c44e52")
    fig.suptitle(_title("Training reward per step", meta), fontsize=10)
    fig.tight_layout()
    return fig


def plot(report: dict, out: str, meta: dict | None = None) -> list[str]:
    """Write ``step_time.png`` and ``reward.png`` into ``out``; their paths."""
    plt = _pyplot()
    meta = meta or {}
    paths = []
    for name, make in (("step_time.png", step_time_figure), ("reward.png", reward_figure)):
        fig = make(report, meta)
        p = os.path.join(out, name)
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths
