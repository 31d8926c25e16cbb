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


def step_weight_bytes(cfg, batch: int) -> float:
    """Bytes of weights one decode step at ``batch`` sequences reads: every dense weight once (the embedding table
    only as the lm_head); in an MoE layer the router, the shared expert if any, and the experts the batch routes to,
    expected under uniform routing: ``E * (1 - (1 - k/E) ** batch)`` of the ``E`` experts (k per token)."""
    from areal_tik.layers.family import head_dim_of, moe_layer
    head_dim, H = head_dim_of(cfg), cfg.hidden_size
    attn = H * (cfg.num_attention_heads * head_dim) * 2 + 2 * H * cfg.num_key_value_heads * head_dim + 2 * H
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        if moe_layer(cfg, i):          # the layers with experts, by the family table's rule
            E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
            mlp = E * (1 - (1 - k / E) ** batch) * 3 * H * I + E * H
            shared = getattr(cfg, "shared_expert_intermediate_size", None)
            if shared:
                mlp += 3 * H * shared + H
        else:
            mlp = 3 * H * cfg.intermediate_size
        total += attn + mlp
    return 2 * (total + cfg.vocab_size * H + H)


def roofline(model: str, workloads, arms: dict) -> dict:
    """``workloads``: ``((batch, prompt, new), name)`` pairs; ``arms``: arm -> {"workloads": {name: {"tokens_per_s"}}}.
    Each arm's tokens/s over the read floor of its workload: every decode step reads the weights it must
    (:func:`step_weight_bytes`) and the K/V of every active sequence, at this GPU's streaming read rate; prefill is
    left out, so the floor is a little optimistic. ``weight_gb``: all the model's weights (every expert)."""
    from areal_tik.layers.family import head_dim_of
    from areal_tik.layers.models import preset_config
    cfg = preset_config(model)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim_of(cfg) * 2
    rate = read_rate_bytes_per_s()
    all_experts = 1 << 30      # a batch this large routes to every expert
    out = dict(read_rate_tb_s=round(rate / 1e12, 3), weight_gb=round(step_weight_bytes(cfg, all_experts) / 1e9, 2),
               workloads={})
    for (B, P, N), w in workloads:
        read = N * step_weight_bytes(cfg, B) + B * kv_per_token * (N * P + N * (N - 1) / 2)
        floor = B * N / (read / rate)
        out["workloads"][w] = dict(floor_tokens_per_s=round(floor, 1), **{
            arm: round(r["workloads"][w]["tokens_per_s"] / floor, 3) for arm, r in arms.items()
            if w in r.get("workloads", {})})
    return out
