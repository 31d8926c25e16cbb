"""The read floor of a rollout: how many generated tokens per second a GPU could give if every decode step only
read what it must (every weight once, the K/V of every active sequence) at the GPU's streaming read rate, and each
arm's measured rate over it (bench_rollout's roofline column)."""
from __future__ import annotations


def read_rate_bytes_per_s() -> float:
    """This GPU's streaming read rate: a sum over 4 GiB of bf16 (median of 5 runs after a warm one)."""
    import torch
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x.sum(dtype=torch.float32)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del x
    torch.cuda.empty_cache()
    return (4 << 30) / sorted(times[1:])[2]


def roofline(model: str, workloads, arms: dict) -> dict:
    """``workloads``: ``((batch, prompt, new), name)`` pairs; ``arms``: arm -> {"workloads": {name: {"tokens_per_s"}}}.
    Each arm's tokens/s over the read floor of its workload: every decode step reads every weight once (the
    embedding table only where it is also the lm_head) and the K/V of every active sequence, at this GPU's
    streaming read rate; prefill is left out, so the floor is a little optimistic."""
    from areal_tik.layers.models import preset_config
    cfg = preset_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads, H, I, V, L = cfg.num_key_value_heads, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, \
        cfg.num_hidden_layers
    per_layer = H * (cfg.num_attention_heads * head_dim) * 2 + 2 * H * kv_heads * head_dim + 3 * H * I + 2 * H
    weight_bytes = 2 * (L * per_layer + V * H + H)
    kv_per_token = 2 * L * kv_heads * head_dim * 2
    rate = read_rate_bytes_per_s()
    out = dict(read_rate_tb_s=round(rate / 1e12, 3), weight_gb=round(weight_bytes / 1e9, 2), workloads={})
    for (B, P, N), w in workloads:
        read = N * weight_bytes + B * kv_per_token * (N * P + N * (N - 1) / 2)
        floor = B * N / (read / rate)
        out["workloads"][w] = dict(floor_tokens_per_s=round(floor, 1), **{
            arm: round(r["workloads"][w]["tokens_per_s"] / floor, 3) for arm, r in arms.items()
            if w in r.get("workloads", {})})
    return out
