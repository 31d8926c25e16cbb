"""Backward of the causal varlen (training) attention, shared by the Triton and the csrc forward's autograd.

Both forwards save their bf16 output and each row's base-2 log-sum-exp ``lse2 [T, Hq]`` (fp32, scores scaled
by ``sm_scale * log2(e)``). From those, two backward kernels compute dq, dk, dv:

- ``"triton"``: :func:`areal_tik.kernels.attention.varlen_backward`, the Triton flash-attention-2 recompute
  (a dk/dv kernel and a dq kernel, no atomics: the same gradient bits on every run);
- ``"flash"``: PyTorch's flash-attention-2 backward kernel (``aten._flash_attention_backward``, varlen, GQA)
  on the same output and ``lse2 * ln 2`` laid out ``[Hq, T]``. Its dq is accumulated with atomics, so its
  bits may differ from run to run (as SDPA's flash backward does). H200, same run
  (docs/results.md): 1.16-1.79x faster than the Triton backward on 12/2 and
  32/8 heads at D 128; relative error against float64 autograd 0.0025-0.0030 (Triton 0.0023-0.0025).

``Settings.attention_backward`` (set once by the entry point through :func:`configure`) picks: ``auto`` (default) takes ``flash`` where PyTorch
has the kernel for these tensors (a CUDA device of compute capability >= 8.0, bf16/fp16, head dim a
multiple of 8 up to 256) and ``torch.are_deterministic_algorithms_enabled()`` is False, else ``triton``;
``flash`` or ``triton`` force one (``flash`` where it cannot run raises). The forward's bits, the rollout /
training contract, do not depend on this choice: gradients are correct, not bitwise invariant.
"""
from __future__ import annotations

import math

import torch

from areal_tik.kernels.attention import triton_backward

__all__ = ["BACKWARDS", "ATTN_BACKWARD", "configure", "flash_backward_supported", "select_backward", "varlen_backward_flash",
           "varlen_attention_backward", "describe"]

BACKWARDS = ("auto", "flash", "triton")
ATTN_BACKWARD = "auto"   # the process's choice: configure() at the entry point (Settings.attention_backward)
_LN2 = math.log(2.0)


def flash_backward_supported(q: torch.Tensor, k: torch.Tensor) -> tuple[bool, str]:
    """Whether PyTorch's flash-attention-2 backward can run for q ``[T, Hq, D]`` / k ``[T, Hkv, D]``."""
    if not q.is_cuda or torch.version.cuda is None:
        return False, "not a CUDA tensor"
    if not hasattr(torch.ops.aten, "_flash_attention_backward"):
        return False, "this PyTorch has no aten._flash_attention_backward"
    avail = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if avail is not None and not avail():
        return False, "this PyTorch build has no flash attention"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return False, "flash attention needs compute capability >= 8.0"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"flash attention needs bf16/fp16, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return False, f"flash attention needs a head dim that is a multiple of 8 up to 256, got {d}"
    if q.shape[1] % k.shape[1]:
        return False, f"Hq {q.shape[1]} is not a multiple of Hkv {k.shape[1]}"
    return True, ""


def configure(choice: str) -> None:
    """Set the process's attention backward (``Settings.attention_backward``), once, at the entry point."""
    global ATTN_BACKWARD
    if choice not in BACKWARDS:
        raise ValueError(f"attention_backward={choice!r}: expected one of {BACKWARDS}")
    ATTN_BACKWARD = choice


def select_backward(q: torch.Tensor, k: torch.Tensor, choice: str | None = None) -> str:
    """``"flash"`` or ``"triton"`` for these tensors under ``choice`` (default :data:`ATTN_BACKWARD`)."""
    choice = ATTN_BACKWARD if choice is None else choice
    if choice not in BACKWARDS:
        raise ValueError(f"attention_backward={choice!r}: expected one of {BACKWARDS}")
    if choice == "triton":
        return "triton"
    ok, why = flash_backward_supported(q, k)
    if choice == "flash":
        if not ok:
            raise RuntimeError(f"attention backward 'flash' cannot run here: {why}")
        return "flash"
    return "flash" if ok and not torch.are_deterministic_algorithms_enabled() else "triton"


def varlen_backward_flash(q, k, v, out, lse2, cu_seqlens, max_seqlen, sm_scale, dout):
    """dq, dk, dv by PyTorch's flash-attention-2 varlen backward on the forward's ``out`` and base-2 ``lse2``."""
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    cu = cu_seqlens.to(torch.int32).contiguous()
    lse = (lse2.float() * _LN2).t().contiguous()  # [Hq, T], natural log
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)  # philox state: not read without dropout
    unused = torch.empty(0, device=q.device)
    m = int(max_seqlen)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, m, m, 0.0, True, rng,
                                                          unused, scale=float(sm_scale))
    return dq, dk, dv


def varlen_attention_backward(q, k, v, out, lse2, cu_seqlens, max_seqlen, sm_scale, qk_scale, dout, choice=None):
    """dq, dk, dv of the causal varlen attention from the forward's saved tensors (module docstring)."""
    if select_backward(q, k, choice) == "flash":
        return varlen_backward_flash(q, k, v, out, lse2, cu_seqlens, max_seqlen, sm_scale, dout)
    return triton_backward.varlen_backward(q, k, v, out, lse2, cu_seqlens, max_seqlen, sm_scale, qk_scale, dout)


def describe() -> str:
    """One line for ``areal-tik env``: the setting and what it selects here for bf16 D=128 GQA tensors."""
    if not torch.cuda.is_available():
        return f"{ATTN_BACKWARD} (no CUDA GPU: the Triton and csrc forwards, whose backward this is, do not run)"
    q = torch.empty(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(1, 2, 128, dtype=torch.bfloat16, device="cuda")
    try:
        picked = select_backward(q, k)
    except (RuntimeError, ValueError) as e:
        return f"{ATTN_BACKWARD}: {e}"
    if picked == "triton" and ATTN_BACKWARD == "auto":
        ok, why = flash_backward_supported(q, k)
        return f"auto -> triton ({why if not ok else 'deterministic algorithms are on'})"
    return f"{ATTN_BACKWARD} -> {picked}"
