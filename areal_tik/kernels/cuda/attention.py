"""CUDA C++ backend (``csrc/``) of the attention pair: the ``attention_varlen`` and
``attention_paged`` wrappers (validation, launch selectors, autograd) over the extension of
:mod:`.extension` (which holds the build constants, ``META``, ``CUDA_SOURCES`` and the
stale-build checks).

Entry points (``OPS``), same signatures as the Triton backend (docs/interfaces.md):

- ``attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale=None)`` — R1, autograd.
- ``attention_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
  scale=None)`` — R2/R3/R4.

Attention maths: ``out[t,h] = softmax(scale * q[t,h] . k[j, h//G], j <= pos(t)) @ v``, bf16
in/out, D in {64, 128}, G = Hq/Hkv, causal. Contract (within this backend): for a query at
absolute position p the output bits are the same for every entry point, batch mix,
packing, page size and chunking. By construction (see the header of tik_attention.cu):
rows = (token, head) packed 16 per warp into mma.sync m16n8k16 rows (GQA group of one KV
head per CTA); KV blocks of ``BLOCK_N`` = 64 positions aligned to 0, ascending; split-KV
chunks of ``SPLIT`` = 256 absolute positions, each with a fresh online softmax, merged in
ascending order by one scalar formula (in registers in FOLD mode, by a merge kernel in
SPLIT mode); all softmax arithmetic explicitly rounded (no FMA contraction). ``mode``
(``"auto"``, ``"fold"``, ``"split"``) is a test hook: every mode gives the same bits.
Decode-shaped launches (``max_seqlen_q * G <= 16``) run a separate 4-warp kernel (the four
warps share 16 rows and split the output head dim; same per-row arithmetic as the prefill
kernel, so the same bits); there is one decode kernel (the earlier 1-warp "v1" decode and
the ``variant=`` switch were removed after the H200 run of 2026-11-30 measured the 4-warp
kernel bit-identical and 1.6-2.4x faster). Its split-KV merge runs, by default, inside the
same launch (``decode_merge="fused"``): a tile whose rows end in the first 256-position
chunk finalizes in registers; otherwise the chunk CTA that finishes last (atomic ticket on a
per-device counter buffer that each launch leaves zeroed) merges the chunk partials in
ascending order with the merge kernel's operations. ``decode_merge="kernel"`` keeps the earlier decode + merge-kernel pair; both
give the same bits (GPU tests compare them). Fused decode launches on one device must not
run concurrently on two streams (they share the counters).
Prefill kernel (launches that are not decode-shaped, FOLD mode): on sm_90a at D = 128 the
default (``prefill_kernel="auto"``) is a warpgroup-MMA kernel fed by TMA (csrc/
tik_attention_wgmma.cuh: 2 consumer warpgroups x 64 rows per CTA and a producer warpgroup that
issues the K/V loads, the same per-row arithmetic as the mma.sync kernel, so the same bits; the GPU
tests and bench_cuda compare them); ``"mma"`` forces the mma.sync kernel, ``"wgmma"`` the warpgroup
kernel (an error where it cannot run); None takes ``PREFILL_KERNEL``.
Tensors without a TMA descriptor (a k/v base not 16-byte aligned) fall back to the mma.sync kernel
under "auto".
Accuracy: relative Frobenius error vs ``attention_reference`` (float64) < 1e-2.

Backward of ``attention_varlen``: the forward also writes each row's base-2 log-sum-exp (same
output bits; FOLD mode) and the backward runs on it, as the Triton forward's does
(``kernels/attention/flash_backward.py``: PyTorch's flash-attention-2 backward kernel by default, the Triton
recompute under deterministic algorithms or with ``Settings.attention_backward="triton"``): correct, not bitwise
invariant, not the exact derivative of the bf16 forward. A forced ``mode="split"`` keeps the older float32
recompute through PyTorch's ``scaled_dot_product_attention`` per sequence.
"""
from __future__ import annotations

import torch

from areal_tik.kernels.attention.checks import check_paged, check_varlen, check_window, softmax_scales
from areal_tik.kernels.attention.flash_backward import varlen_attention_backward
from areal_tik.kernels.attention.tuning import LOG2E
from areal_tik.kernels.cuda.extension import (  # CUDA_SOURCES, META: the registry reads them here
    CUDA_SOURCES, META, PREFILL_KERNEL, need_cuda, extension,
)

__all__ = ["attention_varlen_cuda", "attention_paged_cuda", "describe", "OPS", "META", "CUDA_SOURCES",
           "DECODE_MERGE", "PREFILL_KERNEL"]

_MODES = {"auto": 0, "fold": 1, "split": 2}
_DECODE_MERGES = {"fused": 0, "kernel": 1}
# Default split-KV merge of decode-shaped launches ("fused": in the decode launch; "kernel":
# the separate merge kernel); a launch may pass decode_merge=. Same bits either way.
DECODE_MERGE = "fused"
_PREFILL = {"auto": 0, "mma": 1, "wgmma": 2}


def _mode(mode):
    if mode not in _MODES:
        raise ValueError(f"attention (cuda): mode must be one of {sorted(_MODES)}, got {mode!r}")
    return _MODES[mode]


def _choice(arg, value, module_default, codes):
    """The binding's code for ``value`` (None: the module default)."""
    v = module_default if value is None else value
    if v not in codes:
        raise ValueError(f"attention (cuda): {arg} must be one of {sorted(codes)} (or None: "
                         f"{module_default!r}), got {v!r}")
    return codes[v]


def _prefill_kernel(prefill_kernel):
    return _choice("prefill_kernel", prefill_kernel, PREFILL_KERNEL, _PREFILL)


def _decode_merge(decode_merge):
    return _choice("decode_merge", decode_merge, DECODE_MERGE, _DECODE_MERGES)


def _varlen_grad_reference(q, k, v, cu_seqlens, scale, dout):
    """Float32 recompute of the varlen attention and its gradients, one sequence at a time."""
    g = q.shape[1] // k.shape[1]
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    cu = cu_seqlens.tolist()
    F = torch.nn.functional
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        if b <= a:
            continue
        with torch.enable_grad():
            qs = q[a:b].float().transpose(0, 1).unsqueeze(0).requires_grad_(True)   # [1, Hq, L, D]
            ks = k[a:b].float().transpose(0, 1).unsqueeze(0).requires_grad_(True)   # [1, Hkv, L, D]
            vs = v[a:b].float().transpose(0, 1).unsqueeze(0).requires_grad_(True)
            kr = ks.repeat_interleave(g, dim=1)
            vr = vs.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(qs, kr, vr, is_causal=True, scale=scale)
            go = dout[a:b].float().transpose(0, 1).unsqueeze(0)
            gq, gk, gv = torch.autograd.grad(o, (qs, ks, vs), go)
        dq[a:b] = gq[0].transpose(0, 1)
        dk[a:b] = gk[0].transpose(0, 1)
        dv[a:b] = gv[0].transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _VarlenCudaFunction(torch.autograd.Function):
    """Autograd for the CUDA varlen forward. The forward also writes each row's base-2 log-sum-exp
    (csrc ``TikAttnParams::lse``; same output bits) and the backward runs on it
    (:mod:`areal_tik.kernels.attention.flash_backward`: PyTorch's flash-attention-2 backward kernel, or the Triton
    recompute where that cannot run, under deterministic algorithms, or by ``Settings.attention_backward``). A
    forced ``mode="split"`` (no lse in that mode) keeps the float32 PyTorch recompute
    (:func:`_varlen_grad_reference`)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, mode, pk):
        lse = None
        if mode != _MODES["split"]:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        out = extension().attention_varlen_fwd(q, k, v, cu_seqlens, int(max_seqlen), scale, mode,
                                               prefill_kernel=pk, lse=lse)
        ctx.save_for_backward(q, k, v, cu_seqlens, out, *(() if lse is None else (lse,)))
        ctx.scale, ctx.max_seqlen = scale, int(max_seqlen)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu, out, *lse = ctx.saved_tensors
        if not lse:
            dq, dk, dv = _varlen_grad_reference(q, k, v, cu, ctx.scale, dout)
        else:
            dq, dk, dv = varlen_attention_backward(q, k, v, out, lse[0], cu, ctx.max_seqlen, ctx.scale,
                                                   ctx.scale * LOG2E, dout)
        return dq, dk, dv, None, None, None, None, None


def attention_varlen_cuda(q, k, v, cu_seqlens, max_seqlen, scale=None, window_size=None, mode="auto", out=None,
                          prefill_kernel=None):
    """R1 packed causal GQA attention (CUDA). q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` bf16,
    ``cu_seqlens`` int32 ``[B+1]`` (covering all T tokens), ``max_seqlen`` host int >= the
    longest segment. Returns ``[T, Hq, D]`` bf16, bitwise equal to :func:`attention_paged_cuda`
    for the same positions (module docstring). Autograd: ``kernels/attention_backward.py`` on the
    log-sum-exp the forward writes alongside (float32 PyTorch recompute under ``mode="split"``).
    ``prefill_kernel``: ``"auto"``, ``"mma"``, ``"wgmma"`` or None (``PREFILL_KERNEL``); same bits."""
    check_window(window_size)
    need_cuda("attention_varlen", ("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens))
    check_varlen(q, k, v, cu_seqlens, max_seqlen, triton_path=False)
    sc, _ = softmax_scales(scale, q.shape[-1])
    md = _mode(mode)
    pk = _prefill_kernel(prefill_kernel)
    q, k, v, cu = q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenCudaFunction.apply(q, k, v, cu, int(max_seqlen), sc, md, pk)
    return extension().attention_varlen_fwd(q, k, v, cu, int(max_seqlen), sc, md, out=out, prefill_kernel=pk)


def attention_paged_cuda(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, scale=None,
                         window_size=None, mode="auto", out=None, decode_merge=None, prefill_kernel=None):
    """R2 prefill / R3 chunked prefill / R4 decode over the paged KV cache (CUDA).

    q ``[Tq, Hq, D]`` bf16; caches ``[num_pages, page_size, Hkv, D]`` bf16 contiguous
    (page_size a power of two 16..256); ``block_table`` int32 ``[B, max_pages]``;
    ``cu_seqlens_q`` int32 ``[B+1]``; ``seqlens_k`` int32 ``[B]`` (includes the queries,
    each sequence's last n_i positions); ``max_seqlen_q`` host int. No host sync (split
    workspace is sized from ``max_pages * page_size``), so it can be graph-captured.
    Decode-shaped launches (max_seqlen_q * G <= 16) run the 4-warp decode kernel with split-KV
    across CTAs. ``out``: optional contiguous ``[Tq, Hq, D]`` bf16 buffer to write (CUDA graphs,
    poisoned-output tests); rows of tokens outside ``cu_seqlens_q[B]`` are left untouched.
    ``decode_merge``: ``"fused"`` (the split-KV merge of decode-shaped launches runs in the
    decode launch), ``"kernel"`` (a second, merge-kernel launch) or None (``DECODE_MERGE``); same bits. The fused path needs the per-device
    counter buffer, created by the first eager (not graph-captured) attention call on the
    device; a capture before any eager call falls back to the merge kernel. ``prefill_kernel``: as
    :func:`attention_varlen_cuda` (launches that are not decode-shaped)."""
    check_window(window_size)
    need_cuda("attention_paged", ("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
               ("cu_seqlens_q", cu_seqlens_q), ("seqlens_k", seqlens_k))
    check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, triton_path=False,
                contiguous_caches=True)
    return extension().attention_paged_fwd(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                                           cu_seqlens_q.contiguous(), seqlens_k.contiguous(), int(max_seqlen_q),
                                           softmax_scales(scale, q.shape[-1])[0], _mode(mode), out=out,
                                           decode_merge=_decode_merge(decode_merge),
                                           prefill_kernel=_prefill_kernel(prefill_kernel))


def describe() -> str:
    """Registers / spills / shared memory of every attention kernel (needs the GPU)."""
    return extension().describe()


OPS = {
    "attention_varlen": {"cuda": attention_varlen_cuda},
    "attention_paged": {"cuda": attention_paged_cuda},
}
