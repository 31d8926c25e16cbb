"""Row-invariant linear layer: ``y = x @ W^T (+ b)``, one reduction schedule for every M.

Maths: ``y[m, n] = round_to(x.dtype)( sum_k x[m, k] * W[n, k]  (+ b[n]) )`` with the sum
accumulated in fp32; bias added in fp32 before the single rounding.

Shapes/dtypes: x ``[..., K]`` (bf16, fp16 or fp32, unit stride in the last dim; a 2-D x
may have any row stride), W ``[N, K]`` contiguous, same dtype, b ``[N]`` or None. Output
``[..., N]`` in x's dtype, contiguous. fp32 inputs use exact fp32 products (``ieee``,
no TF32).

Accuracy: relative Frobenius error against :func:`linear_reference` (float64) below
``1e-2`` for bf16 (a final bf16 rounding dominates, ~2e-3 typical), ``1e-5`` for fp32.

Invariance (triton backend): output row m depends only on x[m], W and b, bit for bit —
not on M, on the other rows, on where row m sits in the batch, on padding rows. Every
output tile is reduced as ``acc = tl.dot(x_tile, w_tile^T, acc)`` over K in ascending
BLOCK_K=64 steps, fp32 accumulator, no split-K. The tile sizes in M and N (and warps,
stages, K-loop unrolling) are chosen per problem size from :data:`CONFIGS`; on the H200
with Triton 3.6 that form has been measured bit-identical across such tiles, and
``tests/kernels/test_linear.py::test_gpu_all_configs_bit_identical`` proves it for every
config in the table on the GPU it runs on. Under the CPU interpreter one fixed config is
used (the interpreter's numpy matmul is *not* tile-shape invariant).

torch_ref backend: the same row invariance on any device, from a loop over K of
``acc = acc + x[:, k] * W[:, k]`` (separately rounded fp32 ops, ascending k). Its bits
differ from the triton backend's; the contract holds within one backend.

Backward (both backends): ``dx = dy @ W``, ``dW = dy^T @ x``, ``db = sum dy`` with
torch matmuls (fp32 accumulation); gradients are accurate but not promised invariant.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from areal_tik.kernels._dense_common import (
    check_dtype, check_last_dim_contiguous, check_contiguous, check_same_device, check_same_dtype,
    check_triton_device, div16_attrs, interpreting,
)

__all__ = ["linear_triton", "linear_torch", "linear_reference", "linear_fwd", "pick_config", "CONFIGS"]

BLOCK_K = 64  # the bit-defining reduction step (fixed for every config)


@triton.jit
def _linear_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_UNROLL: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile; K walked ascending in BLOCK_K steps.

    K_UNROLL only issues K_UNROLL tile loads per loop trip (more bytes in flight for
    memory-bound decode); the sequence of ``acc = dot(a, b^T, acc)`` over BLOCK_K chunks
    is the same for every K_UNROLL.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped tile order: GROUP_M row-tiles share each weight tile while it is in L2
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size)
    pid_n = (pid % num_in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    K_STEP: tl.constexpr = BLOCK_K * K_UNROLL
    k_main = (K // K_STEP) * K_STEP
    for k in range(0, k_main, K_STEP):
        for u in tl.static_range(K_UNROLL):
            a = tl.load(x_ptrs + (k + u * BLOCK_K), mask=m_mask[:, None], other=0.0)
            b = tl.load(w_ptrs + (k + u * BLOCK_K), mask=n_mask[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    for k in range(k_main, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)

    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------- configs

def _cfg(bm, bn, warps, stages, unroll=1, group=8):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, K_UNROLL=unroll, GROUP_M=group,
                num_warps=warps, num_stages=stages)


#: Every tile config the triton backend may use on a GPU. They differ only in M/N tiling,
#: warps, stages and load unrolling, never in the reduction (BLOCK_K=64, ascending K,
#: one fp32 accumulator); the GPU test checks each against the others bit for bit.
CONFIGS = {
    # decode: memory bound, small M tile, N tile sized for enough programs, 4 loads in flight
    "dec16_n16": _cfg(16, 16, 4, 4, unroll=4),
    "dec16_n32": _cfg(16, 32, 4, 4, unroll=4),
    "dec16_n64": _cfg(16, 64, 4, 4, unroll=2),
    "dec32_n32": _cfg(32, 32, 4, 4, unroll=2),
    "dec32_n64": _cfg(32, 64, 4, 4, unroll=2),
    "dec64_n64": _cfg(64, 64, 4, 4, unroll=2),
    # medium M
    "mid64_n128": _cfg(64, 128, 4, 4),
    "big128_n128": _cfg(128, 128, 8, 4),
    # large M: Hopper-style big tile
    "big128_n256": _cfg(128, 256, 8, 3),
}

#: fp32 inputs take twice the shared memory per stage: smaller tiles, fewer stages.
CONFIGS_FP32 = {
    "f32_dec16_n32": _cfg(16, 32, 4, 2),
    "f32_mid64_n64": _cfg(64, 64, 4, 2),
    "f32_big64_n128": _cfg(64, 128, 8, 2),
}

#: The single config used under the CPU interpreter (tile-shape invariance of the
#: interpreter's numpy dot is not guaranteed, so tests there use one tile shape).
INTERPRETER_CONFIG = _cfg(16, 32, 4, 1, unroll=2, group=4)

_NUM_SMS = 132  # H100/H200 SXM; only affects speed (tile choice), never bits


def _dec_bn(N: int, bm: int) -> int:
    if N >= 64 * 256 or bm >= 64:
        return 64
    if N >= 32 * 128:
        return 32
    return 16


@functools.lru_cache(maxsize=4096)
def pick_config(M: int, N: int, K: int) -> str:
    """Name of the GPU tile config for an ``[M, K] x [K, N]`` problem (speed only)."""
    if M <= 16:
        return f"dec16_n{_dec_bn(N, 16)}"
    if M <= 32:
        return "dec32_n64" if _dec_bn(N, 32) == 64 else "dec32_n32"
    if M <= 64:
        return "dec64_n64"
    if M <= 256:
        return "mid64_n128"
    tiles_256 = triton.cdiv(M, 128) * triton.cdiv(N, 256)
    return "big128_n256" if tiles_256 >= _NUM_SMS else "big128_n128"


def _config_for(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    if interpreting():
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return CONFIGS_FP32["f32_dec16_n32" if M <= 16 else "f32_mid64_n64" if M <= 256 else "f32_big64_n128"]
    return CONFIGS[pick_config(M, N, K)]


# --------------------------------------------------------------------------- launcher

def linear_fwd(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config: dict | str | None = None) -> torch.Tensor:
    """Launch the forward kernel on a 2-D ``x2 [M, K]`` (row stride free, unit last stride).

    ``out`` (``[M, N]``, x dtype, unit last stride) receives the result when given;
    ``config`` forces a tile config (name in :data:`CONFIGS` or a dict) — tests only.
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
    cfg = dict(config or _config_for(M, N, K, x2.dtype))
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _linear_fwd_kernel[grid](
        x2, w, b if b is not None else w, out, M, N, K,
        x2.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=b is not None, PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        num_warps=nw, num_stages=ns, **cfg,
    )
    return out


def _validate(x, weight, bias, triton_path: bool):
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_same_dtype(x=x, weight=weight)
    if bias is not None:
        check_dtype("bias", bias)
        check_same_dtype(x=x, bias=bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        check_contiguous("bias", bias)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x last dim {tuple(x.shape)[-1:]} does not match weight K={weight.shape[1]}")
    check_contiguous("weight", weight)
    check_last_dim_contiguous("x", x)
    if triton_path:
        check_triton_device(("x", x), ("weight", weight), ("bias", bias))
    else:
        check_same_device(("x", x), ("weight", weight), ("bias", bias))


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"x of shape {tuple(x.shape)} and strides {tuple(x.stride())} cannot be viewed as "
                         f"[M, K] without a copy; pass a contiguous tensor") from e


def _linear_backward(ctx, dy, x2, w):
    dx = dw = db = None
    dy = dy.contiguous()
    if ctx.needs_input_grad[0]:
        dx = (dy @ w).to(x2.dtype)
    if ctx.needs_input_grad[1]:
        dw = (dy.t() @ x2).to(w.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dy.float().sum(0).to(dy.dtype)
    return dx, dw, db


class _LinearTritonFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, b):
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return linear_fwd(x2, w, b)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        return _linear_backward(ctx, dy, x2, w)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a row-invariant Triton GEMM (see the module docstring)."""
    _validate(x, weight, bias, triton_path=True)
    x2 = _as_2d(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        y = _LinearTritonFn.apply(x2, weight, bias)
    else:
        y = linear_fwd(x2, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------- torch_ref

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


class _LinearTorchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, b):
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return _linear_torch_fwd(x2, w, b)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        return _linear_backward(ctx, dy, x2, w)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row-invariant ``F.linear`` in plain PyTorch (any device; slow, the CPU path)."""
    _validate(x, weight, bias, triton_path=False)
    x2 = _as_2d(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        y = _LinearTorchFn.apply(x2, weight, bias)
    else:
        y = _linear_torch_fwd(x2, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ W^T + b`` (accuracy reference)."""
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y


OPS = {"linear": {"triton": linear_triton, "torch_ref": linear_torch}}
META = {"linear.BLOCK_K": BLOCK_K, "linear.form": "acc=tl.dot(a,b^T,acc) ascending K, fp32 acc, no split-K",
        "linear.torch_ref": "ascending-k fp32 mul+add"}

_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
        "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}


def _spec(name, has_bias=False, dtype="bf16"):
    c = dict({**CONFIGS, **CONFIGS_FP32}[name])
    nw, ns = c.pop("num_warps"), c.pop("num_stages")
    sig = {k: (f"*{dtype}" if v.startswith("*") else v) for k, v in _SIG.items()}
    return dict(fn=_linear_fwd_kernel, signature=sig,
                constexprs=dict(c, HAS_BIAS=has_bias, PRECISION="ieee" if dtype == "fp32" else "tf32"),
                num_warps=nw, num_stages=ns,
                attrs=div16_attrs(_linear_fwd_kernel, ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "N", "K",
                                                        "stride_xm", "stride_wn", "stride_ym"]))


COMPILE_SPECS = ([_spec(n) for n in CONFIGS] + [_spec("mid64_n128", has_bias=True)]
                 + [_spec(n, dtype="fp32") for n in CONFIGS_FP32])
