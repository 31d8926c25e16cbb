"""What the tik actor and critic both do to AReaL's FSDP model: patch it before FSDP2 wraps it,
then, once wrapped, keep the RoPE table fp32 and pre-compile the linear tiles.

:class:`TikModelMixin` goes before AReaL's engine class in the bases
(``class TikFSDPPPOActor(TikModelMixin, FSDPPPOActor)``); the subclass sets ``kernels``
and ``settings`` in its ``__init__``.
"""
from __future__ import annotations

import torch
from areal.utils import logging

from areal_tik.dispatch.process import configure_process
from areal_tik.layers import precompile
from areal_tik.layers.patch import ops_of, patch_model
from areal_tik.settings import Settings

logger = logging.getLogger("TikModel")

__all__ = ["TikModelMixin", "settings_of", "keep_rope_fp32", "precompile_model"]

FLASH_IMPLS = ("flash_attention_2", "flash_attention_3")


def settings_of(config, kernels: str) -> Settings:
    """The process settings of an actor/critic config (its ``tik`` section, when it has one)."""
    tik = getattr(config, "tik", None)
    return tik.settings(kernels) if tik is not None else Settings.from_env(kernels=kernels)


def keep_rope_fp32(model) -> None:
    """FSDP2's ``cast_forward_inputs=True`` (hard-wired in AReaL's ``parallelize_model``) casts
    every floating tensor in a wrapped layer's inputs to bf16, including the fp32 RoPE table the
    patched layers receive in their step (``layers/steps.TikStep``); the contract says that table is never cast.
    A pre-hook registered after FSDP's (so it runs after the cast) puts the fp32 table back; the
    rollout server (no FSDP) uses the same table."""
    base = getattr(model, "model", None)
    rope = getattr(base, "_tik_rope", None)
    layers = getattr(base, "layers", None)
    if rope is None or layers is None:
        return

    def fix(module, args, kwargs):
        for a in list(args) + list(kwargs.values()):
            c = getattr(a, "cos", None) if not isinstance(a, torch.Tensor) else None
            if isinstance(c, torch.Tensor) and c.dtype != torch.float32:
                a.cos, a.sin = rope.get(a.cos.device)
        return None

    for layer in layers:
        layer.register_forward_pre_hook(fix, with_kwargs=True)


def precompile_model(model, config, enabled: bool) -> None:
    """Compile every linear tile config a micro-batch can pick (M up to the micro-batch token
    budget) now, so no training step pays a Triton compile; a no-op off CUDA or when disabled.
    FSDP2 stores fp32 masters and runs the forward in ``config.dtype``."""
    max_tokens = int(getattr(config.mb_spec, "max_tokens_per_mb", None) or 32768)
    precompile.precompile_linears(model, max_tokens=max_tokens, min_tokens=64, dtype=getattr(torch, config.dtype),
                                  enabled=enabled)


class TikModelMixin:
    """Patches ``self.model`` with ``self.kernels`` and ``self.settings.backend`` when AReaL
    creates it (before FSDP2), and finishes the tik model after ``initialize``.

    ``default`` on a flash-attention implementation leaves AReaL's model untouched; ``default``
    on ``sdpa``/``eager`` (wrong for packed batches, see docs/design.md) gets the varlen-aware
    default modules: same maths, no invariance promise."""

    kernels: str
    settings: Settings

    def _create_device_model(self):
        super()._create_device_model()
        kernels = self.kernels
        if kernels == "default" and self.config.attn_impl in FLASH_IMPLS:
            logger.info("%s: kernel_backend=default with %s: AReaL's model left unpatched", type(self).__name__,
                        self.config.attn_impl)
            return
        configure_process(self.settings)
        self.model = patch_model(self.model, kernels=kernels, backend=self.settings.backend)
        self.tik_ops = ops_of(self.model)
        logger.info("%s: model patched with kernels=%s before FSDP wrapping", type(self).__name__, kernels)

    def initialize(self, *args, **kwargs):
        out = super().initialize(*args, **kwargs)
        if self.kernels == "tik":
            keep_rope_fp32(self.model)
            precompile_model(self.model, self.config, self.settings.precompile)
        return out
