"""Input checks shared by the dense kernel modules (linear, rms_norm, rope, swiglu, logprobs).

Every public entry point validates its inputs with these and raises ``TypeError`` (wrong
dtype) or ``ValueError`` (wrong device, shape, layout) with a message naming the argument,
instead of silently falling back to a different (non-invariant) path.
"""
from __future__ import annotations

import torch

from areal_tik.kernels import interpreting

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in allowed)}")


def check_same_dtype(**named: torch.Tensor) -> None:
    items = list(named.items())
    for n, t in items[1:]:
        if t.dtype != items[0][1].dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {items[0][0]} has {items[0][1].dtype}; they must match")


def check_triton_device(*named: tuple[str, torch.Tensor]) -> None:
    """Triton path: CUDA tensors on one device, or CPU tensors under the interpreter."""
    dev = None
    for n, t in named:
        if t is None:
            continue
        if t.device.type == "cuda":
            pass
        elif t.device.type == "cpu" and interpreting():
            pass
        else:
            raise ValueError(f"triton backend: {n} is on {t.device}; needs a CUDA tensor "
                             f"(or TRITON_INTERPRET=1 for CPU tensors)")
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise ValueError(f"{n} is on {t.device} but the other inputs are on {dev}")


def check_same_device(*named: tuple[str, torch.Tensor]) -> None:
    dev = None
    for n, t in named:
        if t is None:
            continue
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise ValueError(f"{n} is on {t.device} but the other inputs are on {dev}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())} for shape {tuple(t.shape)}); "
                         f"call .contiguous() explicitly")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension (strides {tuple(t.stride())})")


def as_2d(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` viewed as 2-D (leading dims flattened) without a copy; ``layout`` names the 2-D
    shape in the error (e.g. "[M, K]")."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"x of shape {tuple(x.shape)} and strides {tuple(x.stride())} cannot be viewed as "
                         f"{layout} without a copy; pass a contiguous tensor") from e


def div16_attrs(fn, names) -> dict:
    """ASTSource ``attrs`` marking ``names`` (pointer/stride args of ``fn``) divisible by 16,
    the specialisation Triton applies at launch to aligned tensors (compile checks)."""
    idx = {n: i for i, n in enumerate(fn.arg_names)}
    return {(idx[n],): [["tt.divisibility", 16]] for n in names}
