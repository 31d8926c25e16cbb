"""``verify/offline.py`` without vLLM: the vLLM generator's engine arguments (the tik plugin's for tik kernels, none
for stock vLLM), its sampling parameters and its records, against a stand-in ``vllm`` module; and the staggered
arrivals of both generators giving the all-at-once outputs."""
import json
import os
import sys
import types

import pytest

from areal_tik import vllm_plugin
from areal_tik.verify import offline


class _Out:
    """A finished request as vLLM returns it: log-probs only when asked for (``logprobs=None``: vLLM's None)."""

    def __init__(self, rid, prompt, n, with_logprobs=True):
        toks = [(sum(prompt) + i) % 50 + 3 for i in range(n)]
        self.request_id, self.prompt_token_ids, self.finished = rid, list(prompt), True
        lps = [{t: types.SimpleNamespace(logprob=-t / 100)} for t in toks] if with_logprobs else None
        self.outputs = [types.SimpleNamespace(token_ids=toks, logprobs=lps)]


class _Engine:
    def __init__(self):
        self.waiting = []

    def add_request(self, rid, prompt, params):
        self.waiting.append((rid, prompt["prompt_token_ids"], params.kw["max_tokens"]))

    def step(self):
        out = [_Out(*w) for w in self.waiting[:1]]
        self.waiting = self.waiting[1:]
        return out

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def abort_request(self, rids):
        self.waiting = [w for w in self.waiting if w[0] not in rids]


@pytest.fixture
def fake_vllm(monkeypatch):
    built = []

    class LLM:
        def __init__(self, **kw):
            built.append(kw)
            self.llm_engine = _Engine()

        def generate(self, prompts, params, use_tqdm=True):
            return [_Out(f"g{i}", p["prompt_token_ids"], sp.kw["max_tokens"], sp.kw["logprobs"] is not None)
                    for i, (p, sp) in enumerate(zip(prompts, params))]

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    return built


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(tmp_path)


def test_vllm_generator_arguments_follow_the_kernels(fake_vllm, ckpt):
    offline.VLLMEngine(ckpt, kernels="tik", max_model_len=128)
    offline.VLLMEngine(ckpt, kernels="default", block_size=64, seed=0)
    tik, stock = fake_vllm
    assert {k: tik[k] for k in vllm_plugin.llm_kwargs("qwen2")} == vllm_plugin.llm_kwargs("qwen2")
    assert tik["max_model_len"] == 128 and tik["dtype"] == "bfloat16" and tik["skip_tokenizer_init"]
    assert "attention_backend" not in stock and "hf_overrides" not in stock and stock["block_size"] == 64
    offline.VLLMEngine(ckpt, kernels="tik", piecewise=True)
    assert fake_vllm[-1]["compilation_config"] == vllm_plugin.llm_kwargs("qwen2", piecewise=True)["compilation_config"]
    assert "piecewise" not in fake_vllm[-1]
    offline.VLLMEngine(ckpt, kernels="tik", piecewise=True, graph_tokens=1024)
    assert fake_vllm[-1]["compilation_config"]["max_cudagraph_capture_size"] == 1024 and "graph_tokens" not in fake_vllm[-1]


def test_vllm_generator_records_and_staggers(fake_vllm, ckpt):
    gen = offline.VLLMEngine(ckpt, kernels="tik")
    prompts = [[5, 6, 7], [8, 9], [10]]
    at_once = gen.generate(prompts, 4, seeds=[1, 2, 3])
    assert [p for p, _, _ in at_once] == prompts and all(len(o) == 4 for _, o, _ in at_once)
    assert all(lp == [-t / 100 for t in o] for _, o, lp in at_once)
    assert gen.generate(prompts, 4, arrivals=1) == at_once
    sp = gen.sampling(7, seed=3, temperature=0.5).kw
    assert sp == dict(temperature=0.5, top_p=1.0, top_k=-1, max_tokens=7, ignore_eos=True, logprobs=0,
                      detokenize=False, seed=3)


def test_vllm_generator_preset_weights_and_no_logprobs(fake_vllm, ckpt):
    """``weights_preset`` adds the plugin's tik_preset load format (no checkpoint read); ``logprobs=False`` asks
    vLLM for none and records an empty list."""
    from areal_tik.vllm_plugin import preset_loader
    gen = offline.VLLMEngine(ckpt, kernels="default", weights_preset="qwen2.5-7b", logprobs=False)
    stock = fake_vllm[0]
    assert {k: stock[k] for k in preset_loader.llm_kwargs("qwen2.5-7b")} == preset_loader.llm_kwargs("qwen2.5-7b")
    assert gen.sampling(7).kw["logprobs"] is None
    out = gen.generate([[5, 6, 7]], 3)
    assert len(out[0][1]) == 3 and out[0][2] == []


@pytest.mark.parametrize("preset,arch", [("qwen2.5-7b", "Qwen2ForCausalLM"), ("qwen3-30b-a3b", "Qwen3MoeForCausalLM")])
def test_preset_config_dir_holds_the_preset_config(tmp_path, preset, arch):
    """Only the config, with the causal-LM architecture a checkpoint names (without it vLLM 0.24 resolved
    qwen3_moe to its base model and ran it as a pooling model)."""
    from areal_tik.layers.models import preset_config
    from areal_tik.vllm_plugin import preset_loader
    d = preset_loader.config_dir(preset, str(tmp_path / "cfg"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    ref = preset_config(preset)
    assert os.listdir(d) == ["config.json"]
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == \
        (ref.model_type, ref.hidden_size, ref.num_hidden_layers, ref.vocab_size)
    assert cfg["architectures"] == [arch]


def test_our_engine_staggered_equals_all_at_once():
    gen = offline.OurEngine("tiny-qwen2", kernels="tik", device="cpu", max_model_len=64, max_num_seqs=4)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    at_once = gen.generate(prompts, 5, seeds=[1, 2, 3])
    assert gen.generate(prompts, 5, seeds=[1, 2, 3], arrivals=1) == at_once
    assert gen.generate(prompts, 5, seeds=[4, 5, 6]) != at_once       # the seeds reach the requests


def test_vllm_parity_runs_its_regimes_through_the_generator(fake_vllm, tmp_path):
    """``run_vllm_parity`` on the stand-in: both regimes run, the abort regime aborts, every token is compared with
    the trainer's, and the stand-in's made-up log-probs fail the comparison (the check can fail)."""
    import torch

    from areal_tik.layers.models import build_model, checkpoint_dir
    from areal_tik.layers.patch import patch_model
    from areal_tik.verify.vllm_parity import run_vllm_parity
    src = checkpoint_dir("tiny-qwen2", str(tmp_path / "m"), device="cpu")
    trainer = patch_model(build_model(src, dtype=torch.bfloat16, device="cpu"))
    rep = run_vllm_parity(src, trainer, n_prompts=8, min_prompt_len=3, max_prompt_len=9, max_new_tokens=4)
    assert set(rep["regimes"]) == {"batch", "abort"} and rep["regimes"]["abort"]["aborted"] == 1
    assert rep["regimes"]["batch"]["n_tokens"] == 32 and rep["regimes"]["abort"]["n_tokens"] == 28
    assert not rep["passed"] and rep["regimes"]["batch"]["n_mismatch"] > 0
    assert "CUSTOM" in rep["vllm_kwargs"]["attention_backend"] and rep["engine"] == "vllm (tik kernels)"
