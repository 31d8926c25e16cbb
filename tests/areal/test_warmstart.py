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


def _fake_training(calls, seconds=0.0):
    """A warm_start that writes what a real one writes (config.json, warmstart.json), counting calls."""
    import time

    def fake(model, out_dir, progress=True, **kw):
        calls.append((model, kw))
        time.sleep(seconds)
        (out_dir_p := __import__("pathlib").Path(out_dir)).mkdir(parents=True, exist_ok=True)
        (out_dir_p / "config.json").write_text("{}")
        (out_dir_p / "warmstart.json").write_text(json.dumps({"steps": kw.get("steps")}))
        return {}
    return fake


def test_cached_warm_start_trains_once_per_spec(tmp_path, monkeypatch):
    """The first run trains into the cache, the next reuses it; other arguments are another entry; two runs
    at once train it once (a file lock), and neither sees a half-written folder."""
    import threading

    from areal_tik.areal import warmstart as ws
    calls = []
    monkeypatch.setattr(ws, "warm_start", _fake_training(calls, seconds=1.0))
    spec = "warmstart:tiny-qwen2?task=add1&steps=7&batch=8&lr=0.01"
    got = []
    threads = [threading.Thread(target=lambda: got.append(ws.cached_warm_start(spec, str(tmp_path)))) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(calls) == 1 and calls[0] == ("tiny-qwen2", {"task": "add1", "steps": 7, "batch": 8, "lr": 0.01})
    assert len(set(got)) == 1 and json.load(open(f"{got[0]}/warmstart.json"))["steps"] == 7
    assert ws.cached_warm_start(spec, str(tmp_path)) == got[0] and len(calls) == 1
    other = ws.cached_warm_start(spec.replace("steps=7", "steps=8"), str(tmp_path))
    assert other != got[0] and len(calls) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".training-")]


def test_warm_spec_errors_name_the_argument():
    from areal_tik.areal.warmstart import parse_warm_spec
    assert parse_warm_spec("warmstart:tiny-qwen2?task=mix&lr=3e-4") == {"model": "tiny-qwen2", "task": "mix",
                                                                       "lr": 3e-4}
    with pytest.raises(ValueError, match="unknown warm-start argument 'epochs'"):
        parse_warm_spec("warmstart:tiny-qwen2?epochs=3")
    with pytest.raises(ValueError, match="steps='many' is not a int"):
        parse_warm_spec("warmstart:tiny-qwen2?steps=many")
    with pytest.raises(ValueError, match="names no model"):
        parse_warm_spec("warmstart:?steps=3")
