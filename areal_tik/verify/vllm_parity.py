"""``areal-tik verify --engine vllm``: rollout log-probs from vLLM (tik plugin) vs the trainer's, bit for bit.

One ``vllm.LLM`` on the tik plugin (:class:`~areal_tik.verify.offline.VLLMEngine`) is built with a small prefill
token budget and a small KV cache, so that one run goes through vLLM's own scheduler regimes:

- ``batch``: every request at once: continuous batching (prompts of different lengths finish
  prefill at different steps), chunked prefill (prompts longer than the token budget), decode in
  full CUDA graphs, and preemption when the KV cache runs out (vLLM re-prefills the preempted).
- ``abort``: the same requests stepped through ``LLMEngine``; after a few steps every third one
  is aborted and the rest run on (their bits must not notice).

Each generated token's log-prob (``logprobs=0``: the sampled token's, from our log-prob path) is
compared with ``packed_logprobs`` of the tik-patched HF model on the same sequences. With
``kernels="default"`` the LLM is stock vLLM (the negative control: it must mismatch). Needs vLLM 0.24
and the plugin's entry point installed (``pip install 'areal-tik[vllm]'``).
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time

import torch

from areal_tik.layers.logprob_head import generated_logprobs
from areal_tik.layers.models import build_model, checkpoint_dir
from areal_tik.layers.patch import patch_model
from areal_tik.verify import contract
from areal_tik.verify.offline import VLLMEngine
from areal_tik.verify.request import VerifyRequest

__all__ = ["run_vllm_parity", "verify_vllm", "REGIMES"]

REGIMES = ("batch", "abort")


def _requests(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _seeds(seed: int, n: int) -> list[int]:
    return [seed * 7919 + i for i in range(n)]


def _run_abort(gen: VLLMEngine, prompts, max_new, seed, abort_after: int = 4):
    eng = gen.llm.llm_engine
    ids = [f"abort-{seed}-{i}" for i in range(len(prompts))]
    for rid, p, s in zip(ids, prompts, _seeds(seed, len(prompts))):
        eng.add_request(rid, {"prompt_token_ids": p}, gen.sampling(max_new, s))
    done, steps, aborted = {}, 0, set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id not in aborted:
                done[o.request_id] = gen.record(o)
        steps += 1
        if steps == abort_after:
            aborted = {rid for k, rid in enumerate(ids) if k % 3 == 0 and rid not in done}
            eng.abort_request(sorted(aborted))
    return [done[r] for r in ids if r in done], len(aborted)


def _preemptions(llm) -> int | None:
    try:
        return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if "preempt" in m.name))
    except Exception:                                    # metrics off or renamed: not reported
        return None


def run_vllm_parity(model_dir: str, trainer_model, *, n_prompts: int = 48, min_prompt_len: int = 8,
                    max_prompt_len: int = 600, max_new_tokens: int = 64, seed: int = 0, kernels: str = "tik",
                    max_num_batched_tokens: int = 512, num_gpu_blocks: int | None = None,
                    regimes: tuple = REGIMES, progress=None) -> dict:
    """Run the regimes on one LLM over the HF checkpoint ``model_dir`` (the tik plugin, or stock vLLM with
    ``kernels="default"``) and compare every generated token's log-prob with ``trainer_model`` (the tik-patched HF
    model of the same checkpoint). ``num_gpu_blocks`` (default: a quarter of what the requests need at once) forces
    preemption."""
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    block = 64
    max_len = -(-(max_prompt_len + max_new_tokens + 1) // block) * block
    need_blocks = n_prompts * (max_len // block)
    t0 = time.perf_counter()
    gen = VLLMEngine(model_dir, kernels=kernels, block_size=block, max_model_len=max_len,
                     max_num_seqs=min(64, n_prompts), max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                     disable_log_stats=False, gpu_memory_utilization=0.5,
                     num_gpu_blocks_override=num_gpu_blocks or max(max_len // block + 1, need_blocks // 4))
    start_s = time.perf_counter() - t0
    report = dict(engine=f"vllm ({kernels} kernels)", vllm_kwargs={k: str(v) for k, v in gen.kwargs.items()},
                  start_s=round(start_s, 1), regimes={})
    prompts = _requests(n_prompts, min_prompt_len, max_prompt_len, vocab, seed)
    for k, name in enumerate(regimes):
        if progress:
            progress(name, k / len(regimes))
        t = time.perf_counter()
        extra = {}
        if name == "batch":
            seqs = gen.generate(prompts, max_new_tokens, seeds=_seeds(seed, len(prompts)))
            extra["preemptions"] = _preemptions(gen.llm)
        elif name == "abort":
            seqs, extra["aborted"] = _run_abort(gen, prompts, max_new_tokens, seed + 1)
        else:
            raise ValueError(f"unknown vLLM regime {name!r}; known: {REGIMES}")
        gen_s = time.perf_counter() - t
        train = generated_logprobs(trainer_model, seqs)
        rollout = [torch.tensor(lp, dtype=torch.float32) for _, _, lp in seqs]
        short = sum(len(o) != max_new_tokens for _, o, _ in seqs)
        rep = contract.compare_bits(torch.cat(rollout), torch.cat(train), name=f"vLLM {name} rollout vs trainer")
        report["regimes"][name] = dict(passed=bool(rep.passed) and rep.n_compared > 0 and short == 0,
                                       n_sequences=len(seqs), n_tokens=rep.n_compared, n_mismatch=rep.n_mismatch,
                                       max_abs_diff=rep.max_abs_diff, short_sequences=short,
                                       gen_s=round(gen_s, 2), **extra)
    report["passed"] = all(r["passed"] for r in report["regimes"].values())
    if progress:
        progress("done", 1.0)
    return report


def verify_vllm(req: VerifyRequest, progress=None) -> dict:
    """The vLLM engine's ``verify`` entry: a preset is saved as a checkpoint for vLLM, the trainer is the tik-patched
    HF model of it (the comparison is always against the tik trainer; ``req.kernels`` picks vLLM's side)."""
    with tempfile.TemporaryDirectory(prefix="areal_tik_verify_vllm_") as tmp:
        src = checkpoint_dir(req.model, tmp, device=req.device, seed=req.seed)   # a preset: saved for vLLM
        model = patch_model(build_model(src, dtype=getattr(torch, req.dtype), device=req.device),
                            kernels="tik", backend=req.backend)
        rep = run_vllm_parity(src, model, n_prompts=req.prompts, min_prompt_len=req.min_prompt_len,
                              max_prompt_len=max(req.max_prompt_len, req.min_prompt_len),
                              max_new_tokens=req.max_new_tokens, seed=req.seed, kernels=req.kernels,
                              progress=progress)
    rep.update(model=req.model, kernels=req.kernels)
    return rep
