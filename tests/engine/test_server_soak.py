"""A bounded soak of the rollout server (bench/soak_server.py) on the CPU: 24 concurrent clients for
a dozen seconds, random disconnects (half retried with the same rid), pauses, continues, weight
updates from disk (two checkpoints, alternating), abort-all and abort-one, and a KV cache of 10
pages of 16 tokens for up to 8 sequences of up to 36 tokens, so sequences are preempted.

Every completed request must have the bits of the same request alone on the same weights, every
aborted one a prefix of them; no retried rid refused; no request, page or reply left over; the
process's RSS grown by at most 64 MiB after the warm-up; and the soak must really have completed,
disconnected, paused, updated and preempted. The longer GPU run is ``python bench/soak_server.py``
(docs/results.md)."""
from __future__ import annotations

import os
import sys

import torch

from areal_tik.engine.server import ServerConfig, build, serving
from areal_tik.layers.models import build_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import soak_server  # noqa: E402

SOAK_S = float(os.environ.get("AREAL_TIK_SOAK_S", "12"))
RSS_BOUND_MB = 64.0


def test_soak_bits_and_no_leaks(tmp_path):
    cfg = ServerConfig(model="tiny-qwen2", port=soak_server.free_port(), max_running_requests=8, context_length=64,
                       page_size=16, max_total_tokens=160, precompile=False)
    server = build(cfg, device="cpu")
    assert server.worker.engine.stats()["num_pages"] == 10
    ckpts = [str(tmp_path / "a"), str(tmp_path / "b")]
    server.worker.engine.model.save_pretrained(ckpts[0])
    build_model("tiny-qwen2", dtype=torch.bfloat16, device="cpu", seed=1).save_pretrained(ckpts[1])
    with serving(server) as addr:
        summary = soak_server.soak_server(server, addr, ckpts, n_specs=6, max_prompt=24, max_new=12,
                                          duration_s=SOAK_S, clients=24, seed=3, rss_bound_mb=RSS_BOUND_MB)
    print(summary)
    assert summary["problems"] == [], summary
    assert summary["served"] >= 10 and summary["retry_409"] == 0, summary
