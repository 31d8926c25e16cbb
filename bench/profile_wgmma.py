"""One wgmma prefill launch (32 q / 8 kv heads, D 128, causal) for Nsight Compute:

    ncu -k regex:attn_kernel_wgmma -c 1 --section ... python bench/profile_wgmma.py [L]
"""
import sys

import torch

from areal_tik.kernels import cuda_ops

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
q = torch.randn(L, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(L, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(L, 8, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
for _ in range(3):
    cuda_ops.attention_varlen_cuda(q, k, v, cu, L, prefill_kernel="wgmma")
torch.cuda.synchronize()
