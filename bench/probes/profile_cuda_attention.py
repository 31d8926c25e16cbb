"""A few launches of one csrc attention kernel, for Nsight Compute (32 q / 8 kv heads, D 128, bf16).

    ncu -k regex:attn_kernel_wgmma -c 1 --launch-skip 2 ... python bench/probes/profile_cuda_attention.py prefill 4096
    ncu -k regex:attn_decode_kernel -c 1 --launch-skip 2 ... python bench/probes/profile_cuda_attention.py decode 16 8192 [CPC]

prefill L: one causal sequence of L tokens through attention_varlen (the default prefill kernel);
decode B CTX: B sequences of CTX cached positions (page size 64, shuffled pages), one query each,
through attention_paged (the fused split-KV decode); CPC forces the split chunks per CTA (decode_cpc).
"""
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/

from areal_tik.kernels.cuda import attention as cuda_attention, elementwise as cuda_elementwise, extension as cuda_extension

kind = sys.argv[1] if len(sys.argv) > 1 else "prefill"
HQ, HKV, D = 32, 8, 128
dev, bf = "cuda", torch.bfloat16
if kind == "prefill":
    L = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    q = torch.randn(L, HQ, D, device=dev, dtype=bf)
    k = torch.randn(L, HKV, D, device=dev, dtype=bf)
    v = torch.randn(L, HKV, D, device=dev, dtype=bf)
    cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
    run = lambda: cuda_attention.attention_varlen_cuda(q, k, v, cu, L)  # noqa: E731
elif kind == "decode":
    B = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    from bench_cuda import decode_case
    q, kc, vc, bt, cq, sk = decode_case(B, ctx, hq=HQ, hkv=HKV, page=64, device=dev)
    if len(sys.argv) > 4:
        cpc = int(sys.argv[4])
        run = lambda: cuda_extension.extension().attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, D ** -0.5, 0,  # noqa: E731
                                                               decode_cpc=cpc)
    else:
        run = lambda: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1)  # noqa: E731
else:
    raise SystemExit(f"unknown kind {kind!r}: prefill | decode")
for _ in range(3):
    run()
torch.cuda.synchronize()
