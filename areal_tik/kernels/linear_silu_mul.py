"""The stacked gate/up GEMM and SiLU-and-multiply as one launch: ``silu_mul_packed(linear(x, w, b))``.

Maths: with ``w [2I, K]`` the gate rows then the up rows (``layers/stacking``) and ``b [2I]`` or None::

    g = round(x @ w[:I]^T + b[:I]),  u = round(x @ w[I:]^T + b[I:])     (the linear op, kernels/linear)
    y = round(round(silu(g)) * u)                                      (kernels/swiglu.silu_times)

Returns ``y [..., I]`` in x's dtype, contiguous. The ``[..., 2I]`` GEMM output is never written: at decode
sizes it is as many bytes as the MLP's activations read and written twice more, plus a launch.

Shapes/dtypes: the linear op's (x ``[..., K]`` bf16 / fp16 / fp32, a unit last stride; w contiguous ``[2I, K]``
of x's dtype, an even row count; b ``[2I]`` or None). Forward only: the stacked path runs with autograd off
(training keeps gate_proj and up_proj apart); an argument that needs a gradient is refused.

Triton: program (tile m, tile n) of the ``[M, I]`` output reduces the gate columns ``n`` and then the up
columns ``I + n`` with the linear op's own chain helpers (``ptr_split_sum`` or ``_tma_split_sum``: the fixed K
split of :mod:`.linear.splits`, ascending ``BLOCK_K`` dots from fresh fp32 accumulators), adds the bias and
rounds as the linear op's store does, then applies :func:`~areal_tik.kernels.swiglu.silu_times`. So every
output element has the bits of ``linear_triton`` then ``silu_mul_packed_triton``, for any tile (the linear
op's tile-invariance; ``tests/kernels/test_linear_silu_mul.py`` checks it in the interpreter and on the GPU
for every tile the stacked GEMM may pick). The tile is the stacked GEMM's own pick for ``[M, 2I]`` with half
its N tile (the same number of programs, each reducing two half-width tiles); persistent and split picks run
as the one-tile-per-program TMA or pointer kernel (same chain). Above :data:`FUSED_MAX_M` rows (prefill) the
two ops run apart, their own tiles and persistent kernel (the same bits by definition).
torch_ref: exactly ``linear_torch`` then ``silu_mul_packed_torch``.

Invariance: output row m depends only on ``x[m]``, w and b (the linear op's row invariance; silu_times is
elementwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from areal_tik.kernels._dense_common import as_2d, div16_attrs
from areal_tik.kernels.linear import linear_torch
from areal_tik.kernels.linear.autograd import validate_linear
from areal_tik.kernels.linear.configs import CONFIGS, CONFIGS_FP32, TMA_KERNELS, fallback_ptr_config
from areal_tik.kernels.linear.launcher import dot_precision, linear_fwd, tma_ok
from areal_tik.kernels.linear.selection import config_for, tile_configs
from areal_tik.kernels.linear.splits import k_split
from areal_tik.kernels.linear.triton_kernels import _ptr_tile, _tile_coords, _tma_split_sum, ptr_split_sum
from areal_tik.kernels.swiglu import silu_mul_packed_torch, silu_mul_packed_triton, silu_times

__all__ = ["linear_silu_mul_triton", "linear_silu_mul_torch", "linear_silu_mul_fwd", "fused_tile_configs",
           "FUSED_MAX_M"]

#: rows up to which the fused kernel runs (decode and mixed steps); above it the GEMM is compute-bound, its output
#: write a small share, and the persistent GEMM then silu_mul_packed run apart
FUSED_MAX_M = 256


@triton.jit
def _store_silu_tile(g, u, b_ptr, y_ptr, pid_m, pid_n, M, I, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The linear op's store (bias in fp32, one rounding) for the gate and up tiles, then silu_times."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    if HAS_BIAS:
        g = g + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        u = u + tl.load(b_ptr + I + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    gr = g.to(y_ptr.dtype.element_ty).to(tl.float32)
    ur = u.to(y_ptr.dtype.element_ty).to(tl.float32)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, silu_times(gr, ur, y_ptr), mask=(offs_m[:, None] < M) & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def linear_silu_mul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, I, K, K_CHUNK, UP_OFF,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_UNROLL: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of y: the gate tile's chain, the up tile's chain (``UP_OFF`` elements, I
    weight rows, further), then the SiLU-and-multiply epilogue (pointer loads)."""
    pid = tl.program_id(0)
    pid_m, pid_n, offs_m, offs_n, offs_k, m_mask, n_mask, x_ptrs, w_ptrs = _ptr_tile(
        pid, x_ptr, w_ptr, M, I, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    g = ptr_split_sum(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, K, K_CHUNK,
                      BLOCK_M, BLOCK_N, BLOCK_K, K_UNROLL, PRECISION, SPLITS)
    u = ptr_split_sum(x_ptrs, w_ptrs + UP_OFF, m_mask, n_mask, offs_k, K, K_CHUNK,
                      BLOCK_M, BLOCK_N, BLOCK_K, K_UNROLL, PRECISION, SPLITS)
    _store_silu_tile(g, u, b_ptr, y_ptr, pid_m, pid_n, M, I, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def linear_silu_mul_tma_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, I, K, K_CHUNK, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
):
    """:func:`linear_silu_mul_kernel` with tiles fetched by TMA (a gate tile reaching past row I reads up rows
    into columns it never stores; the up tiles past 2I are zero-filled)."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)
    g = _tma_split_sum(x_desc, w_desc, off_m, off_n, k_tiles, K_CHUNK // BLOCK_K,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, SPLITS)
    u = _tma_split_sum(x_desc, w_desc, off_m, I + off_n, k_tiles, K_CHUNK // BLOCK_K,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, SPLITS)
    _store_silu_tile(g, u, b_ptr, y_ptr, pid_m, pid_n, M, I, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N)


def fused_config(M: int, I: int, K: int, x2: torch.Tensor, w: torch.Tensor, config: dict | None = None):
    """``(kind, cfg)`` of the fused launch: the stacked GEMM's pick for ``[M, 2I]`` (or ``config``) with half its
    N tile; a TMA pick runs the TMA kernel where :func:`~.linear.launcher.tma_ok` holds, anything else the
    pointer kernel with the pick's tile."""
    cfg = dict(config or config_for(M, 2 * I, K, x2))
    kind = cfg.pop("kind", None) or cfg.pop("kernel", "ptr")
    if kind in TMA_KERNELS and tma_ok(x2, w):
        cfg = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")}
        kind = "tma"
    else:
        cfg = fallback_ptr_config(cfg)
        kind = cfg.pop("kernel")
    cfg["BLOCK_N"] = max(16, cfg["BLOCK_N"] // 2)
    return kind, cfg


def linear_silu_mul_fwd(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The launch on a 2-D ``x2 [M, K]``, no checks, into ``out [M, I]`` or a new tensor; ``config`` forces the
    stacked GEMM's tile config (tests)."""
    M, K = x2.shape
    I = w.shape[0] // 2
    if M > 0 and I > 0 and (K == 0 or (M > FUSED_MAX_M and config is None)):
        y = silu_mul_packed_triton(linear_fwd(x2, w, b))        # apart: no copy unless the caller gave ``out``
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty((M, I), dtype=x2.dtype, device=x2.device)
    if M == 0 or I == 0:
        return out
    kind, cfg = fused_config(M, I, K, x2, w, config)
    n_chunks, chunk = k_split(K)
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(I, bn),)
    bias = b if b is not None else out
    prec = dot_precision(x2.dtype)
    if kind == "ptr":
        linear_silu_mul_kernel[grid](x2, w, bias, out, M, I, K, chunk, I * w.stride(0), x2.stride(0), w.stride(0),
                                     out.stride(0), HAS_BIAS=b is not None, PRECISION=prec, SPLITS=n_chunks,
                                     num_warps=nw, num_stages=ns, **cfg)
        return out
    xd = TensorDescriptor(x2, [M, K], [x2.stride(0), 1], [bm, cfg["BLOCK_K"]])
    wd = TensorDescriptor(w, [2 * I, K], [w.stride(0), 1], [bn, cfg["BLOCK_K"]])
    linear_silu_mul_tma_kernel[grid](xd, wd, bias, out, M, I, K, chunk, out.stride(0), HAS_BIAS=b is not None,
                                     PRECISION=prec, SPLITS=n_chunks, num_warps=nw, num_stages=ns, **cfg)
    return out


def _validate(x, weight, bias, triton_path):
    validate_linear(x, weight, bias, triton_path)
    if weight.shape[0] % 2:
        raise ValueError(f"linear_silu_mul: the weight must stack gate then up rows (an even count), got "
                         f"{tuple(weight.shape)}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise ValueError("linear_silu_mul is forward-only (the stacked inference path): run it under "
                         "torch.no_grad(), or gate_proj/up_proj and silu_mul apart for gradients")


def linear_silu_mul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           config: str | None = None) -> torch.Tensor:
    """``silu_mul_packed(linear(x, weight, bias))`` in one launch at decode sizes (the same bits). ``config``
    forces the stacked GEMM's tile config by name (precompilation; every config gives the same bits)."""
    _validate(x, weight, bias, True)
    forced = {**CONFIGS, **CONFIGS_FP32}[config] if config else None
    y = linear_silu_mul_fwd(as_2d(x, "[M, K]"), weight, bias, config=forced)
    return y.view(*x.shape[:-1], weight.shape[0] // 2)


def fused_tile_configs(n: int, k: int, dtype: torch.dtype, m_min: int, m_max: int, device) -> list[str]:
    """The ``TILE_CONFIGS`` hook: the stacked GEMM's configs a fused launch on ``[n, k]`` weights with m_min <= M
    <= min(m_max, FUSED_MAX_M) can take (each is its own compile of the fused kernels; above FUSED_MAX_M the
    linear op's own configs run)."""
    if m_min > FUSED_MAX_M:
        return []
    return tile_configs(n, k, dtype, m_min, min(m_max, FUSED_MAX_M), device)


def linear_silu_mul_torch(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch_ref ops apart: ``silu_mul_packed_torch(linear_torch(x, weight, bias))``."""
    _validate(x, weight, bias, False)
    return silu_mul_packed_torch(linear_torch(x, weight, bias))


OPS = {"linear_silu_mul": {"triton": linear_silu_mul_triton, "torch_ref": linear_silu_mul_torch}}
META = {"linear_silu_mul.tile": "the stacked GEMM's pick, half its N tile; apart above FUSED_MAX_M rows",
        "linear_silu_mul.fused_max_m": str(FUSED_MAX_M)}
USES = ("areal_tik.kernels.linear", "areal_tik.kernels.swiglu")
# the tile configs precompilation launches the fused op with (layers/precompile.py)
TILE_CONFIGS = {"linear_silu_mul": {"triton": fused_tile_configs}}


def _compile_spec(name: str, has_bias: bool = False, splits: int = 1) -> dict:
    """The fused launch of the stacked GEMM's config ``name`` (bf16), as :func:`fused_config` shapes it."""
    c = dict(CONFIGS[name])
    nw, ns, kind = c.pop("num_warps"), c.pop("num_stages"), c.pop("kernel")
    c["BLOCK_N"] = max(16, c["BLOCK_N"] // 2)
    cx = dict(HAS_BIAS=has_bias, PRECISION="tf32", SPLITS=splits)
    if kind in TMA_KERNELS:
        c = {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
        fn = linear_silu_mul_tma_kernel
        sig = {"x_desc": f"tensordesc<bf16[{c['BLOCK_M']}, {c['BLOCK_K']}]>",
               "w_desc": f"tensordesc<bf16[{c['BLOCK_N']}, {c['BLOCK_K']}]>", "b_ptr": "*bf16", "y_ptr": "*bf16",
               "M": "i32", "I": "i32", "K": "i32", "K_CHUNK": "i32", "stride_ym": "i32"}
        aligned = ["b_ptr", "y_ptr", "I", "K", "K_CHUNK", "stride_ym"]
    else:
        fn = linear_silu_mul_kernel
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "I": "i32",
               "K": "i32", "K_CHUNK": "i32", "UP_OFF": "i32", "stride_xm": "i32", "stride_wn": "i32",
               "stride_ym": "i32"}
        aligned = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "I", "K", "K_CHUNK", "UP_OFF", "stride_xm", "stride_wn",
                   "stride_ym"]
    return dict(fn=fn, signature=sig, constexprs=dict(c, **cx), num_warps=nw, num_stages=ns,
                attrs=div16_attrs(fn, aligned))


#: the decode picks of the 1.5B/7B stacked gate/up GEMMs' forms: a TMA tile, one with a bias, a pointer tile
#: with a split of K
COMPILE_SPECS = [_compile_spec("tma64_n128"), _compile_spec("tma64_n64_s6", has_bias=True),
                 _compile_spec("dec64_n64", splits=2)]
