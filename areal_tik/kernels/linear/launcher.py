"""Launching the linear forward on a 2-D input (:func:`linear_fwd`: config choice, the fixed K split,
the TMA preconditions and their pointer-kernel fallback, the persistent grid, the split kernel's
workspace and arrival counters) and the triton backend's entry point :func:`linear_triton`."""
from __future__ import annotations

import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from areal_tik.kernels.linear.autograd import linear_2d
from areal_tik.kernels.linear.configs import CONFIGS, CONFIGS_FP32, TMA_KERNELS, fallback_ptr_config
from areal_tik.kernels.linear.selection import config_for, device_info
from areal_tik.kernels.linear.splits import k_split
from areal_tik.kernels.linear.triton_kernels import (
    linear_fwd_kernel, linear_fwd_splitk_kernel, linear_fwd_tma_kernel, linear_fwd_tma_persistent_kernel,
)

#: arrival counters of the split kernel, one int32 per output tile, per device; each launch leaves them at 0
COUNTER_CAPACITY = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision of the linear op's chain for inputs of ``dtype`` (bit-defining): ``ieee`` for
    fp32, the tensor cores' products for bf16/fp16. Every kernel that reproduces the chain launches with it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def split_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed arrival counters, created on first use outside a CUDA-graph capture (a buffer
    first allocated inside a capture would only be zeroed when the graph replays); None inside a capture
    that finds none, and the caller runs the in-program split instead (same bits)."""
    cnt = _COUNTERS.get(device)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = _COUNTERS[device] = torch.zeros(COUNTER_CAPACITY, dtype=torch.int32, device=device)
    return cnt


def tma_ok(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA descriptor preconditions: 16-byte aligned bases and row strides, one dtype."""
    return (w.dtype == x2.dtype
            and x2.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and (x2.stride(0) * x2.element_size()) % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0
            and x2.shape[1] * x2.element_size() >= 16)


def linear_fwd(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config: dict | str | None = None,
               splits: int | None = None) -> torch.Tensor:
    """Launch the forward kernel on a 2-D ``x2 [M, K]`` (row stride free, unit last stride).

    ``out`` (``[M, N]``, x dtype, unit last stride) receives the result when given;
    ``config`` forces a tile config (name in :data:`CONFIGS` or a dict) and ``splits`` the number of
    K chunks (default: :data:`.splits.K_SPLITS`) — tests/tuning. A TMA config whose preconditions
    (:func:`tma_ok`) fail, or a split config with one chunk or without arrival counters, runs its
    pointer-kernel twin, which the tests prove gives the same bits.
    """
    M, K = x2.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        if b is not None:
            out.copy_(b.to(out.dtype).expand(M, N))
        return out
    if isinstance(config, str):
        config = {**CONFIGS, **CONFIGS_FP32}[config]
    cfg = dict(config or config_for(M, N, K, x2))
    kind = cfg.pop("kind", None) or cfg.pop("kernel", "ptr")
    n_chunks, chunk = k_split(K, splits)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    counters = None
    if kind == "splitk" and n_chunks > 1 and tiles <= COUNTER_CAPACITY:
        counters = split_counters(x2.device)
    if (kind in TMA_KERNELS and not tma_ok(x2, w)) or (kind == "splitk" and counters is None):
        cfg = fallback_ptr_config(cfg)
        kind = cfg.pop("kernel")
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    prec = dot_precision(x2.dtype)
    bias = b if b is not None else out
    if kind == "ptr":
        linear_fwd_kernel[(tiles,)](
            x2, w, bias, out, M, N, K, chunk, x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=b is not None, PRECISION=prec, SPLITS=n_chunks, num_warps=nw, num_stages=ns, **cfg)
        return out
    if kind == "splitk":
        ws = torch.empty((n_chunks, M, N), dtype=torch.float32, device=x2.device)
        linear_fwd_splitk_kernel[(tiles, n_chunks)](
            x2, w, bias, out, ws, counters, M, N, K, chunk, x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=b is not None, PRECISION=prec, SPLITS=n_chunks, num_warps=nw, num_stages=ns, **cfg)
        return out
    bk = cfg["BLOCK_K"]
    xd = TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [bm, bk])
    wd = TensorDescriptor(w, [N, K], [w.stride(0), 1], [bn, bk])
    if kind == "tma":
        linear_fwd_tma_kernel[(tiles,)](
            xd, wd, bias, out, M, N, K, chunk, out.stride(0), HAS_BIAS=b is not None, PRECISION=prec,
            SPLITS=n_chunks, num_warps=nw, num_stages=ns, **cfg)
        return out
    # one program per SM whatever the problem (one compile; programs without a tile exit)
    progs = device_info(x2.device.index if x2.device.index is not None else torch.cuda.current_device())[1] \
        if x2.is_cuda else 4
    linear_fwd_tma_persistent_kernel[(progs,)](
        xd, wd, bias, out, M, N, K, chunk, out.stride(0), HAS_BIAS=b is not None, PRECISION=prec,
        SPLITS=n_chunks, NUM_PROGS=progs, num_warps=nw, num_stages=ns, **cfg)
    return out


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: str | None = None) -> torch.Tensor:
    """``F.linear`` with a row-invariant Triton GEMM (see the module docstring). ``config`` forces one tile
    config by name (precompilation; every config gives the same bits)."""
    fwd = linear_fwd if config is None else functools.partial(linear_fwd, config=config)
    return linear_2d(fwd, x, weight, bias, triton_path=True)
