"""Warm start on the built-in arithmetic task: the saved model answers, and a recipe that loads it
has a nonzero training reward (what the A/B's reward comparison needs on a machine without
pretrained weights). The warm start and the recipe run are tests/areal/conftest.py's warm_model and
warm_xccl_run."""
import json

import pytest
import torch

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal_tik.areal import arith  # noqa: E402
from areal_tik.areal.warmstart import greedy_accuracy, warm_start  # noqa: E402

pytestmark = pytest.mark.areal


def test_saved_model_answers(warm_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, rec = warm_model
    assert rec["greedy_accuracy_before"] <= 0.05 and rec["loss_last"] < rec["loss_first"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == model.config.eos_token_id and tok.pad_token_id == model.config.pad_token_id
    held = arith.make_dataset(256, seed=rec["seed"] + 2000, task="add1")
    acc = greedy_accuracy(model, tok, held)  # from the saved bf16 files, not the in-memory model
    assert acc == rec["greedy_accuracy_after"] and acc >= 0.5
    assert json.load(open(out / "warmstart.json"))["greedy_accuracy_after"] == acc


def test_recipe_from_warm_start_has_reward(warm_xccl_run):
    """The tiny recipe loading the warm start (tik kernels, xccl weight updates: tests/areal/conftest.py)."""
    _, log, r = warm_xccl_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in open(log)]
    rewards = [t["reward_mean"] for row in rows for t in row["tik"]]
    assert len(rewards) == 2 and max(rewards) > 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown arithmetic task"):
        warm_start("tiny-qwen2", "/nonexistent", task="sub9")
    with pytest.raises(ValueError, match="steps and batch"):
        warm_start("tiny-qwen2", "/nonexistent", steps=0)
