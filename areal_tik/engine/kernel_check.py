"""Can the tik kernels of a backend spec run a model in this engine? Checked from the model's config
alone, before anything is built: the entry points (``areal-tik serve``, the trainer's launch) call it
so that a refusal is one line up front, not a failure inside a model build or a server start-up."""
from __future__ import annotations

from areal_tik.dispatch.bound import bind
from areal_tik.engine.config import EngineConfig
from areal_tik.layers.models import PRESETS, preset_config

__all__ = ["check_kernel_shapes", "KernelShapeError"]


class KernelShapeError(ValueError):
    """A bound implementation cannot keep its contract at the model's head dim or the KV page size."""


def check_kernel_shapes(model: str | None, backend: str | None, page_size: int | None = None) -> None:
    """Bind ``backend`` (a ``Settings.backend`` spec; ``BackendUnavailable`` when what it demands cannot
    run here), then run its implementations' shape checks (``BoundOps.check_shapes``) at ``model``'s head
    dim and the engine's KV ``page_size`` (default ``EngineConfig``'s): :class:`KernelShapeError`, one
    line. ``model``: a preset name or an HF checkpoint directory (only its config.json is read); None
    checks the binding alone."""
    ops = bind(backend)
    if model is None:
        return
    if model in PRESETS:
        cfg = preset_config(model)
    else:
        from transformers import AutoConfig  # lazy: only for a checkpoint directory
        cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        ops.check_shapes(head_dim, EngineConfig.page_size if page_size is None else page_size)
    except ValueError as e:
        raise KernelShapeError(str(e).splitlines()[0]) from None
