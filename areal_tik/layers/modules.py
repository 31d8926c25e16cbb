"""The op modules ``patch_model`` installs (and ``decoder.build_decoder`` builds), keeping HF attribute names.

Installed by ``__class__`` swap on an existing HF module, so parameters, their names, tying and
the module tree stay exactly as HF built them (state dicts, FSDP2 wrapping by
``_no_split_modules`` class name, optimizers unchanged):

- ``TikLinear`` (``nn.Linear``): the bound ``linear`` -- one GEMM schedule for every M.
- ``TikRMSNorm``: the bound ``rms_norm`` with HF's ``weight`` / ``variance_epsilon``.
- ``TikMLP``: ``down_proj(silu_mul(gate_proj(x), up_proj(x)))`` (gate/up as one stacked GEMM when
  ``stacking.py`` stacked them, with the activation in its epilogue where ``linear_silu_mul`` computes the bound
  ops' arithmetic: the same bits).
- ``RopeCache``: the fp32 RoPE table of a model, per device.

Each calls ``self._tik_ops``, the model's :class:`~areal_tik.dispatch.bound.BoundOps` bound by
``patch_model``: implementations are chosen once, when the model is patched. How these modules
are wired into a decoder is ``decoder.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from areal_tik.layers.family import head_dim_of
from areal_tik.layers.model_config import rope_spec
from areal_tik.layers.stacking import GATE_UP_ATTR, active_stack

__all__ = ["TikLinear", "TikRMSNorm", "TikMLP", "RopeCache", "fuses", "fuses_add_norm", "fuses_norm_rope",
           "fuses_gate_up_silu"]


class TikLinear(nn.Linear):
    """``nn.Linear`` computed by the bound ``linear`` (batch-invariant rows, fp32 accumulate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tik_ops.linear(x, self.weight, self.bias)


def fuses(ops, fused_op: str, parts: tuple[str, ...]) -> bool:
    """Whether the bound ``fused_op`` computes the bound ``parts``' arithmetic: it is bound on the same backend as
    each part and each part's sources are among its own. Then a tik module runs the parts as its one launch;
    otherwise (e.g. an exported or csrc kernel bound for a part) the bound parts run apart."""
    fused = ops.impls.get(fused_op)
    return fused is not None and all(
        ops.impls[op].backend == fused.backend and set(ops.impls[op].sources) <= set(fused.sources) for op in parts)


def fuses_add_norm(ops) -> bool:
    """The residual add and ``rms_norm`` as one ``add_rms_norm`` launch (:func:`fuses`)."""
    return fuses(ops, "add_rms_norm", ("rms_norm",))


def fuses_norm_rope(ops) -> bool:
    """The per-head q/k norms and RoPE as one ``qk_norm_rope`` launch (:func:`fuses`)."""
    return fuses(ops, "qk_norm_rope", ("rms_norm", "apply_rope"))


def fuses_gate_up_silu(ops) -> bool:
    """The stacked gate/up GEMM and SiLU-and-multiply as one ``linear_silu_mul`` launch (:func:`fuses`)."""
    return fuses(ops, "linear_silu_mul", ("linear", "silu_mul_packed"))


class TikRMSNorm(nn.Module):
    """HF RMSNorm (``weight``, ``variance_epsilon``) computed by ``ops.rms_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tik_ops.rms_norm(x, self.weight, self.variance_epsilon)

    def fused_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(self(residual + x), residual + x)`` in one ``add_rms_norm`` launch (the same bits as apart), or None
        where it cannot run this norm's arithmetic (:func:`fuses_add_norm`, mixed dtypes)."""
        ops = self._tik_ops
        if x.dtype == residual.dtype and x.dtype == self.weight.dtype and fuses_add_norm(ops):
            return ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return None

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, tik"


class TikMLP(nn.Module):
    """HF gated MLP (``gate_proj``/``up_proj``/``down_proj``) with ``ops.silu_mul``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._tik_ops
        st = active_stack(self, GATE_UP_ATTR)           # stacking.py: same bits, one GEMM
        if st is not None:
            if fuses_gate_up_silu(ops):                  # and the activation in its epilogue: same bits
                return self.down_proj(ops.linear_silu_mul(x, st.weight, st.bias))
            return self.down_proj(ops.silu_mul_packed(ops.linear(x, st.weight, st.bias)))
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class RopeCache:
    """The fp32 RoPE table, built once per device by ``ops.rope_table`` (never a buffer
    or parameter, so ``.to(dtype)`` and FSDP mixed precision cannot cast it)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, rope_table):
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self._rope_table = rope_table
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of_config(cls, cfg, rope_table) -> "RopeCache":
        """The table of ``cfg``'s head dim, positions and RoPE (``model_config.rope_spec``), by ``rope_table``."""
        theta, scaling = rope_spec(cfg)
        return cls(head_dim_of(cfg), cfg.max_position_embeddings, theta, scaling, rope_table)

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._tables.get(device)
        if t is None:
            t = self._rope_table(self.head_dim, self.max_positions, self.theta, device, scaling=self.scaling)
            self._tables[device] = t
        return t
