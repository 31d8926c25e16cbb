"""The op modules ``patch_model`` installs (and ``decoder.build_decoder`` builds), keeping HF attribute names.

Installed by ``__class__`` swap on an existing HF module, so parameters, their names, tying and
the module tree stay exactly as HF built them (state dicts, FSDP2 wrapping by
``_no_split_modules`` class name, optimizers unchanged):

- ``TikLinear`` (``nn.Linear``): the bound ``linear`` -- one GEMM schedule for every M.
- ``TikRMSNorm``: the bound ``rms_norm`` with HF's ``weight`` / ``variance_epsilon``.
- ``TikMLP``: ``down_proj(silu_mul(gate_proj(x), up_proj(x)))`` (gate/up as one stacked GEMM when
  ``stacking.py`` stacked them: the same bits).
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
from areal_tik.layers.stacking import GATE_UP_ATTR, stacked_output

__all__ = ["TikLinear", "TikRMSNorm", "TikMLP", "RopeCache", "fuses_add_norm", "fuses_norm_rope"]


class TikLinear(nn.Linear):
    """``nn.Linear`` computed by the bound ``linear`` (batch-invariant rows, fp32 accumulate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tik_ops.linear(x, self.weight, self.bias)


def fuses_add_norm(ops) -> bool:
    """Whether ``ops.add_rms_norm`` computes the bound ``rms_norm``'s arithmetic (the same backend and sources):
    then the residual add and the norm run as one launch; otherwise (e.g. an exported or csrc RMSNorm bound) the
    add and the bound norm run apart."""
    fused, plain = ops.impls.get("add_rms_norm"), ops.impls["rms_norm"]
    return fused is not None and fused.backend == plain.backend and fused.sources == plain.sources


def fuses_norm_rope(ops) -> bool:
    """Whether ``ops.qk_norm_rope`` computes the bound ``rms_norm``'s and ``apply_rope``'s arithmetic (the same
    backend, their sources among its own): then a tik step runs the per-head q/k norms and RoPE as one launch;
    otherwise (e.g. the csrc RoPE or an exported RMSNorm bound) the bound ops run apart."""
    fused = ops.impls.get("qk_norm_rope")
    if fused is None:
        return False
    return all(ops.impls[op].backend == fused.backend and set(ops.impls[op].sources) <= set(fused.sources)
               for op in ("rms_norm", "apply_rope"))


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
        gu = stacked_output(self, GATE_UP_ATTR, x)      # stacking.py: same bits, one GEMM
        if gu is not None:
            return self.down_proj(self._tik_ops.silu_mul_packed(gu))
        return self.down_proj(self._tik_ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


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
