"""Input validation of the log-prob entry points (temperature, tokens, logits, hidden and
lm_head weight): clear errors before any kernel runs."""
from __future__ import annotations

import math

import torch

from areal_tik.kernels._dense_common import (
    check_contiguous, check_dtype, check_last_dim_contiguous, check_same_device, check_same_dtype,
    check_triton_device,
)


def check_temperature(temperature) -> float:
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


def validate_logits(logits, tokens, triton_path):
    check_dtype("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    check_last_dim_contiguous("logits", logits)
    _check_tokens(tokens, logits.shape[0], logits.shape[1])
    (check_triton_device if triton_path else check_same_device)(("logits", logits), ("tokens", tokens))


def validate_hidden(hidden, weight, tokens, triton_path):
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
