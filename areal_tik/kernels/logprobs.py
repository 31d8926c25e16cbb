"""The one log-prob function: ``logp = log_softmax(logits.float() / T)[token]`` (+ entropy).

Used by both the rollout sampler and the trainer loss (docs/design.md, "The contract").

Maths, per row i with ``z = logits[i].float() / T`` (correctly rounded division):
``lse = m + log(s)`` where the vocab is walked in fixed blocks of ``V_BLOCK`` columns at
absolute positions ``[0, V_BLOCK), [V_BLOCK, 2 V_BLOCK), ...`` in ascending order, each
block updating a running ``(m, s, t)``: ``m' = max(m, max(z_blk))``,
``s' = s * exp(m - m') + sum(exp(z_blk - m'))``, ``t' = t * exp(m - m') + sum(exp(z_blk - m') * z_blk)``.
``logp = z[token] - lse``; ``entropy = lse - t / s``.

Entry points:
- :func:`logprobs_from_logits` (``logits [T, V]`` bf16/fp16/fp32, unit last stride;
  tokens ``[T]`` int32/int64) -> fp32 ``[T]`` (and entropy ``[T]``).
- :func:`token_logprobs` (``hidden [T, K]``, ``lm_head_weight [V, K]``, same dtype,
  contiguous) -> fp32 ``[T]`` (and entropy): the lm_head GEMM (``linear``'s kernel) runs
  on vocab chunks of ``C`` columns (a multiple of V_BLOCK, ``T*C <= LOGITS_CHUNK_ELEMS``),
  each chunk's bf16 logits feeding the same block update. No fp32 logits are stored and
  at most ``T*C`` logits (x dtype) exist at once. **Bitwise equal** to
  ``logprobs_from_logits(linear(hidden, W), tokens, T)`` on the same backend: the chunk
  GEMM gives the same bits as the full GEMM (row- and tile-invariant ``linear``), and the
  block walk is the same kernel over the same absolute blocks whatever C is.

Accuracy vs :func:`logprobs_reference` (float64 from the same rounded logits): abs error
< 1e-4 per token for |logits|/T up to ~30.

Invariance: one row per program, fixed V_BLOCK and warps, so a row's bits do not depend
on T, its neighbours, its position, nor on C. torch_ref: the same block walk with
``_torch_math.exp/log`` and fixed pairwise trees inside a block (max is exact).

Backward (both entry points, both backends): w.r.t. logits, or hidden and weight
(chunked recompute of logits; ``dh`` accumulated in fp32 over chunks, ``dW`` per chunk):
``dz = g_logp * (onehot - p) - g_ent * p * (z - t/s)``, ``dlogits = dz / T``. Accurate,
not promised invariant.

Tokens must lie in ``[0, V)``: checked on CPU tensors; on the GPU an out-of-range token
gives NaN (never a silent wrong number).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from areal_tik.kernels import _torch_math as tm
from areal_tik.kernels._dense_common import (
    check_contiguous, check_dtype, check_last_dim_contiguous, check_same_device, check_same_dtype,
    check_triton_device, div16_attrs,
)
from areal_tik.kernels.linear import linear_fwd, matmul_invariant_torch
from areal_tik.kernels.rms_norm import tree_sum_lastdim

__all__ = ["logprobs_from_logits_triton", "logprobs_from_logits_torch", "token_logprobs_triton",
           "token_logprobs_torch", "logprobs_reference", "V_BLOCK", "LOGITS_CHUNK_ELEMS"]

V_BLOCK = 2048             # bit-defining vocab block of the log-sum-exp walk
LSE_WARPS = 8              # bit-defining (reduction tree inside a block)
LOGITS_CHUNK_ELEMS = 1 << 26  # at most T*C logits (x dtype) alive in token_logprobs (128 MiB bf16)
_STATE = 4                 # (m, s, t, z_token) per row, fp32


@triton.jit
def _lse_update(z, m, s, t):
    """Online (max, sum exp, sum p*z) over one block of scaled logits ``z`` (-inf = absent)."""
    mn = tl.maximum(m, tl.max(z, axis=0))
    e = tl.where(z > float("-inf"), tl.exp(z - mn), 0.0)
    alpha = tl.where(m > float("-inf"), tl.exp(m - mn), 0.0)
    return mn, s * alpha + tl.sum(e, axis=0), t * alpha + tl.sum(tl.where(e > 0.0, e * z, 0.0), axis=0)


@triton.jit(do_not_specialize=["stride_l", "c0", "c1"])
def _lse_blocks_kernel(lg_ptr, stride_l, tok_ptr, state_ptr, lp_ptr, ent_ptr, c0, c1, temperature, last,
                       V_BLOCK: tl.constexpr):
    """Update row ``pid``'s (m, s, t, z_tok) with absolute vocab columns [c0, c1).

    ``lg_ptr`` points at column c0 of row 0; rows are ``stride_l`` apart (a multiple of
    ROW_ALIGN=8 elements, base 16-byte aligned: ``_lse_launch`` refuses anything else, and
    the callers allocate padded buffers via ``alloc_logits_buffer``). Full blocks take the
    unmasked path, the final partial block of the vocab the masked one — the same path
    for the same absolute block whichever caller and chunking.
    """
    row = tl.program_id(0).to(tl.int64)
    row_off = tl.multiple_of(row * stride_l, 8)  # == ROW_ALIGN, checked by _lse_launch
    base = lg_ptr + row_off
    sp = state_ptr + row * 4
    m = tl.load(sp)
    s = tl.load(sp + 1)
    t = tl.load(sp + 2)
    ztok = tl.load(sp + 3)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    offs = tl.arange(0, V_BLOCK)
    n_full = (c1 - c0) // V_BLOCK
    # software prefetch: block j+1 is loaded before block j is reduced (latency hiding for
    # small T, where a few programs walk the whole vocab); the loaded values and the
    # arithmetic on them are the same as without it.
    x_next = tl.load(base + offs, mask=(offs < V_BLOCK) & (n_full > 0), other=0.0)
    for j in range(0, n_full):
        x_cur = x_next
        nxt = tl.minimum(j + 1, n_full - 1)
        x_next = tl.load(base + tl.multiple_of(nxt * V_BLOCK, V_BLOCK) + offs)
        m, s, t = _lse_update(tl.math.div_rn(x_cur.to(tl.float32), temperature), m, s, t)
    rem = (c1 - c0) - n_full * V_BLOCK
    if rem > 0:
        off = n_full * V_BLOCK
        msk = offs < rem
        x = tl.load(base + off + offs, mask=msk, other=float("-inf")).to(tl.float32)
        m, s, t = _lse_update(tl.math.div_rn(x, temperature), m, s, t)
    if (tok >= c0) & (tok < c1):
        ztok = tl.math.div_rn(tl.load(base + (tok - c0)).to(tl.float32), temperature)
    if last != 0:
        lse = m + tl.log(s)
        tl.store(lp_ptr + row, ztok - lse)
        tl.store(ent_ptr + row, lse - t / s)
    tl.store(sp, m)
    tl.store(sp + 1, s)
    tl.store(sp + 2, t)
    tl.store(sp + 3, ztok)


@triton.jit
def _dlogits_kernel(lg_ptr, stride_l, tok_ptr, lse_ptr, mz_ptr, glp_ptr, gent_ptr, c0, ncols, temperature,
                    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr):
    """In place: logits chunk -> d loss / d logits (x dtype) for columns [c0, c0+ncols)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = cols < ncols
    ptr = lg_ptr + row * stride_l + cols
    z = tl.math.div_rn(tl.load(ptr, mask=msk, other=0.0).to(tl.float32), temperature)
    p = tl.exp(z - tl.load(lse_ptr + row))
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_GLP:
        glp = tl.load(glp_ptr + row)
        tok = tl.load(tok_ptr + row).to(tl.int64)
        g = g + tl.where(cols + c0 == tok, glp, 0.0) - p * glp
    if HAS_GENT:
        gent = tl.load(gent_ptr + row)
        g = g - gent * p * (z - tl.load(mz_ptr + row))
    tl.store(ptr, (g / temperature).to(lg_ptr.dtype.element_ty), mask=msk)


# --------------------------------------------------------------------------- validation

def _check_temperature(temperature) -> float:
    t = float(temperature)
    if not (t > 0.0) or math.isinf(t):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return t


def _check_tokens(tokens, T, V):
    check_dtype("tokens", tokens, (torch.int32, torch.int64))
    if tokens.shape != (T,):
        raise ValueError(f"tokens must have shape [T]=[{T}], got {tuple(tokens.shape)}")
    check_contiguous("tokens", tokens)
    if tokens.device.type == "cpu" and T and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
        raise ValueError(f"tokens must lie in [0, {V})")


def _validate_logits(logits, tokens, triton_path):
    check_dtype("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    check_last_dim_contiguous("logits", logits)
    _check_tokens(tokens, logits.shape[0], logits.shape[1])
    (check_triton_device if triton_path else check_same_device)(("logits", logits), ("tokens", tokens))


def _validate_hidden(hidden, weight, tokens, triton_path):
    check_dtype("hidden", hidden)
    check_dtype("lm_head_weight", weight)
    check_same_dtype(hidden=hidden, lm_head_weight=weight)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, K] and lm_head_weight [V, K] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    check_contiguous("hidden", hidden)
    check_contiguous("lm_head_weight", weight)
    _check_tokens(tokens, hidden.shape[0], weight.shape[0])
    named = (("hidden", hidden), ("lm_head_weight", weight), ("tokens", tokens))
    (check_triton_device if triton_path else check_same_device)(*named)


def chunk_cols(T: int, V: int, budget: int | None = None) -> int:
    """Vocab columns per token_logprobs GEMM chunk: a multiple of V_BLOCK, T*C <= budget."""
    budget = LOGITS_CHUNK_ELEMS if budget is None else budget
    c = (budget // max(T, 1)) // V_BLOCK * V_BLOCK
    return max(V_BLOCK, min(c, triton.cdiv(V, V_BLOCK) * V_BLOCK))


def _init_state(T, device):
    st = torch.empty((T, _STATE), dtype=torch.float32, device=device)
    st[:, 0] = -math.inf
    st[:, 1:3] = 0.0
    st[:, 3] = math.nan
    return st


# --------------------------------------------------------------------------- triton path

ROW_ALIGN = 8      # the kernel's ``tl.multiple_of(row * stride_l, ROW_ALIGN)`` promise (elements)
_BUF_ALIGN = 64    # logits buffers are allocated with row strides padded to this many elements


def lse_alignment_ok(data_ptr: int, stride0: int, n_rows: int) -> bool:
    """True when the LSE kernel's alignment promises hold for a logits view: base pointer
    16-byte aligned and every row offset a multiple of ROW_ALIGN elements (vector loads
    of up to 16 bytes never straddle; with one row the stride is never used)."""
    return data_ptr % 16 == 0 and (n_rows <= 1 or stride0 % ROW_ALIGN == 0)


def _aligned(t: torch.Tensor) -> bool:
    return lse_alignment_ok(t.data_ptr(), t.stride(0), t.shape[0])


def padded_row_stride(ncols: int) -> int:
    """Row stride (elements) of the logits buffers: ncols rounded up to _BUF_ALIGN."""
    return max(_BUF_ALIGN, -(-ncols // _BUF_ALIGN) * _BUF_ALIGN)


def alloc_logits_buffer(T: int, ncols: int, dtype, device) -> torch.Tensor:
    """``[T, ncols]`` view with an aligned row stride (any ncols, odd vocab sizes included)."""
    return torch.empty((T, padded_row_stride(ncols)), dtype=dtype, device=device)[:, :ncols]


def _lse_launch(lg, tokens, state, lp, ent, c0, c1, temperature, last):
    T = lg.shape[0]
    if T == 0:
        return
    if not _aligned(lg):
        # never launch with a false multiple_of promise (misaligned vector loads crash the
        # context); callers pass padded buffers or copy first
        raise ValueError(f"LSE kernel needs a 16-byte aligned base and a row stride that is a multiple of "
                         f"{ROW_ALIGN} elements; got data_ptr % 16 = {lg.data_ptr() % 16}, stride {lg.stride(0)}")
    _lse_blocks_kernel[(T,)](lg, lg.stride(0), tokens, state, lp, ent, c0, c1, temperature, int(last),
                             V_BLOCK=V_BLOCK, num_warps=LSE_WARPS)


def _logits_fwd_triton(logits, tokens, temperature):
    T, V = logits.shape
    if not _aligned(logits):  # same kernel specialisation as token_logprobs' aligned buffers
        pad = alloc_logits_buffer(T, V, logits.dtype, logits.device)
        pad.copy_(logits)
        logits = pad
    state = _init_state(T, logits.device)
    lp = torch.empty(T, dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    _lse_launch(logits, tokens, state, lp, ent, 0, V, temperature, True)
    return lp, ent, state


def _dlogits_triton(lg, tokens, lse, mz, glp, gent, c0, temperature):
    T, n = lg.shape
    if T == 0 or n == 0:
        return lg
    blk = 2048
    _dlogits_kernel[(T, triton.cdiv(n, blk))](
        lg, lg.stride(0), tokens, lse, mz, glp if glp is not None else lse, gent if gent is not None else lse,
        c0, n, temperature, HAS_GLP=glp is not None, HAS_GENT=gent is not None, BLOCK=blk, num_warps=8)
    return lg


def _token_fwd_triton(hidden, weight, tokens, temperature, chunk):
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk or chunk_cols(T, V)
    state = _init_state(T, hidden.device)
    lp = torch.empty(T, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(lp)
    buf = alloc_logits_buffer(T, min(C, V), hidden.dtype, hidden.device)
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        lg = linear_fwd(hidden, weight[c0:c1], out=buf[:, :c1 - c0])
        _lse_launch(lg, tokens, state, lp, ent, c0, c1, temperature, c1 == V)
    return lp, ent, state


def _token_bwd(hidden, weight, tokens, lse, mz, glp, gent, temperature, chunk, triton_path):
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk or chunk_cols(T, V)
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    dw = torch.empty_like(weight)
    buf = alloc_logits_buffer(T, min(C, V), hidden.dtype, hidden.device)
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        w = weight[c0:c1]
        if triton_path:
            lg = linear_fwd(hidden, w, out=buf[:, :c1 - c0])
            dl = _dlogits_triton(lg, tokens, lse, mz, glp, gent, c0, temperature)
        else:
            lg = matmul_invariant_torch(hidden, w).to(hidden.dtype)
            dl = _dlogits_torch(lg, tokens, lse, mz, glp, gent, c0, temperature)
        dh += (dl @ w).float()
        dw[c0:c1] = dl.t() @ hidden
    return dh.to(hidden.dtype), dw


class _TokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk, triton_path):
        fwd = _token_fwd_triton if triton_path else _token_fwd_torch
        lp, ent, state = fwd(hidden, weight, tokens, temperature, chunk)
        lse = state[:, 0] + torch.log(state[:, 1])
        mz = state[:, 2] / state[:, 1]
        ctx.save_for_backward(hidden, weight, tokens, lse, mz)
        ctx.temperature, ctx.chunk, ctx.triton_path = temperature, chunk, triton_path
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        hidden, weight, tokens, lse, mz = ctx.saved_tensors
        if glp is None and gent is None:
            return None, None, None, None, None, None
        glp = glp.float().contiguous() if glp is not None else None
        gent = gent.float().contiguous() if gent is not None else None
        dh, dw = _token_bwd(hidden, weight, tokens, lse, mz, glp, gent, ctx.temperature, ctx.chunk, ctx.triton_path)
        return (dh if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
                None, None, None, None)


class _LogitsLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, triton_path):
        lp, ent, state = (_logits_fwd_triton if triton_path else _logits_fwd_torch)(logits, tokens, temperature)
        lse = state[:, 0] + torch.log(state[:, 1])
        mz = state[:, 2] / state[:, 1]
        ctx.save_for_backward(logits, tokens, lse, mz)
        ctx.temperature, ctx.triton_path = temperature, triton_path
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, glp, gent):
        logits, tokens, lse, mz = ctx.saved_tensors
        if glp is None and gent is None:
            return None, None, None, None
        # contiguous: the kernel reads them as ptr + row (lp.sum() hands over a stride-0 grad)
        glp = glp.float().contiguous() if glp is not None else None
        gent = gent.float().contiguous() if gent is not None else None
        if ctx.triton_path:  # the token path's kernel, in place on one contiguous copy of the logits
            g = torch.empty_like(logits, memory_format=torch.contiguous_format).copy_(logits)
            return _dlogits_triton(g, tokens, lse, mz, glp, gent, 0, ctx.temperature), None, None, None
        return _dlogits_rowwise(logits, tokens, lse, mz, glp, gent, ctx.temperature), None, None, None


def _run_logits(logits, tokens, temperature, return_entropy, triton_path):
    temperature = _check_temperature(temperature)
    _validate_logits(logits, tokens, triton_path)
    if torch.is_grad_enabled() and logits.requires_grad:
        lp, ent = _LogitsLogprobsFn.apply(logits, tokens, temperature, triton_path)
    else:
        lp, ent, _ = (_logits_fwd_triton if triton_path else _logits_fwd_torch)(logits, tokens, temperature)
    return (lp, ent) if return_entropy else lp


def _run_token(hidden, weight, tokens, temperature, return_entropy, chunk, triton_path):
    temperature = _check_temperature(temperature)
    _validate_hidden(hidden, weight, tokens, triton_path)
    if chunk is not None and (chunk <= 0 or chunk % V_BLOCK):
        raise ValueError(f"_chunk_cols must be a positive multiple of V_BLOCK={V_BLOCK}, got {chunk}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = _TokenLogprobsFn.apply(hidden, weight, tokens, temperature, chunk, triton_path)
    else:
        fwd = _token_fwd_triton if triton_path else _token_fwd_torch
        lp, ent, _ = fwd(hidden, weight, tokens, temperature, chunk)
    return (lp, ent) if return_entropy else lp


def logprobs_from_logits_triton(logits, tokens, temperature, return_entropy=False):
    """fp32 ``log_softmax(logits.float()/T)[token]`` (+ entropy), fixed vocab blocks (Triton)."""
    return _run_logits(logits, tokens, temperature, return_entropy, True)


def token_logprobs_triton(hidden, lm_head_weight, tokens, temperature, return_entropy=False, _chunk_cols=None):
    """Fused lm_head + log-probs (+ entropy) with bounded logits memory (Triton); see module doc."""
    return _run_token(hidden, lm_head_weight, tokens, temperature, return_entropy, _chunk_cols, True)


# --------------------------------------------------------------------------- torch_ref path

def _lse_update_torch(lg, tokens, state, c0, c1, temperature):
    """torch_ref block walk over absolute columns [c0, c1) of ``lg`` (column 0 = c0)."""
    m, s, t, ztok = state.unbind(1)
    T = lg.shape[0]
    for b0 in range(c0, c1, V_BLOCK):
        b1 = min(b0 + V_BLOCK, c1)
        z = lg[:, b0 - c0:b1 - c0].float() / temperature
        if b1 - b0 < V_BLOCK:
            z = torch.cat([z, z.new_full((T, V_BLOCK - (b1 - b0)), -math.inf)], 1)
        mn = torch.maximum(m, z.max(dim=1).values)
        finite = z > -math.inf
        e = torch.where(finite, tm.exp(torch.where(finite, z - mn[:, None], 0.0)), 0.0)
        alpha = torch.where(m > -math.inf, tm.exp(torch.where(m > -math.inf, m - mn, 0.0)), 0.0)
        s = s * alpha + tree_sum_lastdim(e)
        t = t * alpha + tree_sum_lastdim(torch.where(e > 0, e * z, 0.0))
        m = mn
    tl_ = tokens.long()
    inside = (tl_ >= c0) & (tl_ < c1)
    idx = torch.where(inside, tl_ - c0, 0)
    zt = lg.gather(1, idx[:, None])[:, 0].float() / temperature
    ztok = torch.where(inside, zt, ztok)
    return torch.stack([m, s, t, ztok], 1)


def _finalize_torch(state):
    m, s, t, ztok = state.unbind(1)
    lse = m + tm.log(s)
    return ztok - lse, lse - t / s


def _logits_fwd_torch(logits, tokens, temperature):
    T, V = logits.shape
    state = _lse_update_torch(logits, tokens, _init_state(T, logits.device), 0, V, temperature)
    lp, ent = _finalize_torch(state)
    return lp, ent, state


def _token_fwd_torch(hidden, weight, tokens, temperature, chunk):
    T, V = hidden.shape[0], weight.shape[0]
    C = chunk or chunk_cols(T, V)
    state = _init_state(T, hidden.device)
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        lg = matmul_invariant_torch(hidden, weight[c0:c1]).to(hidden.dtype)
        state = _lse_update_torch(lg, tokens, state, c0, c1, temperature)
    lp, ent = _finalize_torch(state)
    return lp, ent, state


def _dlogits_torch(lg, tokens, lse, mz, glp, gent, c0, temperature):
    z = lg.float() / temperature
    p = torch.exp(z - lse[:, None])
    g = torch.zeros_like(z)
    if glp is not None:
        cols = torch.arange(c0, c0 + lg.shape[1], device=lg.device)
        onehot = (cols[None, :] == tokens.long()[:, None]).float()
        g = g + glp[:, None] * (onehot - p)
    if gent is not None:
        g = g - gent[:, None] * p * (z - mz[:, None])
    return (g / temperature).to(lg.dtype)


# fp32 temporaries of _dlogits_torch per row block: ~6 x rows x V x 4 bytes (about 3.6 GiB at V=151936)
_DLOGITS_ROW_BLOCK = 1024


def _dlogits_rowwise(lg, tokens, lse, mz, glp, gent, temperature):
    """d loss / d logits for a [T, V] logits tensor, written block of rows by block of rows into one
    output of the logits' dtype. Each row's gradient depends only on that row, so the blocking changes
    no bits; it bounds the fp32 temporaries (a 16K-token micro-batch at V=151936 otherwise needs ~60 GiB,
    measured as an OOM in the 1.5B GRPO run on the H200)."""
    out = torch.empty_like(lg)
    for r0 in range(0, lg.shape[0], _DLOGITS_ROW_BLOCK):
        r1 = min(lg.shape[0], r0 + _DLOGITS_ROW_BLOCK)
        out[r0:r1] = _dlogits_torch(lg[r0:r1], tokens[r0:r1], lse[r0:r1], mz[r0:r1],
                                    glp[r0:r1] if glp is not None else None,
                                    gent[r0:r1] if gent is not None else None, 0, temperature)
    return out


def logprobs_from_logits_torch(logits, tokens, temperature, return_entropy=False):
    """torch_ref twin of :func:`logprobs_from_logits_triton` (row-invariant on any device)."""
    return _run_logits(logits, tokens, temperature, return_entropy, False)


def token_logprobs_torch(hidden, lm_head_weight, tokens, temperature, return_entropy=False, _chunk_cols=None):
    """torch_ref twin of :func:`token_logprobs_triton`; bitwise equal to
    ``logprobs_from_logits_torch(linear_torch(hidden, W), tokens, T)``."""
    return _run_token(hidden, lm_head_weight, tokens, temperature, return_entropy, _chunk_cols, False)


def logprobs_reference(logits, tokens, temperature):
    """float64 ``(logp, entropy)`` from the given logits."""
    z = logits.double() / float(temperature)
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(1, tokens.long()[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent


OPS = {
    "logprobs_from_logits": {"triton": logprobs_from_logits_triton, "torch_ref": logprobs_from_logits_torch},
    "token_logprobs": {"triton": token_logprobs_triton, "torch_ref": token_logprobs_torch},
}
META = {"logprobs.V_BLOCK": V_BLOCK, "logprobs.num_warps": LSE_WARPS, "logprobs.division": "div_rn by T"}

_LSE_SIG = {"lg_ptr": "*bf16", "stride_l": "i32", "tok_ptr": "*i64", "state_ptr": "*fp32", "lp_ptr": "*fp32",
            "ent_ptr": "*fp32", "c0": "i32", "c1": "i32", "temperature": "fp32", "last": "i32"}
_DL_SIG = {"lg_ptr": "*bf16", "stride_l": "i32", "tok_ptr": "*i64", "lse_ptr": "*fp32", "mz_ptr": "*fp32",
           "glp_ptr": "*fp32", "gent_ptr": "*fp32", "c0": "i32", "ncols": "i32", "temperature": "fp32"}
COMPILE_SPECS = [
    dict(fn=_lse_blocks_kernel, signature=_LSE_SIG, constexprs={"V_BLOCK": V_BLOCK}, num_warps=LSE_WARPS,
         attrs=div16_attrs(_lse_blocks_kernel, ["lg_ptr", "tok_ptr", "state_ptr", "lp_ptr", "ent_ptr"])),
    dict(fn=_lse_blocks_kernel, signature=dict(_LSE_SIG, lg_ptr="*fp32", tok_ptr="*i32"),
         constexprs={"V_BLOCK": V_BLOCK}, num_warps=LSE_WARPS),
    dict(fn=_dlogits_kernel, signature=_DL_SIG, constexprs={"HAS_GLP": True, "HAS_GENT": True, "BLOCK": 2048},
         num_warps=8, attrs=div16_attrs(_dlogits_kernel, ["lg_ptr", "stride_l"])),
    dict(fn=_dlogits_kernel, signature=_DL_SIG, constexprs={"HAS_GLP": True, "HAS_GENT": False, "BLOCK": 2048},
         num_warps=8),
]
