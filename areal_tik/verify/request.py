"""What ``areal-tik verify`` asks of a rollout engine, and our engine's answer.

A :class:`VerifyRequest` names the model, the kernels and the request mix; each rollout engine of the registry
(``areal_tik.areal.engines``) has a ``verify`` entry that takes one and returns a JSON-ready report:
``{"passed", "regimes": {name: {"passed", "n_tokens", "n_mismatch", "max_abs_diff", ...}}, ...}``. With
``kernels="default"`` an engine's entry is its negative control (the bits must differ).
:func:`verify_ours` is our engine's entry: the R1-R5 harness of :mod:`areal_tik.verify.parity`.
"""
from __future__ import annotations

import dataclasses

import torch

from areal_tik.dispatch.fingerprint import compute
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import ops_of, patch_model
from areal_tik.verify.parity import REGIMES, ParityConfig, run_parity

__all__ = ["VerifyRequest", "verify_ours"]


@dataclasses.dataclass(frozen=True)
class VerifyRequest:
    model: str = "tiny-qwen2"              # preset name or HF directory
    kernels: str = "tik"                   # tik | default (the negative control)
    backend: str | None = None             # Settings.backend
    device: str | None = None
    dtype: str = "bfloat16"
    prompts: int = 8
    min_prompt_len: int = 3
    max_prompt_len: int = 40
    max_new_tokens: int = 16
    pad_to: int = 256                      # R1 micro-batch padding multiple (our engine)
    seed: int = 0
    regimes: tuple[str, ...] = REGIMES     # our engine's regimes to run
    backward: bool = True                  # R1 with a backward pass


def verify_ours(req: VerifyRequest, progress=None) -> dict:
    """Our engine through R2-R5 and the training forward through R1 on one patched model, every generated token's
    log-prob compared bit for bit; the report names the fingerprint of the bound ops (tik kernels)."""
    model = build_model(req.model, dtype=getattr(torch, req.dtype), device=req.device, seed=req.seed)
    patch_model(model, kernels=req.kernels, backend=req.backend)
    cfg = ParityConfig(n_prompts=req.prompts, min_prompt_len=req.min_prompt_len, max_prompt_len=req.max_prompt_len,
                       max_new_tokens=req.max_new_tokens, seed=req.seed, pad_to=req.pad_to, backward=req.backward,
                       regimes=tuple(req.regimes))
    rep = run_parity(model, cfg, progress=progress)
    rep.update(model=req.model, kernels=req.kernels, device=str(next(model.parameters()).device))
    ops = ops_of(model)
    if ops is not None:   # which backend ran each op (the settings may pick one per op)
        fp = compute(ops)
        rep.update(kernel_fingerprint=fp["fingerprint"], kernel_selection=fp["selection"])
    return rep
