"""An MoE preset through AReaL's real PPOTrainer (FSDP actor, the areal-tik rollout server), the tik arm of
``areal-tik ab``: the trainer's disk weight updates are checkpoints with per-expert tensor names, which the
server loads into its fused expert weights; step 0 is audited bit for bit, step 1 skips the recompute."""
import os

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal_tik.ab.analysis import load_steps  # noqa: E402
from areal_tik.cli import main as cli_main  # noqa: E402

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")
pytestmark = [pytest.mark.areal, pytest.mark.slow]


def test_tiny_qwen3_moe_tik_arm_audits_equal_then_skips(tmp_path):
    rc = cli_main(["ab", "--config", RECIPE, "--steps", "2", "--out", str(tmp_path), "--no-progress", "--timeout",
                   "400", "--set", "baseline,tik", "--arms", "tik", "actor.path=preset:tiny-qwen3-moe",
                   "actor.tik.audit_interval=2", "experiment_name=tiktest-moe"])
    assert rc == 0
    steps = load_steps(os.path.join(tmp_path, "tik", "steps.jsonl"))
    assert [s["global_step"] for s in steps] == [0, 1]
    s0, s1 = steps[0]["tik"][0], steps[1]["tik"][0]
    assert s0["audit"] and s0["audit_passed"] and s0["audit_tokens"] > 0 and s0["audit_mismatch_tokens"] == 0, s0
    assert s1["skipped"] and s1["recompute_forward_s"] == 0.0 and s1["reasons"] == [] and not s1["audit"], s1
