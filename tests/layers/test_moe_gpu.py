"""MoE parity at the Qwen3-30B-A3B widths on a GPU (the lead runs these; CPU runs skip them): the 4-layer preset
``qwen3-30b-a3b-4l`` (hidden 2048, 32/4 heads, head dim 128, 128 experts, top-8, moe_intermediate 768, vocab
151,936), random weights, our engine (CUDA graphs: the triton experts never wait on the host) against the
trainer's forward, 0 mismatching tokens. Sized to run in well
under two minutes on one H100 (about 6 GB of weights; most of the time is Triton compiling linear configs)."""
import pytest
import torch

from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.kernels import moe
from areal_tik.layers.logprob_head import generated_logprobs
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model
from areal_tik.verify.parity import ParityConfig, run_parity

pytestmark = pytest.mark.gpu
PRESET = "qwen3-30b-a3b-4l"


@pytest.fixture(scope="module")
def model():
    m = patch_model(build_model(PRESET, device="cuda", seed=3))
    with torch.no_grad():                  # router logits of a trained model's spread: routing decided, not uniform
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.1)
    return m


def test_engine_equals_trainer_forward(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 151000, (int(n),), generator=g).tolist() for n in torch.randint(8, 120, (12,), generator=g)]
    eng = LLMEngine(model, EngineConfig(max_num_seqs=12, max_model_len=512, max_num_batched_tokens=256,
                                        chunked_prefill=True, page_size=16))
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=11)
    outs = eng.generate(prompts, params)
    train = generated_logprobs(model, [(p, o.output_ids) for p, o in zip(prompts, outs)])
    mismatches = sum(int((torch.tensor(o.output_logprobs, dtype=torch.float32) != t).sum()) for o, t in zip(outs, train))
    assert mismatches == 0
    assert eng.runner.num_graph_steps > 0               # the triton experts never sync: CUDA graphs as a dense model
    alone = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=512, page_size=32)).generate(prompts[:1], params)
    assert alone[0].output_ids == outs[0].output_ids and alone[0].output_logprobs == outs[0].output_logprobs


def test_regimes_r1_to_r5(model):
    rep = run_parity(model, ParityConfig(n_prompts=6, max_prompt_len=64, max_new_tokens=12, seed=5, pad_to=256))
    assert rep["passed"], {r: (v["n_mismatch"], v["max_abs_diff"]) for r, v in rep["regimes"].items()}


def test_ops_at_full_width_alone_equals_crowded():
    torch.manual_seed(0)
    T, E, k, H, I = 512, 128, 8, 2048, 768
    x = torch.randn(T, H, device="cuda").bfloat16()
    wgu = (torch.randn(E, 2 * I, H, device="cuda") * 0.02).bfloat16()
    wd = (torch.randn(E, H, I, device="cuda") * 0.02).bfloat16()
    logits = torch.randn(T, E, device="cuda").bfloat16()
    logits[:, :8] += 4.0                                # crowd experts 0..7
    w, ids = moe.route_triton(logits, k, True)
    y = moe.experts_triton(x, wgu, wd, ids)
    out = moe.combine_triton(y, w)
    for t in (0, 255, 511):
        w1, i1 = moe.route_triton(logits[t:t + 1].contiguous(), k, True)
        assert torch.equal(w1, w[t:t + 1]) and torch.equal(i1, ids[t:t + 1])
        y1 = moe.experts_triton(x[t:t + 1].contiguous(), wgu, wd, i1)
        assert torch.equal(y1, y[t:t + 1])
        assert torch.equal(moe.combine_triton(y1, w1), out[t:t + 1])
    assert torch.equal(moe.combine_torch(y, w), out)    # the stated fp32 order, no FMA, on the GPU too
