"""moe_combine and moe_shared_add: the stated fp32 order, one rounding; both backends the same bits; a token's
row alone equals its row in a batch; accurate; backward accurate. Negative control: the same sum in another
order (descending rank) differs on some input."""
import json
import os
import subprocess
import sys

import pytest
import torch

from areal_tik.kernels import moe
from moe_helpers import BACKENDS, COMBINE, SHARED_ADD, poisoned_empty  # noqa: F401  (fixture)


def _inputs(T=33, k=8, H=96, dtype=torch.bfloat16):
    y = torch.randn(T, k, H).to(dtype)
    w = torch.softmax(torch.randn(T, k), -1)
    return y, w


@pytest.mark.parametrize("backend", BACKENDS)
def test_stated_order_alone_and_in_batch(backend, seed_rng, poisoned_empty):  # noqa: F811
    y, w = _inputs()
    out = COMBINE[backend](y, w)
    acc = torch.zeros(33, 96)
    for r in range(8):                               # the order the docstring states
        acc = acc + w[:, r, None] * y[:, r].float()
    assert torch.equal(out, acc.bfloat16())
    for t in (0, 32):
        assert torch.equal(COMBINE[backend](y[t:t + 1].contiguous(), w[t:t + 1].contiguous()), out[t:t + 1])


def test_backends_agree_and_other_orders_differ(seed_rng):
    y, w = _inputs(T=256)
    out = moe.combine_triton(y, w)
    assert torch.equal(out, moe.combine_torch(y, w))
    # negative control 1: HF's combine (each weighted output rounded to bf16, added in bf16 by index_add_ in
    # expert order) is not ours
    hf = torch.zeros(256, 96, dtype=torch.bfloat16)
    for r in torch.randperm(8).tolist():
        hf = hf + (w[:, r, None] * y[:, r]).bfloat16()
    assert not torch.equal(hf, out)
    # negative control 2: our fp32 sum in descending rank order (fp32 outputs, where no final rounding hides it)
    y32 = y.float()
    out32 = moe.combine_torch(y32, w)
    acc = torch.zeros(256, 96)
    for r in reversed(range(8)):
        acc = acc + w[:, r, None] * y32[:, r]
    assert not torch.equal(acc, out32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_accurate(backend, dtype, tol, seed_rng):
    y, w = _inputs(dtype=dtype)
    ref = moe.combine_reference(y, w)
    assert (COMBINE[backend](y, w).double() - ref).norm() / ref.norm() < tol
    r, s, g = torch.randn(9, 40).to(dtype), torch.randn(9, 40).to(dtype), torch.randn(9, 1).to(dtype)
    ref = moe.shared_add_reference(r, s, g)
    assert (SHARED_ADD[backend](r, s, g).double() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward(backend, seed_rng):
    y, w = _inputs(T=5, dtype=torch.float32)
    y.requires_grad_()
    w.requires_grad_()
    d = torch.randn(5, 96)
    (COMBINE[backend](y, w) * d).sum().backward()
    yr, wr = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (moe.combine_reference(yr, wr) * d.double()).sum().backward()
    assert torch.allclose(y.grad.double(), yr.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.grad.double(), wr.grad, rtol=1e-5, atol=1e-5)
    r, s, g = (torch.randn(*sh).requires_grad_() for sh in ((5, 40), (5, 40), (5, 1)))
    (SHARED_ADD[backend](r, s, g) * d[:, :40]).sum().backward()
    rr, sr, gr = (t.detach().double().requires_grad_() for t in (r, s, g))
    (moe.shared_add_reference(rr, sr, gr) * d[:, :40].double()).sum().backward()
    for a, b in ((r, rr), (s, sr), (g, gr)):
        assert torch.allclose(a.grad.double(), b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_add_row_alone_and_backends_agree(backend, seed_rng, poisoned_empty):  # noqa: F811
    r, s, g = torch.randn(17, 40).bfloat16(), torch.randn(17, 40).bfloat16(), torch.randn(17, 1).bfloat16()
    out = SHARED_ADD[backend](r, s, g)
    assert not torch.isnan(out).any()
    assert torch.equal(SHARED_ADD[backend](r[3:4].contiguous(), s[3:4].contiguous(), g[3:4].contiguous()), out[3:4])


def test_refuses_bad_arguments():
    y, w = _inputs(T=2)
    with pytest.raises(TypeError, match="weights"):
        moe.combine_torch(y, w.bfloat16())
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        moe.combine_torch(y, w[:, :3].contiguous())


_PTX_FMA = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from areal_tik.kernels import moe
spec = next(s for s in moe.COMPILE_SPECS if s["fn"].__name__ == "_combine_kernel")
out = {}
for fusion in (spec["enable_fp_fusion"], True):
    src = ASTSource(fn=spec["fn"], signature=dict(spec["signature"]), constexprs=dict(spec["constexprs"]))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["num_warps"],
                                                                        "enable_fp_fusion": fusion})
    out[str(fusion)] = k.asm["ptx"].count("fma.rn.f32")
print(json.dumps(out))
"""


def test_combine_compiles_without_fma_as_launched():
    """The combine's contract is ``acc += w * y`` as a rounded product then a rounded add (no FMA): its
    compile spec (what CI compiles for sm_90) carries the launch's ``enable_fp_fusion=False``, and that PTX has
    no ``fma.rn.f32``. Negative control: the same kernel compiled with fusion on has FMAs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _PTX_FMA], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts["False"] == 0 and counts["True"] > 0, counts
