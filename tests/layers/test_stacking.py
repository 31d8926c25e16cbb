"""Stacked q/k/v and gate/up projections in the engine: the same bits as the separate ones, parameters
still HF-named views, in-place weight updates reach the stack, autograd keeps the separate path."""
import pytest
import torch

from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
from areal_tik.layers import weights_digest
from areal_tik.layers.logprob_head import packed_logprobs
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model
from areal_tik.layers.stacking import stack_projections, stacked_projection

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(model, stack):
    return LLMEngine(model, EngineConfig(max_num_seqs=8, max_model_len=96, page_size=16, enforce_eager=True,
                                         stack_projections=stack))


def _gen(eng, prompts):
    outs = eng.generate(prompts, [SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=11 + i)
                                  for i in range(len(prompts))])
    return [(list(o.output_ids), torch.tensor(o.output_logprobs)) for o in outs]


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_stacked_engine_equals_separate(name):
    torch.manual_seed(0)
    a = patch_model(build_model(name, device=DEV, seed=3), kernels="tik")
    b = patch_model(build_model(name, device=DEV, seed=3), kernels="tik")
    d0 = weights_digest.model_digest(a)
    ea, eb = _engine(a, True), _engine(b, False)
    assert getattr(a.model.layers[0].self_attn, "_tik_qkv", None) is not None
    assert getattr(b.model.layers[0].self_attn, "_tik_qkv", None) is None
    assert weights_digest.model_digest(a) == d0                  # names and bits of the parameters unchanged
    x = torch.randn(3, a.config.hidden_size, device=DEV).to(torch.bfloat16)
    with torch.no_grad():                                        # the stacked path is the one that runs
        assert stacked_projection(a.model.layers[0].self_attn, "_tik_qkv", x) is not None
    assert stacked_projection(a.model.layers[0].self_attn, "_tik_qkv", x) is None     # autograd on: separate
    prompts = [torch.randint(3, a.config.vocab_size, (n,)).tolist() for n in (5, 17, 9)]
    ra, rb = _gen(ea, prompts), _gen(eb, prompts)
    for (ta, la), (tb, lb) in zip(ra, rb):
        assert ta == tb and torch.equal(la, lb)
    # the trainer's forward (autograd off) on the stacked model gives the unstacked model's bits
    ids = torch.tensor(sum(prompts, []), device=DEV)
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(packed_logprobs(a, ids, cu, temperature=1.0), packed_logprobs(b, ids, cu, temperature=1.0))


def test_in_place_update_reaches_the_stack_and_replacement_falls_back():
    torch.manual_seed(1)
    m = patch_model(build_model("tiny-qwen2", device=DEV, seed=1), kernels="tik")
    ref = patch_model(build_model("tiny-qwen2", device=DEV, seed=1), kernels="tik")
    assert stack_projections(m) == 2 * m.config.num_hidden_layers
    assert stack_projections(m) == 0                                 # idempotent
    attn = m.model.layers[0].self_attn
    st = attn._tik_qkv
    new_k = torch.randn_like(attn.k_proj.weight)
    with torch.no_grad():
        attn.k_proj.weight.copy_(new_k)                              # how weight updates write
        ref.model.layers[0].self_attn.k_proj.weight.copy_(new_k)
    assert st.intact() and torch.equal(st.weight[st.sizes[0]:st.sizes[0] + st.sizes[1]], new_k)
    ids = torch.randint(3, m.config.vocab_size, (12,), device=DEV)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(packed_logprobs(m, ids, cu, temperature=1.0), packed_logprobs(ref, ids, cu, temperature=1.0))
    # a parameter replaced by another tensor: the stack is no longer intact, the separate path runs (fresh bits)
    other = torch.randn_like(attn.v_proj.weight)
    attn.v_proj.weight = torch.nn.Parameter(other)
    ref.model.layers[0].self_attn.v_proj.weight = torch.nn.Parameter(other.clone())
    assert not st.intact()
    with torch.no_grad():
        assert torch.equal(packed_logprobs(m, ids, cu, temperature=1.0), packed_logprobs(ref, ids, cu, temperature=1.0))


def test_autograd_uses_separate_parameters():
    m = patch_model(build_model("tiny-qwen2", device=DEV, seed=2), kernels="tik")
    stack_projections(m)
    ids = torch.randint(3, m.config.vocab_size, (10,), device=DEV)
    lp = packed_logprobs(m, ids, torch.tensor([0, 10], dtype=torch.int32), temperature=1.0)
    lp.sum().backward()
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_default_kernels_are_never_stacked():
    m = patch_model(build_model("tiny-qwen2", device=DEV, seed=2), kernels="default")
    assert stack_projections(m) == 0


def test_stacked_mlp_runs_the_fused_activation_with_the_same_bits(monkeypatch, seed_rng):
    """A stacked tik MLP runs gate/up and SiLU-and-multiply as one ``linear_silu_mul`` launch where the bound ops
    allow it: the same bits as the stacked GEMM then ``silu_mul_packed``, and as the separate projections."""
    from areal_tik.layers import modules
    m = patch_model(build_model("tiny-qwen2", device=DEV, seed=5), kernels="tik")
    assert stack_projections(m) > 0
    mlp = m.model.layers[1].mlp
    ops = mlp._tik_ops
    assert modules.fuses_gate_up_silu(ops)
    calls = []
    fused_op = ops.linear_silu_mul
    monkeypatch.setattr(ops, "linear_silu_mul", lambda *a: calls.append(1) or fused_op(*a))
    x = torch.randn(5, m.config.hidden_size, device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        fused = mlp(x)
        assert len(calls) == 1
        monkeypatch.setattr(modules, "fuses_gate_up_silu", lambda ops: False)
        apart = mlp(x)
        assert len(calls) == 1
    separate = mlp(x).detach()                      # autograd on: gate_proj / up_proj / silu_mul apart
    assert torch.equal(fused, apart) and torch.equal(fused, separate)
