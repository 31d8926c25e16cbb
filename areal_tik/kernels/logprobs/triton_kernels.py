"""The Triton kernels of the log-prob op: the fixed-block log-sum-exp walk over absolute vocab
columns (one row per program) and the in-place d loss / d logits of a logits chunk."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lse_update(z, m, s, t):
    """Online (max, sum exp, sum p*z) over one block of scaled logits ``z`` (-inf = absent)."""
    mn = tl.maximum(m, tl.max(z, axis=0))
    e = tl.where(z > float("-inf"), tl.exp(z - mn), 0.0)
    alpha = tl.where(m > float("-inf"), tl.exp(m - mn), 0.0)
    return mn, s * alpha + tl.sum(e, axis=0), t * alpha + tl.sum(tl.where(e > 0.0, e * z, 0.0), axis=0)


@triton.jit(do_not_specialize=["stride_l", "c0", "c1"])
def lse_blocks_kernel(lg_ptr, stride_l, tok_ptr, state_ptr, lp_ptr, ent_ptr, c0, c1, temperature, last,
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
def dlogits_kernel(lg_ptr, stride_l, tok_ptr, lse_ptr, mz_ptr, glp_ptr, gent_ptr, c0, ncols, temperature,
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
