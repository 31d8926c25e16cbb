"""Runs shared by test modules of tests/areal.

``warm_model``: a warm start of tiny-qwen2 on the add1 task (test_warmstart.py checks it answers).
``warm_xccl_run``: the tiny recipe from that warm start with the tik kernels and AReaL's ``xccl`` weight updates,
2 steps, through ``python -m areal_tik.areal.train``; test_trainer_ab.py checks the updates (broadcast, digests,
skip) and test_warmstart.py the training reward of a recipe that loads the warm start.
"""
import os
import subprocess
import sys

import pytest

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """(model dir, the warm start's record)."""
    pytest.importorskip("areal.api")
    from areal_tik.areal.warmstart import warm_start
    out = tmp_path_factory.mktemp("warm")
    rec = warm_start("tiny-qwen2", str(out), task="add1", steps=150, batch=64, lr=3e-3, progress=False)
    return out, rec


@pytest.fixture(scope="session")
def warm_xccl_run(warm_model, tmp_path_factory):
    """(fileroot, step log, the finished process)."""
    out, _ = warm_model
    root = tmp_path_factory.mktemp("warm_xccl")
    log = root / "steps.jsonl"
    cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config", os.path.abspath(RECIPE), "actor.kernel_backend=tik",
           f"actor.path={out}", f"tokenizer_path={out}", "actor.weight_update_mode=xccl", "total_train_steps=2",
           "trial_name=xccl", "experiment_name=tiktest-xccl", f"cluster.fileroot={root}", "actor.tik.audit_interval=2",
           "--step-log", str(log)]
    env = {k: v for k, v in os.environ.items() if k not in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT")}
    return root, log, subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
