"""Packed-sequence causal attention for the *default* (baseline) kernels.

The baseline an AReaL user gets on a GPU is FlashAttention over packed sequences
(``attn_impl=flash_attention_2``). The device image has no ``flash-attn`` package, and
AReaL's ``sdpa`` path attends across the sequences of a packed row (AREAL_NOTES), so the
default kernels' attention (``steps.DefaultStep``) used to loop over sequences calling SDPA once each:
correct, but thousands of small launches per micro-batch (28 layers x 128 sequences in
the 1.5B GRPO run), which made the baseline's train step and recompute slower than a
real AReaL baseline. This module picks, once per process:

- ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's FlashAttention varlen kernels,
  forward and backward) when this torch has it and the tensors are on CUDA. Its keyword
  set changed between releases (2.10: ``is_causal``; later: ``scale``, ``window_size``,
  ``enable_gqa``), so the call is built from its signature; without ``enable_gqa`` the
  K/V heads are repeated; without ``scale`` it is used only for the default
  ``D**-0.5`` scale.
- otherwise the per-sequence SDPA loop (CPU, or a torch without varlen).

If the varlen call raises, the reason is logged once and the loop is used for that
(dtype, head dim) for the rest of the process (``status()`` reports which path ran last
and why). The signature is inspected once per process. Errors in the backward are not
caught (the GPU test runs it); ``FORCE_LOOP = True`` forces the loop. Neither path
promises batch invariance: this is the negative-control baseline.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math

import torch
import torch.nn.functional as F

__all__ = ["varlen_call_plan", "packed_causal_attention", "sdpa_causal", "status"]

log = logging.getLogger(__name__)
FORCE_LOOP = False   # True: always the per-sequence loop (a diagnostic switch for probes)
_STATE = {"path": None, "why": "not used yet", "disabled": {}}   # disabled: (dtype, head dim) -> reason


def varlen_call_plan(fn) -> dict | None:
    """How to call ``fn`` (a ``varlen_attn``) for causal attention: which keywords it takes.

    Returns ``{"causal": ("is_causal", True) | ("window_size", (-1, 0)), "scale": bool,
    "gqa": bool}``, or None when the signature offers no way to ask for causal masking."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "is_causal" in params:
        causal = ("is_causal", True)
    elif "window_size" in params:
        causal = ("window_size", (-1, 0))
    else:
        return None
    return {"causal": causal, "scale": "scale" in params, "gqa": "enable_gqa" in params}


@functools.lru_cache(maxsize=1)
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: keeps triton out of this module's import
    except Exception:  # noqa: BLE001 - older torch: no such module
        return None, None
    return varlen_attn, varlen_call_plan(varlen_attn)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def sdpa_causal(q, k, v, scale):
    """SDPA over [B, L, H, D] tensors, causal, GQA."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _loop(q, k, v, cu_host, scale):
    out = torch.empty_like(q)
    for a, b in zip(cu_host[:-1], cu_host[1:]):
        if b > a:
            out[a:b] = sdpa_causal(q[a:b][None], k[a:b][None], v[a:b][None], scale)[0]
    return out


def packed_causal_attention(q, k, v, cu_host: list, cu: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence. q [T, Hq, D], k/v [T, Hkv, D];
    ``cu_host`` / ``cu``: the same cumulative lengths on the host and on q's device."""
    key = (q.dtype, q.shape[-1])
    forced_loop = FORCE_LOOP
    fn, plan = _torch_varlen() if _on_gpu(q) and key not in _STATE["disabled"] and not forced_loop else (None, None)
    if fn is not None and plan is not None and (plan["scale"] or math.isclose(scale, q.shape[-1] ** -0.5)):
        kw = {plan["causal"][0]: plan["causal"][1]}
        if plan["scale"]:
            kw["scale"] = scale
        kk, vv = k, v
        if q.shape[1] != k.shape[1]:
            if plan["gqa"]:
                kw["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        try:
            out = fn(q, kk, vv, cu, cu, max_seqlen, max_seqlen, **kw)
            _STATE.update(path="torch varlen_attn", why=f"keywords {sorted(kw)}")
            return out
        except Exception as e:  # noqa: BLE001 - fall back for the rest of the process, said once
            _STATE["disabled"][key] = f"varlen_attn raised {type(e).__name__}: {e}"[:300]
            log.warning("default attention (%s, head dim %d): %s; using the per-sequence SDPA loop for these",
                        q.dtype, q.shape[-1], _STATE["disabled"][key])
    why = (_STATE["disabled"].get(key) or ("FORCE_LOOP set" if forced_loop else "CPU tensors" if not _on_gpu(q) else
           "no usable torch.nn.attention.varlen.varlen_attn in this torch (or a non-default scale)"))
    _STATE.update(path="per-sequence SDPA loop", why=why)
    return _loop(q, k, v, cu_host, scale)


def status() -> dict:
    """Which path the default packed attention took in this process, and why."""
    return dict(_STATE)
