"""Stacked projections for inference: q/k/v as one GEMM, gate/up as one GEMM, same bits.

``ops.linear`` computes output element (m, n) from ``x[m]`` and weight row ``n`` alone, in one
K order for every tile shape (``kernels/linear``: "Invariance"), so a GEMM over the weights
stacked by rows gives, column block by column block, exactly the separate GEMMs' outputs;
``ops.silu_mul_packed`` is ``ops.silu_mul`` on the two halves of the stacked gate/up output.
A decode step then launches 4 GEMMs per layer instead of 7, larger ones, which is what
matters at decode batch sizes.

:func:`stack_projections` moves each tik layer's q/k/v (and gate/up) parameters into one
contiguous tensor and leaves the HF parameters in place as *views* of it, so names,
``state_dict()``, the weights digest and in-place weight updates (``copy_`` into
``q_proj.weight``, how the engine and its CUDA graphs update weights) are unchanged and
always reach the stacked tensor. The stacked path runs only when

- autograd is off (training keeps the separate projections, whose parameters get gradients),
- and every HF parameter still views the stacked tensor at its offset (a parameter replaced
  by another tensor, e.g. ``load_state_dict(assign=True)``, falls back to the separate path:
  a correct answer, never a stale one). A forward traced by ``torch.compile`` (the vLLM plugin's
  compiled mode) takes the stacked path without this check, which reads storage pointers: its host
  writes weights in place only (``load_hf_tensors``), so the views stay intact.

Only for inference models (the rollout engine); an FSDP-sharded training model must not be
stacked.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["stack_projections", "active_stack", "stacked_output", "stacked_projection", "stacks_of", "StackedWeights",
           "QKV_ATTR", "GATE_UP_ATTR", "STACK_ATTRS"]

#: the attributes :func:`stack_projections` sets on a tik attention (q/k/v) and a tik MLP (gate/up)
QKV_ATTR, GATE_UP_ATTR = "_tik_qkv", "_tik_gate_up"
STACK_ATTRS = (QKV_ATTR, GATE_UP_ATTR)


class StackedWeights:
    """One stacked weight (and bias) and the HF linears whose parameters view it, in row order."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        w = torch.cat([lin.weight.detach() for lin in linears])
        has_b = [lin.bias is not None for lin in linears]
        if any(has_b) and not all(has_b):
            raise ValueError("stack_projections: stacked linears must all have a bias or none")
        b = torch.cat([lin.bias.detach() for lin in linears]) if all(has_b) else None
        self.weight, self.bias = w, b
        off = 0
        for lin, n in zip(linears, self.sizes):
            lin.weight.data = w.narrow(0, off, n)
            if b is not None:
                lin.bias.data = b.narrow(0, off, n)
            off += n
        self._ptrs = self._expected_ptrs()

    def _expected_ptrs(self) -> list[int]:
        ptrs, off = [], 0
        es = self.weight.element_size()
        K = self.weight.shape[1]
        for n in self.sizes:
            ptrs.append(self.weight.data_ptr() + off * K * es)
            if self.bias is not None:
                ptrs.append(self.bias.data_ptr() + off * self.bias.element_size())
            off += n
        return ptrs

    def intact(self) -> bool:
        """Every HF parameter still views the stacked tensors at its own offset."""
        got = []
        for lin in self.linears:
            got.append(lin.weight.data_ptr())
            if self.bias is not None:
                got.append(lin.bias.data_ptr())
        return got == self._ptrs and all(lin.weight.dtype == self.weight.dtype for lin in self.linears)


def active_stack(module: nn.Module, attr: str) -> StackedWeights | None:
    """``module.<attr>`` (a :class:`StackedWeights`) when the stacked path may run now, or None when the separate
    path must (autograd on, nothing stacked, or the stack no longer intact)."""
    st = getattr(module, attr, None)
    if st is None or torch.is_grad_enabled() or (not torch.compiler.is_compiling() and not st.intact()):
        return None
    return st


def stacked_output(module: nn.Module, attr: str, x: torch.Tensor) -> torch.Tensor | None:
    """The stacked GEMM's output for ``module.<attr>``, or None when the separate path must run."""
    st = active_stack(module, attr)
    return None if st is None else module._tik_ops.linear(x, st.weight, st.bias)


def stacked_projection(module: nn.Module, attr: str, x: torch.Tensor) -> list[torch.Tensor] | None:
    """:func:`stacked_output` split into the stacked linears' column blocks (views), or None."""
    out = stacked_output(module, attr, x)
    return None if out is None else list(out.split(getattr(module, attr).sizes, dim=-1))


def stack_projections(model: nn.Module) -> int:
    """Stack every tik attention's q/k/v and every tik MLP's gate/up in ``model`` (in place; see the
    module docstring). Returns the number of stacks made. Idempotent. Modules on HF's kernels (no bound
    tik ops) are left alone: cuBLAS picks its kernel by N, so stacking would change their bits."""
    n = 0
    for m in model.modules():
        if getattr(m, "_tik_ops", None) is None:
            continue
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")) and getattr(m, QKV_ATTR, None) is None:
            setattr(m, QKV_ATTR, StackedWeights([m.q_proj, m.k_proj, m.v_proj]))
            n += 1
        elif all(hasattr(m, a) for a in ("gate_proj", "up_proj")) and getattr(m, GATE_UP_ATTR, None) is None:
            setattr(m, GATE_UP_ATTR, StackedWeights([m.gate_proj, m.up_proj]))
            n += 1
    return n


def stacks_of(module: nn.Module) -> list[StackedWeights]:
    """The stacked weights :func:`stack_projections` attached to ``module`` (none when it was not stacked): the
    GEMMs an inference forward runs in place of the linears they stack."""
    return [st for st in (getattr(module, a, None) for a in STACK_ATTRS) if isinstance(st, StackedWeights)]
