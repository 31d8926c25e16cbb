"""AReaL's single-controller mode (``scheduler.type=local``) on a CPU.

- ``launch_server`` on its own: ``TikRemoteSGLangEngine.launch_server`` (what AReaL's
  ``RolloutController`` calls on each rollout worker) starts ``areal-tik serve``, waits for
  ``/health`` and ``teardown_server`` stops it;
- slow: the tiny recipe with ``scheduler.type=local actor.kernel_backend=tik`` for 2 steps:
  AReaL's ``LocalScheduler`` starts RPC workers for the actor (``TikFSDPPPOActor`` by dotted
  path) and the rollout; the rollout worker's ``launch_server`` starts ``areal-tik serve``;
  the controller sends the server address to the actor worker; step 0 is audited equal and
  step 1 skips the recompute (stats gathered from the workers through AReaL's tracker).
"""
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from areal_tik.settings import Settings

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

pytestmark = pytest.mark.areal

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")


def _clean_env():
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AREAL_LLM_SERVER_ADDRS",
                         "AREAL_SPMD_MODE")}


def test_launch_server_starts_tik_serve(tmp_path):
    import torch
    from transformers import AutoTokenizer

    from areal.api.cli_args import InferenceEngineConfig

    from areal_tik.areal.arith import TOKENIZER_DIR
    from areal_tik.areal.rollout import TikRemoteSGLangEngine, server_args
    from areal_tik.layers.models import build_model
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    build_model("tiny-qwen2", dtype=torch.bfloat16, device="cpu", seed=1,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    eng = TikRemoteSGLangEngine(InferenceEngineConfig(experiment_name="tiktest-ls", trial_name="t0",
                                                      backend="sglang:d1p1t1", setup_timeout=120))
    info = eng.launch_server(server_args(str(tmp_path), Settings(kernels="tik"), dtype="bfloat16", seed=1))
    try:
        assert info.process is not None and info.process.poll() is None
        assert any("areal_tik.cli" in a for a in info.process.args) and "serve" in info.process.args
        with urllib.request.urlopen(f"http://{info.host}:{info.port}/get_server_info", timeout=30) as r:
            srv = json.loads(r.read())
        assert srv["kernels"] == "tik"
    finally:
        eng.teardown_server()
    info.process.wait(timeout=30)
    assert info.process.poll() is not None


@pytest.mark.slow
def test_single_controller_tiny_tik_two_steps(tmp_path):
    steps, log = tmp_path / "steps.jsonl", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config", RECIPE, "scheduler.type=local",
           "actor.kernel_backend=tik", "total_train_steps=2", "experiment_name=tiktest-sc",
           f"cluster.fileroot={tmp_path}/exp", f"cluster.name_resolve.nfs_record_root={tmp_path}/nr",
           "--step-log", str(steps)]
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_clean_env(), timeout=500).returncode
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert "Starting worker actor/0" in text and "Starting worker rollout/0" in text  # AReaL's LocalScheduler
    assert "areal-tik server (tik kernels" in text  # started by the rollout worker's launch_server
    assert "tik actor workers told the rollout server addresses" in text
    recs = [json.loads(l) for l in steps.read_text().splitlines()]
    assert [r["global_step"] for r in recs] == [0, 1]
    s0, s1 = recs[0]["stats"], recs[1]["stats"]
    assert s0["tik/audit"] == 1.0 and s0["tik/audit_tokens"] > 0 and s0["tik/audit_mismatch_tokens"] == 0
    assert s0["tik/recompute_skipped"] == 0.0 and s1["tik/recompute_skipped"] == 1.0
    assert s1["tik/recompute_forward_s"] == 0.0
    assert all(v == 0.0 for k, v in s1.items() if k.startswith("tik/no_skip/") and not k.endswith("__count"))
