"""moe_experts: a token's expert outputs are the same bits alone and in a batch where its experts are crowded;
equal to the linear + silu_mul_packed ops on the single row; accurate; a deterministic, accurate backward.

Negative control: HF's own MoE block on its default kernels (``torch.nn.functional.linear`` per expert,
``index_add_`` combine) gives a token other bits alone than in a crowded batch."""
import pytest
import torch

from areal_tik.dispatch.bound import bind
from areal_tik.kernels import moe
from moe_helpers import BACKENDS, EXPERTS, expert_weights, poisoned_empty  # noqa: F401  (fixture)

E, H, I = 8, 64, 32


def _crowded(T=48, k=2):
    """Token 0 routed to experts 3 and 5; every other token to 3 or 5 as well, with some other expert."""
    ids = torch.stack([torch.where(torch.arange(T) % 2 == 0, 3, 5), torch.randint(0, E, (T,))], 1)
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    ids[0] = torch.tensor([3, 5])
    return ids[:, :k].contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_alone_equals_crowded_batch(backend, seed_rng, poisoned_empty):  # noqa: F811
    wgu, wd = expert_weights(E, H, I)
    x = torch.randn(48, H).bfloat16()
    ids = _crowded()
    y = EXPERTS[backend](x, wgu, wd, ids)
    assert not torch.isnan(y).any()
    for t in (0, 1, 47):
        alone = EXPERTS[backend](x[t:t + 1].contiguous(), wgu, wd, ids[t:t + 1].contiguous())
        assert torch.equal(alone, y[t:t + 1])
    perm = torch.randperm(48)
    assert torch.equal(EXPERTS[backend](x[perm].contiguous(), wgu, wd, ids[perm].contiguous()), y[perm])


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_the_dense_ops_on_one_row(backend, seed_rng):
    ops = bind(backend)
    wgu, wd = expert_weights(E, H, I)
    x = torch.randn(10, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(10)]).contiguous()
    y = EXPERTS[backend](x, wgu, wd, ids)
    for t in (0, 9):
        for r in range(3):
            e = int(ids[t, r])
            one = ops.linear(ops.silu_mul_packed(ops.linear(x[t:t + 1], wgu[e])), wd[e])
            assert torch.equal(one[0], y[t, r])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_accurate_against_reference(backend, dtype, tol, seed_rng):
    wgu, wd = expert_weights(E, H, I, dtype)
    x = torch.randn(20, H).to(dtype)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(20)]).contiguous()
    y, ref = EXPERTS[backend](x, wgu, wd, ids), moe.experts_reference(x, wgu, wd, ids)
    assert (y.double() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_matches_reference_and_repeats(backend, seed_rng):
    wgu, wd = expert_weights(E, H, I, torch.float32)
    x = torch.randn(14, H)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(14)]).contiguous()
    ids[:, 0] = torch.where(torch.arange(14) < 7, 2, ids[:, 0])     # a crowded expert
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    dy = torch.randn(14, 2, H)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, wgu, wd)]
        (EXPERTS[backend](*leaves, ids) * dy).sum().backward()
        grads.append([t.grad for t in leaves])
    ref = [t.double().requires_grad_() for t in (x, wgu, wd)]
    (moe.experts_reference(*ref, ids) * dy.double()).sum().backward()
    for g, r in zip(grads[0], ref):
        assert (g.double() - r.grad).norm() / r.grad.norm() < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_negative_control_hf_experts_differ_alone_and_crowded(seed_rng):
    """HF's Qwen3-MoE experts (eager loop: ``F.linear`` per expert on its gathered tokens, ``index_add_``): a
    token's output alone differs from its output in a crowded batch on some input (CPU GEMMs block by M). Which
    dtype shows it depends on the CPU's GEMM library: on some, bf16 GEMMs round a lone row like a batched one
    (measured on an AMD EPYC host) while fp32 GEMMs still block by M; the first dtype that differs is used."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    H2, I2 = 2048, 384                   # at bf16 with K 2048, CPU GEMMs round a lone row otherwise (measured)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=H2, moe_intermediate_size=I2, num_experts=2,
                               num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    T = 64
    ids = torch.tensor([[0, 1]] * T)                 # every token on both experts: crowded
    w = torch.full((T, 2), 0.5)
    differs = []
    for dtype in (torch.bfloat16, torch.float32):
        ex = Qwen3MoeExperts(cfg).to(dtype)
        with torch.no_grad():
            ex.gate_up_proj.normal_(0, 0.05)
            ex.down_proj.normal_(0, 0.05)
        for _ in range(3):                           # fresh tokens until a row differs (typically the first try)
            x = torch.randn(T, H2).to(dtype)
            with torch.no_grad():
                batch = ex(x, ids, w.to(dtype))
                alone = torch.cat([ex(x[t:t + 1], ids[t:t + 1], w[t:t + 1].to(dtype)) for t in range(T)])
            differs.append((str(dtype), int((alone != batch).any(-1).sum())))
            if differs[-1][1]:
                break
        if differs[-1][1]:
            break
    assert differs[-1][1] > 0, differs
    # ours on the same weights and tokens: equal
    y = moe.experts_torch(x, ex.gate_up_proj.detach(), ex.down_proj.detach(), ids)
    assert torch.equal(torch.cat([moe.experts_torch(x[t:t + 1], ex.gate_up_proj.detach(), ex.down_proj.detach(),
                                                    ids[t:t + 1]) for t in range(2)]), y[:2])
