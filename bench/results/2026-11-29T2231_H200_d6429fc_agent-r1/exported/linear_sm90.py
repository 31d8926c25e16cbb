# Exported by `areal-tik agent export` from run 'h200', version 6 (hash c901ef470b02e405), GPU arch sm_90. Do not edit by hand: re-export instead.
"""Agent root: a deliberately naive, contract-correct unified linear (Triton).

Maths: ``C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N])``; A, W bf16 (or fp32), fp32
accumulate, the result rounded once to ``out``'s dtype. Bias is added in fp32 after
the K loop, before the single rounding.

Contract (DESIGN.md section 2): every output element is ``acc = tl.dot(a, b, acc)``
over K blocks walked in ascending order from 0, with no split-K and no shape-dependent
change of the per-element reduction. Rows are computed independently (masked rows
read zeros and are never stored), so row m of C depends only on row m of A: any
subset or extension of the batch gives the same bits for the shared rows. On the
H200 this form is measured bitwise identical for BLOCK_M 16-128, BLOCK_N 64-256,
BLOCK_K 32-128, 4/8 warps, 2-4 stages; the agent's evaluator re-checks it per version.

This file is a *source template* for the optimization agent (areal_tik/agent): the
agent reads it as text, stores it content-hashed with its meta-parameters, and rewrites
the regions delimited by ``# <tik:NAME>`` / ``# </tik:NAME>`` comments (known code
transformations of the offline proposer). Entry point used by the evaluator:
``forward(x, w, bias, out, meta)`` writing ``x @ w.T (+ bias)`` into ``out``.

Meta-parameters: ``{"buckets": [{"max_m": int | None, "BLOCK_M", "BLOCK_N", "BLOCK_K",
"GROUP_M", "num_warps", "num_stages", "PROGS_PER_SM"}, ...]}``; a launch with M rows
uses the first bucket whose ``max_m`` is None or >= M.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _tile(tile_id, a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
          s_am, s_ak, s_wn, s_wk, s_cm, s_cn,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # <tik:tile-order>
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    # </tik:tile-order>
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # <tik:k-loop>
    # rows/cols past M/N wrap onto valid rows (computed, never stored): loads need no row mask
    offs_am = offs_m % M
    offs_wn = offs_n % N
    a_ptrs = a_ptr + offs_am[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = w_ptr + offs_wn[None, :] * s_wn + offs_k[:, None] * s_wk
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_wk
    # </tik:k-loop>
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _linear_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
                   s_am, s_ak, s_wn, s_wk, s_cm, s_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    # <tik:schedule>
    _tile(tl.program_id(0), a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
          s_am, s_ak, s_wn, s_wk, s_cm, s_cn,
          HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K)
    # </tik:schedule>


def _bucket(meta, m):
    for b in meta["buckets"]:
        if b.get("max_m") is None or m <= b["max_m"]:
            return b
    return meta["buckets"][-1]


def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _grid(m, n, cfg, device):
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    # <tik:grid>
    return (tiles,)
    # </tik:grid>


def forward(x, w, bias, out, meta):
    """Write ``x @ w.T (+ bias)`` into ``out`` ([M, N]); x [M, K], w [N, K]."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return out
    cfg = _bucket(meta, m)
    _linear_kernel[_grid(m, n, cfg, x.device)](
        x, w, bias if bias is not None else x, out, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg.get("GROUP_M", 1), EVEN_K=(k % cfg["BLOCK_K"] == 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ======================= areal-tik agent export adapter (generated) =======================
import torch as _torch

OP = 'linear'
ARCH = 'sm_90'
EXPORT_META = {'buckets': [{'BLOCK_K': 64, 'BLOCK_M': 16, 'BLOCK_N': 64, 'GROUP_M': 1, 'max_m': 16, 'num_stages': 5, 'num_warps': 4}, {'BLOCK_K': 64, 'BLOCK_M': 64, 'BLOCK_N': 128, 'GROUP_M': 8, 'max_m': 256, 'num_stages': 4, 'num_warps': 4}, {'BLOCK_K': 64, 'BLOCK_M': 128, 'BLOCK_N': 128, 'GROUP_M': 8, 'max_m': None, 'num_stages': 4, 'num_warps': 8}]}
META = {"agent_export": 'c901ef470b02e405'}
PROVENANCE = {'checks': {'passed': 107, 'total': 107}, 'contract_hash': '341014190c19d802', 'db': '/tmp/tmp.TthnVKF7eG/stage/agent.sqlite', 'env': {'cuda': '13.0', 'gpu': {'arch': 'sm_90', 'name': 'NVIDIA H200', 'sms': 132}, 'python': '3.12.3', 'torch': '2.11.0+cu130', 'triton': '3.6.0'}, 'exported_at': '2026-11-29T22:30:47Z', 'final': {'best_us': 1477.0381306608517, 'best_version': 6, 'per_workload': {'down_m16': 5.767366244561758, 'down_m256': 3.9955705348462147, 'down_m4096': 4.7164390763393, 'gate_up_m16': 2.3298359807904143, 'gate_up_m256': 4.223717636260171, 'gate_up_m4096': 5.036594731449274, 'o_m16': 3.580158737450924, 'o_m256': 2.8435361282401357, 'o_m4096': 4.099588156437937, 'qkv_m16': 3.8015032880586848, 'qkv_m256': 2.8669746555504463, 'qkv_m4096': 4.143223324021699}, 'root_us': 6680.339548985164, 'root_version': 1, 'session': 'f6d95963f108', 'simulated': False, 'speedup': 4.522794239574754}, 'kind': 'triton', 'latency_us': {'down_m16': 32.016001641750336, 'down_m256': 44.24799978733063, 'down_m4096': 203.09333006540933, 'gate_up_m16': 17.080000042915344, 'gate_up_m256': 38.70239853858948, 'gate_up_m4096': 447.27998971939087, 'o_m16': 7.298000156879425, 'o_m256': 11.107999831438065, 'o_m4096': 40.13866682847341, 'qkv_m16': 8.692000061273575, 'qkv_m256': 11.546666423479715, 'qkv_m4096': 54.627999663352966}, 'lineage': [{'description': 'bucket 2 (M<=None): prior config 1', 'hash': 'c901ef470b02e405', 'id': 6}, {'description': "apply transformation 'grouped-order' to region <tik:tile-order>", 'hash': '882a767271f3a419', 'id': 4}, {'description': "apply transformation 'unmasked-k-loop' to region <tik:k-loop>", 'hash': '374311c982efd50c', 'id': 3}, {'description': 'specialise M buckets [16, 256, None] with prior set 0', 'hash': 'b9bdc023bffac83e', 'id': 2}, {'description': 'naive root (linear)', 'hash': '24df1f49b42512c5', 'id': 1}], 'noise_floor': 0.01, 'op': 'linear', 'root_hash': '24df1f49b42512c5', 'run': 'h200', 'version_hash': 'c901ef470b02e405', 'version_id': 6, 'workloads': {'down_m16': {'shape': {'K': 8960, 'M': 16, 'N': 1536, 'bias': False}, 'weight': 8.0}, 'down_m256': {'shape': {'K': 8960, 'M': 256, 'N': 1536, 'bias': False}, 'weight': 2.0}, 'down_m4096': {'shape': {'K': 8960, 'M': 4096, 'N': 1536, 'bias': False}, 'weight': 1.0}, 'gate_up_m16': {'shape': {'K': 1536, 'M': 16, 'N': 17920, 'bias': False}, 'weight': 8.0}, 'gate_up_m256': {'shape': {'K': 1536, 'M': 256, 'N': 17920, 'bias': False}, 'weight': 2.0}, 'gate_up_m4096': {'shape': {'K': 1536, 'M': 4096, 'N': 17920, 'bias': False}, 'weight': 1.0}, 'o_m16': {'shape': {'K': 1536, 'M': 16, 'N': 1536, 'bias': False}, 'weight': 8.0}, 'o_m256': {'shape': {'K': 1536, 'M': 256, 'N': 1536, 'bias': False}, 'weight': 2.0}, 'o_m4096': {'shape': {'K': 1536, 'M': 4096, 'N': 1536, 'bias': False}, 'weight': 1.0}, 'qkv_m16': {'shape': {'K': 1536, 'M': 16, 'N': 2048, 'bias': True}, 'weight': 8.0}, 'qkv_m256': {'shape': {'K': 1536, 'M': 256, 'N': 2048, 'bias': True}, 'weight': 2.0}, 'qkv_m4096': {'shape': {'K': 1536, 'M': 4096, 'N': 2048, 'bias': True}, 'weight': 1.0}}}


class _ExportedLinear(_torch.autograd.Function):
    """Forward: the exported kernel (the contract above). Backward: plain torch matmuls
    in fp32 (the backward need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, x2, weight, bias):
        out = _torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
        forward(x2, weight, bias, out, EXPORT_META)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        x2, weight = ctx.saved_tensors
        gf = g.float()
        gx = (gf @ weight.float()).to(x2.dtype)
        gw = (gf.t() @ x2.float()).to(weight.dtype)
        gb = gf.sum(0).to(weight.dtype) if ctx.has_bias else None
        return gx, gw, gb


def linear_exported(x, weight, bias=None):
    """``linear(x, weight, bias=None)`` with the agent-exported kernel (see PROVENANCE)."""
    shp = x.shape
    x2 = x.reshape(-1, shp[-1]).contiguous()
    w = weight.contiguous()
    if x2.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad):
        y = _ExportedLinear.apply(x2, w, bias)
    else:
        y = _torch.empty(x2.shape[0], w.shape[0], dtype=x2.dtype, device=x2.device)
        forward(x2, w, bias, y, EXPORT_META)
    return y.reshape(*shp[:-1], w.shape[0])


OPS = {OP: {"triton": linear_exported}}
