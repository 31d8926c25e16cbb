"""Mixture-of-experts families (``qwen3_moe``, ``qwen2_moe``): entries of the family table plus the MoE block
(``layers/moe.py``), through the trainer's patched HF model, our engine and the vLLM plugin's model.

Every generated token's rollout log-prob equals the trainer's, torch.equal; a token's MoE-block output is the
same alone and in a batch that crowds its experts; the plugin loads both the fused (state dict) and the
per-expert (checkpoint file) expert names. Negative controls: the plugin's model with the router's
renormalisation flipped, or (Qwen2-MoE) the shared-expert gate zeroed, no longer matches the trainer; HF's own
expert loop alone vs crowded differs in tests/kernels/test_moe_experts.py (at K=2048, where CPU GEMMs round a
lone row otherwise; at these tiny widths they happen not to)."""
import os
import sys

import pytest
import torch

import areal_tik.engine.model_runner as mr
from areal_tik import vllm_plugin
from areal_tik.dispatch.bound import bind
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.layers.family import UnsupportedModelError, moe_layer
from areal_tik.layers.logprob_head import generated_logprobs
from areal_tik.layers.models import PRESETS, build_model, preset_config
from areal_tik.layers.moe import TikMoE, host_synced
from areal_tik.layers.modules import TikMLP
from areal_tik.layers.patch import patch_model
from areal_tik.layers.precompile import linear_shapes
from areal_tik.verify.contract import poison_
from areal_tik.verify.parity import ParityConfig, run_parity

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "vllm_plugin"))
from plugin_sim import load_from, run_plugin_path  # noqa: E402  (tests/vllm_plugin/plugin_sim.py)

FAMILIES = {"qwen3_moe": "tiny-qwen3-moe", "qwen2_moe": "tiny-qwen2-moe"}
LENS = [(9, 6), (14, 4), (5, 7)]                         # (prompt, generated) per sequence


def _model(preset, seed=0, dtype=torch.bfloat16, device="cpu", **overrides):
    m = build_model(preset, device=device, seed=seed, dtype=dtype, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():                                # larger router logits: routing decided, not uniform
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return m


def _per_expert_tensors(hf):
    """The model's tensors as a checkpoint file names them (``save_pretrained``): one tensor per expert and
    projection."""
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), t[e, :half]
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), t[e]
        else:
            yield name, t


def test_entries_presets_and_layer_rule():
    for mt, preset in FAMILIES.items():
        assert PRESETS[preset]["model_type"] == mt and vllm_plugin.architecture_for(mt) in vllm_plugin.ARCHITECTURES.values()
        # decode graphs as a dense model's on the triton experts (no host sync), none on the torch_ref experts
        graphs = {be: vllm_plugin.llm_kwargs(mt, ops=bind(be))["compilation_config"]["cudagraph_mode"]
                  for be in ("moe_experts=triton", "torch_ref")}
        assert graphs == {"moe_experts=triton": vllm_plugin.llm_kwargs("qwen3")["compilation_config"]["cudagraph_mode"],
                          "torch_ref": "NONE"}
        assert vllm_plugin.llm_kwargs(mt, ops=bind("moe_experts=triton"), piecewise=True)["compilation_config"]["mode"] == 3
        with pytest.raises(ValueError, match="host"):
            vllm_plugin.llm_kwargs(mt, ops=bind("torch_ref"), piecewise=True)
    for name in ("qwen3-30b-a3b", "qwen3-30b-a3b-4l"):
        cfg = preset_config(name)
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2048, 32, 4, 128)
        assert (cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == \
            (768, 128, 8, True)
        assert cfg.vocab_size == 151936
    assert preset_config("qwen3-30b-a3b").num_hidden_layers == 48 and preset_config("qwen3-30b-a3b-4l").num_hidden_layers == 4
    # decoder_sparse_step and mlp_only_layers decide which layers are MoE, in HF's model and in the patched one
    for overrides, want in (({"mlp_only_layers": [0]}, [False, True]), ({"decoder_sparse_step": 2}, [False, True]),
                            ({}, [True, True])):
        m = patch_model(_model("tiny-qwen3-moe", **overrides))
        assert [moe_layer(m.config, i) for i in range(2)] == want
        assert [type(layer.mlp) for layer in m.model.layers] == [TikMoE if w else TikMLP for w in want]
    # host syncs, read from the bound experts op: triton none, torch_ref and HF's own block per-expert counts
    assert [host_synced(patch_model(_model("tiny-qwen3-moe"), kernels=kn, backend=be)) for kn, be in
            (("tik", "moe_experts=triton"), ("tik", "torch_ref"), ("default", None))] == [False, True, True]
    # precompilation knows the router's GEMM shape (N, K); the experts' GEMMs are not the linear op's launches
    shapes = {(n, k) for n, k, _, _ in linear_shapes(m)}
    assert (8, 128) in shapes and (128, 128) not in shapes and (128, 64) not in shapes


@pytest.mark.parametrize("mt", FAMILIES)
def test_patched_forward_is_hf_within_bf16_noise(mt, seed_rng):
    ref, m = _model(FAMILIES[mt]), patch_model(_model(FAMILIES[mt]))
    ids = torch.randint(3, 512, (2, 19))
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits.float(), m(input_ids=ids).logits.float()
    assert (a - b).norm() / a.norm() < 2e-2
    d = patch_model(_model(FAMILIES[mt]), kernels="default")   # HF's block on the graph's flattened tokens
    with torch.no_grad():
        assert torch.equal(d(input_ids=ids).logits.float(), a)


@pytest.mark.parametrize("mt", FAMILIES)
def test_trainer_engine_and_vllm_plugin_agree_bitwise(mt, seed_rng):
    hf = patch_model(_model(FAMILIES[mt]), kernels="tik")
    prompts = [torch.randint(3, 512, (a,)).tolist() for a, _ in LENS]
    eng = LLMEngine(hf, EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=24,
                                     chunked_prefill=True, page_size=16))
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True, seed=7))
    train = generated_logprobs(hf, [(p, o.output_ids) for p, o in zip(prompts, outs)])
    for o, ref in zip(outs, train):
        assert torch.equal(torch.tensor(o.output_logprobs, dtype=torch.float32), ref)
    seqs = [p + o.output_ids[:b] for p, o, (_, b) in zip(prompts, outs, LENS)]
    for tensors in (None, list(_per_expert_tensors(hf))):      # fused names, then a checkpoint file's
        got, refs = run_plugin_path(load_from(hf, hf.config, tensors=tensors), hf, LENS, seqs)
        for mine, ref in zip(got, refs):
            assert torch.equal(mine, ref)


def test_regimes_r1_to_r5_zero_mismatches(seed_rng):
    m = patch_model(_model("tiny-qwen3-moe", seed=seed_rng % 1000))
    rep = run_parity(m, ParityConfig(seed=seed_rng, n_prompts=4, max_prompt_len=20, max_new_tokens=6, pad_to=64))
    assert set(rep["regimes"]) == {"R1", "R2", "R3", "R4", "R5"}
    for r, v in rep["regimes"].items():
        assert v["n_tokens"] > 0 and v["n_mismatch"] == 0 and v["divergent_sequences"] == 0, (r, v)
    assert rep["passed"]


def test_engine_graphs_on_the_triton_experts(seed_rng, monkeypatch):
    """The triton experts never wait on the host, so the engine captures the MoE model's decode and prefill steps
    (emulated graphs on a CPU, ``model_runner.EMULATE_GRAPHS_ON_CPU``; real ones on a GPU): graph steps happen, and
    tokens and log-prob bits equal the eager engine's and the trainer forward's. The torch_ref experts stay
    eager."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setattr(mr, "EMULATE_GRAPHS_ON_CPU", True)
    hf = patch_model(_model("tiny-qwen3-moe", seed=seed_rng % 1000, device=dev), backend="moe_experts=triton")
    prompts = [torch.randint(3, 512, (a,)).tolist() for a, _ in LENS]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=seed_rng % 997)
    cfg = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=24, chunked_prefill=True, page_size=16)
    graphed, eager = (LLMEngine(hf, EngineConfig(**cfg, enforce_eager=e)) for e in (False, True))
    got, ref = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert graphed.runner.num_prefill_graph_steps > 0 and graphed.runner.num_graph_steps > \
        graphed.runner.num_prefill_graph_steps and eager.runner.num_graph_steps == 0   # prefill and decode graphs
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    train = generated_logprobs(hf, [(p, o.output_ids) for p, o in zip(prompts, got)])
    for g, r, t in zip(got, ref, train):
        assert torch.equal(torch.tensor(g.output_logprobs), torch.tensor(r.output_logprobs))
        assert torch.equal(torch.tensor(g.output_logprobs, dtype=torch.float32), t.cpu())
    synced = patch_model(_model("tiny-qwen3-moe", device=dev), backend="torch_ref")
    assert not LLMEngine(synced, EngineConfig(**cfg)).runner.use_graphs


@pytest.mark.parametrize("mt", FAMILIES)
def test_block_output_alone_equals_crowded_batch(mt, seed_rng, monkeypatch):
    m = patch_model(_model(FAMILIES[mt]))
    block = m.model.layers[0].mlp
    x0 = torch.randn(1, 128).bfloat16()
    x = torch.cat([x0, x0 + 0.05 * torch.randn(63, 128).bfloat16(), torch.randn(16, 128).bfloat16()])
    with torch.no_grad():
        _, ids = block._tik_ops.moe_route(block._tik_ops.linear(x, block.gate.weight), block._tik_top_k,
                                          block._tik_norm_topk)
        crowd = sum(int(torch.isin(ids[t], ids[0]).any()) for t in range(1, 80))
        assert crowd >= 40                                   # token 0's experts are crowded
        empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison_(empty(*a, **kw)))
        batch, alone = block(x), block(x0)
    assert not torch.isnan(batch).any()
    assert torch.equal(alone, batch[:1])
    perm = torch.randperm(80)
    with torch.no_grad():
        assert torch.equal(block(x[perm].contiguous()), batch[perm])


@pytest.mark.parametrize("mt", FAMILIES)
def test_backward_through_the_trainer_path(mt, seed_rng):
    """A packed bf16 training forward and backward: the MoE parameters' gradients are as close to HF's fp32
    gradients (same weights) as HF's own bf16 gradients are."""
    tik, hf16 = patch_model(_model(FAMILIES[mt])), _model(FAMILIES[mt])
    hf32 = _model(FAMILIES[mt]).float()
    ids = torch.randint(3, 512, (1, 24))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    for model in (tik, hf16, hf32):
        model.train()
        if model is tik:
            loss = model(input_ids=ids, position_ids=pos).logits.float().logsumexp(-1).sum()
        else:              # HF's unpatched model: the two sequences one at a time
            loss = sum(model(input_ids=part).logits.float().logsumexp(-1).sum() for part in (ids[:, :10], ids[:, 10:]))
        loss.backward()
    names = [n for n, _ in tik.named_parameters() if ".mlp." in n]
    assert any("experts.gate_up_proj" in n for n in names) and any("mlp.gate.weight" in n for n in names)
    g = [dict(m.named_parameters()) for m in (tik, hf16, hf32)]
    for n in names:
        ours, theirs, ref = (d[n].grad.float() for d in g)
        assert torch.isfinite(ours).all() and ours.norm() > 0, n
        err, hf_err = (ours - ref).norm() / ref.norm(), (theirs - ref).norm() / ref.norm()
        assert err < 2 * hf_err + 2e-2, (n, float(err), float(hf_err))


@pytest.mark.parametrize("mt", FAMILIES)
def test_negative_controls(mt, seed_rng):
    hf = patch_model(_model(FAMILIES[mt]), kernels="tik")
    seqs = [torch.randint(3, 512, (a + b,)).tolist() for a, b in LENS]
    m = load_from(hf, hf.config)
    for layer in m.model.layers:                         # the router's renormalisation reaches the bits
        layer.mlp._tik_norm_topk = not layer.mlp._tik_norm_topk
    got, refs = run_plugin_path(m, hf, LENS, seqs)
    assert not any(torch.equal(a, b) for a, b in zip(got, refs))
    if mt == "qwen2_moe":                                # the gated shared expert reaches the bits
        m = load_from(hf, hf.config)
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.shared_expert_gate.weight.zero_()
        got, refs = run_plugin_path(m, hf, LENS, seqs)
        assert not any(torch.equal(a, b) for a, b in zip(got, refs))


def test_refusals():
    cfg = preset_config("tiny-qwen3-moe")
    m = _model("tiny-qwen3-moe")
    m.config.mlp_only_layers = [1]                       # the config no longer says what the model holds
    with pytest.raises(UnsupportedModelError, match="layer 1"):
        patch_model(m)
    m = _model("tiny-qwen3-moe")
    m.config.output_router_logits = True
    with pytest.raises(UnsupportedModelError, match="output_router_logits"):
        patch_model(m)
    cfg.model_type = "mixtral"
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        patch_model(type("M", (torch.nn.Module,), {"config": cfg})())
    m = _model("tiny-qwen2-moe")                         # a block without its shared expert
    del m.model.layers[0].mlp.shared_expert
    with pytest.raises(UnsupportedModelError, match="shared_expert"):
        patch_model(m)
