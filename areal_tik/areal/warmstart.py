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

A recipe can name a warm start instead of a directory, ``actor.path:
"warmstart:tiny-qwen2?task=add1&steps=80&batch=64&lr=0.003"``: :func:`cached_warm_start` trains it
the first time and keeps it in a cache folder (``$XDG_CACHE_HOME/areal_tik/warmstart``, else
``~/.cache/...``), keyed by the arguments, the preset's shape and :data:`WARM_START_VERSION`; later
runs, and runs at the same time (a file lock), load the same directory.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
import urllib.parse

import torch
from tqdm import tqdm

from areal_tik.areal import arith
from areal_tik.layers.models import PRESETS, build_model

__all__ = ["warm_start", "greedy_accuracy", "special_token_ids", "WARM_PREFIX", "WARM_START_VERSION",
           "parse_warm_spec", "warm_cache_root", "cached_warm_start"]

WARM_PREFIX = "warmstart:"
WARM_START_VERSION = 1   # bump when warm_start trains differently: cached warm starts are then made anew


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
    from transformers import AutoTokenizer  # lazy: keeps transformers out of this module's import

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
    if not progress:
        from transformers.utils import logging as hf_logging  # lazy: keeps transformers out of this module's import
        hf_logging.disable_progress_bar()   # the shard-writing bar
    net.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    rec = {"model": model, "task": task, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "device": device,
           "loss_first": losses[0], "loss_last": losses[-1], "losses_every_10": losses[::10],
           "greedy_accuracy_before": acc_before, "greedy_accuracy_after": acc_after, "eval_items": eval_items,
           "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(out_dir, "warmstart.json"), "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def parse_warm_spec(spec: str) -> dict:
    """``warmstart:<model>?task=..&steps=..&batch=..&lr=..&seed=..`` -> :func:`warm_start`'s arguments
    (the others at their defaults); ``ValueError`` naming what is wrong."""
    if not spec.startswith(WARM_PREFIX):
        raise ValueError(f"{spec!r} is not a warm start (it starts with {WARM_PREFIX!r})")
    u = urllib.parse.urlsplit(spec[len(WARM_PREFIX):])
    model = u.path.strip()
    if not model:
        raise ValueError(f"{spec!r} names no model: {WARM_PREFIX}<preset>?task=add1&steps=80")
    types = {"task": str, "steps": int, "batch": int, "lr": float, "seed": int}
    args = {"model": model}
    for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True):
        if k not in types:
            raise ValueError(f"{spec!r}: unknown warm-start argument {k!r}; known: {', '.join(types)}")
        try:
            args[k] = types[k](v)
        except ValueError:
            raise ValueError(f"{spec!r}: {k}={v!r} is not a {types[k].__name__}") from None
    return args


def warm_cache_root(environ=None) -> str:
    """Where cached warm starts live: ``$XDG_CACHE_HOME/areal_tik/warmstart`` (default ``~/.cache``)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "areal_tik", "warmstart")


def _is_complete(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "warmstart.json")) and os.path.isfile(os.path.join(d, "config.json"))


def cached_warm_start(spec: str, cache_root: str, progress: bool = False, on_train=None) -> str:
    """The HF directory of the warm start ``spec`` (:func:`parse_warm_spec`), trained into ``cache_root``
    the first time and reused after. ``on_train(dir)`` is called before a training starts. Concurrent
    callers wait on a file lock; the directory appears whole (trained elsewhere, then renamed)."""
    args = parse_warm_spec(spec)
    shape = PRESETS.get(args["model"], {"dir": os.path.abspath(args["model"])})
    key = hashlib.sha256(json.dumps({"args": args, "shape": shape, "version": WARM_START_VERSION},
                                    sort_keys=True, default=str).encode()).hexdigest()[:12]
    name = "-".join([os.path.basename(args["model"].rstrip("/")), args.get("task", "mix"), key])
    final = os.path.join(cache_root, name)
    if _is_complete(final):
        return final
    os.makedirs(cache_root, exist_ok=True)
    with open(final + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
        if _is_complete(final):                   # made by another run while this one waited
            return final
        if on_train:
            on_train(final)
        tmp = tempfile.mkdtemp(prefix=".training-", dir=cache_root)
        try:
            warm_start(args.pop("model"), tmp, progress=progress, **args)
            shutil.rmtree(final, ignore_errors=True)   # an incomplete leftover of a killed run
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
