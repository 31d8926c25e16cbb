"""FSDP PPO critic whose value model is patched like the actor's (before FSDP2 wraps it).

What AReaL 1.0.4 does on its own (``areal/engine/fsdp_engine.py``, read from the installed
package): with ``critic.is_critic=true`` ``FSDPEngine._create_llm_actor_or_critic`` builds
``AutoModelForTokenClassification(num_labels=1, attn_implementation=critic.attn_impl)``,
i.e. the HF decoder plus a linear value head ``score`` (bias, random init when loaded from
a causal-LM checkpoint). ``PPOCritic.compute_values`` / ``ppo_update`` go through
``FSDPEngine._prepare_mb_list``, which packs each micro-batch into ONE row and passes
``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids`` restarting at 0 per sequence and
``attention_mask={"full_attention": None, "sliding_attention": None}``. HF's decoder
takes a dict mask as the already-built per-layer masks, so every layer sees mask None:

- ``attn_impl=sdpa`` runs ``F.scaled_dot_product_attention(is_causal=True)`` over the whole
  packed row: each sequence after the first attends to all earlier sequences of the
  micro-batch (RoPE positions are right, the attention span is not), so its values depend
  on its neighbours (``tests/areal/test_critic.py`` shows the drift on the real class);
- ``attn_impl=eager`` with mask None applies no causal mask at all;
- only ``flash_attention_2/3`` (the flash_attn package, GPU only) read ``cu_seq_lens_*``
  and are correct.

:class:`TikFSDPPPOCritic` patches the freshly built model with
``areal_tik.layers.patch.patch_model`` (parameter names, module tree and the value head
unchanged): ``critic.kernel_backend=tik`` (``auto`` follows ``actor.kernel_backend``) puts
the decoder and the value head on the tik kernels (values bitwise independent of packing);
``default`` keeps HF's math but with a varlen attention that respects ``cu_seq_lens``
(correct values, no bitwise promise). ``default`` with ``flash_attention_2/3`` leaves
AReaL's model untouched, as the actor does.
"""
from __future__ import annotations

from areal.engine.fsdp_engine import FSDPPPOCritic

from areal_tik.areal.device_model import TikModelMixin, settings_of

__all__ = ["TikFSDPPPOCritic", "critic_kernels"]


def critic_kernels(config) -> str:
    k = getattr(config, "kernel_backend", "default")
    return "default" if k in ("auto", None, "") else k


class TikFSDPPPOCritic(TikModelMixin, FSDPPPOCritic):
    """``FSDPPPOCritic`` on a patched value model (the actor's patching, RoPE fix and pre-compile)."""

    def __init__(self, config):
        super().__init__(config)
        self.kernels = critic_kernels(config)
        self.settings = settings_of(config, self.kernels)
