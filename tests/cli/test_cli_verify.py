"""``areal-tik verify`` as a user runs it: tik passes with zero mismatches and names the backend
of every op; HF-default kernels are the negative control (exit 1, mismatching tokens)."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ARGS = ["--model", "tiny-qwen2", "--prompts", "4", "--max-new-tokens", "8", "--max-prompt-len", "24",
        "--device", "cpu", "--json"]


def _verify(*extra, env=None):
    p = subprocess.run([sys.executable, "-m", "areal_tik.cli", "verify", *ARGS, *extra], capture_output=True,
                       text=True, timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})
    return p.returncode, json.loads(p.stdout), p.stderr


def test_verify_tik_passes_and_reports_selection():
    rc, rep, err = _verify()
    assert rc == 0, err[-2000:]
    assert rep["passed"] and rep["kernels"] == "tik" and rep["n_mismatch_total"] == 0
    assert set(rep["regimes"]) == {"R1", "R2", "R3", "R4", "R5"}
    assert all(r["n_tokens"] > 0 and r["n_mismatch"] == 0 for r in rep["regimes"].values())
    assert len(rep["kernel_fingerprint"]) == 16
    assert {"attention_varlen", "attention_paged", "linear", "rms_norm"} <= set(rep["kernel_selection"])


def test_verify_default_kernels_fail():
    rc, rep, _ = _verify("--kernels", "default")
    assert rc == 1 and not rep["passed"] and rep["n_mismatch_total"] > 0
    assert "kernel_selection" not in rep


def test_verify_moe_preset_passes():
    """An MoE preset (tiny-qwen3-moe) through every regime; the MoE ops are in the reported selection."""
    rc, rep, err = _verify("--model", "tiny-qwen3-moe")      # a later --model wins
    assert rc == 0, err[-2000:]
    assert rep["passed"] and rep["n_mismatch_total"] == 0 and rep["model"] == "tiny-qwen3-moe"
    assert all(r["n_tokens"] > 0 for r in rep["regimes"].values())
    assert {"moe_route", "moe_experts", "moe_combine"} <= set(rep["kernel_selection"])
