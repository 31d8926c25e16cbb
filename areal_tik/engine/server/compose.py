"""The composition root: build the model, patch it, start the engine and its worker, and describe
the server for ``/get_server_info`` (kernels, fingerprint, weights digest, log-prob definition)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from areal_tik.dispatch.fingerprint import compute, environment
from areal_tik.engine.server.config import ServerConfig
from areal_tik.engine.server.routes import TikServer
from areal_tik.engine.server.worker import EngineWorker
from areal_tik.kernels import jit_watch

logger = logging.getLogger("areal_tik.server")


def _default_fingerprint() -> str:
    env = environment()
    return "default-" + hashlib.sha256(json.dumps(env, sort_keys=True, default=str).encode()).hexdigest()[:12]


def build(cfg: ServerConfig, device: str | None = None, dtype: str = "bfloat16") -> TikServer:
    """Build model (preset or HF dir), patch it per ``cfg.kernels``, wrap engine and server."""

    # lazy: keeps torch out of this module's import
    import torch

    from areal_tik.layers.weights_digest import model_digest
    from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams
    from areal_tik.layers.models import build_model

    if cfg.kernels not in ("tik", "default"):
        raise ValueError(f"--kernels must be 'tik' or 'default', got {cfg.kernels!r}")
    jit_watch.install()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build_model(cfg.model, dtype=getattr(torch, dtype), device=device, seed=cfg.seed)
    from areal_tik.layers.patch import ops_of, patch_model  # lazy: keeps torch out of this module's import
    model = patch_model(model, kernels=cfg.kernels, backend=cfg.backend)
    model.eval()
    t1 = time.perf_counter()
    max_pos = int(getattr(model.config, "max_position_embeddings", 8192))
    optional = {}  # EngineConfig's defaults unless the server config sets them
    if cfg.prefill_graph_max_tokens is not None:
        optional["prefill_graph_max_tokens"] = int(cfg.prefill_graph_max_tokens)
    if cfg.page_size is not None:
        optional["page_size"] = int(cfg.page_size)
    if cfg.max_total_tokens is not None:
        page = optional.get("page_size", EngineConfig.page_size)
        optional["num_pages"] = -(-int(cfg.max_total_tokens) // page)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=int(cfg.max_running_requests),
                                           max_model_len=min(int(cfg.context_length), max_pos)
                                           if cfg.context_length else None,
                                           gpu_memory_utilization=float(cfg.mem_fraction),
                                           enforce_eager=bool(cfg.disable_cuda_graph),
                                           cuda_graph_max_bs=cfg.cuda_graph_max_bs,
                                           enable_prefix_sharing=not cfg.disable_radix_cache,
                                           async_decode=not cfg.disable_overlap_schedule, seed=int(cfg.seed),
                                           **optional))
    logger.info("start-up: model built/loaded + patched in %.1fs, engine (KV cache) in %.1fs",
                t1 - t0, time.perf_counter() - t1)
    if cfg.kernels == "tik":
        # every linear tile config a prefill or decode step can pick, compiled now rather than
        # inside a rollout (a no-op off CUDA)
        from areal_tik.layers.precompile import precompile_linears, step_token_bound
        precompile_linears(model, max_tokens=step_token_bound(engine.config.max_num_batched_tokens,
                                                              engine.config.max_num_seqs),
                           enabled=cfg.precompile)

    if cfg.kernels == "tik":
        fp = compute(ops_of(model))      # the ops patch_model bound to the served model
        fingerprint, selection = fp["fingerprint"], fp["selection"]
    else:
        fingerprint, selection = _default_fingerprint(), {}
    tok_path = cfg.model if os.path.isdir(cfg.model) else None
    info = {
        "model_path": cfg.model,
        "tokenizer_path": tok_path,
        "kernels": cfg.kernels,
        "kernel_fingerprint": fingerprint,
        "kernel_selection": selection,
        "logprobs": "log_softmax(logits.float()/T)[token], unfiltered (no top-p/top-k/penalty)",
        "dtype": dtype,
        "device": device,
        "server": "areal-tik",
    }
    digest_cache = {}

    def model_info():
        v = engine.weights_serial  # advances with every load (a bucketed update is several per version)
        if digest_cache.get("v") != v:
            digest_cache.update(v=v, d=model_digest(model, dtype=getattr(torch, dtype)))
        return {"weights_digest": digest_cache["d"]}

    worker = EngineWorker(engine, SamplingParams, model_info=model_info)
    return TikServer(worker, cfg, info)

