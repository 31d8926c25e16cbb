"""``bench/run_ab_gpu.sh`` end to end on a CPU (``SMOKE=1``): the 1.5B GRPO recipe with
CPU-size overrides (preset tiny-qwen2, 16 new tokens, batch 2) through ``areal-tik ab``,
2 steps per arm, the same script, launch path and packing the GPU run uses, one arm per
call as on the device (ARMS=baseline, then ARMS=tik writes the report; ~50 s)."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)
pytest.importorskip("areal_tik.engine")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pytestmark = [pytest.mark.areal, pytest.mark.slow]


def test_run_ab_gpu_script_smoke(tmp_path):
    out, ab_out, runs = tmp_path / "out", tmp_path / "ab", tmp_path / "runs"
    out.mkdir()
    env = {**os.environ, "SMOKE": "1", "RECIPES": "grpo", "OUT": str(out), "AB_OUT": str(ab_out),
           "RUNS_DIR": str(runs), "EXTRA_OVERRIDES": "experiment_name=tiktest-abgpu"}
    for k in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT", "SERVER_DEVICE", "PROFILE_STEP"):
        env.pop(k, None)
    def call(arms):
        p = subprocess.run(["bash", os.path.join(ROOT, "bench", "run_ab_gpu.sh")], env={**env, "ARMS": arms},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    first = call("baseline")  # the first device call: one arm, no report yet, the arm packed
    assert "arm(s) tik not run yet" in first and not (ab_out / "grpo" / "report.json").exists()
    assert "grpo/baseline/steps.jsonl" in tarfile.open(out / "ab_grpo.tgz").getnames()
    assert sorted(os.listdir(out)) == ["ab_grpo.tgz"]
    call("tik")               # the second: the tik arm meets the baseline in AB_OUT, report written
    # what a device call returns: <= 8 files, the model dirs/checkpoints kept out of it
    assert sorted(os.listdir(out)) == ["ab_grpo.tgz", "ab_grpo_summary.md"]
    assert not runs.exists()
    names = tarfile.open(out / "ab_grpo.tgz").getnames()
    for f in ("grpo/report.json", "grpo/summary.md", "grpo/baseline/steps.jsonl", "grpo/tik/steps.jsonl",
              "grpo/tik/tik_server.log", "grpo/tik/train.log", "env.json"):
        assert f in names, names
    rep = json.load(open(ab_out / "grpo" / "report.json"))
    assert rep["meta"]["config"].endswith("grpo_qwen2.5-1.5b_gsm8k.yaml")
    assert rep["n_steps"] == 2 and rep["meta"]["timed_out"] == {"baseline": False, "tik": False}
    assert rep["meta"]["arms_run_here"] == ["tik"] and len(rep["rows"]["baseline"]) == 2
    assert rep["tik"]["audits"] == 1 and rep["tik"]["audit_mismatch_tokens"] == 0 and rep["tik"]["steps_skipped"] == 1
    assert all(r["recompute_forward_s"] > 0 for r in rep["rows"]["baseline"])
    assert "step throughput tik/baseline" in (out / "ab_grpo_summary.md").read_text()
    # a lost machine leaves two packed arms: --arms none rebuilds the same report from them
    os.remove(ab_out / "grpo" / "report.json")
    p = subprocess.run([sys.executable, "-m", "areal_tik.cli", "ab", "--config",
                        os.path.join(ROOT, "recipes", "grpo_qwen2.5-1.5b_gsm8k.yaml"), "--out", str(ab_out / "grpo"),
                        "--arms", "none", "--steps", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    again = json.load(open(ab_out / "grpo" / "report.json"))
    assert again["meta"]["arms_run_here"] == [] and again["rows"] == rep["rows"]
