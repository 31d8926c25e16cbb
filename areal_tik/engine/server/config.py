"""The server's settings (SGLang's flag names where they exist)."""
from __future__ import annotations

import dataclasses

MAX_BODY_BYTES = 64 << 20  # the largest request body (a context-length prompt is well under 1 MiB)
# the route of an update from the trainer's shared buffer (engine/weight_ipc; the tik vLLM server has it too) and
# the peers it serves: the buffer's handle is only meaningful on this machine
IPC_ROUTE = "/update_weights_from_ipc"
LOOPBACK_HOSTS = ("127.0.0.1", "::1")


@dataclasses.dataclass
class ServerConfig:
    """``max_running_requests``: sequences decoded together (SGLang's name; AReaL sends a whole
    RL batch at once, e.g. 16 prompts x 8 samples, so 64 made the rollout run in waves).
    ``context_length``: longest prompt + output (SGLang's name; ``None``: the model's, capped at
    8192); it and ``max_running_requests`` bound the KV cache. ``mem_fraction``: share of the
    GPU memory free at start-up the KV cache may take (the trainer shares the GPU in an SPMD
    world of one, so SGLang's ``mem_fraction_static`` = 0.9 is not taken over).
    ``disable_cuda_graph`` / ``cuda_graph_max_bs`` (SGLang's names): ``EngineConfig.enforce_eager`` /
    ``cuda_graph_max_bs``; ``prefill_graph_max_tokens``: ``EngineConfig``'s (``None``: its default).
    ``disable_radix_cache`` (SGLang's name): ``EngineConfig.enable_prefix_sharing = False``.
    ``disable_overlap_schedule`` (SGLang's name): ``EngineConfig.async_decode = False`` (no pipelined decode
    steps). ``page_size`` / ``max_total_tokens`` (SGLang's names): the KV cache's page size and its size in tokens
    (``None``: ``EngineConfig``'s page size, the cache sized from ``mem_fraction``). ``seed``: ``EngineConfig.seed`` (draws the seed of each request that gives none) and a preset's
    random weights."""
    model: str
    kernels: str = "tik"
    backend: str | None = None          # Settings.backend: the op implementations (bound at patch time)
    precompile: bool = True             # Settings.precompile
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    seed: int = 0
    max_running_requests: int = 256
    context_length: int | None = None
    mem_fraction: float = 0.5
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    prefill_graph_max_tokens: int | None = None
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    page_size: int | None = None
    max_total_tokens: int | None = None
