"""Runs shared by test modules of tests/areal.

``warm_model``: a warm start of tiny-qwen2 on the add1 task (test_warmstart.py checks it answers).
``warm_xccl_run``: the tiny recipe from that warm start with the tik kernels and AReaL's ``xccl`` weight updates,
2 steps, through ``python -m areal_tik.areal.train``; test_trainer_ab.py checks the updates (broadcast, digests,
skip) and test_warmstart.py the training reward of a recipe that loads the warm start. ``warm_ipc_run``: the same
with the shared-buffer weight transfer (``actor.tik.weight_transfer=ipc``).
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


def _warm_run(warm_model, tmp_path_factory, name, *overrides):
    out, _ = warm_model
    root = tmp_path_factory.mktemp(f"warm_{name}")
    log = root / "steps.jsonl"
    cmd = [sys.executable, "-m", "areal_tik.areal.train", "--config", os.path.abspath(RECIPE), "actor.kernel_backend=tik",
           f"actor.path={out}", f"tokenizer_path={out}", *overrides, "total_train_steps=2",
           f"trial_name={name}", f"experiment_name=tiktest-{name}", f"cluster.fileroot={root}",
           "actor.tik.audit_interval=2", "--step-log", str(log)]
    env = {k: v for k, v in os.environ.items() if k not in ("AREAL_LLM_SERVER_ADDRS", "MASTER_PORT")}
    return root, log, subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="session")
def warm_xccl_run(warm_model, tmp_path_factory):
    """(fileroot, step log, the finished process)."""
    return _warm_run(warm_model, tmp_path_factory, "xccl", "actor.weight_update_mode=xccl")


@pytest.fixture(scope="session")
def warm_ipc_run(warm_model, tmp_path_factory):
    """(fileroot, step log, the finished process)."""
    return _warm_run(warm_model, tmp_path_factory, "ipc", "actor.weight_update_mode=disk",
                     "actor.tik.weight_transfer=ipc")
