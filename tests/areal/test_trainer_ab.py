"""The tiny recipe through AReaL's real PPOTrainer (FSDP actor, gloo world of one, SPMD
mode, the areal-tik rollout server over HTTP), both arms, via ``areal-tik ab``.

One 2-step A/B run (module fixture) serves three checks:
- tik arm: step 0 audited and bitwise equal, step 1 recompute skipped (no forward);
- default arm: recompute ran every step;
- the report's numbers are consistent with the logged step times.
"""
import json
import math
import os

import pytest
import torch

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)
engine = pytest.importorskip("areal_tik.engine")

from areal_tik.ab.analysis import PHASES, analyze, load_steps  # noqa: E402
from areal_tik.cli import main as cli_main  # noqa: E402

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")
pytestmark = [pytest.mark.areal, pytest.mark.slow]


@pytest.fixture(scope="module")
def ab_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    # both arms record step 1 under torch.profiler
    rc = cli_main(["ab", "--config", RECIPE, "--steps", "2", "--out", str(out), "--no-progress", "--timeout",
                   "400", "actor.tik.audit_interval=2", "actor.tik.profile_step=1", "experiment_name=tiktest-ab"])
    assert rc == 0
    return out


def test_tik_arm_skips_and_audits_equal(ab_dir):
    steps = load_steps(os.path.join(ab_dir, "tik", "steps.jsonl"))
    assert [s["global_step"] for s in steps] == [0, 1]
    s0, s1 = steps[0]["tik"][0], steps[1]["tik"][0]
    assert s0["audit"] and s0["audit_passed"] and s0["audit_tokens"] > 0 and s0["audit_mismatch_tokens"] == 0
    assert s0["reasons"] == []  # every docs/design.md section 6 condition held (fingerprint, versions, digest)
    assert s1["skipped"] and s1["recompute_forward_s"] == 0.0 and s1["reasons"] == [] and not s1["audit"]
    assert steps[1]["stats"]["tik/recompute_skipped"] == 1.0  # through AReaL's stats tracker
    assert "tik/audit_mismatch_tokens" in steps[0]["stats"]


def test_default_arm_recomputes(ab_dir):
    steps = load_steps(os.path.join(ab_dir, "baseline", "steps.jsonl"))
    assert len(steps) == 2
    for s in steps:
        rec = s["tik"][0]
        assert not rec["skipped"] and rec["reasons"] == ["kernels_default"] and rec["recompute_forward_s"] > 0
        assert s["stats"]["timeperf/recompute_logp"] >= rec["recompute_forward_s"]


def test_report_consistent(ab_dir):
    rep = json.load(open(os.path.join(ab_dir, "report.json")))
    for f in ("summary.md", "steps.csv", "step_time.png", "reward.png"):
        assert os.path.getsize(os.path.join(ab_dir, f)) > 0
    # recompute phase absent in the tik arm on the non-audit step
    tik_rows = rep["rows"]["tik"]
    assert tik_rows[1]["recompute_skipped"] and tik_rows[1]["recompute_forward_s"] == 0.0
    assert all(r["recompute_forward_s"] > 0 for r in rep["rows"]["baseline"])
    for arm in ("baseline", "tik"):
        for r in rep["rows"][arm]:
            assert math.isfinite(r["reward"]) and 0.0 <= r["reward"] <= 1.0
            assert abs(r["other"] + sum(r[p] for p, _ in PHASES) - r["wall_s"]) < 1e-9
    # ratios recomputed from the logged times
    b = load_steps(os.path.join(ab_dir, "baseline", "steps.jsonl"))
    t = load_steps(os.path.join(ab_dir, "tik", "steps.jsonl"))
    assert rep["measured_steps"] == [1]
    assert rep["throughput_ratio_total"] == pytest.approx(b[1]["wall_s"] / t[1]["wall_s"])
    assert rep["step_time_ratio"]["mean"] == pytest.approx(b[1]["wall_s"] / t[1]["wall_s"])
    assert rep == {**rep, **{k: v for k, v in analyze({"baseline": b, "tik": t}).items() if k in ("throughput_ratio_total", "tokens_per_s")}}
    assert rep["tik"]["audit_mismatch_tokens"] == 0 and rep["tik"]["audits"] == 1 and rep["tik"]["steps_skipped"] == 1
    assert rep["baseline_rollout_vs_recompute"]["tokens"] > 0
    # the report names the baseline's packed attention (CPU: the per-sequence SDPA loop)
    expect = "torch varlen_attn" if torch.cuda.is_available() else "per-sequence SDPA loop"
    assert {r["default_attention"] for r in rep["rows"]["baseline"]} == {expect}
    assert f"baseline packed attention (train + recompute forward): {expect}" in open(
        os.path.join(ab_dir, "summary.md")).read()
    # whole-process wall time per arm and the part outside the logged steps (start-up): non-negative
    import re
    m = re.search(r"Arm wall time \(whole process\): baseline ([0-9.]+) s, of which ([0-9.-]+) s outside the logged "
                  r"steps; tik ([0-9.]+) s, of which ([0-9.-]+) s", open(os.path.join(ab_dir, "summary.md")).read())
    assert m and all(float(x) >= 0 for x in m.groups())
    # the rollout server's per-step counters reach the report (parsed from each arm's server log)
    for arm in ("baseline", "tik"):
        iv = rep["meta"]["server_intervals"][arm]
        assert len(iv) >= 2 and all(x["requests"] > 0 and x["tokens"] > 0 and x["engine_busy_s"] > 0 for x in iv)
    assert "Rollout server, mean per step after the first: baseline: engine stepping" in open(
        os.path.join(ab_dir, "summary.md")).read()


def test_profiled_step_and_compile_counts(ab_dir):
    """actor.tik.profile_step=1: each arm's step 1 is recorded under torch.profiler into a table next
    to its step log and marked in the report; every step record carries this process's Triton
    compiles, and every server interval its eager/graph/compile counters."""
    rep = json.load(open(os.path.join(ab_dir, "report.json")))
    for arm in ("baseline", "tik"):
        steps = load_steps(os.path.join(ab_dir, arm, "steps.jsonl"))
        assert "profiled" not in steps[0] and steps[1]["profiled"].endswith("profile_step1.txt")
        text = open(os.path.join(ab_dir, arm, "profile_step1.txt")).read()
        assert f"# step 1, {'tik' if arm == 'tik' else 'default'} kernels" in text and "## top host ops" in text
        assert all(isinstance(s["jit"]["compiles"], int) and s["jit"]["compiles"] >= 0 for s in steps)
        assert [r["profiled"] for r in rep["rows"][arm]] == [False, True]
        for x in rep["meta"]["server_intervals"][arm]:
            assert x["eager_steps"] >= 1 and 0 < x["eager_s"] <= x["engine_busy_s"] + 1e-9 and x["max_step_ms"] > 0
            assert x["jit_compiles"] >= 0 and x["graphs_captured"] >= 0
    assert "| tik | 1 (profiled) |" in open(os.path.join(ab_dir, "summary.md")).read()


def _audited_then_skipped(run, trial: str) -> str:
    """The two-step run ``run`` (fileroot, step log, process): step 0 audited with 0 mismatches, step 1 skipped
    with no reason (the server's version and weights digest matched the trainer's after the update); returns the
    server's log."""
    import glob
    tmp_path, log, r = run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = load_steps(str(log))
    assert [s["global_step"] for s in steps] == [0, 1]
    s0, s1 = steps[0]["tik"][0], steps[1]["tik"][0]
    assert s0["audit"] and s0["audit_tokens"] > 0 and s0["audit_mismatch_tokens"] == 0 and s0["reasons"] == []
    assert s1["skipped"] and s1["reasons"] == []
    return open(glob.glob(str(tmp_path / "*" / trial / "tik_server.log"))[0]).read()


def test_tik_arm_with_ipc_weight_updates(warm_ipc_run):
    """The shared-buffer weight transfer (``actor.tik.weight_transfer=ipc``, on a CPU a /dev/shm buffer, on a GPU a
    CUDA IPC handle) instead of the disk round trip: the server loads the trainer's buffer at each update, its bf16
    weights equal the trainer's (digest), so step 1 skips the recompute; no checkpoint is written or read."""
    server_log = _audited_then_skipped(warm_ipc_run, "ipc")
    assert server_log.count("shared tensors as version") == 2, server_log[-3000:]
    assert "update_weights_from_disk" not in server_log and "loaded weights from" not in server_log


def test_async_recipe_with_ipc_weight_updates_audits_equal(tmp_path):
    """AReaL's asynchronous mode (recipes/tiny_async.yaml: rollout up to 2 versions ahead, weight updates interrupt
    generation) with the shared-buffer weight transfer: every update loads through the buffer while requests are
    paused and resumed, batches mix stale and interrupted sequences with current ones, and the audits (steps 0
    and 2: every sequence recomputed, the current-version ones compared) find 0 differing tokens."""
    import glob
    import subprocess
    import sys
    log = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config",
           os.path.join(os.path.dirname(RECIPE), "tiny_async.yaml"), "actor.kernel_backend=tik",
           "actor.weight_update_mode=disk", "actor.tik.weight_transfer=ipc", "total_train_steps=4", "trial_name=ipc",
           "experiment_name=tiktest-async-ipc", f"cluster.fileroot={tmp_path}", "actor.tik.audit_interval=2",
           "--step-log", str(log)]
    env = {k: v for k, v in os.environ.items() if k not in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT")}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [s["tik"][0] for s in load_steps(str(log))]
    assert [t["version"] for t in recs] == [0, 1, 2, 3]
    assert [t["audit"] for t in recs] == [True, False, True, False]
    # an audit compares the current-version sequences (step 0: all of them; later, however many the timing left)
    assert all(t["audit_mismatch_tokens"] == 0 for t in recs if t["audit"]) and recs[0]["audit_tokens"] > 0
    assert any(t["seqs_stale_version"] + t["seqs_mixed_versions"] > 0 for t in recs)         # the async mix
    server_log = open(glob.glob(str(tmp_path / "*" / "ipc" / "tik_server.log"))[0]).read()
    assert server_log.count("shared tensors as version") == 4 and "loaded weights from" not in server_log


def test_tik_arm_with_xccl_weight_updates(warm_xccl_run):
    """AReaL's default weight transfer (``xccl``: trainer rank 0 broadcasts every parameter to the
    rollout server; gloo on a CPU) instead of the disk round trip: the server's bf16 weights after
    each update equal the trainer's (digest), so step 1 still skips the recompute. The run (the tiny
    recipe from a warm start, tik kernels, 2 steps) is tests/areal/conftest.py's warm_xccl_run."""
    server_log = _audited_then_skipped(warm_xccl_run, "xccl")
    assert "joined weight update group update_weight_group as rank 1 of 2 (gloo)" in server_log
    assert server_log.count("from group update_weight_group into version") == 2
    assert "update_weights_from_disk" not in server_log
