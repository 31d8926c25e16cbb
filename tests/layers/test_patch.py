"""patch_model: names and structure kept, refusals, and the training forward's input forms."""
import pytest
import torch

from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.layers.patch import UnsupportedModelError, patch_model
from areal_tik.layers.models import build_model, preset_config

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-llama"]


@pytest.mark.parametrize("name", TINY)
def test_patch_keeps_names_params_and_layer_classes(name):
    ref = build_model(name, device="cpu")
    m = build_model(name, device="cpu")
    before = {k: v.data_ptr() for k, v in m.state_dict().items()}
    layer_cls = type(m.model.layers[0]).__name__
    patch_model(m, kernels="tik")
    after = m.state_dict()
    assert list(after) == list(ref.state_dict())
    assert {k: v.data_ptr() for k, v in after.items()} == before          # same tensors, nothing copied
    assert all(torch.equal(a, b) for a, b in zip(after.values(), ref.state_dict().values()))
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert type(m.model.layers[0]).__name__ == layer_cls in m._no_split_modules
    assert type(m.lm_head).__name__ == "TikLinear" and isinstance(m.lm_head, torch.nn.Linear)
    assert patch_model(m, kernels="tik") is m                              # idempotent
    with pytest.raises(ValueError):
        patch_model(m, kernels="default")


@pytest.mark.parametrize("name", TINY)
def test_tik_forward_close_to_hf(name, seed_rng):
    """Accuracy sanity: tik logits are within bf16 noise of HF's own forward."""
    ref = build_model(name, device="cpu")
    m = patch_model(build_model(name, device="cpu"))
    ids = torch.randint(3, 512, (2, 19))
    with torch.no_grad():
        a = ref(input_ids=ids).logits.float()
        b = m(input_ids=ids).logits.float()
    rel = (a - b).norm() / a.norm()
    assert rel < 2e-2, rel


def test_unsupported_architectures_raise_before_touching_the_model():
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = preset_config("tiny-qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    m = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="sliding"):
        patch_model(m)
    assert type(m.model.layers[0].self_attn).__name__ == "Qwen2Attention"  # untouched
    # an MoE type without a family entry (supported MoE families: tests/layers/test_moe_family.py)
    moe = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        patch_model(AutoModelForCausalLM.from_config(moe))
    gpt2 = AutoConfig.for_model("gpt2", n_layer=1, n_embd=64, n_head=1, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match="model_type"):
        patch_model(AutoModelForCausalLM.from_config(gpt2))
    bad_hd = preset_config("tiny-llama", head_dim=32, num_attention_heads=4)
    with pytest.raises(UnsupportedModelError, match="head_dim"):
        patch_model(AutoModelForCausalLM.from_config(bad_hd))


@pytest.mark.parametrize("kernels", ["tik", "default"])
def test_training_input_forms_agree(kernels):
    """Packed row with cu_seq_lens (AReaL), packed row with restarting position_ids, and a
    plain [B, L] batch give the same bits for the same sequences; padding masks are refused."""
    m = patch_model(build_model("tiny-qwen3", device="cpu"), kernels=kernels)
    seqs = torch.randint(3, 512, (3, 11))
    flat = seqs.reshape(-1)
    cu = torch.tensor([0, 11, 22, 33], dtype=torch.int32)
    pos = torch.arange(11).repeat(3)[None]
    with torch.no_grad():
        a = m(input_ids=flat[None], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11,
              max_length_k=11, attention_mask={"full_attention": None}).logits[0]
        b = m(input_ids=flat[None], position_ids=pos).logits[0]
        c = m(input_ids=seqs, attention_mask=torch.ones_like(seqs)).logits.reshape(33, -1)
    assert torch.equal(a, b)
    if kernels == "tik":
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="padded"):
        mask = torch.ones_like(seqs)
        mask[0, -1] = 0
        m(input_ids=seqs, attention_mask=mask)


def test_packed_logprobs_fused_equals_logits_path_and_has_grad():
    m = patch_model(build_model("tiny-qwen2", device="cpu"))
    ids = torch.randint(3, 512, (40,))
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    temps = torch.tensor([0.7] * 13 + [1.0] * 27)
    with torch.enable_grad():
        a = packed_logprobs(m, ids, cu, temperature=temps, fused=True)
        a.sum().backward()
    b = packed_logprobs(m, ids, cu, temperature=temps, fused=False)
    assert torch.equal(a.detach(), b.detach())
    assert m.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert m.lm_head.weight.grad is not None and torch.isfinite(m.lm_head.weight.grad).all()
