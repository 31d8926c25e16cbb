"""What the A/B summary and figures tell a reader: the number of measured steps, an interval only
when there is a spread to take it from (a smoke run says it is one), whole-step axes, and titles
naming the workload and the machine. Step logs are written the way the trainer writes them."""
import math
import random

import pytest

from areal_tik.ab import analysis, plots, report

CFG = "recipes/tiny.yaml"
META = {"config": CFG, "overrides": ["gconfig.max_new_tokens=6"], "environment": {"gpu": None},
        "machine": "CPU only (test CPU, 2 cores)"}


def _records(n_steps: int, step_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n_steps):
        w = 30.0 if i == 0 else step_s * (1.0 + 0.2 * rng.random())
        out.append({"global_step": i, "wall_s": w,
                    "stats": {"timeperf/rollout": 0.4 * w, "timeperf/recompute_logp": 0.2 * w,
                              "timeperf/train_step": 0.3 * w},
                    "tik": [{"gen_tokens": 64, "reward_mean": rng.random()}]})
    return out


def _report(n_steps: int, seed: int = 0) -> dict:
    return analysis.analyze({"baseline": _records(n_steps, 6.0, seed), "tik": _records(n_steps, 5.0, seed + 1)})


@pytest.mark.parametrize("n_steps", [1, 2])
def test_one_measured_step_prints_no_spread_figure(n_steps):
    """One measured step (steps=2: step 1; steps=1: step 0 alone) has no spread: the summary says so and
    prints no standard deviation, no interval and no standard error; the run is labelled a smoke test."""
    rep = _report(n_steps)
    assert rep["n_measured"] == 1 and rep["smoke"]
    md = report.summary_markdown(rep, META)
    head = md.split("## Mean seconds")[0]
    assert "**Smoke test (one measured step: no spread).**" in head
    assert "one measured step: no spread" in head.split("step throughput tik/baseline")[1]
    for spread_figure in ("std", "CI [", "s.e.", "+-"):
        assert spread_figure not in head, spread_figure
    assert math.isnan(rep["step_time_ratio"]["std"])


def test_two_measured_steps_are_a_smoke_test_without_a_throughput_interval():
    """Two measured steps (steps=3) have a spread but too little of one: the verdict and the ratio line both
    say so, and neither prints a throughput interval."""
    rep = _report(3)
    assert rep["n_measured"] == 2 and rep["smoke"]
    md = report.summary_markdown(rep, META)
    head = md.split("## Mean seconds")[0]
    assert "**Smoke test (2 measured steps: too few for an interval).**" in head
    line = next(x for x in head.splitlines() if x.startswith("- **step throughput tik/baseline"))
    assert "2 measured steps: too few for an interval; per-step ratios" in line
    assert "CI [" not in line.split("; generated tokens/s")[0]


def test_enough_measured_steps_give_an_interval_around_the_ratio():
    rep = _report(8)
    assert rep["n_measured"] == 7 and not rep["smoke"]
    lo, hi = rep["throughput_ratio_ci95"]
    assert lo < rep["throughput_ratio_total"] < hi
    md = report.summary_markdown(rep, META)
    assert f"**tik/baseline step throughput: {rep['throughput_ratio_total']:.2f}x, 95% CI [{lo:.2f}, {hi:.2f}]** " \
           "over 7 measured steps per arm (steps 1-7; step 0 is warm-up and not measured)." in md
    assert "Smoke test" not in md and "CPU only (test CPU, 2 cores)" in md and "says nothing about a GPU" in md


def test_interval_widens_with_the_spread_and_holds_the_ratio_of_means():
    """Recomputable: the ratio is mean(ref)/mean(arm), and noisier steps widen the interval."""
    ref, arm = [6.0, 6.2, 5.9, 6.1], [5.0, 5.1, 4.9, 5.2]
    lo, hi = analysis.ratio_of_means_ci(ref, arm)
    r = sum(ref) / sum(arm)
    assert lo < r < hi
    noisy_lo, noisy_hi = analysis.ratio_of_means_ci([6.0, 7.2, 4.9, 6.1], [5.0, 6.1, 3.9, 5.2])
    assert noisy_hi - noisy_lo > hi - lo
    assert all(math.isnan(x) for x in analysis.ratio_of_means_ci([6.0], [5.0]))


def _step_axes(fig):
    """The axes whose x axis counts training steps."""
    return [ax for ax in fig.axes if ax.get_xlabel() == "training step"]


@pytest.mark.parametrize("n_steps", [1, 2, 7, 40])
def test_plot_ticks_are_whole_steps(n_steps):
    rep = _report(n_steps)
    for make in (plots.step_time_figure, plots.reward_figure):
        fig = make(rep, META)
        axes = _step_axes(fig)
        assert axes, make.__name__
        for ax in axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), (make.__name__, ticks)
        title = fig._suptitle.get_text()
        assert "tiny-arith" in title and "CPU only (test CPU, 2 cores)" in title
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_step_time_figure_leaves_the_warm_up_off_its_axis_and_names_it():
    rep = _report(4)
    fig = plots.step_time_figure(rep, META)
    (ax,) = _step_axes(fig)
    assert min(ax.get_xticks()) >= 1 and "step 0 (warm-up: baseline 30.0 s, tik 30.0 s) not shown" in ax.get_title()
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][0] == "rollout"   # the phases' legend
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"baseline", "tik"}  # the arms' legend
    assert "4 steps" not in fig._suptitle.get_text() and "3 measured steps" in fig._suptitle.get_text()
    import matplotlib.pyplot as plt
    plt.close(fig)


def _rewarded(n_steps: int, seed: int, reward: float) -> list[dict]:
    rng = random.Random(seed)
    recs = _records(n_steps, 5.0, seed)
    for r in recs:
        r["tik"][0]["reward_mean"] = reward + 0.004 * (rng.random() - 0.5) if reward else 0.0
    return recs


@pytest.mark.parametrize("tik_reward, warned", [(0.976, True), (1.0, False)])
def test_a_reward_gap_is_called_out_in_the_verdict(tik_reward, warned):
    """Rewards whose ratio's interval leaves out 1 (what a sampler that drew ~1% random tokens gave: 0.976 vs 1.000)
    get a bold line in the verdict; matching rewards, or a reference that earns nothing, get none."""
    rep = analysis.analyze({"baseline": _rewarded(8, 0, 1.0), "tik": _rewarded(8, 1, tik_reward)})
    head = report.summary_markdown(rep, META).split("## Mean seconds")[0]
    assert ("**Reward differs: tik/baseline reward ratio" in head) is warned
    zero = analysis.analyze({"baseline": _rewarded(8, 0, 0.0), "tik": _rewarded(8, 1, 0.5)})
    assert "Reward differs" not in report.summary_markdown(zero, META)


def test_the_summary_bounds_what_a_skip_can_give():
    """The reference's recompute share of its step bounds any skip's gain: 1 / (1 - share). The records put 20% of
    each step in the recompute (1.25x at most); a reference without a recompute gets no such line."""
    rep = _report(8)
    share, bound = report.skip_ceiling(rep)
    assert share == pytest.approx(0.2, abs=1e-9) and bound == pytest.approx(1.25, abs=1e-9)
    assert "skipping all of it, and nothing else, gives at most 1.250x over baseline" in report.summary_markdown(rep, META)
    recs = _records(8, 6.0, 0)
    for x in recs:
        x["stats"]["timeperf/recompute_logp"] = 0.0
    none = analysis.analyze({"baseline": recs, "tik": _records(8, 5.0, 1)})
    assert report.skip_ceiling(none) is None and "what a skip can give" not in report.summary_markdown(none, META)
