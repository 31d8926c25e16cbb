"""Supervised warm start on the built-in arithmetic task: a model that earns reward.

A randomly initialised preset never answers (the 1.5B preset samples from 151,936 ids, the
character tokenizer uses 88), so its GRPO reward is 0 in both A/B arms and the reward
comparison of the A/B is undefined. With no pretrained weights on the device (no network),
:func:`warm_start` trains a preset for a few hundred steps of next-token loss on
``"<a><op><b>=" + answer + <|endoftext|>`` (loss on the answer and the end token only),
checks greedy accuracy on held-out items, and saves an HF directory (bf16 weights, the
character tokenizer, ``warmstart.json`` with the loss curve and accuracies) that a recipe
takes as ``actor.path=<dir> tokenizer_path=<dir>``.

The warm start is plain PyTorch (AdamW, bf16 autocast on CUDA, fp32 master weights): it
only has to produce a starting point; both A/B arms then load the same directory.
"""
from __future__ import annotations

import json
import math
import os
import random
import time

import torch

from areal_tik.areal import arith

__all__ = ["warm_start", "greedy_accuracy", "special_token_ids"]


def special_token_ids(tok) -> dict:
    """eos/pad/bos ids of a tokenizer as model-config overrides (bos falls back to eos)."""
    return dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id)


def _batch(items: list[dict], tok, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 except on answer + eos)."""
    seqs, labels = [], []
    for it in items:
        p = tok(it["messages"][0]["content"], add_special_tokens=False)["input_ids"]
        a = tok(it["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(lb)] = torch.tensor(lb)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device), lab.to(device)


@torch.no_grad()
def greedy_accuracy(model, tok, items: list[dict], max_new_tokens: int = 8, batch: int = 256) -> float:
    """Share of ``items`` whose greedy completion earns :func:`arith.reward_fn` 1.0."""
    dev = next(model.parameters()).device
    hits = 0
    for i in range(0, len(items), batch):
        chunk = items[i:i + batch]
        prompts = [tok(it["messages"][0]["content"], add_special_tokens=False)["input_ids"] for it in chunk]
        width = max(len(p) for p in prompts)  # left-pad for batched greedy decoding
        ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(prompts):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for j, it in enumerate(chunk):
            text = tok.decode(out[j, width:], skip_special_tokens=True)
            hits += arith.reward_fn(None, text, None, None, it["answer"]) == 1.0
    return hits / max(1, len(items))


def warm_start(model: str, out_dir: str, task: str = "mix", steps: int = 300, batch: int = 256,
               lr: float = 3e-4, seed: int = 0, device: str | None = None, eval_items: int = 256,
               progress: bool = True) -> dict:
    """Train ``model`` (a preset name or HF dir) on ``task`` for ``steps`` and save it to ``out_dir``.
    Returns the record also written to ``<out_dir>/warmstart.json``."""
    from transformers import AutoTokenizer

    from areal_tik.layers.models import build_model

    if task not in arith.TASKS:
        raise ValueError(f"unknown arithmetic task {task!r}; known: {arith.TASKS}")
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got steps={steps}, batch={batch}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(arith.TOKENIZER_DIR)
    t0 = time.perf_counter()
    net = build_model(model, dtype=torch.float32, device=device, seed=seed, **special_token_ids(tok))
    net.generation_config.eos_token_id = tok.eos_token_id
    net.generation_config.pad_token_id = tok.pad_token_id
    train_items = arith.make_dataset(steps * batch, seed=seed + 1000, task=task)
    held_out = arith.make_dataset(eval_items, seed=seed + 2000, task=task)
    net.eval()
    acc_before = greedy_accuracy(net, tok, held_out)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    use_amp = torch.device(device).type == "cuda"
    losses = []
    it = range(steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"warm start {model} on {task}", unit="step")
    net.train()
    rng = random.Random(seed)
    for s in it:
        items = train_items[s * batch:(s + 1) * batch]
        rng.shuffle(items)
        ids, mask, lab = _batch(items, tok, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            loss = net(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if progress and s % 10 == 0:
            it.set_postfix(loss=f"{losses[-1]:.3f}")
    net.eval()
    net = net.to(torch.bfloat16)
    acc_after = greedy_accuracy(net, tok, held_out)  # the bf16 weights the recipe will load
    os.makedirs(out_dir, exist_ok=True)
    net.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    rec = {"model": model, "task": task, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "device": device,
           "loss_first": losses[0], "loss_last": losses[-1], "losses_every_10": losses[::10],
           "greedy_accuracy_before": acc_before, "greedy_accuracy_after": acc_after, "eval_items": eval_items,
           "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(out_dir, "warmstart.json"), "w") as f:
        json.dump(rec, f, indent=1)
    return rec
