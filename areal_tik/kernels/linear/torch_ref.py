"""Pure-PyTorch linear: the row-invariant torch_ref backend (ascending-k fp32 mul+add, any
device) and the float64 accuracy reference."""
from __future__ import annotations

import torch

from areal_tik.kernels.linear.autograd import linear_2d


def matmul_invariant_torch(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``x2 @ w^T`` from exactly-rounded elementwise ops, ascending k (row-invariant)."""
    xf = x2.float()
    wt = w.float().t().contiguous()  # [K, N]
    acc = torch.zeros((x2.shape[0], w.shape[0]), dtype=torch.float32, device=x2.device)
    for k in range(x2.shape[1]):
        acc = acc + xf[:, k, None] * wt[k][None, :]
    return acc


def _linear_torch_fwd(x2, w, b):
    acc = matmul_invariant_torch(x2, w)
    if b is not None:
        acc = acc + b.float()[None, :]
    return acc.to(x2.dtype)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row-invariant ``F.linear`` in plain PyTorch (any device; slow, the CPU path)."""
    return linear_2d(_linear_torch_fwd, x, weight, bias, triton_path=False)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ W^T + b`` (accuracy reference)."""
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y
