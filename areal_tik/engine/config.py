"""``EngineConfig``: the engine's typed config slice, validated on construction. No torch."""
from __future__ import annotations

import dataclasses

__all__ = ["EngineConfig"]


@dataclasses.dataclass
class EngineConfig:
    """Settings of one ``LLMEngine``.

    - ``page_size``: tokens per KV page (power of two, 16..256 for the tik kernels). 64 by default: on the
      H200 at the 1.5B shape, the csrc paged prefill is 1.45x faster at 64 than at 16 (one TMA box per
      64-row half instead of four) and the decode equal or 1-6% faster, for both attention backends
      (docs/results.md); a page holds at most 63 unused slots per sequence.
    - ``num_pages``: KV pages; ``None`` sizes the cache from free GPU memory times
      ``gpu_memory_utilization`` (GPU) or from ``max_num_seqs * max_model_len`` (CPU).
    - ``max_num_seqs``: sequences in flight (decode batch size bound).
    - ``max_num_batched_tokens``: token budget of one prefill step.
    - ``chunked_prefill``: split prompts longer than the remaining budget across steps.
    - ``max_model_len``: longest sequence (prompt + output); ``None`` = the model's
      ``max_position_embeddings`` capped at 8192.
    - ``enforce_eager``: no CUDA graphs (always eager on CPU).
    - ``cuda_graph_max_bs``: largest decode batch captured (``None`` = ``max_num_seqs``).
    - ``prefill_graph_max_tokens``: prefill steps of at most this many tokens (and at most
      ``cuda_graph_max_bs`` chunks) replay a CUDA graph captured per (token bucket, chunk bucket); 0 = every
      prefill step eager. Only with the tik kernels (the default kernels' prefill needs host lengths). Eager
      prefill is host-bound: one 512-token prompt at the 1.5B shape took 31-57 ms of wall time for 6.3 ms of
      device work on the H200. Measured step wall time eager -> graph at that shape (docs/results.md):
      512 tokens 56.5 -> 8.0 ms, 2048 tokens 46.2 -> 13.5, 4096 tokens 34.3 -> 23.7, 8192 tokens 44.8 -> 44.1
      (device-bound: no gain), hence 4096. Each graph keeps its logits buffer ([chunk bucket, vocab]; 78 MB at 256
      chunks and Qwen2.5's 151,936-token vocabulary) for the engine's lifetime; captures are lazy, one per
      (token bucket, chunk bucket) the workload reaches.
    - ``stack_projections``: run each tik layer's q/k/v and gate/up as one GEMM each (``layers/stacking.py``:
      the same bits; 4 GEMM launches per layer instead of 7). The model's q/k/v and gate/up parameters become
      views of the stacked tensors (names, state dict and in-place weight updates unchanged). Models on HF's
      kernels are never stacked.
    - ``eos_token_id``: ``None`` = the model config's (first) eos id.
    - ``seed``: draws per-request seeds for requests that give none.
    - ``page_order_seed``: shuffle physical page order (tests: placement must not matter).
    - ``async_decode``: pipeline decode steps that draw inside the graph (the RL case: one temperature, no
      top-k / top-p): the next step is launched, its ids taken from the current step's draw on the device,
      before the current step's tokens are read back, so the host's per-step work (recording tokens,
      scheduling, staging, graph launch; ~0.9 ms of a 5.2 ms step at B 64 and 3K contexts) overlaps the
      device's. Only when the scheduler would run that step next anyway (nothing waiting, the same running
      sequences, pages without preemption); rows of sequences that finish meanwhile are discarded. Each
      step computes what the unpipelined step computes, so the bits are the same. ``step()`` then reports a
      finished sample one call later. On by default: on one H200 (1.5B shape) it ran 1.14x-1.28x the
      unpipelined engine's tokens/s (docs/results.md, rollout table).
    - ``enable_prefix_sharing``: requests whose leading tokens fill pages already in the KV cache
      (GRPO's n samples of a prompt, a multi-turn history sent again) read those pages instead of
      recomputing them (``kv_cache``: full pages only, refcounted, LRU-evicted, all dropped on a
      weight update). The bits are those without sharing (DESIGN section 9).
    """

    page_size: int = 64
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    max_model_len: int | None = None
    enforce_eager: bool = False
    cuda_graph_max_bs: int | None = None
    prefill_graph_max_tokens: int = 4096
    stack_projections: bool = True
    eos_token_id: int | None = None
    seed: int = 0
    page_order_seed: int | None = None
    enable_prefix_sharing: bool = True
    async_decode: bool = True

    def __post_init__(self):
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"prefill_graph_max_tokens must be >= 0, got {self.prefill_graph_max_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
