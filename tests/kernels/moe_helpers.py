"""Shared by the MoE kernel tests: both backends of each op, and output buffers poisoned as they are allocated."""
import pytest
import torch

from areal_tik.kernels import moe
from areal_tik.verify.contract import poison_

ROUTE = {"triton": moe.route_triton, "torch_ref": moe.route_torch}
EXPERTS = {"triton": moe.experts_triton, "torch_ref": moe.experts_torch}
COMBINE = {"triton": moe.combine_triton, "torch_ref": moe.combine_torch}
SHARED_ADD = {"triton": moe.shared_add_triton, "torch_ref": moe.shared_add_torch}
BACKENDS = ("triton", "torch_ref")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every ``torch.empty`` / ``empty_like`` while the test runs returns a NaN-poisoned buffer (integers: -1), so
    an output element a kernel forgot to write shows up."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison_(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison_(empty_like(*a, **kw)))


def expert_weights(E, H, I, dtype=torch.bfloat16, scale=0.2):
    return ((torch.randn(E, 2 * I, H) * scale).to(dtype), (torch.randn(E, H, I) * scale).to(dtype))
