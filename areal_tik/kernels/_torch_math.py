"""Deterministic transcendental functions for the torch_ref backend.

ATen's CPU ``exp``/``log`` use SIMD code for most of a tensor and scalar libm code for
the tail of each thread's chunk, which can differ by an ulp: the bits of an element
then depend on its flat position, i.e. on the batch size. These versions are built
only from exactly-rounded IEEE operations (``+ - * /``, exact power-of-two scaling,
``frexp``, ``round``, ``where``), each a separate torch call so nothing is contracted
into an FMA, evaluated in float64 and rounded once to the input dtype. Every element's
result therefore depends only on its own input value, on any device, at any position.

Accuracy: float64 polynomial evaluation, error well under 1e-15 relative before the
final rounding, so fp32/bf16 results are correctly rounded except in rare halfway
cases (and even then deterministic).
"""
from __future__ import annotations

import math

import torch

__all__ = ["exp", "log", "sigmoid", "silu", "rsqrt"]

_LN2_HI = 6.93147180369123816490e-01   # Cody-Waite split of ln 2 (hi has trailing zeros)
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.0 / math.log(2.0)
# Taylor coefficients 1/k! for exp on |r| <= ln2/2; degree 13 gives < 1e-17 error.
_EXP_COEF = [1.0 / math.factorial(k) for k in range(14)]


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """Exact 2**n for integer-valued float64 n in [-1022, 1023]."""
    bits = (n.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` rounded to ``x.dtype``, bit-identical wherever the element sits."""
    out_dtype = x.dtype
    xd = x.to(torch.float64)
    nan = torch.isnan(xd)
    xd = torch.clamp(xd, -1400.0, 1400.0)
    n = torch.round(xd * _INV_LN2)
    r = (xd - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEF[-1])
    for c in reversed(_EXP_COEF[:-1]):
        p = p * r
        p = p + c
    # scale by 2**n in two exact steps so large |n| neither overflows the exponent field
    n1 = torch.clamp(torch.floor(n * 0.5), -1022.0, 1023.0)
    n2 = torch.clamp(n - n1, -1022.0, 1023.0)
    y = (p * _pow2(n1)) * _pow2(n2)
    y = torch.where(nan, torch.full_like(y, float("nan")), y)
    return y.to(out_dtype)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log rounded to ``x.dtype``; log(0) = -inf, log(<0) = nan, log(inf) = inf."""
    out_dtype = x.dtype
    xd = x.to(torch.float64)
    m, e = torch.frexp(xd)  # xd = m * 2**e, m in [0.5, 1)
    e = e.to(torch.float64)
    small = m < 0.7071067811865476
    m = torch.where(small, m * 2.0, m)
    e = torch.where(small, e - 1.0, e)
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    # log(m) = 2 * atanh(f) = 2 * (f + f^3/3 + f^5/5 + ...), |f| <= 0.1716
    s = torch.full_like(f, 1.0 / 23.0)
    for k in range(21, 0, -2):
        s = s * f2
        s = s + 1.0 / k
    lm = (2.0 * f) * s
    y = (e * _LN2_HI + lm) + e * _LN2_LO
    y = torch.where(xd == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(xd < 0, torch.full_like(y, math.nan), y)
    y = torch.where(torch.isinf(xd) & (xd > 0), torch.full_like(y, math.inf), y)
    y = torch.where(torch.isnan(xd), xd, y)
    return y.to(out_dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in float64, rounded once to ``x.dtype``."""
    e = exp(-x.to(torch.float64))
    return (1.0 / (1.0 + e)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` in float64, rounded once to ``x.dtype``."""
    xd = x.to(torch.float64)
    return (xd / (1.0 + exp(-xd))).to(x.dtype)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)`` from two correctly rounded ops, in ``x.dtype``."""
    return 1.0 / torch.sqrt(x)
