"""``run_ab(arms=...)``: how arms run in separate calls are paired (``run_arm`` faked: it writes
step logs the way the trainer does; everything else is the real report code)."""
import json
import os

import pytest

from areal_tik.ab import analysis, report, runner as ab


def _fake_run_arm(log_steps, crash_after=None):
    """A run_arm that logs ``log_steps[arm]`` steps (or raises after ``crash_after`` steps, as a
    killed device call would, leaving its start record and partial log behind)."""
    calls = []

    def run_arm(config, arm, steps, out, overrides=(), on_step=None, timeout=None, runs_dir=None, partial_ok=False,
                on_phase=None):
        calls.append((arm, steps, list(overrides)))
        n = min(steps, log_steps[arm])
        with open(os.path.join(out, arm, "steps.jsonl"), "w") as f:
            for i in range(n if crash_after is None else crash_after):
                f.write(json.dumps({"global_step": i, "wall_s": 10.0 if arm == "baseline" else 8.0,
                                    "stats": {"timeperf/rollout": 5.0}, "tik": [{"gen_tokens": 100}]}) + "\n")
        if crash_after is not None:
            raise KeyboardInterrupt("device call killed")
        return {"cmd": ab._arm_cmd(config, arm, steps, out, list(overrides), runs_dir), "wall_s": 1.0,
                "steps": analysis.load_steps(os.path.join(out, arm, "steps.jsonl")), "timed_out": n < steps}
    return run_arm, calls


CFG = "recipes/tiny.yaml"


def test_pair_across_calls(tmp_path, monkeypatch):
    fake, calls = _fake_run_arm({"baseline": 3, "tik": 3})
    monkeypatch.setattr(ab, "run_arm", fake)
    first = ab.run_ab(CFG, 3, str(tmp_path), ["a=1"], progress=False, arms=("baseline",))
    assert first["pending"] == ["tik"] and not (tmp_path / "report.json").exists()
    rep = ab.run_ab(CFG, 3, str(tmp_path), ["a=1"], progress=False, arms=("tik",))
    assert rep["n_steps"] == 3 and rep["throughput_ratio_total"] == pytest.approx(10.0 / 8.0)
    assert [c[0] for c in calls] == ["baseline", "tik"]
    again = ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=())       # --arms none: rebuild
    assert again["rows"] == rep["rows"]


def test_mismatched_overrides_refused_before_running(tmp_path, monkeypatch):
    fake, calls = _fake_run_arm({"baseline": 3, "tik": 3})
    monkeypatch.setattr(ab, "run_arm", fake)
    ab.run_ab(CFG, 3, str(tmp_path), ["gconfig.max_new_tokens=512"], progress=False, arms=("baseline",))
    with pytest.raises(ValueError, match="start a new pair"):
        ab.run_ab(CFG, 3, str(tmp_path), ["gconfig.max_new_tokens=256"], progress=False, arms=("tik",))
    assert [c[0] for c in calls] == ["baseline"]


def test_killed_arm_loads_as_partial(tmp_path, monkeypatch):
    fake, _ = _fake_run_arm({"baseline": 5, "tik": 5}, crash_after=2)
    monkeypatch.setattr(ab, "run_arm", fake)
    with pytest.raises(KeyboardInterrupt):
        ab.run_ab(CFG, 5, str(tmp_path), progress=False, arms=("baseline",))
    loaded = ab.load_arm(str(tmp_path), "baseline")
    assert loaded["timed_out"] is True and len(loaded["steps"]) == 2
    fake2, calls = _fake_run_arm({"baseline": 5, "tik": 5})
    monkeypatch.setattr(ab, "run_arm", fake2)
    rep = ab.run_ab(CFG, 5, str(tmp_path), progress=False, arms=("tik",))
    assert calls[0][:2] == ("tik", 2)              # the tik arm asks for what the baseline logged
    assert rep["n_steps"] == 2
    assert "PARTIAL" in open(tmp_path / "summary.md").read()


def test_no_tik_run_against_an_empty_baseline(tmp_path, monkeypatch):
    fake, calls = _fake_run_arm({"baseline": 0, "tik": 3})
    monkeypatch.setattr(ab, "run_arm", fake)
    ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("baseline",))
    with pytest.raises(RuntimeError, match="logged no step"):
        ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("tik",))
    assert [c[0] for c in calls] == ["baseline"]


def test_rerun_replaces_stale_report(tmp_path, monkeypatch):
    fake, _ = _fake_run_arm({"baseline": 2, "tik": 2})
    monkeypatch.setattr(ab, "run_arm", fake)
    ab.run_ab(CFG, 2, str(tmp_path), progress=False)
    assert (tmp_path / "report.json").exists()
    again = ab.run_ab(CFG, 2, str(tmp_path), progress=False, arms=("baseline",))
    assert not (tmp_path / "report.json").exists()   # the old pair's report no longer describes the arms
    assert again["pending"] == ["tik"]                # and the old tik arm is not paired with the new baseline
    assert ab.load_arm(str(tmp_path), "tik") is None


def test_arm_stops_when_its_server_fails(tmp_path, monkeypatch):
    """A rollout server whose engine failed answers every /generate with 500 and AReaL's client keeps
    retrying: run_arm must stop the arm on the server's log line, not wait for the timeout."""
    import sys
    import time
    runs = tmp_path / "runs"
    script = ("import os, time; d = os.path.join(%r, 'exp', 'tik'); os.makedirs(d, exist_ok=True); "
              "open(os.path.join(d, 'tik_server.log'), 'w').write('INFO up\\nERROR engine.step failed: Traceback\\n"
              "CUDA error: operation not permitted when stream is capturing\\n'); time.sleep(120)") % str(runs)
    monkeypatch.setattr(ab, "_arm_cmd", lambda *a, **k: [sys.executable, "-c", script])
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="rollout server failed(.|\n)*stream is capturing"):
        ab.run_arm("cfg.yaml", "tik", 3, str(tmp_path / "out"), runs_dir=str(runs), timeout=100, partial_ok=True)
    assert time.perf_counter() - t0 < 30
    assert (tmp_path / "out" / "tik" / "tik_server.log").exists()  # copied into the report dir


def test_arm_that_hangs_after_its_last_step_is_complete(tmp_path, monkeypatch):
    """All requested steps logged, then the process hangs in teardown (seen with xccl on 2x H200):
    killed after the grace period, counted complete (not timed out, not failed)."""
    import sys
    import time
    out = tmp_path / "out"
    log = out / "tik" / "steps.jsonl"
    row = json.dumps({"global_step": 0, "wall_s": 1.0, "stats": {}})
    script = ("import json, time; f = open(%r, 'a'); [f.write(%r + '\\n') for _ in range(3)]; f.flush(); "
              "time.sleep(120)") % (str(log), row)
    monkeypatch.setattr(ab, "_arm_cmd", lambda *a, **k: [sys.executable, "-c", script])
    t0 = time.perf_counter()
    res = ab.run_arm("cfg.yaml", "tik", 3, str(out), runs_dir=str(tmp_path / "runs"), timeout=100,
                     partial_ok=False, teardown_grace_s=2)
    assert time.perf_counter() - t0 < 30
    assert len(res["steps"]) == 3 and res["teardown_killed"] and not res["timed_out"]


def test_reward_ratio_interval():
    """The reward ratio's 95% interval (Welch's t on the log of the ratio of means, per-step means as the
    samples) is recomputable from the logged rewards, and undefined (nan) when an arm's reward is 0."""
    import math
    import statistics
    rb, rt = [0.40, 0.50, 0.45, 0.55], [0.42, 0.48, 0.50, 0.52]
    ci = analysis._ratio_ci(rb, rt)
    mb, mt = statistics.fmean(rb), statistics.fmean(rt)
    vb, vt = statistics.variance(rb) / (4 * mb * mb), statistics.variance(rt) / (4 * mt * mt)
    df = (vb + vt) ** 2 / (vb ** 2 / 3 + vt ** 2 / 3)
    assert 5 < df < 6                                       # Welch: 5.2 degrees of freedom, t at 5 (errs wide)
    half = 2.571 * math.sqrt(vb + vt)
    assert ci["ratio_ci95"] == pytest.approx([mt / mb * math.exp(-half), mt / mb * math.exp(half)])
    assert ci["se_baseline"] == pytest.approx(statistics.stdev(rb) / 2) and ci["se_tik"] == pytest.approx(
        statistics.stdev(rt) / 2)
    assert all(math.isnan(x) for x in analysis._ratio_ci([0.0, 0.0], [0.1, 0.2])["ratio_ci95"])


def test_stale_server_failure_from_an_earlier_run_is_ignored(tmp_path, monkeypatch):
    """The server log is appended to: a failure line left by an earlier run in the same runs dir
    must not stop a healthy arm."""
    import sys
    runs = tmp_path / "runs"
    d = runs / "exp" / "tik"
    d.mkdir(parents=True)
    (d / "tik_server.log").write_text("ERROR engine.step failed: an earlier run\n")
    out = tmp_path / "out"
    log = out / "tik" / "steps.jsonl"
    row = json.dumps({"global_step": 0, "wall_s": 1.0, "stats": {}})
    script = ("import time; time.sleep(6); f = open(%r, 'a'); [f.write(%r + '\\n') for _ in range(2)]; f.close(); "
              "open(%r, 'a').write('INFO this run is fine\\n')") % (str(log), row, str(d / "tik_server.log"))
    monkeypatch.setattr(ab, "_arm_cmd", lambda *a, **k: [sys.executable, "-c", script])
    res = ab.run_arm("cfg.yaml", "tik", 2, str(out), runs_dir=str(runs), timeout=60)
    assert len(res["steps"]) == 2 and not res["timed_out"]


def test_profiled_step_left_out_and_compiles_reported():
    """A step recorded under torch.profiler (slowed by it) is left out of the ratios; the per-step
    table shows each step's Triton compiles, the trainer's and the server's."""
    def recs(walls, profiled_at, jit):
        return [{"global_step": i, "wall_s": w, "stats": {"timeperf/rollout": w / 2}, "tik": [{"gen_tokens": 10}],
                 "jit": {"compiles": jit[i], "seconds": 0.5 * jit[i], "by_kernel": {}},
                 **({"profiled": "/x/profile_step3.txt"} if i == profiled_at else {})} for i, w in enumerate(walls)]
    b = recs([20.0, 10.0, 10.0, 30.0], 3, [0, 0, 0, 0])
    t = recs([25.0, 8.0, 8.0, 24.0], 3, [9, 2, 0, 0])
    rep = analysis.analyze({"baseline": b, "tik": t})
    assert rep["measured_steps"] == [1, 2]
    assert rep["throughput_ratio_total"] == pytest.approx(20.0 / 16.0)
    assert [r["jit_compiles"] for r in rep["rows"]["tik"]] == [9, 2, 0, 0]
    iv = [{"engine_busy_s": 1.0, "engine_steps": 3, "tokens": 9, "requests": 3, "first_request_to_last_finish_s": 1.1,
           "eager_steps": 1, "eager_s": 0.2, "max_step_ms": 200.0, "graphs_captured": 2 - min(i, 2),
           "jit_compiles": 4 - i, "jit_compile_s": 1.0, "jit_kernels": {}} for i in range(4)]
    md = report.summary_markdown(rep, {"config": CFG, "server_intervals": {"baseline": iv, "tik": iv}})
    assert "| tik | 3 (profiled) |" in md and "| 2 (1.0 s) / 3 (1.0 s) |" in md
    assert "eager steps (prefill, run without a CUDA graph) 0.20 s" in md and "1 graph captures and 6 Triton compiles in all" in md


def test_critic_phase_is_its_own_column():
    """PPO: AReaL's critic timers (values before the actor's update, critic update after) form a
    'critic' phase instead of hiding in 'other'; without a critic the column is left out."""
    def recs(critic):
        return [{"global_step": i, "wall_s": 10.0, "tik": [{"gen_tokens": 10}],
                 "stats": {"timeperf/rollout": 4.0, "timeperf/train_step": 2.0, "timeperf/critic_values": critic,
                           "timeperf/critic_train_step": 2 * critic}} for i in range(3)]
    rep = analysis.analyze({"baseline": recs(1.0), "tik": recs(0.5)})
    assert [r["critic"] for r in rep["rows"]["baseline"]] == [3.0] * 3
    assert rep["rows"]["tik"][1]["other"] == pytest.approx(10.0 - 4.0 - 2.0 - 1.5)
    md = report.summary_markdown(rep, {"config": CFG})
    assert "| weight update (trainer's save) | critic | other |" in md and "| 3.000 |" in md
    no_critic = report.summary_markdown(analysis.analyze({"baseline": recs(0.0), "tik": recs(0.0)}), {"config": CFG})
    assert "critic" not in no_critic.split("## Per step")[0]


def test_weight_update_split_into_the_trainers_save():
    """The disk weight update's trainer share (``tik/hf_save_s``, the tik actor's timed HF save) is reported
    beside the whole update; a log without it reads nan, not 0. Rewards all 0 (a random preset): no reward ratio."""
    def recs(save):
        return [{"global_step": i, "wall_s": 12.0, "tik": [{"gen_tokens": 10}],
                 "stats": {"timeperf/update_weights": 8.0, "ppo_actor/task_reward/avg": 0.0,
                           **({"tik/hf_save_s": save + i} if save else {})}}
                for i in range(3)]
    rep = analysis.analyze({"vllm": recs(None), "tik": recs(4.0)})
    assert [r["weight_save"] for r in rep["rows"]["tik"]] == [4.0, 5.0, 6.0]
    assert rep["phase_mean_s"]["tik"]["weight_save"] == pytest.approx(5.5)  # steps 1-2 measured
    md = report.summary_markdown(rep, {"config": CFG})
    assert "reward ratio: none (vllm's mean reward is 0)" in md and "reward ratio nan" not in md
    assert "no reward ratio (vllm's mean reward is 0)" in md and "nan, nan" not in md
    earning = [{"global_step": i, "wall_s": 12.0, "tik": [{"gen_tokens": 10}],
                "stats": {"timeperf/update_weights": 8.0, "ppo_actor/task_reward/avg": 0.5}} for i in range(3)]
    md_earning = report.summary_markdown(analysis.analyze({"vllm": earning, "tik": earning}), {"config": CFG})
    assert "; reward ratio tik/vllm 1.000, 95% CI [" in md_earning and "no reward ratio" not in md_earning
    assert "| tik | 0.000 | 0.000 | 0.000 | 8.000 (5.500) |" in md and "| vllm | 0.000 | 0.000 | 0.000 | 8.000 (nan) |" in md


def test_vllm_set_across_calls_ratios_against_vllm(tmp_path, monkeypatch):
    """The set vllm, tik, vllm_tik run one arm per call: the report waits for all three, compares each with
    stock vLLM, names every arm's rollout engine (vLLM's version from the package metadata) and keeps the
    skip counts of the tik arms and the rollout-vs-recompute count of the vLLM arm."""
    import importlib.metadata as md
    real_version = md.version
    monkeypatch.setattr(md, "version", lambda name: "0.24.0" if name == "vllm" else real_version(name))
    walls = {"vllm": 12.0, "tik": 8.0, "vllm_tik": 10.0}
    calls = []

    def run_arm(config, arm, steps, out, overrides=(), on_step=None, timeout=None, runs_dir=None, partial_ok=False,
                on_phase=None):
        calls.append(arm)
        with open(os.path.join(out, arm, "steps.jsonl"), "w") as f:
            for i in range(steps):
                tik = [{"gen_tokens": 100, "skipped": arm != "vllm" and i > 0, "audit": arm != "vllm" and i == 0,
                        "audit_tokens": 50 if arm != "vllm" and i == 0 else 0,
                        "compare_tokens": 100 if arm == "vllm" else 0,
                        "compare_mismatch_tokens": 99 if arm == "vllm" else 0}]
                f.write(json.dumps({"global_step": i, "wall_s": walls[arm], "stats": {"timeperf/rollout": 5.0},
                                    "tik": tik}) + "\n")
        return {"cmd": ab._arm_cmd(config, arm, steps, out, list(overrides), runs_dir), "wall_s": 1.0,
                "steps": analysis.load_steps(os.path.join(out, arm, "steps.jsonl")), "timed_out": False}
    monkeypatch.setattr(ab, "run_arm", run_arm)
    s = ("vllm", "tik", "vllm_tik")
    assert ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("vllm",), arm_set=s)["pending"] == ["tik", "vllm_tik"]
    assert ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("vllm_tik",), arm_set=s)["pending"] == ["tik"]
    rep = ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("tik",), arm_set=s)
    assert calls == ["vllm", "vllm_tik", "tik"]
    assert rep["reference"] == "vllm" and rep["headline"] == "tik" and rep["arms"] == list(s)
    assert rep["throughput_ratio_total"] == pytest.approx(12.0 / 8.0)
    assert rep["vs_reference"]["vllm_tik"]["throughput_ratio_total"] == pytest.approx(12.0 / 10.0)
    assert rep["skip"]["vllm_tik"]["steps_skipped"] == 2 and rep["skip"]["vllm_tik"]["audit_tokens"] == 50
    assert rep["rollout_vs_recompute"] == {"vllm": {"tokens": 300, "mismatch_tokens": 297, "max_abs_diff": 0.0}}
    md_text = open(tmp_path / "summary.md").read()
    assert "step throughput tik/vllm: 1.500x" in md_text and "step throughput vllm_tik/vllm: 1.200x" in md_text
    assert "`vllm` (reference): stock vLLM" in md_text and "vllm 0.24.0" in md_text
    assert "vllm rollout vs recompute log-probs: 297/300" in md_text
    assert ab.load_arm(str(tmp_path), "vllm_tik")["engine"].endswith("vllm 0.24.0")
    # the vLLM arms roll out on vLLM with the recipe's layout; the kernels make the arm
    meta = json.load(open(tmp_path / "report.json"))["meta"]
    assert meta["engines"]["vllm"].endswith("vllm 0.24.0") and "areal-tik serve" in meta["engines"]["tik"]
    assert "actor.kernel_backend=tik rollout.backend=vllm:d1p1t1" in " ".join(meta["cmds"]["vllm_tik"])
    assert "actor.kernel_backend=default rollout.backend=vllm:d1p1t1" in " ".join(meta["cmds"]["vllm"])
    assert "rollout.backend" not in " ".join(meta["cmds"]["tik"])
    # running the reference again starts a new set: the other arms are no longer paired with it
    again = ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("vllm",), arm_set=s)
    assert again["pending"] == ["tik", "vllm_tik"] and not (tmp_path / "report.json").exists()
    with pytest.raises(ValueError, match="not in the comparison"):
        ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=("baseline",), arm_set=s)


def test_parse_arms_names_bad_arms():
    assert ab.parse_arms("vllm_tik, vllm") == ("vllm", "vllm_tik")
    with pytest.raises(ValueError, match="unknown arm.*sglang"):
        ab.parse_arms("vllm,sglang")


def test_per_sequence_skip_and_loglinear_arm_in_the_report():
    """The asynchronous A/B's numbers: the fraction of sequences and of generated tokens the tik arm skipped
    (over every step, audits included), the sequences recomputed per reason and the estimated time saved; the
    loglinear arm (no compute_logp, so no tik record) counts its tokens from AReaL's own stat."""
    def tik_step(i, skipped, total, stale, mixed):
        rec = {"gen_tokens": 10 * total, "skipped": skipped == total, "audit": i == 0, "seqs_skipped": skipped,
               "seqs_total": total, "gen_tokens_skipped": 10 * skipped, "gen_tokens_total": 10 * total,
               "seqs_stale_version": stale, "seqs_mixed_versions": mixed, "recompute_saved_s": 0.1 * skipped,
               "reasons": ["stale_version"] * bool(stale) + ["mixed_versions"] * bool(mixed)}
        return {"global_step": i, "wall_s": 8.0, "stats": {}, "tik": [rec]}
    tik = [tik_step(0, 0, 16, 0, 0), tik_step(1, 12, 16, 3, 1), tik_step(2, 16, 16, 0, 0)]
    ll = [{"global_step": i, "wall_s": 9.0, "stats": {"ppo_actor/n_valid_tokens": 160.0}} for i in range(3)]
    ref = [{"global_step": i, "wall_s": 12.0, "stats": {}, "tik": [{"gen_tokens": 160}]} for i in range(3)]
    rep = analysis.analyze({"vllm": ref, "vllm_loglinear": ll, "tik": tik})
    k = rep["skip"]["tik"]
    assert k["seq_skip_frac"] == pytest.approx(28 / 48) and k["token_skip_frac"] == pytest.approx(28 / 48)
    assert (k["seqs_stale_version"], k["seqs_mixed_versions"], k["steps_skipped"]) == (3, 1, 1)
    assert k["recompute_saved_s"] == pytest.approx(2.8) and k["skip_reasons"] == ["mixed_versions", "stale_version"]
    assert [r["gen_tokens"] for r in rep["rows"]["vllm_loglinear"]] == [160, 160, 160]
    assert rep["vs_reference"]["vllm_loglinear"]["tokens_per_s_ratio"] == pytest.approx(12.0 / 9.0)
    md = report.summary_markdown(rep, {"config": CFG})
    assert "- tik: sequences skipped 58.3%, generated tokens skipped 58.3% (all 3 steps, audits included); " \
           "recomputed: 3 stale, 1 mixed-version sequences; recompute time saved (estimate) 2.80 s" in md
    assert "step throughput vllm_loglinear/vllm: 1.333x" in md and "prox_logp_method=loglinear" in md
    assert ab.arm_overrides("vllm_loglinear", CFG) == ["actor.kernel_backend=default", "rollout.backend=vllm:d1p1t1",
                                                      "actor.prox_logp_method=loglinear",
                                                      "++actor.tik.rollout_engine=vllm"]


def test_rebuilt_report_names_the_arms_machine_and_overrides(tmp_path, monkeypatch):
    """A report rebuilt with --arms none (on a CPU, after the arms ran on a GPU machine) names the machine the arms
    recorded and the overrides they ran, not the rebuilding machine or the rebuilding call's flags."""
    fake, _ = _fake_run_arm({"baseline": 3, "tik": 3})
    monkeypatch.setattr(ab, "run_arm", fake)
    gpu = {"gpu": {"name": "NVIDIA H100 80GB HBM3", "arch": "sm_90"}}
    monkeypatch.setattr(ab, "environment", lambda: gpu)
    ab.run_ab(CFG, 3, str(tmp_path), ["gconfig.max_new_tokens=7"], progress=False, arms=("baseline", "tik"))
    monkeypatch.setattr(ab, "environment", lambda: {"gpu": None})              # the rebuild runs on a CPU
    again = ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=())
    meta = json.load(open(tmp_path / "report.json"))["meta"]
    assert meta["environment"] == gpu and meta["overrides"] == ["gconfig.max_new_tokens=7"]
    assert "Machine: NVIDIA H100 80GB HBM3 (sm_90)." in again["summary_md"] and "On a CPU" not in again["summary_md"]
    # arms recorded on different machines say so
    rec = json.load(open(tmp_path / "tik" / "arm.json"))
    rec["environment"] = {"gpu": {"name": "NVIDIA H200", "arch": "sm_90"}}
    json.dump(rec, open(tmp_path / "tik" / "arm.json", "w"))
    mixed = ab.run_ab(CFG, 3, str(tmp_path), progress=False, arms=())
    assert "different machines: baseline on NVIDIA H100 80GB HBM3 (sm_90), tik on NVIDIA H200 (sm_90)" \
        in mixed["summary_md"]
