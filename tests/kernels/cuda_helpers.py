"""Helpers of the CUDA backend tests (tests/kernels/test_cuda_*.py; no tests here): the repository root, the
attention module, poisoned outputs, paged caches written with the cuda kv_cache_write, per-sequence inputs and their
varlen rows, the fused-decode counters."""
from __future__ import annotations

import os

import pytest
import torch

from areal_tik.kernels.cuda import elementwise as cuda_elementwise, extension as cuda_extension
from areal_tik.verify.contract import check_outputs_written, poison_

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def attn():
    from areal_tik.kernels.cuda import attention as cuda_attention
    return cuda_attention


def written(fn, shape, dtype, device="cuda"):
    """Run ``fn(out)`` into a poisoned buffer; assert every element was written."""
    out = torch.empty(shape, dtype=dtype, device=device)
    rep = check_outputs_written(lambda o: fn(o), out)
    assert rep, rep
    return out


def build_cache(ks, vs, page_size, gen, extra_pages=3):
    """Paged caches (NaN-poisoned) holding the sequences at random pages, written with the cuda
    kv_cache_write (plus a garbage token with slot -1 that must be skipped)."""
    Hkv, D = ks[0].shape[1:]
    npg = [max(1, -(-k.shape[0] // page_size)) for k in ks]
    num_pages = sum(npg) + extra_pages
    max_pages = max(npg) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    bt = torch.full((len(ks), max_pages), -1, dtype=torch.int32)
    slots, at = [], 0
    for i, k in enumerate(ks):
        pages = perm[at:at + npg[i]]
        at += npg[i]
        bt[i, :npg[i]] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(k.shape[0])
        slots.append(torch.tensor(pages)[pos // page_size] * page_size + pos % page_size)
    kc = poison_(torch.empty(num_pages, page_size, Hkv, D, dtype=torch.bfloat16, device="cuda"))
    vc = poison_(torch.empty_like(kc))
    kall, vall = torch.cat(ks), torch.cat(vs)
    junk = torch.randn(1, Hkv, D, device="cuda").bfloat16()
    slot = torch.cat(slots + [torch.tensor([-1])]).cuda()
    cuda_elementwise.kv_cache_write_cuda(torch.cat([kall, junk]), torch.cat([vall, junk]), kc, vc, slot)
    return kc, vc, bt.cuda()


def seq_data(lens, hq, hkv, D, g):
    """Per-sequence K, V, Q (drawn in that order from g), bf16 on the GPU."""
    ks = [torch.randn(L, hkv, D, generator=g).bfloat16().cuda() for L in lens]
    vs = [torch.randn(L, hkv, D, generator=g).bfloat16().cuda() for L in lens]
    qs = [torch.randn(L, hq, D, generator=g).bfloat16().cuda() for L in lens]
    return qs, ks, vs


def varlen_rows(cu, qs, ks, vs):
    """Each sequence's attention on its own through the varlen (training) path: the rows every
    paged regime must equal."""
    return [cu.attention_varlen_cuda(qs[i], ks[i], vs[i],
                                     torch.tensor([0, qs[i].shape[0]], dtype=torch.int32, device="cuda"),
                                     qs[i].shape[0]) for i in range(len(qs))]


def counters_zero(cu):
    c = cuda_extension.extension().decode_counters(torch.cuda.current_device())
    assert c is not None, "no fused-decode counter buffer was created"
    nz = int((c != 0).sum())
    assert nz == 0, f"{nz} fused-decode counters left non-zero"
    return c


def both_merges(cu, args, mode="auto"):
    """(fused, merge-kernel) outputs of one paged launch, each into a NaN-poisoned buffer."""
    shape, dtype = args[0].shape, args[0].dtype
    a = written(lambda o: cu.attention_paged_cuda(*args, mode=mode, out=o, decode_merge="fused"), shape, dtype)
    b = written(lambda o: cu.attention_paged_cuda(*args, mode=mode, out=o, decode_merge="kernel"), shape, dtype)
    return a, b


def wgmma_or_skip(cu):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma prefill kernel is sm_90a only")
    assert cuda_extension.extension().wgmma_prefill_available(), "sm_90 device but the build has no sm_90a wgmma kernel"
