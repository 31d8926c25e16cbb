"""Gumbel-max sampling of one token per row from counter-based noise, in one pass over the logits.

Maths: ``token[b] = first argmax_v ( logits[b, v] / T[b] + g(key[b], v) )`` with
``g = -log(-log(u))`` and ``u`` the fp32 uniform in (0, 1) of a 32-bit hash of
``(key[b], vocab index v)`` (:func:`uniform_noise`, exact integer arithmetic, so every backend
draws the same ``u``). ``u = ((x >> 9) + 0.5) / 2**23``: the hash's top 23 bits, every value exact in
fp32 and strictly inside (0, 1), so ``g`` is finite (at most ~16.6). Not 24 bits: ``(2**24 - 0.5) / 2**24``
rounds to 1.0 in fp32, whose ``g`` is +inf, and a row of V entries would then hold an entry that wins
whatever the logits with probability ~V / 2**24 (0.9% of rows at V 151,936: a uniformly random token).
``key[b]`` (:func:`row_key` of the request's seed and the token's position) is the only per-row state: a
row's token never depends on the other rows, the batch size, or the row's place in the batch. A top-k /
top-p draw is the same op on logits outside :func:`kept_mask` set to ``-inf``.

Shapes/dtypes: logits ``[B, V]`` (bf16, fp16 or fp32, unit last stride, any row stride),
keys int64 ``[B]`` (values < 2**32), temperatures fp32 ``[B]`` (> 0). Returns int64 ``[B]``.

Backends: the Triton kernel computes the hash in uint32 (wrapping multiply = the reference's
``* C & 0xFFFFFFFF``), converts and scales in fp32 and takes the logs with its own fp32 ``log``;
``torch_ref`` runs the same maths as tensor ops over ``[B, V]`` (about twelve int64 passes over
the batch's logits: 3.4 ms per decode step at B=128, V=151936 on an H200, the step's largest
cost after the forward). Each backend is consistent with itself; the two can differ only where
two candidates' scores tie to the last bit of the noise (the log's rounding).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from areal_tik.kernels import _torch_math as tm
from areal_tik.kernels._dense_common import check_triton_device

__all__ = ["gumbel_argmax_triton", "gumbel_argmax_torch", "uniform_noise", "vocab_hash", "noise_bits", "unit_uniform",
           "hash32", "mix32", "row_key", "kept_mask"]

M32 = 0xFFFFFFFF
C_MIX = 0x45D9F3B      # < 2**31: products of 32-bit values stay below 2**63 (no int64 overflow)
C_VOCAB = 0x61C88647
C_KEY = 0x27D4EB2F
BLOCK_V = 4096
U_SHIFT = 9            # uniforms from the hash's top 32 - U_SHIFT = 23 bits (exact in fp32; the kernel's literal too)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer mix of an int64 tensor of values < 2**32 (exact, any device)."""
    x = ((x >> 16) ^ x) * C_MIX & M32
    x = ((x >> 16) ^ x) * C_MIX & M32
    return (x >> 16) ^ x


def mix32(x: int) -> int:
    """:func:`hash32` of one Python int (host side)."""
    x &= M32
    x = (((x >> 16) ^ x) * C_MIX) & M32
    x = (((x >> 16) ^ x) * C_MIX) & M32
    return ((x >> 16) ^ x) & M32


@functools.lru_cache(maxsize=1 << 16)
def _seed_key(seed: int) -> int:
    s = int(seed) & ((1 << 64) - 1)
    k = mix32(s & M32)
    return mix32(k ^ (s >> 32) ^ 0x9E3779B9)


def row_key(seed: int, position: int) -> int:
    """32-bit key of the random draw for token ``position`` of a request seeded ``seed`` (the ``keys`` entry of
    its row)."""
    return mix32(_seed_key(seed) ^ (int(position) * 0x2545F491 & M32))


def kept_mask(logits: torch.Tensor, temperatures: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """bool ``[B, V]``: the entries a top-k then top-p filter keeps in each row of ``logits.float() / T`` (``top_k``
    per row in 1..V, ``top_p`` in (0, 1]; the most probable entry is always kept, ties at the threshold too).
    Row-invariant: sorts, the cumulative sum (a sequential scan) and float64 ``exp`` per element (``_torch_math``
    on a CPU: position-independent bits) depend on the row alone."""
    dev = logits.device
    exp = tm.exp if dev.type != "cuda" else torch.exp
    V = logits.shape[-1]
    x = logits.float() / temperatures.float()[:, None]
    xs, _ = torch.sort(x, dim=-1, descending=True, stable=True)
    k_t = torch.tensor(top_k, device=dev)[:, None]
    ranks = torch.arange(V, device=dev)[None, :]
    e = exp((xs - xs[:, :1]).double())                              # unnormalised probs, sorted
    e = torch.where(ranks < k_t, e, torch.zeros_like(e))
    cum = torch.cumsum(e, dim=-1)
    p_t = torch.tensor(top_p, dtype=torch.float64, device=dev)[:, None]
    kept_sorted = ((cum - e) < p_t * cum[:, -1:]) & (ranks < k_t)
    kept_sorted[:, 0] = True
    thresh = xs.gather(-1, kept_sorted.sum(-1, keepdim=True) - 1)    # smallest kept value
    return x >= thresh


def vocab_hash(vocab_size: int, device) -> torch.Tensor:
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) * C_VOCAB & M32)


def uniform_noise(keys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in (0, 1), ``[B, V]``: row b depends only on ``keys[b]``."""
    return unit_uniform(noise_bits(keys, vhash))


def noise_bits(keys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash values (int64) ``[B, V]`` the uniforms are drawn from."""
    x = hash32(vhash[None, :] ^ keys[:, None])
    return hash32(x ^ (keys[:, None] * C_KEY & M32))


def unit_uniform(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``((x >> 9) + 0.5) / 2**23`` of 32-bit hash values ``x`` (int64): exact, in [2**-24, 1 - 2**-24]."""
    return ((x >> U_SHIFT).to(torch.float32) + 0.5) * (1.0 / (1 << (32 - U_SHIFT)))


def gumbel_argmax_torch(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor,
                        vhash: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the maths above as tensor ops (``_torch_math`` logs on a CPU: position-independent bits)."""
    _check(logits, keys, temperatures)
    B, V = logits.shape
    if vhash is None:
        vhash = vocab_hash(V, logits.device)
    log = tm.log if logits.device.type != "cuda" else torch.log
    u = uniform_noise(keys.to(torch.int64), vhash)
    score = logits.float() / temperatures.float()[:, None] - log(-log(u))
    return torch.argmax(score, dim=-1)


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel_argmax_kernel(lg_ptr, stride_l, keys_ptr, temp_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    kmix = key * 0x27D4EB2F                       # uint32: wraps mod 2**32 like the reference's & M32
    temp = tl.load(temp_ptr + row)
    base = lg_ptr + row.to(tl.int64) * stride_l
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        vh = _mix32(offs.to(tl.uint32) * 0x61C88647)
        x = _mix32(vh ^ key)
        x = _mix32(x ^ kmix)
        u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)     # unit_uniform: top 23 bits, inside (0, 1)
        g = -tl.log(-tl.log(u))
        # IEEE division, as the reference's logits.float() / T (a plain '/' may lower to an approximation)
        z = tl.math.div_rn(tl.load(base + offs, mask=ok, other=0.0).to(tl.float32), temp) + g
        z = tl.where(ok, z, float("-inf"))
        m = tl.max(z, axis=0)
        i = tl.min(tl.where(z == m, offs, V), axis=0)
        take = m > best                                # strict: the first block with the max keeps it
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def _check(logits, keys, temperatures):
    if logits.ndim != 2:
        raise ValueError(f"gumbel_argmax: logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"gumbel_argmax: logits dtype {logits.dtype} not supported (bf16, fp16, fp32)")
    B = logits.shape[0]
    if keys.shape != (B,) or temperatures.shape != (B,):
        raise ValueError(f"gumbel_argmax: keys and temperatures must be [{B}], got {tuple(keys.shape)} and "
                         f"{tuple(temperatures.shape)}")
    if keys.device != logits.device or temperatures.device != logits.device:
        raise ValueError("gumbel_argmax: logits, keys and temperatures must be on one device")


def gumbel_argmax_triton(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor,
                         vhash: torch.Tensor | None = None) -> torch.Tensor:
    """One program per row streams its logits once (``vhash`` is recomputed in the kernel)."""
    _check(logits, keys, temperatures)
    check_triton_device(("logits", logits))
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    out = torch.full((B,), -1, dtype=torch.int64, device=logits.device)
    if B == 0 or V == 0:
        return out
    _gumbel_argmax_kernel[(B,)](logits, logits.stride(0), keys.to(torch.int64).contiguous(),
                                temperatures.to(torch.float32).contiguous(), out, V, BLOCK=BLOCK_V, num_warps=8)
    return out


OPS = {"gumbel_argmax": {"triton": gumbel_argmax_triton, "torch_ref": gumbel_argmax_torch}}
META = {"gumbel_argmax.noise":
        "hash32(hash32(vhash(v) ^ key) ^ key*C) -> fp32 u = ((x >> 9) + 0.5) / 2**23; -log(-log u)"}

COMPILE_SPECS = [
    dict(fn=_gumbel_argmax_kernel, signature={"lg_ptr": "*bf16", "stride_l": "i32", "keys_ptr": "*i64",
                                              "temp_ptr": "*fp32", "out_ptr": "*i64", "V": "i32"},
         constexprs={"BLOCK": BLOCK_V}, num_warps=8),
]
