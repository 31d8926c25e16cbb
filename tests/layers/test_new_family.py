"""Adding a model family is one table entry (docs/adding-a-family.md, whose steps this test follows).

A throwaway family, a Llama variant with a bias on every projection (q/k/v, o and the MLP's
gate/up/down; HF's Llama code builds them from ``attention_bias`` and ``mlp_bias``), is registered
for this test only and runs through the three hosts of the one decoder graph: ``patch_model`` (the
trainer's forward), our engine (the same patched model) and the vLLM plugin's model (built from
the entry, on vLLM-layout caches). Every generated token's log-prob is the trainer's, torch.equal.

Negative controls: the same checkpoint under an entry that denies the MLP bias is refused by
``patch_model`` and by the plugin's loader, and the plugin's model with its MLP biases zeroed no
longer matches the trainer (the biases reach the bits)."""
import dataclasses
import os
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from areal_tik import vllm_plugin
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.layers.family import Family, UnsupportedModelError, register_family, unregister_family
from areal_tik.layers.logprob_head import generated_logprobs
from areal_tik.layers.models import PRESETS, build_model
from areal_tik.layers.patch import patch_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm_plugin"))
from plugin_sim import OPS, load_from, run_plugin_path, tik_lm  # noqa: E402  (tests/vllm_plugin/plugin_sim.py)

MODEL_TYPE = "tik_test_llama_bias"


# step 1: HF knows the model type (here a registered config/model pair on HF's Llama code)
class BiasLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE

    def __init__(self, attention_bias=True, mlp_bias=True, **kwargs):
        super().__init__(attention_bias=attention_bias, mlp_bias=mlp_bias, **kwargs)


class BiasLlamaForCausalLM(LlamaForCausalLM):
    config_class = BiasLlamaConfig


AutoConfig.register(MODEL_TYPE, BiasLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(BiasLlamaConfig, BiasLlamaForCausalLM, exist_ok=True)

# step 2: the family entry, every fact of the family
FAMILY = Family(MODEL_TYPE, "TikTestLlamaBiasForCausalLM", qkv_bias=True, o_bias=True, mlp_bias=True,
                presets={"tiny-llama-bias": dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 max_position_embeddings=1024, rms_norm_eps=1e-6,
                                                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                                 rope_theta=500000.0)})


@pytest.fixture
def family():
    register_family(FAMILY)
    try:
        yield FAMILY
    finally:
        unregister_family(MODEL_TYPE)


def _model(seed=0):
    """The preset with random biases (HF initialises biases to zero, where a host that dropped one would agree)."""
    m = build_model("tiny-llama-bias", device="cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return m


def _engine_run(model, prompts, n_new):
    eng = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=24,
                                        chunked_prefill=True, page_size=16))
    return eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=n_new, ignore_eos=True, seed=7))


def test_the_entry_is_all_the_table_needs(family):
    assert "tiny-llama-bias" in PRESETS and PRESETS["tiny-llama-bias"]["model_type"] == MODEL_TYPE
    assert vllm_plugin.architecture_for(MODEL_TYPE) == "TikTestLlamaBiasForCausalLM"
    assert "TikTestLlamaBiasForCausalLM" in vllm_plugin.ARCHITECTURES.values()
    m = _model()
    layer = m.model.layers[0]
    assert all(getattr(layer.self_attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert all(getattr(layer.mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj"))
    unregister_family(MODEL_TYPE)                       # without its entry the model type is refused
    with pytest.raises(UnsupportedModelError, match="model_type"):
        patch_model(m)
    register_family(FAMILY)


def test_patched_forward_is_hf_within_bf16_noise(family, seed_rng):
    ref, m = _model(), patch_model(_model())
    ids = torch.randint(3, 512, (2, 19))
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits.float(), m(input_ids=ids).logits.float()
    assert (a - b).norm() / a.norm() < 2e-2


def test_trainer_engine_and_vllm_plugin_agree_bitwise(family, seed_rng):
    hf = patch_model(_model(), kernels="tik")
    lens = [(9, 6), (14, 4), (5, 7)]                   # (prompt, generated) per sequence
    prompts = [torch.randint(3, 512, (a,)).tolist() for a, _ in lens]
    # our engine (stacked projections, chunked prefill, decode) against the trainer's forward
    outs = _engine_run(hf, prompts, max(b for _, b in lens))
    train = generated_logprobs(hf, [(p, o.output_ids) for p, o in zip(prompts, outs)])
    for o, ref in zip(outs, train):
        assert torch.equal(torch.tensor(o.output_logprobs, dtype=torch.float32), ref)
    # the vLLM plugin's model, built from the entry, against the trainer's forward
    seqs = [p + o.output_ids[:b] for p, o, (_, b) in zip(prompts, outs, lens)]
    got, refs = run_plugin_path(load_from(hf, hf.config), hf, lens, seqs)
    for mine, ref in zip(got, refs):
        assert torch.equal(mine, ref)


def test_negative_controls(family, seed_rng):
    hf = patch_model(_model(), kernels="tik")
    lens = [(9, 6), (14, 4), (5, 7)]
    seqs = [torch.randint(3, 512, (a + b,)).tolist() for a, b in lens]
    # the biases reach the bits: without the plugin's MLP biases the log-probs are not the trainer's
    m = load_from(hf, hf.config)
    with torch.no_grad():
        for layer in m.model.layers:
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, n).bias.zero_()
    got, refs = run_plugin_path(m, hf, lens, seqs)
    assert not any(torch.equal(a, b) for a, b in zip(got, refs))
    # an entry that denies the MLP bias: patch_model refuses the checkpoint, the plugin's model cannot load it
    fresh = _model()
    unregister_family(MODEL_TYPE)
    register_family(dataclasses.replace(FAMILY, mlp_bias=False))
    with pytest.raises(UnsupportedModelError, match="gate_proj has a bias"):
        patch_model(fresh)
    with pytest.raises(ValueError, match="does not have"):
        tik_lm(hf.config, OPS).load_weights(hf.state_dict().items())
    unregister_family(MODEL_TYPE)
    register_family(FAMILY)
