"""Every arm's config that ``bench/run_ab_gpu.sh`` would launch composes on a CPU.

The script's shared overrides (``DRY_RUN=1`` prints them per recipe), plus each arm's own
(``areal_tik.ab.runner.arm_overrides``), go through the trainer's ``load_config`` (Hydra over the
recipe YAML, then AReaL's config classes): an override of a key the recipe lacks fails there, as
``vllm.gpu_memory_utilization`` once did on the H200 after the wheels were installed. One GPU
(disk updates, vLLM on 0.35 of the GPU) and the two-GPU layout (xccl, server on cuda:1)."""
import json
import os
import subprocess

import pytest

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal_tik.ab.runner import ARM_WIRING, arm_overrides  # noqa: E402
from areal_tik.areal import engines  # noqa: E402
from areal_tik.areal.train import load_config  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pytestmark = pytest.mark.areal


def _shared(tmp_path, **env):
    e = {**os.environ, "DRY_RUN": "1", "SET": "vllm,tik,vllm_tik,baseline,vllm_loglinear", "RECIPES": "grpo ppo grpo_async",
         "AB_OUT": str(tmp_path / "ab"), "EXTRA_OVERRIDES": "train_dataset.batch_size=16", **env}
    e.pop("SERVER_DEVICE", None) if "SERVER_DEVICE" not in env else None
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "run_ab_gpu.sh")], env=e, capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]


@pytest.mark.parametrize("layout", ["one_gpu", "two_gpus"])
def test_every_arm_config_composes(tmp_path, layout):
    # (on a CPU the script sees no GPU and would pick disk: the two-GPU layout names its update mode)
    env = {"SERVER_DEVICE": "cuda:1", "WEIGHT_UPDATE": "xccl"} if layout == "two_gpus" else {}
    recipes = _shared(tmp_path, **env)
    assert len(recipes) == 3
    for cfg_path, *shared in recipes:
        cfg_path = os.path.join(ROOT, cfg_path)
        # the vLLM server's path, as the script passes it when /tmp/site-vllm exists on the device
        shared = shared + ["actor.tik.server_pythonpath='/repo:/tmp/vsite:/tmp/site-vllm'"]
        for arm in ("vllm", "tik", "vllm_tik", "baseline", "vllm_loglinear") + (("tik_ipc", "vllm_tik_ipc") if layout == "one_gpu" else ()):
            loaded = load_config(["--config", cfg_path, *arm_overrides(arm, cfg_path), *shared])
            c = loaded[0] if isinstance(loaded, tuple) else loaded
            # the loglinear arm: AReaL's approximation, no recompute forward; every other arm recomputes or skips
            assert c.actor.prox_logp_method == ("loglinear" if arm == "vllm_loglinear" else "recompute"), arm
            assert c.actor.should_compute_prox_logp() == (arm != "vllm_loglinear"), arm
            if "async" in cfg_path:
                assert c.rollout.max_head_offpolicyness >= 2 and c.actor.use_decoupled_loss
            assert c.rollout.backend.startswith("vllm:") == arm.startswith("vllm"), (arm, c.rollout.backend)
            assert c.actor.kernel_backend == ("tik" if "tik" in arm else "default"), arm
            assert engines.for_config(c).name == ARM_WIRING[arm][0], arm      # the arm's rollout engine, by name
            assert c.train_dataset.batch_size == 16
            if layout == "one_gpu":
                assert c.actor.weight_update_mode == "disk" and c.vllm.gpu_memory_utilization == 0.35
            else:
                assert c.actor.weight_update_mode == "xccl" and c.vllm.gpu_memory_utilization == 0.9
            assert c.vllm.skip_tokenizer_init is True   # the char tokenizer cannot detokenize a random model
            assert c.actor.tik.weight_transfer == ("ipc" if arm.endswith("_ipc") else "areal"), arm


def test_warm_start_is_reused_by_the_next_call_only_when_it_matches(tmp_path):
    """One arm per device call: the second call with the same warm-start settings reuses the first call's model
    (no retraining on the device's clock), a call with other settings trains again; every call's arms load it."""
    warm = tmp_path / "warm"
    env = {"WARMSTART_STEPS": "2", "WARM_MODEL": "tiny-qwen2", "WARM_DIR": str(warm)}

    def run(**more):
        e = {**os.environ, "DRY_RUN": "1", "SET": "vllm,tik", "RECIPES": "grpo", "AB_OUT": str(tmp_path / "ab"),
             **env, **more}
        p = subprocess.run(["bash", os.path.join(ROOT, "bench", "run_ab_gpu.sh")], env=e, capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        (recipe,) = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]
        assert f"actor.path={warm}" in recipe, recipe
        return p.stdout
    first = run()
    assert "reusing the warm start" not in first and (warm / "config.json").exists()
    stamp = (warm / ".warmstart_stamp").read_text()
    assert "reusing the warm start" in run()
    assert "reusing the warm start" not in run(WARMSTART_STEPS="3")   # other settings: trained again
    assert (warm / ".warmstart_stamp").read_text() != stamp
